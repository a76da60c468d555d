"""metainfer's custom ops: schema and fake implementations agree with the real ones
(torch.library.opcheck), and each op dispatches to its kernel as documented."""

import pytest
import torch

import metainfer.lowering.ops  # noqa: F401
from metainfer import kernels

m = torch.ops.metainfer


def cases():
    q = torch.randn(2, 4, 5, 16).transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous
    k, v = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 8)
    x, w, r = torch.randn(3, 5, 32), torch.randn(32), torch.randn(3, 5, 32)
    gu = torch.randn(3, 2 * 24)
    return [
        (m.attention.default, (q, k, v, None, 0.25, True, 2, False)),
        (m.attention.default, (q, k, v, torch.randn(2, 1, 5, 7), 0.25, False, 0, True)),
        (m.rmsnorm.default, (x, w, 1e-6, 0.0, torch.float32)),
        (m.rmsnorm.default, (x.bfloat16(), w.bfloat16(), 1e-6, 1.0, torch.float32)),
        (m.add_rmsnorm.default, (x, r, w, 1e-5, 0.0, torch.float32)),
        (m.swiglu.default, (gu[:, :24], gu[:, 24:])),
        (m.rope.default, (q, torch.randn(5, 16), torch.randn(1, 1, 5, 16))),
    ]


@pytest.mark.parametrize("op, args", cases(), ids=lambda x: getattr(x, "__name__", ""))
def test_opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("op, args", cases(), ids=lambda x: getattr(x, "__name__", ""))
def test_outputs_contiguous_and_match_interpreted_kernels(op, args, interpret):
    with kernels.interpret(False):
        cpu = op(*args)
    triton = op(*args)
    for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (cpu, triton))):
        assert a.is_contiguous() and b.is_contiguous()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)
