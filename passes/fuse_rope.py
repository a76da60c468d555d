"""fuse_rope: rotary embedding x * cos + rotate_half(x) * sin -> metainfer::rope.

rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2], -1) in post-grad form: two slices of x, a
neg, a cat. The adds and multiplies may come in any operand order. Applied to q and k
separately (each a match). cos and sin are read as they are, broadcast (e.g. (B, 1, S, D)).
"""

from __future__ import annotations

import operator

import torch

from metainfer.lowering import ops  # noqa: F401  (registers torch.ops.metainfer.*)

from .base import Pass, PassContext, PassResult, register
from .matching import FLOAT_DTYPES, Node, aten, dtype, escaping_uses, insert_call, is_op, location, ndim, norm_dim, same_shape, shape


@register
class FuseRoPE(Pass):
    """x * cos + rotate_half(x) * sin -> metainfer::rope"""

    name = "fuse_rope"
    cost_gated = True
    profitable_kinds = ("cuda",)
    unprofitable_why = "Inductor's C++ loops already fuse this chain"

    def run(self, graph, ctx: PassContext) -> PassResult:
        res = PassResult(modified=False)
        for node in list(graph.nodes):
            if not is_op(node, aten.add) or node.kwargs.get("alpha", 1) != 1:
                continue
            m = _match(node)
            if m is None:
                continue
            x, cos, sin, inner = m
            why = _why_not(node, x, cos, sin, inner)
            if why:
                res.near_misses.append(f"{location(node)}: rope not fused: {why}")
                continue
            new = insert_call(graph, node, torch.ops.metainfer.rope.default, (x, cos, sin))
            node.replace_all_uses_with(new)
            res.matches += 1
            res.decisions.append(f"{location(node)}: x*cos + rotate_half(x)*sin -> metainfer.rope "
                                 f"(x {list(shape(x))}, cos {list(shape(cos))})")
        res.modified = res.matches > 0
        return res


def _half_of(n, rank: int) -> tuple[Node, int, list[Node]] | None:
    """(x, 0 or 1, nodes) if n is the low (0) or high (1) half of x along the last dim:
    a slice, or one output of split/chunk."""
    if is_op(n, aten.slice):
        x = n.args[0]
        d = shape(x)[-1] if shape(x) else None
        if not isinstance(d, int) or d % 2:
            return None
        a = list(n.args) + [None] * (5 - len(n.args))
        dim, start, end, step = a[1], a[2] or 0, a[3], a[4] or 1
        end = d if end is None or (isinstance(end, int) and end >= d) else end
        if norm_dim(dim, rank) != rank - 1 or step != 1:
            return None
        if (start, end) == (0, d // 2):
            return x, 0, [n]
        if (start, end) == (d // 2, d):
            return x, 1, [n]
        return None
    if n.op == "call_function" and n.target is operator.getitem and is_op(n.args[0], aten.split, aten.split_with_sizes):
        sp, i = n.args[0], n.args[1]
        x = sp.args[0]
        d = shape(x)[-1] if shape(x) else None
        size = sp.args[1]
        dim = sp.args[2] if len(sp.args) > 2 else sp.kwargs.get("dim", 0)
        if not isinstance(d, int) or d % 2 or norm_dim(dim, rank) != rank - 1:
            return None
        ok = size == d // 2 or (isinstance(size, (list, tuple)) and list(size) == [d // 2, d // 2])
        if ok and i in (0, 1):
            return x, i, [n, sp]
    return None


def _rotate_half_of(r) -> tuple[Node, list[Node]] | None:
    """x if r == cat(-x[..., h:], x[..., :h], -1) with h = D/2."""
    if not is_op(r, aten.cat):
        return None
    parts, dim = r.args[0], (r.args[1] if len(r.args) > 1 else 0)
    rank = ndim(r)
    if len(parts) != 2 or rank is None or norm_dim(dim, rank) != rank - 1:
        return None
    neg, lo = parts
    if not is_op(neg, aten.neg):
        return None
    hi, lo = _half_of(neg.args[0], rank), _half_of(lo, rank)
    if hi is None or lo is None or hi[0] is not lo[0] or hi[1] != 1 or lo[1] != 0:
        return None
    return hi[0], [r, neg, *hi[2], *lo[2]]


def _match(add: Node):
    a, b = add.args[0], add.args[1]
    for m1, m2 in ((a, b), (b, a)):
        if not (is_op(m1, aten.mul) and is_op(m2, aten.mul)):
            continue
        for r, sin in ((m2.args[0], m2.args[1]), (m2.args[1], m2.args[0])):
            rh = _rotate_half_of(r)
            if rh is None:
                continue
            x, inner = rh
            if m1.args[0] is x:
                cos = m1.args[1]
            elif m1.args[1] is x:
                cos = m1.args[0]
            else:
                continue
            return x, cos, sin, inner + [m1, m2]
    return None


def _why_not(add: Node, x, cos, sin, inner) -> str | None:
    if not all(isinstance(t, Node) for t in (cos, sin)):
        return "cos or sin is not a tensor"
    if ndim(x) > 4:
        return f"x has {ndim(x)} dims; the op takes up to 4"
    for name, t in (("cos", cos), ("sin", sin)):
        try:
            ok = same_shape(torch.broadcast_shapes(shape(t), shape(x)), shape(x))
        except RuntimeError:
            ok = False
        if not ok:
            return f"{name} {list(shape(t))} does not broadcast to x {list(shape(x))}"
    if not same_shape(shape(add), shape(x)):
        return "the result is broadcast beyond x's shape"
    if any(dtype(t) not in FLOAT_DTYPES for t in (x, cos, sin)):
        return "unsupported dtype"
    want = torch.promote_types(torch.promote_types(dtype(x), dtype(cos)), dtype(sin))
    if dtype(add) != want:
        return f"result dtype {dtype(add)} is not the promoted {want}"
    escaped = escaping_uses(inner, set(inner) | {add})
    if escaped:
        first = escaped[0][0]
        return f"intermediate {first.name} is also used by {', '.join(u.name for n, u in escaped if n is first)}"
    return None
