"""Quantized linear layers as a checkpoint keeps them: the weight stays in its stored precision in
memory and the forward is what any device can run, dequantise then F.linear, so eager runs
anywhere and Dynamo captures a form metainfer's passes turn into one kernel (passes/int4_gemm.py,
passes/fp8_gemm.py).

    layer = Int4Linear.from_linear(nn.Linear(4096, 4096), group=128, symmetric=False)
    layer = FP8Linear.from_linear(nn.Linear(4096, 4096), block=(128, 128))   # or "channel", "tensor"
    quantize_linears(model, group=128)        # every nn.Linear but the embeddings and lm_head, in place

The int4 layout is metainfer.kernels.int4_gemm's (loaders convert GPTQ, AWQ and compressed-
tensors checkpoints to it), the FP8 one metainfer.kernels.fp8_gemm's (e4m3 weight, float32 scales
over blocks; per-channel and per-tensor scales are blocks of 1 x K and N x K). The dequantisation
is `metainfer::int4_dequantize` / `metainfer::fp8_dequantize`, ops whose bodies are plain torch:
Dynamo sees one node whose meaning is fixed, which a pass can prove it replaces exactly (a traced
chain of shifts, masks and gathers could not be told from one that differs).

A model's `.to(torch.bfloat16)` casts its float tensors, FP8 weights and fp16 scales included;
these layers keep their stored tensors' dtypes and follow only device moves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import metainfer.kernels.ops  # noqa: F401  (registers metainfer::int4_dequantize and ::fp8_dequantize)
from metainfer.kernels import fp8_gemm, int4_gemm


class _StoredQuantized(nn.Module):
    """A layer whose `STORED` buffers keep their dtype under .to(dtype) / .half() / .bfloat16()."""

    STORED: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        kept = {k: self._buffers[k] for k in self.STORED if self._buffers.get(k) is not None}
        for k in kept:
            self._buffers[k] = None
        try:
            super()._apply(fn, recurse)
        finally:
            for k, t in kept.items():
                self._buffers[k] = t
        for k, t in kept.items():
            device = fn(torch.empty(0, dtype=t.dtype, device=t.device)).device
            if device != t.device:
                self._buffers[k] = torch.empty_like(t, device=device) if t.is_meta else t.to(device)
        return self


class FP8Linear(_StoredQuantized):
    """y = x @ W^T + b with W (out_features, in_features) kept as float8_e4m3fn (`weight`) and float32
    scales `weight_scale` (ceil(N / block_n), ceil(K / block_k)), W[n, k] = weight[n, k] *
    weight_scale[n // block_n, k // block_k]. `block`: (block_n, block_k) (a "-FP8" checkpoint's
    [128, 128]), "channel" (one scale per output row) or "tensor" (one scale)."""

    STORED = ("weight", "weight_scale")

    def __init__(self, in_features: int, out_features: int, block="channel", bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if isinstance(block, str):
            self.block_n, self.block_k = fp8_gemm.channel_blocks(out_features, in_features, block)
        else:
            self.block_n, self.block_k = (int(b) for b in block)
        fp8_gemm.check_blocks(self.block_n, self.block_k)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.ones(-(-out_features // self.block_n),
                                                        -(-in_features // self.block_k), dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, block="channel") -> "FP8Linear":
        """`linear` quantised per block to e4m3 (scale = block amax / 448; kernels.fp8_gemm.quantize_weight)."""
        layer = cls(linear.in_features, linear.out_features, block, bias=linear.bias is not None)
        w, s = fp8_gemm.quantize_weight(linear.weight.detach().float(), layer.block_n, layer.block_k)
        layer.weight.copy_(w)
        layer.weight_scale.copy_(s)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return layer.to(linear.weight.device).train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.ops.metainfer.fp8_dequantize(self.weight, self.weight_scale, self.block_n, self.block_k, x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def weight_bytes(self) -> int:
        return self.weight.numel() + self.weight_scale.numel() * 4

    def check_rows(self, lo: int, hi: int) -> None:
        N, K = self.out_features, self.in_features
        if self.block_n < N and (lo % self.block_n or (hi % self.block_n and hi != N)):
            raise ValueError(f"rows [{lo}, {hi}) of an FP8 weight [{N}, {K}] would split its {self.block_n}-row scale "
                             f"blocks")

    def check_columns(self, lo: int, hi: int) -> None:
        N, K = self.out_features, self.in_features
        if self.block_k < K and (lo % self.block_k or (hi % self.block_k and hi != K)):
            raise ValueError(f"columns [{lo}, {hi}) of an FP8 weight [{N}, {K}] would split its {self.block_k}-column "
                             f"scale blocks")

    def rows(self, lo: int, hi: int) -> "FP8Linear":
        """The layer of output rows [lo, hi) (a column-parallel shard, a replicated KV head);
        ValueError where the cut would split a block of rows that share a scale."""
        N, K = self.out_features, self.in_features
        self.check_rows(lo, hi)
        whole = self.block_n >= N  # one scale row (per tensor)
        layer = FP8Linear(K, hi - lo, (self.block_n, self.block_k), bias=self.bias is not None)
        srows = slice(0, 1) if whole else slice(lo // self.block_n, -(-hi // self.block_n))
        layer.weight, layer.weight_scale = self.weight[lo:hi].clone(), self.weight_scale[srows].clone()
        if self.bias is not None:
            layer.bias = nn.Parameter(self.bias.detach()[lo:hi].clone(), requires_grad=False)
        return layer

    def columns(self, lo: int, hi: int) -> "FP8Linear":
        """The layer of input columns [lo, hi) without its bias (a row-parallel shard: the bias is
        added once, after the partial sums are reduced); ValueError where the cut would split a
        block of columns that share a scale."""
        N, K = self.out_features, self.in_features
        self.check_columns(lo, hi)
        whole = self.block_k >= K
        layer = FP8Linear(hi - lo, N, (self.block_n, self.block_k))
        scols = slice(0, 1) if whole else slice(lo // self.block_k, -(-hi // self.block_k))
        layer.weight, layer.weight_scale = self.weight[:, lo:hi].clone(), self.weight_scale[:, scols].clone()
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"scales={fp8_gemm.scale_layout(self.out_features, self.in_features, self.block_n, self.block_k)}, "
                f"bias={self.bias is not None}")


class Int4Linear(_StoredQuantized):
    """y = x @ W^T + b with W (out_features, in_features) kept as 4-bit values packed eight to an
    int32 (`qweight`), a scale per output row and group of `group` inputs (`scales`), zero points
    (`zeros`, uint8; None: symmetric, 8), and for an act-order checkpoint the permutation its
    input columns are read through (`perm`)."""

    STORED = ("qweight", "scales", "zeros", "perm")

    def __init__(self, in_features: int, out_features: int, group: int, bias: bool = False, zeros: bool = True,
                 act_order: bool = False, scale_dtype: torch.dtype = torch.float16):
        super().__init__()
        if in_features % int4_gemm.PACK:
            raise ValueError(f"in_features {in_features} is not a multiple of {int4_gemm.PACK} (packed int32 words)")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        G = int4_gemm.groups(in_features, group)
        self.register_buffer("qweight", torch.zeros(out_features, in_features // int4_gemm.PACK, dtype=torch.int32))
        self.register_buffer("scales", torch.ones(out_features, G, dtype=scale_dtype))
        self.register_buffer("zeros", torch.full((out_features, G), 8, dtype=torch.uint8) if zeros else None)
        self.register_buffer("perm", torch.arange(in_features, dtype=torch.int32) if act_order else None)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int, symmetric: bool = True,
                    scale_dtype: torch.dtype = torch.float16) -> "Int4Linear":
        """`linear` quantised round-to-nearest per group (int4_gemm.quantize_weight)."""
        q, s, z = int4_gemm.quantize_weight(linear.weight.detach(), group, symmetric=symmetric, scale_dtype=scale_dtype)
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    zeros=not symmetric, scale_dtype=scale_dtype)
        layer.qweight.copy_(q)
        layer.scales.copy_(s)
        if z is not None:
            layer.zeros.copy_(z)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return layer.to(linear.weight.device).train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        w = torch.ops.metainfer.int4_dequantize(self.qweight, self.scales, self.zeros, self.group, x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros, self.perm)
                   if t is not None)

    def check_rows(self, lo: int, hi: int) -> None:
        pass  # every row has its own scales and zero points

    def check_columns(self, lo: int, hi: int) -> None:
        K = self.in_features
        if self.perm is not None:
            raise ValueError(f"an act-order int4 weight [{self.out_features}, {K}] cannot be split along its inputs: "
                             "each group gathers columns from all of K")
        if lo % self.group or (hi % self.group and hi != K):
            raise ValueError(f"columns [{lo}, {hi}) of an int4 weight with groups of {self.group} would split a group")

    def rows(self, lo: int, hi: int) -> "Int4Linear":
        """The layer of output rows [lo, hi): every row keeps its own scales and zero points."""
        self.check_rows(lo, hi)
        layer = Int4Linear(self.in_features, hi - lo, self.group, bias=self.bias is not None,
                           zeros=self.zeros is not None, act_order=self.perm is not None, scale_dtype=self.scales.dtype)
        layer.qweight, layer.scales = self.qweight[lo:hi].clone(), self.scales[lo:hi].clone()
        layer.zeros = None if self.zeros is None else self.zeros[lo:hi].clone()
        layer.perm = None if self.perm is None else self.perm.clone()
        if self.bias is not None:
            layer.bias = nn.Parameter(self.bias.detach()[lo:hi].clone(), requires_grad=False)
        return layer

    def columns(self, lo: int, hi: int) -> "Int4Linear":
        """The layer of input columns [lo, hi) without its bias (a row-parallel shard); ValueError
        where the cut would split a group, or for act-order (its groups gather columns from all of K)."""
        self.check_columns(lo, hi)
        layer = Int4Linear(hi - lo, self.out_features, self.group, zeros=self.zeros is not None,
                           scale_dtype=self.scales.dtype)
        g = slice(lo // self.group, -(-hi // self.group))
        layer.qweight = self.qweight[:, lo // int4_gemm.PACK:hi // int4_gemm.PACK].clone()
        layer.scales = self.scales[:, g].clone()
        layer.zeros = None if self.zeros is None else self.zeros[:, g].clone()
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
                f"zeros={self.zeros is not None}, act_order={self.perm is not None}, bias={self.bias is not None}")


class FP8Experts(_StoredQuantized):
    """Routed SwiGLU experts with FP8 block weights, as DeepSeek-V3 "-FP8" checkpoints store them
    (per expert `gate_proj`, `up_proj`, `down_proj` e4m3 with `weight_scale_inv` blocks), kept
    stacked: gate / up (E, I, H), down (E, H, I), and their scales. It takes the place of a
    transformers experts module (same call: hidden states (T, H), top-k expert ids and weights);
    its forward is the reference loop, expert e's tokens through its dequantised weights, the form
    the fuse_moe pass turns into one metainfer::moe_experts call on the FP8 weights."""

    STORED = ("gate", "up", "down", "gate_scale", "up_scale", "down_scale")

    def __init__(self, num_experts: int, hidden: int, intermediate: int, block: tuple[int, int]):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, intermediate
        self.block_n, self.block_k = (int(b) for b in block)
        fp8_gemm.check_blocks(self.block_n, self.block_k)
        E, bn, bk = num_experts, self.block_n, self.block_k
        for name, (n, k) in (("gate", (intermediate, hidden)), ("up", (intermediate, hidden)),
                             ("down", (hidden, intermediate))):
            self.register_buffer(name, torch.zeros(E, n, k, dtype=torch.float8_e4m3fn))
            self.register_buffer(f"{name}_scale", torch.ones(E, -(-n // bn), -(-k // bk), dtype=torch.float32))

    def _weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.ops.metainfer.fp8_dequantize(getattr(self, name)[e], getattr(self, f"{name}_scale")[e],
                                                  self.block_n, self.block_k, dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        x = hidden_states
        y = torch.zeros_like(x)
        for e in range(self.num_experts):
            idx, top = torch.where(top_k_index == e)
            h = x[idx]
            h = F.silu(F.linear(h, self._weight("gate", e, x.dtype))) * F.linear(h, self._weight("up", e, x.dtype))
            y.index_add_(0, idx, F.linear(h, self._weight("down", e, x.dtype)) * top_k_weights[idx, top, None].to(x.dtype))
        return y

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, n) for n in self.STORED))

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"scales={self.block_n}x{self.block_k} blocks")


def adopt_transformers_fp8(model: nn.Module) -> int:
    """Replace transformers' own FP8Linear layers (integrations/finegrained_fp8.py, which a user may
    build; its forward needs a Triton kernel downloaded from the hub at run time) by FP8Linear
    holding the same tensors, in place; returns how many. Its static activation scale, if any, is
    not used (activations stay in their dtype, as for every FP8Linear)."""
    found = [(n, m) for n, m in model.named_modules()
             if type(m).__name__ == "FP8Linear" and type(m).__module__.startswith("transformers.")]
    for name, m in found:
        w, s = m.weight.data, m.weight_scale_inv.data
        N, K = w.shape
        if m.block_size is None:
            block = "tensor"
        else:
            block = tuple(int(b) for b in m.block_size)
        if s.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name}: scales of dtype {s.dtype} (ue8m0?) are not read by metainfer's FP8 kernel")
        layer = FP8Linear(K, N, block, bias=m.bias is not None)
        layer.weight, layer.weight_scale = w, s.float().reshape(layer.weight_scale.shape)
        if m.bias is not None:
            layer.bias = nn.Parameter(m.bias.data, requires_grad=False)
        layer.train(m.training)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    return len(found)


QUANTIZED = (FP8Linear, Int4Linear)  # layers with rows() / columns() cuts for tensor parallelism


def quantize_linears(model: nn.Module, group: int = 128, symmetric: bool = True, skip=("lm_head",),
                     fp8=None) -> int:
    """Replace every nn.Linear of `model` (but those whose name ends in one of `skip`) in place by its
    Int4Linear (groups of `group`, zero points unless `symmetric`), or with `fp8` (a block pair,
    "channel" or "tensor") by its FP8Linear; returns how many. For tiny fixtures: a real checkpoint
    comes quantized (models/checkpoint.py loads it)."""
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not name.endswith(tuple(skip))
               and (fp8 is not None or m.in_features % int4_gemm.PACK == 0)]
    for name, linear in targets:
        parent, _, attr = name.rpartition(".")
        layer = (FP8Linear.from_linear(linear, fp8) if fp8 is not None
                 else Int4Linear.from_linear(linear, group, symmetric=symmetric))
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    return len(targets)


# ---- checkpoint formats -> the packed layout Int4Linear holds ------------------------------------
# Each takes one linear's tensors as the format stores them and returns (qweight (N, K/8) int32,
# scales (N, G), zeros (N, G) uint8 or None, perm (K,) int32 or None). The formats:
# - compressed-tensors "pack-quantized" (compressed_tensors/compressors/pack_quantized: pack_to_int32):
#   weight_packed (N, K/8) int32, value k at bits 4(k % 8) of word k // 8, signed int4 stored + 8;
#   weight_scale (N, G); weight_zero_point, if asymmetric, the signed zero points + 8 packed the same
#   way along N: (ceil(N/8), G); weight_g_idx (K,) for act-order;
# - GPTQ (AutoGPTQ / GPTQModel): qweight (K/8, N) int32 packed along K the same way; qzeros (G, N/8)
#   packed along N; scales (G, N); g_idx (K,); checkpoint_format "gptq" (v1) stores each zero point
#   minus one, "gptq_v2" the zero point;
# - AWQ GEMM (AutoAWQ's WQLinear_GEMM): qweight (K, N/8) and qzeros (G, N/8) packed along N with
#   nibble i of word c holding column 8c + AWQ_ORDER[i]; scales (G, N); no g_idx.

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 packed along dim 1 -> (R, 8C) uint8, value j at bits 4(j % 8) of word j // 8."""
    return int4_gemm.unpack(words)


def _symmetric_or(zeros: torch.Tensor) -> torch.Tensor | None:
    """None where every zero point is the symmetric 8 (the kernel then reads no zero points)."""
    return None if bool((zeros == int4_gemm.SYMMETRIC_ZERO).all()) else zeros


def _with_act_order(q: torch.Tensor, scales, zeros, g_idx, group: int):
    """(N, K) values in the checkpoint's column order -> the layout, put in group order where the
    checkpoint's g_idx is not the plain k // group."""
    K = q.shape[1]
    plain = torch.arange(K, device=q.device) // group
    qweight = int4_gemm.pack(q)
    if g_idx is None or torch.equal(g_idx.to(torch.int64), plain):
        return qweight, scales, zeros, None
    return int4_gemm.act_order(qweight, scales, zeros, g_idx, group)


def from_compressed_tensors(weight_packed, weight_scale, weight_zero_point=None, weight_shape=None, g_idx=None,
                            group: int = 128):
    N, K = (int(v) for v in weight_shape) if weight_shape is not None else (weight_packed.shape[0],
                                                                            weight_packed.shape[1] * 8)
    if K % int4_gemm.PACK:
        raise ValueError(f"a weight of {K} inputs does not fill its int32 words (K must be a multiple of 8)")
    q = _unpack_rows(weight_packed)[:, :K]
    zeros = None
    if weight_zero_point is not None:
        zeros = _unpack_rows(weight_zero_point.t().contiguous())[:, :N].t().contiguous()  # packed along N
    return _with_act_order(q, weight_scale, zeros, g_idx, group)


def from_gptq(qweight, qzeros, scales, g_idx=None, group: int = 128, zero_offset: int = 1):
    """`zero_offset`: 1 for checkpoint_format "gptq" (zero points stored minus one), 0 for "gptq_v2"."""
    q = _unpack_rows(qweight.t().contiguous())  # (N, K): packed along K, N rows after the transpose
    zeros = (_unpack_rows(qzeros).to(torch.int16) + zero_offset).t().contiguous()  # (N, G); v1's 15 + 1 = 16
    if int(zeros.max()) > 255:
        raise ValueError("GPTQ zero points past 255")
    zeros = _symmetric_or(zeros.to(torch.uint8))
    return _with_act_order(q, scales.t().contiguous(), zeros, g_idx, group)


def _unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """(R, C) AWQ words -> (R, 8C): nibble i of word c is column 8c + AWQ_ORDER[i]."""
    nibbles = _unpack_rows(words).view(words.shape[0], words.shape[1], 8)
    out = torch.empty_like(nibbles)
    out[..., list(AWQ_ORDER)] = nibbles
    return out.view(words.shape[0], -1)


def from_awq(qweight, qzeros, scales, group: int = 128):
    q = _unpack_awq(qweight).t().contiguous()  # (K, N) -> (N, K)
    zeros = _symmetric_or(_unpack_awq(qzeros).t().contiguous())
    return _with_act_order(q, scales.t().contiguous(), zeros, None, group)
