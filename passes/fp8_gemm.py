"""fp8_gemm: F.linear(x, dequant(w_fp8, scale_inv)) -> metainfer::fp8_linear.

The fallback dequantises the whole FP8 weight to the activation dtype on every call (an
(N, K) bf16 copy written and read again: 3x the weight bytes of the FP8 weight itself) and
runs a bf16 GEMM. The op reads the FP8 weight and its block scales directly.

Modes: "w8a16" (default: activations stay in their dtype; equal to the fallback within the
dtype's rounding) or "w8a8" (activations quantised per 1 x block_k group to e4m3, DeepSeek's
scheme for FP8 tensor cores; relative error ~2^-5 per product, see
metainfer.kernels.fp8_gemm). W8A8 is opt-in: pass_options={"fp8_mode": "w8a8"}, or
`[passes] fp8_mode = "w8a8"` in the target's TOML. The report says which mode ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from metainfer.kernels.fp8_gemm import scale_layout

from .base import MatchPass, PassContext, register
from .options import Option
from .fp8_dequant import Dequant, NotDequant, find_dequant
from .matching import (
    FLOAT_DTYPES, Node, aten, dtype, insert_call, is_op, linear_operands, location, shape, untransposed,
)

SUPPORTED_FP8 = (torch.float8_e4m3fn,)
MODES = ("w8a16", "w8a8")


def fp8_mode(ctx: PassContext) -> str:
    """The FP8 GEMM mode (pass_options, else the target's [passes] table, else w8a16)."""
    return ctx.options["fp8_mode"]


@dataclass
class _Site:
    x: Node
    wt: Node  # the transposed dequantised weight the GEMM reads
    bias: Node | None
    dq: Dequant
    mode: str


@register
class FP8GEMM(MatchPass):
    """dequant(FP8 weight, block scales) + linear -> metainfer::fp8_linear (no bf16 weight copy)"""

    name = "fp8_gemm"
    options = (Option("fp8_mode", str, "w8a16", "w8a16: FP8 weights, activations in their dtype; w8a8: activations "
                      "quantised per token to FP8 too (faster on FP8 tensor cores, rounds more)", choices=MODES),)
    missed = "FP8 GEMM not replaced"
    misses = (NotDequant,)

    def start(self, graph, ctx: PassContext):
        return SimpleNamespace(graph=graph, mode=fp8_mode(ctx))

    def match(self, node, state) -> _Site | None:
        if not is_op(node, aten.mm, aten.addmm, aten.bmm):
            return None
        found = _linear_operands(node)
        if found is None:
            return None
        x, wt, bias = found
        dq = find_dequant(wt.args[0])
        if dq is None:
            return None
        _check(x, bias, dq)
        return _Site(x, wt, bias, dq, state.mode)

    def rewrite(self, node, site: _Site, state) -> None:
        x, bias, dq = site.x, site.bias, site.dq
        vector_bias = bias is not None and len(shape(bias)) == 1
        new = insert_call(state.graph, node, torch.ops.metainfer.fp8_linear.default,
                          (x, dq.weight, dq.scale, bias if vector_bias else None, dq.block_n, dq.block_k,
                           site.mode == "w8a8"))
        if bias is not None and not vector_bias:  # addmm(residual, x, W^T): add it back
            new = insert_call(state.graph, node, aten.add.Tensor, (new, bias))
        node.replace_all_uses_with(new)

    def describe(self, node, site: _Site) -> str:
        dq = site.dq
        N, K = shape(dq.weight)
        shared = [u.name for u in dq.out.users if u is not site.wt]
        extra = f"; the dequantised weight is still computed for {', '.join(shared)}" if shared else ""
        return (f"{location(node)}: dequant + linear -> metainfer.fp8_linear {site.mode.upper()} "
                f"([{N}, {K}] e4m3, {scale_layout(N, K, dq.block_n, dq.block_k)} scales, x "
                f"{str(dtype(site.x)).replace('torch.', '')}; reads {N * K} FP8 weight bytes instead of writing "
                f"and reading a {N * K * dtype(dq.out).itemsize}-byte dequantised copy){extra}")


def _linear_operands(node: Node):
    """(x, the transposed weight node, bias or None) of a linear GEMM with W^T = permute(W)."""
    found = linear_operands(node)
    if found is None:
        return None
    x, wt, bias = found
    return (x, wt, bias) if untransposed(wt, 2) is not None else None


def _check(x, bias, dq) -> None:
    if dtype(dq.weight) not in SUPPORTED_FP8:
        raise NotDequant(f"FP8 format {dtype(dq.weight)} is not supported by the kernel "
                         f"(supported: {', '.join(str(d) for d in SUPPORTED_FP8)})")
    if dtype(dq.scale) != torch.float32:
        raise NotDequant(f"the scales are {dtype(dq.scale)}; the kernel reads float32 scales")
    if dtype(x) not in FLOAT_DTYPES or dtype(x) != dtype(dq.out):
        raise NotDequant(f"activations {dtype(x)} and dequantised weight {dtype(dq.out)} differ")
    if bias is not None and len(shape(bias)) == 1 and dtype(bias) != dtype(x):
        raise NotDequant(f"bias dtype {dtype(bias)} differs from the activations' {dtype(x)}")
