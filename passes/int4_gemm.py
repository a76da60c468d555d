"""int4_gemm: F.linear(x, metainfer::int4_dequantize(packed weight)) -> metainfer::int4_linear.

A quantized linear (models/quantized.py) dequantises its whole packed 4-bit weight to the
activation dtype on every call, an (N, K) copy written and read again (4.5x the packed weight's
bytes in bf16), then runs a dense GEMM. The op reads the packed weight, its scales and zero points
directly (kernels/int4_gemm.py). The dequantisation is an op of fixed meaning, so the match is a
proof: the GEMM's weight is that op's output, transposed, in the activations' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import MatchPass, NearMiss, register
from .matching import (
    FLOAT_DTYPES, Node, aten, dtype, insert_call, is_op, is_reshape, linear_operands, location, shape, untransposed,
)


class NotInt4(NearMiss):
    """A packed int4 weight feeds a GEMM in a way the op does not compute; the message says how."""


@dataclass
class _Site:
    x: Node
    bias: Node | None
    dequant: Node  # metainfer::int4_dequantize(qweight, scales, zeros, group, dtype)
    perm: Node | None = None  # act-order: x is index_select(x0, -1, perm); the kernel reads x0 through perm


@register
class Int4GEMM(MatchPass):
    """int4_dequantize(packed weight) + linear -> metainfer::int4_linear (no dequantised weight copy)"""

    name = "int4_gemm"
    missed = "int4 GEMM not replaced"
    misses = (NotInt4,)

    def match(self, node, state) -> _Site | None:
        if not is_op(node, aten.mm, aten.addmm, aten.bmm):
            return None
        found = linear_operands(node)
        if found is None:
            return None
        x, wt, bias = found
        w = untransposed(wt, 2)
        if w is None or not is_op(w, torch.ops.metainfer.int4_dequantize):
            return None
        if dtype(x) not in FLOAT_DTYPES or dtype(x) != dtype(w):
            raise NotInt4(f"activations {dtype(x)} and the dequantised weight {dtype(w)} differ")
        if bias is not None and len(shape(bias)) == 1 and dtype(bias) != dtype(x):
            raise NotInt4(f"bias dtype {dtype(bias)} differs from the activations' {dtype(x)}")
        x, perm = _act_order_input(x)
        return _Site(x, bias, w, perm)

    def rewrite(self, node, site: _Site, state) -> None:
        qweight, scales, zeros, group = site.dequant.args[:4]
        vector_bias = site.bias is not None and len(shape(site.bias)) == 1
        x = site.x
        if isinstance(x, tuple):  # the flattening view, remade on the ungathered input
            view, x0 = x
            x = insert_call(state.graph, node, view.target, (x0, *view.args[1:]))
        new = insert_call(state.graph, node, torch.ops.metainfer.int4_linear.default,
                          (x, qweight, scales, zeros, site.perm, site.bias if vector_bias else None, group))
        if site.bias is not None and not vector_bias:  # addmm(residual, x, W^T): add it back
            new = insert_call(state.graph, node, aten.add.Tensor, (new, site.bias))
        node.replace_all_uses_with(new)

    def describe(self, node, site: _Site) -> str:
        qweight, scales, zeros, group = site.dequant.args[:4]
        N, words = shape(qweight)
        K = words * 8
        packed = N * words * 4
        copy = N * K * dtype(site.dequant).itemsize
        others = [u.name for u in site.dequant.users if u not in (node,) and not _feeds(u, node)]
        extra = f"; the dequantised weight is still computed for {', '.join(others)}" if others else ""
        return (f"{location(node)}: int4 dequant + linear -> metainfer.int4_linear ([{N}, {K}] in 4 bits, group "
                f"{group}, {'zero points' if zeros is not None else 'symmetric'}"
                f"{', act-order columns read through perm' if site.perm is not None else ''}, x "
                f"{str(dtype(site.x[1] if isinstance(site.x, tuple) else site.x)).replace('torch.', '')}; reads {packed} packed weight bytes instead of writing "
                f"and reading a {copy}-byte dequantised copy){extra}")


def _act_order_input(x: Node) -> tuple[Node | tuple, Node | None]:
    """(x0, perm) where the GEMM's x gathers x0's last-dim columns through a 1-D integer perm (an
    act-order layer's input, models/quantized.py), directly or under a view that flattens the
    leading dims ((x0, view args) then: the view is remade on x0); else (x, None)."""
    view = None
    if is_reshape(x) and _gather(x.args[0]) is not None:
        view, x = x, x.args[0]
    found = _gather(x)
    if found is None:
        return view or x, None
    x0, dim, perm = found
    rank = len(shape(x0) or ())
    val = x0.meta.get("val")
    if not (rank >= 1 and dim in (-1, rank - 1) and dtype(perm) in (torch.int32, torch.int64)
            and len(shape(perm) or ()) == 1 and shape(perm)[0] == shape(x0)[-1] and dtype(x0) == dtype(x)
            and (view is None or (val is not None and val.is_contiguous()))):
        return view or x, None
    return (x0 if view is None else (view, x0)), perm


def _gather(x) -> tuple | None:
    """(x0, dim, perm) of index_select(x0, dim, perm), or of the index.Tensor(x0, [None, ..., perm])
    Inductor's decompositions make of it (the gathered dim last)."""
    if is_op(x, aten.index_select):
        return tuple(x.args[:3])
    if is_op(x, aten.index) and isinstance(x.args[1], (list, tuple)):
        idx = list(x.args[1])
        if idx and all(i is None for i in idx[:-1]) and isinstance(idx[-1], Node):
            return x.args[0], len(idx) - 1, idx[-1]
    return None


def _feeds(transposed: Node, gemm: Node) -> bool:
    return gemm in transposed.users
