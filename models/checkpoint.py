"""Load a quantized Hugging Face checkpoint from a local folder with its weights kept quantized.

    model = load("Qwen3-8B-AWQ/")            # or metainfer.load(...)

Reads `config.json` (its `quantization_config`) and the folder's safetensors, builds the
transformers model on the meta device, puts a quantized layer (models/quantized.py) wherever the
checkpoint stores a quantized linear, and fills every tensor from the files: nothing is
dequantised, nothing downloaded. Formats (each converter's spec is cited in models/quantized.py):

- `quant_method: "fp8"` with `weight_block_size` [bn, bk] (DeepSeek-V3 / Qwen3 "-FP8"): `weight`
  e4m3 and `weight_scale_inv` (ceil(N/bn), ceil(K/bk)) float32;
- `compressed-tensors`, format `float-quantized` (FP8-Dynamic and static): `weight` e4m3 and
  `weight_scale` per channel (N, 1), per tensor (1,) or per block; activation scales are not used
  (activations stay in the model's dtype: W8A16, or W8A8 per token with fp8_gemm's w8a8 mode);
- `compressed-tensors`, format `pack-quantized` (4-bit int, groups, symmetric or with zero points,
  act-order `weight_g_idx`);
- `gptq` (checkpoint_format gptq / gptq_v2, desc_act g_idx) and `awq` (version gemm);
- MoE experts stored FP8 per expert in a block checkpoint (DeepSeek-V3's `experts.{e}.gate_proj.
  weight` + `weight_scale_inv`): one FP8Experts per transformers experts module.

Which linears are quantized is read from the stored tensors (a linear whose `qweight` /
`weight_packed` / FP8 `weight` is in the files), so `ignore` / `modules_to_not_convert` lists
need no pattern matching; a layer the config says is quantized but the files store otherwise is
an error. Untrusted input: config.json is size-checked before parsing, every tensor's shape is
checked against the layer before it is converted, and every mismatch is a ValueError naming the
tensor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import quantized as Q

MAX_CONFIG_BYTES = 4 * 2**20
# stored tensors that belong to no parameter and carry nothing a W8A16 / W4A16 layer needs
_UNUSED_SUFFIXES = (".input_scale", ".input_zero_point", ".output_scale", ".k_scale", ".v_scale",
                    "rotary_emb.inv_freq")


@dataclass
class Scheme:
    """What `quantization_config` says, in the terms of metainfer's layers."""

    method: str  # "fp8" | "compressed-tensors" | "gptq" | "awq"
    kind: str  # "fp8" | "int4"
    block: tuple[int, int] | None = None  # fp8 blocks; None: per channel / per tensor from the scales
    group: int | None = None  # int4 group size (None: one group per row)
    symmetric: bool = True
    act_order: bool = False
    zero_offset: int = 1  # gptq v1 stores zero points minus one
    activations: str = "none"  # "dynamic-token" | "dynamic-group" | "static" | "none"
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.kind == "fp8":
            blocks = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per-channel/tensor scales"
            return f"{self.method} FP8 e4m3, {blocks}, activations {self.activations}"
        zeros = "symmetric" if self.symmetric else "zero points"
        return (f"{self.method} int4, group {self.group or 'per row'}, {zeros}"
                f"{', act-order' if self.act_order else ''}")


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no config.json (not a Hugging Face model folder)")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path} is {size} bytes; a model config is at most {MAX_CONFIG_BYTES}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{path} is not a Hugging Face model config (no \"model_type\")")
    return data


def scheme_of(qc: dict | None) -> Scheme | None:
    """The Scheme of a config's quantization_config (None: not quantized); ValueError for a
    format or setting metainfer does not load, naming it."""
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block)):
            raise ValueError(f"fp8 quantization_config: weight_block_size must be [block_n, block_k], got {block!r} "
                             "(per-tensor FP8 without blocks is read from compressed-tensors checkpoints)")
        act = qc.get("activation_scheme", "dynamic")
        return Scheme("fp8", "fp8", block=(block[0], block[1]),
                      activations="dynamic-group" if act == "dynamic" else str(act))
    if method in ("gptq", "awq"):
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(f"{method} with {bits}-bit weights: metainfer's int4_linear loads 4-bit only")
        group = qc.get("group_size", qc.get("q_group_size", 128))
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"awq version {version!r}: only the GEMM packing (AutoAWQ's WQLinear_GEMM) is loaded")
            return Scheme("awq", "int4", group=None if group == -1 else group, symmetric=not qc.get("zero_point", True))
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {fmt!r}: only gptq and gptq_v2 are loaded")
        return Scheme("gptq", "int4", group=None if group == -1 else group, symmetric=bool(qc.get("sym", True)),
                      act_order=bool(qc.get("desc_act", False)), zero_offset=1 if fmt == "gptq" else 0)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    raise ValueError(f"quant_method {method!r} is not loaded by metainfer (fp8, compressed-tensors, gptq, awq are)")


def _compressed_tensors_scheme(qc: dict) -> Scheme:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError(f"compressed-tensors: {len(groups) if isinstance(groups, dict) else 'no'} config_groups; "
                         "metainfer loads checkpoints with one scheme for every quantized linear")
    (group_cfg,) = groups.values()
    if fmt in (None, "mixed-precision"):  # the format may be given per group
        fmt = group_cfg.get("format", fmt)
    w = group_cfg.get("weights") or {}
    acts = group_cfg.get("input_activations")
    kind = w.get("type")
    if fmt == "float-quantized" and kind == "float" and w.get("num_bits") == 8:
        strategy = w.get("strategy")
        if strategy not in ("channel", "tensor", "block"):
            raise ValueError(f"compressed-tensors FP8 weight strategy {strategy!r}: channel, tensor or block load")
        block = tuple(w.get("block_structure") or ()) if strategy == "block" else None
        if strategy == "block" and len(block) != 2:
            raise ValueError(f"compressed-tensors block strategy without a [block_n, block_k] block_structure: {block}")
        activations = "none"
        if acts:
            activations = (f"dynamic-{acts.get('strategy', 'token')}" if acts.get("dynamic")
                           else f"static-{acts.get('strategy', 'tensor')}")
        return Scheme("compressed-tensors", "fp8", block=block, activations=activations)
    if fmt == "pack-quantized" and kind == "int" and w.get("num_bits") == 4:
        if acts:
            raise ValueError("compressed-tensors pack-quantized with quantized activations (W4A8) is not loaded")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"compressed-tensors int4 weight strategy {strategy!r}: group or channel load")
        order = w.get("actorder")
        return Scheme("compressed-tensors", "int4", group=w.get("group_size") if strategy == "group" else None,
                      symmetric=bool(w.get("symmetric", True)), act_order=order not in (None, False, "static"))
    raise ValueError(f"compressed-tensors format {fmt!r} with {w.get('num_bits')}-bit {kind} weights is not loaded "
                     "(float-quantized FP8 and pack-quantized int4 are)")


# ---- the files ---------------------------------------------------------------------------------

class _Files:
    """Every tensor name of a folder's safetensors and the file holding it; tensors read one at a time."""

    def __init__(self, folder: Path, device: str):
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            if index.stat().st_size > 64 * MAX_CONFIG_BYTES:
                raise ValueError(f"{index} is {index.stat().st_size} bytes: too large for a weight index")
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map object")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder}: no safetensors weights (model.safetensors or an index of shards)")
        self.handles, self.where = {}, {}
        for name in files:
            path = (folder / name).resolve()
            if path.parent != folder.resolve() or not path.is_file():
                raise ValueError(f"{folder}: weight file {name!r} is not a file in the folder")
            handle = safe_open(str(path), framework="pt", device=device)
            self.handles[name] = handle
            for key in handle.keys():
                self.where[key] = name
        self.of_module: dict[str, list[str]] = {}  # "a.b.q_proj" -> its tensors' names, once (not a scan a layer)
        for key in self.where:
            self.of_module.setdefault(key.rpartition(".")[0], []).append(key)

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.handles[self.where[key]].get_slice(key).get_shape())

    def get(self, key: str, shape: tuple | None = None) -> torch.Tensor:
        if key not in self.where:
            raise ValueError(f"the checkpoint has no tensor {key!r}")
        if shape is not None and self.shape(key) != tuple(shape):
            raise ValueError(f"tensor {key!r} has shape {list(self.shape(key))}, the model expects {list(shape)}")
        return self.handles[self.where[key]].get_tensor(key)


# ---- one quantized linear ----------------------------------------------------------------------

def _stored_kind(files: _Files, prefix: str) -> str | None:
    if f"{prefix}.qweight" in files:
        return "int4-gptq-awq"
    if f"{prefix}.weight_packed" in files:
        return "int4-ct"
    if f"{prefix}.weight_scale_inv" in files or f"{prefix}.weight_scale" in files:
        return "fp8"
    return None


def _int4_group(scheme: Scheme, K: int) -> int:
    return scheme.group or K


def _fp8_layer(files: _Files, prefix: str, linear: nn.Linear, scheme: Scheme) -> Q.FP8Linear:
    N, K = linear.out_features, linear.in_features
    w = files.get(f"{prefix}.weight", (N, K))
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{prefix}.weight is {w.dtype}; FP8 checkpoints store float8_e4m3fn")
    key = f"{prefix}.weight_scale_inv" if f"{prefix}.weight_scale_inv" in files else f"{prefix}.weight_scale"
    shape = files.shape(key)
    if scheme.block is not None:
        bn, bk = scheme.block
        want = (-(-N // bn), -(-K // bk))
        if shape != want:
            raise ValueError(f"{key} has shape {list(shape)}; {bn}x{bk} blocks of a [{N}, {K}] weight need {list(want)}")
        block = (bn, bk)
    elif shape in ((N, 1), (N,)):
        block = "channel"
    elif shape in ((), (1,), (1, 1)):
        block = "tensor"
    else:
        raise ValueError(f"{key} has shape {list(shape)}: neither per channel ({N}, 1) nor per tensor (1,)")
    layer = Q.FP8Linear(K, N, block, bias=linear.bias is not None)
    scale = files.get(key).float().reshape(layer.weight_scale.shape)
    layer.weight, layer.weight_scale = w, scale.to(w.device)
    return layer


def _int4_layer(files: _Files, prefix: str, linear: nn.Linear, scheme: Scheme, stored: str) -> Q.Int4Linear:
    N, K = linear.out_features, linear.in_features
    if K % 8:
        raise ValueError(f"{prefix}: {K} inputs do not fill int32 words of eight 4-bit values")
    group = _int4_group(scheme, K)
    G = -(-K // group)
    g_idx = None
    if stored == "int4-ct":
        zp = f"{prefix}.weight_zero_point"
        zeros = files.get(zp, (-(-N // 8), G)) if zp in files else None
        if f"{prefix}.weight_g_idx" in files:
            g_idx = files.get(f"{prefix}.weight_g_idx", (K,))
        q, s, z, perm = Q.from_compressed_tensors(files.get(f"{prefix}.weight_packed", (N, K // 8)),
                                                  files.get(f"{prefix}.weight_scale", (N, G)), zeros,
                                                  (N, K), g_idx, group)
    elif scheme.method == "gptq":
        if f"{prefix}.g_idx" in files:
            g_idx = files.get(f"{prefix}.g_idx", (K,))
        if N % 8:
            raise ValueError(f"{prefix}: {N} outputs do not fill GPTQ's zero-point words (multiples of 8)")
        q, s, z, perm = Q.from_gptq(files.get(f"{prefix}.qweight", (K // 8, N)),
                                    files.get(f"{prefix}.qzeros", (G, N // 8)), files.get(f"{prefix}.scales", (G, N)),
                                    g_idx, group, zero_offset=scheme.zero_offset)
    else:
        if N % 8:
            raise ValueError(f"{prefix}: {N} outputs do not fill AWQ's words (multiples of 8)")
        q, s, z, perm = Q.from_awq(files.get(f"{prefix}.qweight", (K, N // 8)), files.get(f"{prefix}.qzeros", (G, N // 8)),
                                   files.get(f"{prefix}.scales", (G, N)), group)
    layer = Q.Int4Linear(K, N, group, bias=linear.bias is not None, zeros=z is not None, act_order=perm is not None,
                         scale_dtype=s.dtype)
    layer.qweight, layer.scales, layer.zeros, layer.perm = q, s, z, perm
    return layer


# ---- the model -----------------------------------------------------------------------------------

def load(folder, dtype: torch.dtype | None = None, device: str | torch.device = "cpu", attn: str = "sdpa"):
    """The causal LM in `folder` with its quantized linears as metainfer's quantized layers (their
    stored precision kept) and every other tensor in `dtype` (default: the config's). Also loads an
    unquantized folder. Returns the model in eval mode; `model.metainfer_scheme` is its Scheme."""
    import transformers

    from metainfer.models import transformers_adapter as hf

    folder = Path(folder)
    data = read_config(folder)
    scheme = scheme_of(data.get("quantization_config"))
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the layers below are the quantization; transformers must not redo it
    hf.set_attention_implementation(config, attn)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    device = str(device)
    files = _Files(folder, device)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    loaded = _quantized_layers(model, files, scheme)
    _fill(model, files, dtype, device, loaded)
    model.metainfer_scheme = scheme
    return model.eval()


def _quantized_layers(model: nn.Module, files: _Files, scheme: Scheme | None) -> set[str]:
    """Replace each linear the files store quantized; returns the tensor names they used."""
    used = set()
    for name, linear in list(model.named_modules()):
        if not isinstance(linear, nn.Linear):
            continue
        stored = _stored_kind(files, name)
        if stored is None:
            continue
        if scheme is None:
            raise ValueError(f"{name} is stored quantized but config.json has no quantization_config")
        want = "fp8" if stored == "fp8" else "int4"
        if want != scheme.kind:
            raise ValueError(f"{name} is stored as {want}, the config's quantization_config says {scheme.kind}")
        layer = (_fp8_layer(files, name, linear, scheme) if want == "fp8"
                 else _int4_layer(files, name, linear, scheme, stored))
        used.update(files.of_module.get(name, ()))
        if linear.bias is not None:
            bias = files.get(f"{name}.bias", (linear.out_features,))
            layer.bias = nn.Parameter(bias, requires_grad=False)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    used |= _quantized_experts(model, files, scheme)
    if scheme is not None and not used:
        raise ValueError(f"config.json declares {scheme.describe()} but no linear is stored quantized")
    return used


def _is_experts(m: nn.Module) -> bool:
    """A transformers experts module: stacked gate_up_proj (E, 2I, H) and down_proj (E, H, I)."""
    return isinstance(getattr(m, "num_experts", None), int) and all(
        isinstance(getattr(m, p, None), torch.Tensor) and getattr(m, p).dim() == 3 for p in ("gate_up_proj", "down_proj"))


def _quantized_experts(model: nn.Module, files: _Files, scheme: Scheme | None) -> set[str]:
    """Experts stored FP8 per expert (DeepSeek-V3's `experts.{e}.gate_proj.weight_scale_inv`) ->
    one FP8Experts per experts module; returns the tensor names used."""
    used = set()
    for name, m in list(model.named_modules()):
        if not _is_experts(m) or f"{name}.0.gate_proj.weight_scale_inv" not in files:
            continue
        if scheme is None or scheme.kind != "fp8" or scheme.block is None:
            raise ValueError(f"{name}: experts stored as FP8 blocks, but the config declares "
                             f"{scheme.describe() if scheme else 'no quantization'}")
        E, (two_i, H) = m.num_experts, m.gate_up_proj.shape[1:]
        I = two_i // 2
        bn, bk = scheme.block
        layer = Q.FP8Experts(E, H, I, (bn, bk))
        for proj, attr, (n, k) in (("gate_proj", "gate", (I, H)), ("up_proj", "up", (I, H)), ("down_proj", "down", (H, I))):
            weights, scales = [], []
            for e in range(E):
                w = files.get(f"{name}.{e}.{proj}.weight", (n, k))
                if w.dtype != torch.float8_e4m3fn:
                    raise ValueError(f"{name}.{e}.{proj}.weight is {w.dtype}; FP8 experts store float8_e4m3fn")
                weights.append(w)
                scales.append(files.get(f"{name}.{e}.{proj}.weight_scale_inv", (-(-n // bn), -(-k // bk))).float())
                used |= {f"{name}.{e}.{proj}.weight", f"{name}.{e}.{proj}.weight_scale_inv"}
            setattr(layer, attr, torch.stack(weights))
            setattr(layer, f"{attr}_scale", torch.stack(scales))
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    return used


def _fill(model: nn.Module, files: _Files, dtype: torch.dtype, device: str, used: set[str]) -> None:
    """Every remaining parameter and persistent buffer from the files (float ones cast to `dtype`),
    tied weights tied, non-persistent buffers (rotary tables) computed as transformers does."""
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    state = model.state_dict(keep_vars=True)
    missing = []
    for key, current in state.items():
        if not current.is_meta:
            continue  # a quantized layer's tensor, set above
        if key not in files:
            if key not in tied:
                missing.append(key)
            continue
        t = files.get(key, tuple(current.shape))
        if t.is_floating_point():
            t = t.to(dtype)
        _assign(model, key, t)
        used.add(key)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors of the model, e.g. {missing[:4]}")
    unexpected = [k for k in files.where if k not in used and not k.endswith(_UNUSED_SUFFIXES)
                  and not _ignored(model, k)]
    if unexpected:
        raise ValueError(f"the checkpoint has {len(unexpected)} tensors the model does not use, e.g. {unexpected[:4]}")
    if tied:
        model.tie_weights()
    for module in model.modules():
        meta = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
        if meta:
            for k in meta:
                module._buffers[k] = torch.empty_like(module._buffers[k], device=device)
            from metainfer.models import transformers_adapter as hf

            hf.init_weights(model, module)  # the rotary tables, from the config
    left = [k for k, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if left:
        raise ValueError(f"tensors left without values after loading: {left[:4]}")


def _assign(model: nn.Module, key: str, t: torch.Tensor) -> None:
    parent, _, attr = key.rpartition(".")
    module = model.get_submodule(parent) if parent else model
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(t, requires_grad=False)
    else:
        module._buffers[attr] = t


def _ignored(model: nn.Module, key: str) -> bool:
    from metainfer.models import transformers_adapter as hf

    patterns = hf.keys_to_ignore_on_load(model)
    return any(re.search(p, key) for p in patterns)


def weight_bytes(model: nn.Module) -> dict[str, Any]:
    """Bytes the model's linears hold in memory: quantized layers' stored tensors, float linears'
    weights; with the whole model's parameters and buffers."""
    quantized = sum(m.weight_bytes() for m in model.modules() if isinstance(m, (Q.Int4Linear, Q.FP8Linear)))
    experts = sum(m.weight_bytes() for m in model.modules() if isinstance(m, Q.FP8Experts))
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in
                                                       list(model.parameters()) + list(model.buffers())}.values())
    return {"quantized_linears": quantized, "quantized_experts": experts, "total": total}
