"""Quantized checkpoints written as each format's own spec lays them out: the fixtures of the
loader's tests and benches (nothing can be downloaded here), in pure torch.

    real = save_quantized(tiny_hf_model("Llama"), "ckpt/", "gptq", group=32, act_order=True)

writes config.json (with the format's quantization_config) and safetensors, and returns each
quantized weight's real value (what the stored values mean, by the format's formula, in float32),
from which a test builds the dequantised reference model. Specs followed (field names, which
dimension is packed, packing order) are cited beside each writer and in models/quantized.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from metainfer.kernels import fp8_gemm, int4_gemm

FORMATS = ("fp8-block", "ct-fp8-channel", "ct-fp8-tensor", "ct-int4", "gptq", "gptq_v2", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack_along_last(values: torch.Tensor) -> torch.Tensor:
    """(R, C) integers in [0, 15] -> (R, C/8) int32, value j at bits 4(j % 8) of word j // 8 (every
    format's word; they differ in which dim is packed and in AWQ's column order)."""
    R, C = values.shape
    v = values.to(torch.int64).view(R, C // 8, 8)
    words = sum(v[..., i] << (4 * i) for i in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# ---- one linear's tensors, per format --------------------------------------------------------------

def int4_as_compressed_tensors(q, scales, zeros=None, g_idx=None) -> dict:
    """compressed-tensors pack-quantized tensors of one linear from unsigned values q (N, K) in
    [0, 15] (the signed int4 value + 8), scales (N, G), zeros (N, G) unsigned or None
    (compressed_tensors/compressors/quantized_compressors/pack_quantized.py: weight_packed,
    weight_scale, weight_zero_point packed along dim 0, weight_shape, weight_g_idx)."""
    N, K = q.shape
    out = {"weight_packed": _pack_along_last(q), "weight_scale": scales, "weight_shape": torch.tensor([N, K])}
    if zeros is not None:  # packed along N (packed_dim=0), N padded to whole words
        zt = zeros.t().to(torch.int64)
        pad = -N % 8
        zt = torch.nn.functional.pad(zt, (0, pad), value=8)
        out["weight_zero_point"] = _pack_along_last(zt).t().contiguous()
    if g_idx is not None:
        out["weight_g_idx"] = g_idx.to(torch.int32)
    return out


def int4_as_gptq(q, scales, zeros=None, g_idx=None, v1: bool = True, group: int | None = None) -> dict:
    """GPTQ tensors of one linear (AutoGPTQ / GPTQModel QuantLinear): qweight (K/8, N) packed along
    K, qzeros (G, N/8) packed along N (v1: each zero point minus one, wrapped in 4 bits), scales
    (G, N) float16, g_idx (K,) (without act-order k // group)."""
    N, K = q.shape
    z = zeros.to(torch.int64) if zeros is not None else torch.full(scales.shape, 8, dtype=torch.int64)
    stored = (z - 1) % 16 if v1 else z
    if g_idx is None:
        G = scales.shape[1]
        if group is None and K % G:
            raise ValueError(f"{K} columns in {G} groups: pass the group size (the last group is partial)")
        g_idx = torch.arange(K) // (group or K // G)
    return {"qweight": _pack_along_last(q).t().contiguous(), "qzeros": _pack_along_last(stored.t().contiguous()),
            "scales": scales.t().contiguous().to(torch.float16), "g_idx": g_idx.to(torch.int32)}


def int4_as_awq(q, scales, zeros=None) -> dict:
    """AWQ GEMM tensors of one linear (AutoAWQ's WQLinear_GEMM): qweight (K, N/8) and qzeros (G, N/8)
    packed along N, nibble i of word c holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; scales
    (G, N) float16."""
    def pack_awq(m):  # (R, C) -> (R, C/8)
        R, C = m.shape
        cols = torch.tensor([8 * c + AWQ_ORDER[i] for c in range(C // 8) for i in range(8)])
        return _pack_along_last(m[:, cols])

    z = zeros if zeros is not None else torch.full(scales.shape, 8, dtype=torch.uint8)
    return {"qweight": pack_awq(q.t().contiguous()), "qzeros": pack_awq(z.t().contiguous()),
            "scales": scales.t().contiguous().to(torch.float16)}


# ---- quantising one weight -----------------------------------------------------------------------

def _int4_values(w: torch.Tensor, group: int, symmetric: bool, act_order: bool, seed: int):
    """(q (N, K) unsigned, scales (N, G) fp16, zeros (N, G) uint8 or None, g_idx (K,) or None, real
    weight): round to nearest per group; act-order groups the columns in a seeded random order, as
    GPTQ's desc_act groups them by its Hessian's diagonal."""
    N, K = w.shape
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(K)
    packed, scales, zeros = int4_gemm.quantize_weight(w[:, perm], group, symmetric=symmetric)
    q = torch.empty(N, K, dtype=torch.uint8)
    q[:, perm] = int4_gemm.unpack(packed)[:, :K]
    g_idx = torch.empty(K, dtype=torch.int64)
    g_idx[perm] = torch.arange(K) // group
    return q, scales, zeros, (g_idx if act_order else None)


def _int4_real(q, scales, zeros, g_idx, group):
    K = q.shape[1]
    g = g_idx if g_idx is not None else torch.arange(K) // group
    z = zeros.float() if zeros is not None else torch.full(scales.shape, 8.0)
    return (q.float() - z[:, g]) * scales.float()[:, g]


def _fp8_real(w8, scale, bn, bk):
    N, K = w8.shape
    s = scale.float().reshape(-(-N // bn), -(-K // bk))
    return w8.float() * s.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]


def _quantize_linear(fmt: str, prefix: str, w: torch.Tensor, group: int, symmetric: bool, act_order: bool,
                     block: tuple[int, int], seed: int) -> tuple[dict, torch.Tensor]:
    N, K = w.shape
    if fmt == "fp8-block":
        w8, s = fp8_gemm.quantize_weight(w, *block)
        return {"weight": w8, "weight_scale_inv": s}, _fp8_real(w8, s, *block)
    if fmt.startswith("ct-fp8"):
        bn, bk = fp8_gemm.channel_blocks(N, K, fmt.rsplit("-", 1)[1])
        w8, s = fp8_gemm.quantize_weight(w, bn, bk)
        # compressed-tensors stores a channel scale as (N, 1) and a tensor scale as (1,), in the model's dtype
        s = s.to(torch.bfloat16)
        return {"weight": w8, "weight_scale": s if bn == 1 else s.reshape(1)}, _fp8_real(w8, s, bn, bk)
    q, scales, zeros, g_idx = _int4_values(w, group, symmetric, act_order, seed)
    if fmt == "gptq" and zeros is not None:
        zeros = zeros.clamp(min=1)  # v1 cannot store a zero point of 0 (it reads back as 16)
    if fmt == "ct-int4":
        scales = scales.to(torch.bfloat16)  # compressed-tensors keeps the model's dtype
    real = _int4_real(q, scales, zeros, g_idx, group)
    if fmt == "ct-int4":
        return int4_as_compressed_tensors(q, scales, zeros, g_idx), real
    if fmt in ("gptq", "gptq_v2"):
        return int4_as_gptq(q, scales, zeros, g_idx, v1=fmt == "gptq", group=group), real
    if fmt == "awq":
        if act_order:
            raise ValueError("AWQ has no act-order")
        return int4_as_awq(q, scales, zeros), real
    raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")


def quantization_config(fmt: str, group: int, symmetric: bool, act_order: bool, block, skip) -> dict:
    """The config.json entry each format's loader reads (transformers' GPTQConfig / AwqConfig /
    FineGrainedFP8Config, compressed-tensors' QuantizationConfig)."""
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block),
                "modules_to_not_convert": list(skip)}
    if fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": symmetric,
                "checkpoint_format": fmt, "true_sequential": True}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": list(skip)}
    if fmt.startswith("ct-fp8"):
        weights = {"num_bits": 8, "type": "float", "strategy": fmt.rsplit("-", 1)[1], "symmetric": True,
                   "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
        return _ct("float-quantized", weights, acts, skip)
    # act-order with a stored weight_g_idx is actorder "group" (compressed-tensors < 0.20, whose
    # checkpoints are in use; 0.20 refuses the name and writes only "weight", where g_idx is k // group)
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group, "symmetric": symmetric,
               "dynamic": False, "actorder": "group" if act_order else None}
    return _ct("pack-quantized", weights, None, skip)


def _ct(fmt, weights, acts, skip) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": list(skip)}


def save_quantized(model: nn.Module, folder, fmt: str, *, group: int = 32, symmetric: bool = False,
                   act_order: bool = False, block: tuple[int, int] = (32, 32), skip=("lm_head",),
                   dtype: torch.dtype = torch.bfloat16, shards: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write `model` (a transformers causal LM) to `folder` as a `fmt` checkpoint: every nn.Linear
    not named in `skip` quantized, every other tensor in `dtype`, in `shards` safetensors files (an
    index when more than one); for "fp8-block" also MoE experts, per expert. Returns {parameter name
    of each quantized weight ("...q_proj.weight", "...experts.gate_up_proj"): its real value (float32)}."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, real, seen = {}, {}, {}
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not name.endswith(tuple(skip))}
    for i, (name, lin) in enumerate(linears.items()):
        stored, real[name] = _quantize_linear(fmt, name, lin.weight.detach().float(), group, symmetric, act_order,
                                              block, seed + i)
        tensors.update({f"{name}.{k}": v.contiguous() for k, v in stored.items()})
        if lin.bias is not None:
            tensors[f"{name}.bias"] = lin.bias.detach().to(dtype)
    quantized = {f"{n}.weight" for n in linears}
    real = {f"{n}.weight": w for n, w in real.items()}
    if fmt == "fp8-block":  # MoE experts as DeepSeek-V3 "-FP8" stores them: per expert, FP8 blocks
        for name, m in model.named_modules():
            if not (isinstance(getattr(m, "num_experts", None), int) and hasattr(m, "gate_up_proj")):
                continue
            gate_up, down = m.gate_up_proj.detach().float(), m.down_proj.detach().float()
            I = gate_up.shape[1] // 2
            reals = {"gate_up_proj": [], "down_proj": []}
            for e in range(m.num_experts):
                for proj, w in (("gate_proj", gate_up[e, :I]), ("up_proj", gate_up[e, I:]), ("down_proj", down[e])):
                    w8, s = fp8_gemm.quantize_weight(w, *block)
                    tensors[f"{name}.{e}.{proj}.weight"], tensors[f"{name}.{e}.{proj}.weight_scale_inv"] = w8, s
                    reals["down_proj" if proj == "down_proj" else "gate_up_proj"].append(_fp8_real(w8, s, *block))
            real[f"{name}.gate_up_proj"] = torch.stack([torch.cat(reals["gate_up_proj"][2 * e:2 * e + 2])
                                                        for e in range(m.num_experts)])
            real[f"{name}.down_proj"] = torch.stack(reals["down_proj"])
            quantized |= {f"{name}.gate_up_proj", f"{name}.down_proj"}
    for key, t in model.state_dict().items():
        if key in quantized or t.data_ptr() in seen:  # a tied weight is stored once
            continue
        seen[t.data_ptr()] = key
        tensors.setdefault(key, (t.to(dtype) if t.is_floating_point() else t).contiguous())
    keys = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for s in range(shards):
            part = keys[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: tensors[k] for k in part}, str(folder / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = copy.deepcopy(model.config)
    config.quantization_config = quantization_config(fmt, group, symmetric, act_order, block, skip)
    config.dtype = dtype
    config.save_pretrained(str(folder))
    return real


def save_with_compressed_tensors(model: nn.Module, folder, scheme: str) -> dict[str, torch.Tensor]:
    """`model` quantized and written by compressed-tensors itself (its QuantizationConfig, its
    compressor's packing and names, its config.json entry): scheme "fp8-channel" (FP8 e4m3 per
    output channel, float-quantized) or "int4-group" (4-bit, groups of 32 with zero points,
    pack-quantized). The scales are set here (amax / 448; (max - min) / 15), as a calibration
    would. Returns {linear name: the weight the library's decompressor gives back}. Changes `model`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)

    if scheme == "fp8-channel":
        args, fmt = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True), "float-quantized"
    elif scheme == "int4-group":
        args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False)
        fmt = "pack-quantized"
    else:
        raise ValueError(f"scheme must be fp8-channel or int4-group, got {scheme!r}")
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    names = []
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        names.append(name)
        w = module.weight.detach().float()
        if scheme == "fp8-channel":
            amax = w.abs().amax(dim=1, keepdim=True)
            module.weight_scale.data.copy_(torch.where(amax == 0, torch.ones_like(amax), amax / 448.0))
        else:
            _, s, z = int4_gemm.quantize_weight(w, 32, symmetric=False, scale_dtype=torch.float32)
            module.weight_scale.data.copy_(s)
            module.weight_zero_point.data.copy_((z.to(torch.int16) - 8).to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(folder))
    compressor.update_config(str(folder))
    compressor.decompress_model(model)
    return {name: model.get_submodule(name).weight.detach().clone() for name in names}
