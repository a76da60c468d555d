"""fuse_rmsnorm: RMSNorm as models write it (and residual-add + RMSNorm) -> one op.

Recognised (post-grad ATen), with optional float32 upcasts and casts back anywhere:
    x * rsqrt(mean(x^2, -1, keepdim) + eps) * w        (Llama, Mistral, Qwen)
    x / sqrt(mean(x*x, -1, keepdim) + eps) * w
    ... * (1 + w)                                       (Gemma)
When x is itself `a + b` of equal shapes and dtypes, the add is fused too:
metainfer::add_rmsnorm returns (norm, a + b) and the sum's other users (the residual
stream) read the op's second output.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from metainfer.lowering import ops  # noqa: F401  (registers torch.ops.metainfer.*)

from . import base
from .base import Pass, PassContext, PassResult, register
from .matching import (
    CONVERT_OPS, FLOAT_DTYPES, Node, aten, dtype, escaping_uses, insert_call, is_op, is_scalar, location, ndim, order,
    peel, reduces_last_dim, same, same_shape, shape,
)



@dataclass
class Norm:
    x: Node  # input before any upcast
    weight: Node
    eps: float
    weight_offset: float
    out: Node  # the last node of the pattern
    nodes: list[Node]  # pattern nodes whose only users must be inside the pattern
    residual: tuple[Node, Node] | None = None  # (a, b) when x = a + b is fused


@register
class FuseRMSNorm(Pass):
    """x * rsqrt(mean(x^2) + eps) * w (optionally after x = a + b) -> metainfer::rmsnorm / add_rmsnorm"""

    name = "fuse_rmsnorm"
    cost_gated = True
    profitable_kinds = ("cuda",)
    unprofitable_why = "Inductor's C++ loops already fuse this chain"

    def run(self, graph, ctx: PassContext) -> PassResult:
        res = PassResult(modified=False)
        fuse_residual = ctx.options.get("fuse_residual_add", True)
        for node in list(graph.nodes):
            if not is_op(node, aten.rsqrt, aten.sqrt):
                continue
            try:
                m = _match(node)
            except _Miss as e:
                res.near_misses.append(f"{location(node)}: rmsnorm not fused: {e}")
                continue
            if m is None:
                continue
            if fuse_residual:
                _find_residual(m)
            if not _rewrite(graph, m):
                res.near_misses.append(f"{location(node)}: rmsnorm not fused: no valid insertion point")
                continue
            res.matches += 1
            kind = "add+rmsnorm" if m.residual else "rmsnorm"
            res.decisions.append(
                f"{location(node)}: {kind} -> metainfer.{'add_rmsnorm' if m.residual else 'rmsnorm'} "
                f"(dim {shape(m.x)[-1]}, eps {m.eps:g}{', weight+%g' % m.weight_offset if m.weight_offset else ''}, "
                f"{_dt(dtype(m.x))} -> {_dt(dtype(m.out))})")
        res.modified = res.matches > 0
        return res


class _Miss(base.NearMiss):
    pass


def _dt(d) -> str:
    return str(d).replace("torch.", "")


def _match(r: Node) -> Norm | None:
    """Anchor: rsqrt (or sqrt) of mean(x^2) + eps."""
    add = r.args[0]
    if not is_op(add, aten.add):
        return None
    a, b = add.args[0], add.args[1]
    mean, eps = (a, b) if is_scalar(b) else (b, a) if is_scalar(a) else (None, None)
    if mean is None or not is_op(mean, aten.mean):
        return None
    sq = mean.args[0]
    if is_op(sq, aten.pow) and sq.args[1] == 2:
        xf = sq.args[0]
    elif is_op(sq, aten.mul) and sq.args[0] is sq.args[1]:
        xf = sq.args[0]
    else:
        return None
    rank = ndim(xf)
    if rank is None or not reduces_last_dim(mean, rank):
        return None
    if not eps >= 0:
        raise _Miss(f"eps {eps} is negative")
    nodes = [sq, mean, add, r]
    # normalised = x * rsqrt(...)  or  x / sqrt(...)
    normed = None
    for u in r.users:
        if is_op(r, aten.rsqrt) and is_op(u, aten.mul) and {id(u.args[0]), id(u.args[1])} == {id(xf), id(r)}:
            normed = u
        elif is_op(r, aten.sqrt) and is_op(u, aten.div) and u.args[0] is xf and u.args[1] is r:
            normed = u
    if normed is None:
        return None
    nodes.append(normed)
    # optional cast, then the weight multiply
    cur = normed
    while len(cur.users) == 1 and is_op(next(iter(cur.users)), *CONVERT_OPS):
        cur = next(iter(cur.users))
        nodes.append(cur)
    wmul = next(iter(cur.users)) if len(cur.users) == 1 else None
    if wmul is None or not is_op(wmul, aten.mul):
        raise _Miss("the normalised value is not multiplied by a weight (or has other users)")
    wexpr = wmul.args[1] if wmul.args[0] is cur else wmul.args[0]
    weight, offset, wnodes = _weight(wexpr, shape(xf)[-1])
    if weight is None:
        raise _Miss("the scale applied after normalising is not a (1 + )weight vector of the hidden size")
    if not same_shape(shape(wmul), shape(xf)):
        raise _Miss("the weight multiply broadcasts to another shape")
    nodes += wnodes + [wmul]
    out = wmul
    while len(out.users) == 1 and is_op(next(iter(out.users)), *CONVERT_OPS):
        out = next(iter(out.users))
        nodes.append(out)
    x = xf
    while is_op(x, *CONVERT_OPS) and dtype(x.args[0]) in FLOAT_DTYPES and dtype(x) == torch.float32:
        if any(u not in (sq, normed) for u in x.users):
            break  # the upcast has other users: keep it, read the upcast value
        nodes.append(x)
        x = x.args[0]
    if dtype(x) not in FLOAT_DTYPES or dtype(out) not in FLOAT_DTYPES:
        raise _Miss(f"dtypes {dtype(x)} -> {dtype(out)}")
    escaped = escaping_uses(nodes, set(nodes), exits=(out,))
    if escaped:
        first = escaped[0][0]
        raise _Miss(f"intermediate {first.name} is also used by {', '.join(u.name for n, u in escaped if n is first)}")
    return Norm(x=x, weight=weight, eps=float(eps), weight_offset=offset, out=out, nodes=nodes)


def _weight(w, hidden) -> tuple[Node | None, float, list[Node]]:
    """w, cast(w), w + c, c + w (c a number) for a 1-D w of size `hidden`."""
    offset, nodes = 0.0, []
    if is_op(w, aten.add) and (is_scalar(w.args[1]) or is_scalar(w.args[0])):
        c, w2 = (w.args[1], w.args[0]) if is_scalar(w.args[1]) else (w.args[0], w.args[1])
        if w.kwargs.get("alpha", 1) != 1:
            return None, 0.0, []
        offset, nodes, w = float(c), [w], w2
    w, casts = peel(w, CONVERT_OPS)
    nodes += casts
    s = shape(w)
    if not isinstance(w, Node) or s is None or len(s) != 1 or not same(s[0], hidden) or dtype(w) not in FLOAT_DTYPES:
        return None, 0.0, []
    # the weight casts are pattern nodes only when nothing else reads them
    nodes = [n for n in nodes if len(n.users) == 1]
    return w, offset, nodes


def _find_residual(m: Norm) -> None:
    x = m.x
    if not is_op(x, aten.add) or x.kwargs.get("alpha", 1) != 1:
        return
    a, b = x.args[0], x.args[1]
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return
    if not (same_shape(shape(a), shape(x)) and same_shape(shape(b), shape(x))):
        return  # broadcasting add (e.g. a bias): not a residual
    if not (dtype(a) == dtype(b) == dtype(x)):
        return
    m.residual = (a, b)


def _rewrite(graph, m: Norm) -> bool:
    pos = order(graph)
    if m.residual:
        a, b = m.residual
        # the fused op replaces the add: it must sit before every user of the sum and the norm
        users = [u for u in m.x.users if u not in m.nodes] + list(m.out.users)
        anchor = min([m.x] + users, key=pos.__getitem__)
        if any(pos[i] >= pos[anchor] for i in (a, b, m.weight) if i in pos):
            return False
        fused = insert_call(graph, anchor, torch.ops.metainfer.add_rmsnorm.default,
                            (a, b, m.weight, m.eps, m.weight_offset, dtype(m.out)), meta_from=m.out)
        normed = insert_call(graph, anchor, operator.getitem, (fused, 0), meta_from=m.out)
        summed = insert_call(graph, anchor, operator.getitem, (fused, 1), meta_from=m.out)
        m.out.replace_all_uses_with(normed)
        m.x.replace_all_uses_with(summed)
        return True
    anchor = m.out
    if pos.get(m.weight, -1) >= pos[anchor]:
        return False
    new = insert_call(graph, anchor, torch.ops.metainfer.rmsnorm.default,
                      (m.x, m.weight, m.eps, m.weight_offset, dtype(m.out)), meta_from=m.out)
    m.out.replace_all_uses_with(new)
    return True
