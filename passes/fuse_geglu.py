"""fuse_geglu: gelu_tanh(gate) * up -> metainfer::geglu (Gemma's MLP, `gelu_pytorch_tanh`).

The worked example of docs/adding-a-pass.md: the pattern is the model's math, the
replacement one op call, the proof what the pattern cannot say (no broadcasting, float
dtypes: fuse_swiglu's, the same op shape). GeLU's exact (erf) form is a different function and is left alone.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


from .base import register
from .fuse_swiglu import gate_up_proof
from .matching import aten, is_op, shape
from .rules import Rule, PointwiseRulePass, positional


def _rules():
    for up_first, dt in itertools.product((False, True), (torch.float32, torch.bfloat16)):
        def pattern(gate, up, up_first=up_first):
            act = F.gelu(gate, approximate="tanh")
            return up * act if up_first else act * up

        yield Rule("gelu_tanh(gate) * up", "geglu", positional(pattern, ("gate", "up")),
                   lambda gate, up: torch.ops.metainfer.geglu(gate, up),
                   lambda dt: [torch.empty(2, 4, 8, dtype=dt), torch.empty(2, 4, 8, dtype=dt)], dt,
                   check=gate_up_proof, describe=lambda m: f"{list(shape(m.kwargs['gate']))}")


@register
class FuseGeGLU(PointwiseRulePass):
    """gelu_tanh(gate) * up -> metainfer::geglu"""

    name = "fuse_geglu"
    what = "geglu"
    rules = tuple(_rules())

    @staticmethod
    def anchor(n) -> bool:  # the tanh of GeLU's approximation
        return is_op(n, aten.tanh)
