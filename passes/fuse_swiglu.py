"""fuse_swiglu: silu(gate) * up -> metainfer::swiglu.

silu is written as F.silu (which Inductor decomposes to gate / (1 + exp(-gate)), inside a
float32 upcast and a cast back below float32) or as gate * sigmoid(gate); up may sit on
either side. gate and up may be two halves of one fused gate_up projection (split/slice
views); the op reads them in place.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


from .base import register
from .matching import FLOAT_DTYPES, dtype, same_shape, shape, silu_input
from .rules import Rule, PointwiseRulePass, positional


def _silu(g, written: str):
    return F.silu(g) if written == "F.silu" else g * torch.sigmoid(g)


def _rules():
    for written, up_first, dt in itertools.product(("F.silu", "g*sigmoid(g)"), (False, True),
                                                   (torch.float32, torch.bfloat16)):
        def pattern(gate, up, written=written, up_first=up_first):
            return up * _silu(gate, written) if up_first else _silu(gate, written) * up

        yield Rule("silu(gate) * up", "swiglu", positional(pattern, ("gate", "up")),
                   lambda gate, up: torch.ops.metainfer.swiglu(gate, up),
                   lambda dt: [torch.empty(2, 4, 8, dtype=dt), torch.empty(2, 4, 8, dtype=dt)], dt,
                   check=gate_up_proof, describe=_detail)


def gate_up_proof(m) -> str | None:
    """What a gated unit's op needs (SwiGLU, GeGLU): gate and up of one shape, float dtypes."""
    gate, up, out = m.kwargs["gate"], m.kwargs["up"], m.output_nodes()[0]
    if not (same_shape(shape(gate), shape(up)) and same_shape(shape(out), shape(up))):
        return f"gate {list(shape(gate))} and up {list(shape(up))} differ in shape (broadcasting)"
    if dtype(gate) not in FLOAT_DTYPES or dtype(up) not in FLOAT_DTYPES:
        return f"dtypes {dtype(gate)}, {dtype(up)}"
    return None


def _detail(m) -> str:
    return f"{list(shape(m.kwargs['gate']))}, {str(dtype(m.output_nodes()[0])).replace('torch.', '')}"


@register
class FuseSwiGLU(PointwiseRulePass):
    """silu(gate) * up -> metainfer::swiglu"""

    name = "fuse_swiglu"
    what = "swiglu"
    rules = tuple(_rules())

    @staticmethod
    def anchor(n) -> bool:  # silu(g) in any of its forms
        return silu_input(n) is not None
