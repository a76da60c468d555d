"""fuse_rope: rotary embedding x * cos + rotate_half(x) * sin -> metainfer::rope.

rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2], -1) in post-grad form: two slices of x, a
neg, a cat. The adds and multiplies may come in any operand order. Applied to q and k
separately (each a match). cos and sin are read as they are, broadcast (e.g. (B, 1, S, D)).
"""

from __future__ import annotations

import torch

from metainfer.lowering import ops  # noqa: F401  (registers torch.ops.metainfer.*)

from .base import Pass, PassContext, PassResult, register
from .matching import Node, aten, dtype, insert_call, is_op, location, ndim, norm_dim, same, same_shape, shape

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@register
class FuseRoPE(Pass):
    """x * cos + rotate_half(x) * sin -> metainfer::rope"""

    name = "fuse_rope"

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


def _rotate_half_of(r) -> tuple[Node, list[Node]] | None:
    """x if r == cat(-x[..., h:], x[..., :h], -1) with h = D/2."""
    if not is_op(r, aten.cat):
        return None
    parts, dim = r.args[0], (r.args[1] if len(r.args) > 1 else 0)
    rank = ndim(r)
    if len(parts) != 2 or rank is None or norm_dim(dim, rank) != rank - 1:
        return None
    neg, lo = parts
    if not is_op(neg, aten.neg) or not is_op(lo, aten.slice) or not is_op(neg.args[0], aten.slice):
        return None
    hi = neg.args[0]
    x = lo.args[0]
    if hi.args[0] is not x:
        return None
    d = shape(x)[-1]
    if not isinstance(d, int) or d % 2:
        return None
    h = d // 2

    def sl(s):
        a = list(s.args) + [None] * (5 - len(s.args))
        dim_, start, end, step = a[1], a[2] or 0, a[3], a[4] or 1
        end = d if end is None or (isinstance(end, int) and end >= d) else end
        return norm_dim(dim_, rank), start, end, step

    if sl(hi) != (rank - 1, h, d, 1) or sl(lo) != (rank - 1, 0, h, 1):
        return None
    return x, [r, neg, hi, lo]


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
    if any(dtype(t) not in _FLOATS for t in (x, cos, sin)):
        return "unsupported dtype"
    want = torch.promote_types(torch.promote_types(dtype(x), dtype(cos)), dtype(sin))
    if dtype(add) != want:
        return f"result dtype {dtype(add)} is not the promoted {want}"
    inside = set(inner) | {add}
    for n in inner:
        extra = [u.name for u in n.users if u not in inside]
        if extra:
            return f"intermediate {n.name} is also used by {', '.join(extra)}"
    return None
