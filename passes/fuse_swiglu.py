"""fuse_swiglu: silu(gate) * up -> metainfer::swiglu.

silu appears decomposed in post-grad graphs: gate / (1 + exp(-gate)) (Inductor's form,
often inside a float32 upcast and a cast back), gate * sigmoid(gate), or aten.silu. gate and
up may be two halves of one fused gate_up projection (split/slice views); the op reads them
in place.
"""

from __future__ import annotations

import torch

from metainfer.lowering import ops  # noqa: F401  (registers torch.ops.metainfer.*)

from .base import Pass, PassContext, PassResult, register
from .matching import CONVERT_OPS, Node, aten, dtype, insert_call, is_op, location, same_shape, shape

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@register
class FuseSwiGLU(Pass):
    """silu(gate) * up -> metainfer::swiglu"""

    name = "fuse_swiglu"
    cost_gated = True
    profitable_kinds = ("cuda",)
    unprofitable_why = "Inductor's C++ loops already fuse this chain"

    def run(self, graph, ctx: PassContext) -> PassResult:
        res = PassResult(modified=False)
        for node in list(graph.nodes):
            if not is_op(node, aten.mul) or not all(isinstance(a, Node) for a in node.args[:2]):
                continue
            for s_side, up in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
                found = _silu(s_side)
                if found is None:
                    continue
                gate, inner = found
                why = _why_not(node, gate, up, inner)
                if why:
                    res.near_misses.append(f"{location(node)}: swiglu not fused: {why}")
                    break
                new = insert_call(graph, node, torch.ops.metainfer.swiglu.default, (gate, up))
                node.replace_all_uses_with(new)
                res.matches += 1
                res.decisions.append(f"{location(node)}: silu(gate) * up -> metainfer.swiglu "
                                     f"({list(shape(gate))}, {str(dtype(node)).replace('torch.', '')})")
                break
        res.modified = res.matches > 0
        return res


def _silu(n) -> tuple[Node, list[Node]] | None:
    """(gate, the nodes computing silu(gate) from it) if n is silu(gate), with casts."""
    chain = []
    while is_op(n, *CONVERT_OPS):
        chain.append(n)
        n = n.args[0]
    if is_op(n, aten.silu):
        return _uncast(n.args[0], chain + [n])
    if is_op(n, aten.div):  # g / (1 + exp(-g))
        g, den = n.args[0], n.args[1]
        if is_op(den, aten.add) and (den.args[1] == 1 or den.args[0] == 1):
            e = den.args[0] if den.args[1] == 1 else den.args[1]
            if is_op(e, aten.exp) and is_op(e.args[0], aten.neg) and e.args[0].args[0] is g:
                return _uncast(g, chain + [n, den, e, e.args[0]])
    if is_op(n, aten.mul):  # g * sigmoid(g)
        for g, s in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
            if is_op(s, aten.sigmoid) and s.args[0] is g:
                return _uncast(g, chain + [n, s])
    return None


def _uncast(g: Node, chain: list[Node]) -> tuple[Node, list[Node]]:
    """Read the gate before an upcast that only silu uses (the kernel upcasts itself)."""
    while is_op(g, *CONVERT_OPS) and all(u in chain for u in g.users) and dtype(g.args[0]) in _FLOATS:
        chain = chain + [g]
        g = g.args[0]
    return g, chain


def _why_not(mul: Node, gate, up, inner: list[Node]) -> str | None:
    if not isinstance(gate, Node) or not isinstance(up, Node):
        return "gate or up is not a tensor"
    if not (same_shape(shape(gate), shape(up)) and same_shape(shape(mul), shape(up))):
        return f"gate {list(shape(gate))} and up {list(shape(up))} differ in shape (broadcasting)"
    if dtype(gate) not in _FLOATS or dtype(up) not in _FLOATS:
        return f"dtypes {dtype(gate)}, {dtype(up)}"
    if torch.promote_types(dtype(gate), dtype(up)) != dtype(mul):
        return f"result dtype {dtype(mul)} is not promote({dtype(gate)}, {dtype(up)})"
    inside = set(inner) | {mul}
    for n in inner:
        extra = [u.name for u in n.users if u not in inside]
        if extra:
            return f"silu intermediate {n.name} is also used by {', '.join(extra)}"
    return None
