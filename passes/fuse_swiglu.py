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
from .matching import FLOAT_DTYPES, Node, aten, dtype, escaping_uses, insert_call, is_op, location, same_shape, shape, silu_input

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
                found = silu_input(s_side)
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


def _why_not(mul: Node, gate, up, inner: list[Node]) -> str | None:
    if not isinstance(gate, Node) or not isinstance(up, Node):
        return "gate or up is not a tensor"
    if not (same_shape(shape(gate), shape(up)) and same_shape(shape(mul), shape(up))):
        return f"gate {list(shape(gate))} and up {list(shape(up))} differ in shape (broadcasting)"
    if dtype(gate) not in FLOAT_DTYPES or dtype(up) not in FLOAT_DTYPES:
        return f"dtypes {dtype(gate)}, {dtype(up)}"
    if torch.promote_types(dtype(gate), dtype(up)) != dtype(mul):
        return f"result dtype {dtype(mul)} is not promote({dtype(gate)}, {dtype(up)})"
    escaped = escaping_uses(inner, set(inner) | {mul})
    if escaped:
        first = escaped[0][0]
        return f"silu intermediate {first.name} is also used by {', '.join(u.name for n, u in escaped if n is first)}"
    return None
