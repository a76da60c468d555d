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

import torch


from .base import Pass, PassContext, PassResult, register
from .fp8_dequant import NotDequant, find_dequant
from .matching import (
    FLOAT_DTYPES, Node, aten, dtype, insert_call, is_op, linear_operands, location, shape, untransposed,
)

SUPPORTED_FP8 = (torch.float8_e4m3fn,)
MODES = ("w8a16", "w8a8")


def fp8_mode(ctx: PassContext) -> str:
    """The FP8 GEMM mode: pass_options first, then the target's [passes] table, else w8a16."""
    mode = ctx.options.get("fp8_mode", ctx.target.pass_options.get("fp8_mode", "w8a16"))
    if mode not in MODES:
        raise ValueError(f"fp8_mode must be one of {MODES}, got {mode!r}")
    return mode


@register
class FP8GEMM(Pass):
    """dequant(FP8 weight, block scales) + linear -> metainfer::fp8_linear (no bf16 weight copy)"""

    name = "fp8_gemm"

    def run(self, graph, ctx: PassContext) -> PassResult:
        res = PassResult(modified=False)
        mode = fp8_mode(ctx)
        for node in list(graph.nodes):
            if not is_op(node, aten.mm, aten.addmm, aten.bmm):
                continue
            site = _linear_operands(node)
            if site is None:
                continue
            x, wt, bias = site
            try:
                dq = find_dequant(wt.args[0])
                if dq is None:
                    continue
                _check(x, bias, dq)
            except NotDequant as e:
                res.near_misses.append(f"{location(node)}: FP8 GEMM not replaced: {e}")
                continue
            vector_bias = bias is not None and len(shape(bias)) == 1
            new = insert_call(graph, node, torch.ops.metainfer.fp8_linear.default,
                              (x, dq.weight, dq.scale, bias if vector_bias else None, dq.block_n, dq.block_k,
                               mode == "w8a8"))
            if bias is not None and not vector_bias:  # addmm(residual, x, W^T): add it back
                new = insert_call(graph, node, aten.add.Tensor, (new, bias))
            node.replace_all_uses_with(new)
            res.matches += 1
            N, K = shape(dq.weight)
            shared = [u.name for u in dq.out.users if u is not wt]
            extra = f"; the dequantised weight is still computed for {', '.join(shared)}" if shared else ""
            res.decisions.append(
                f"{location(node)}: dequant + linear -> metainfer.fp8_linear {mode.upper()} "
                f"([{N}, {K}] e4m3, {dq.block_n}x{dq.block_k} block scales, x {str(dtype(x)).replace('torch.', '')}; "
                f"reads {N * K} FP8 weight bytes instead of writing and reading a "
                f"{N * K * dtype(dq.out).itemsize}-byte dequantised copy){extra}")
        res.modified = res.matches > 0
        return res


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
    if dtype(x) not in FLOAT_DTYPES or dtype(x) != dtype(dq.out):
        raise NotDequant(f"activations {dtype(x)} and dequantised weight {dtype(dq.out)} differ")
    if bias is not None and len(shape(bias)) == 1 and dtype(bias) != dtype(x):
        raise NotDequant(f"bias dtype {dtype(bias)} differs from the activations' {dtype(x)}")
