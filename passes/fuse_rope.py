"""fuse_rope: rotary embedding x * cos + rotate_half(x) * sin -> metainfer::rope.

rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2], -1), its halves sliced or chunked. The
sum and the products may come in any operand order. Applied to q and k separately (each a
match). cos and sin are read as they are, broadcast (e.g. (B, 1, S, D)).
"""

from __future__ import annotations

import itertools

import torch


from .base import register
from .matching import FLOAT_DTYPES, aten, dtype, is_op, ndim, norm_dim, same_shape, shape
from .rules import Rule, PointwiseRulePass, positional


def _rotate_half(x, halves: str):
    if halves == "slices":
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _product(a, b, swap: bool):
    return b * a if swap else a * b


def _sum(a, b, swap: bool):
    return b + a if swap else a + b


def _rules():
    # every operand order; canonicalize makes most of them one pattern, registered once
    for halves, add_swap, cos_swap, sin_swap in itertools.product(("slices", "chunk"), *[(False, True)] * 3):
        def pattern(x, cos, sin, halves=halves, add_swap=add_swap, cos_swap=cos_swap, sin_swap=sin_swap):
            return _sum(_product(x, cos, cos_swap), _product(_rotate_half(x, halves), sin, sin_swap), add_swap)

        yield Rule("x*cos + rotate_half(x)*sin", "rope", positional(pattern, ("x", "cos", "sin")),
                   lambda x, cos, sin: torch.ops.metainfer.rope(x, cos, sin),
                   lambda dt: [torch.empty(2, 3, 4, 8, dtype=dt), torch.empty(2, 1, 4, 8, dtype=dt),
                               torch.empty(2, 1, 4, 8, dtype=dt)], check=_proof, describe=_detail)


def _proof(m) -> str | None:
    x, out = m.kwargs["x"], m.output_nodes()[0]
    if ndim(x) > 4:
        return f"x has {ndim(x)} dims; the op takes up to 4"
    for name in ("cos", "sin"):
        t = m.kwargs[name]
        try:
            ok = same_shape(torch.broadcast_shapes(shape(t), shape(x)), shape(x))
        except RuntimeError:
            ok = False
        if not ok:
            return f"{name} {list(shape(t))} does not broadcast to x {list(shape(x))}"
    if any(dtype(m.kwargs[k]) not in FLOAT_DTYPES for k in ("x", "cos", "sin")):
        return "unsupported dtype"
    want = torch.promote_types(torch.promote_types(dtype(x), dtype(m.kwargs["cos"])), dtype(m.kwargs["sin"]))
    if dtype(out) != want:
        return f"result dtype {dtype(out)} is not the promoted {want}"
    return None


def _detail(m) -> str:
    return f"x {list(shape(m.kwargs['x']))}, cos {list(shape(m.kwargs['cos']))}"


@register
class FuseRoPE(PointwiseRulePass):
    """x * cos + rotate_half(x) * sin -> metainfer::rope"""

    name = "fuse_rope"
    what = "rope"
    rules = tuple(_rules())

    @staticmethod
    def anchor(n) -> bool:  # cat(-a, b) along the last dim: a rotate_half
        if not is_op(n, aten.cat) or len(n.args[0]) != 2 or not is_op(n.args[0][0], aten.neg):
            return False
        dim, rank = (n.args[1] if len(n.args) > 1 else 0), ndim(n)
        return rank is not None and norm_dim(dim, rank) == rank - 1
