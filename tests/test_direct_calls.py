"""Inductor's wrapper calls metainfer's ops as plain functions (lowering/direct_calls.py): the
generated code names `metainfer_direct.<op>` instead of `torch.ops.metainfer.<op>.default`, and
computes what the ops compute through the dispatcher."""

import torch

from metainfer.kernels import ops
from metainfer.lowering import direct_calls


def test_every_op_has_a_direct_call():
    import inspect

    assert set(vars(ops.direct)) == set(ops.__all__)
    assert set(direct_calls.REGISTERED) == set(ops.__all__)
    for name in ops.__all__:  # Inductor passes the schema's arguments, some by name: the function takes them
        schema = [a.name for a in getattr(torch.ops.metainfer, name).default._schema.arguments]
        assert list(inspect.signature(getattr(ops.direct, name)).parameters) == schema, name


def _step(x, r, w, q, k, v):
    """A multi-output op, optional and default arguments, a dtype argument."""
    y, h = torch.ops.metainfer.add_rmsnorm(x * 2.0, r, w, 1e-6, 0.0, torch.float32)
    a = torch.ops.metainfer.attention(q, k, v, None, 0.25, True, k.shape[2] - q.shape[2], False)
    return y + 1.0, h, a * 3.0


def test_inductor_calls_the_plain_functions():
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g), torch.randn(16, generator=g)
    q, k, v = torch.randn(1, 4, 2, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g)
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False):
        got, (code,) = run_and_get_code(torch.compile(_step, backend="inductor", fullgraph=True), x, r, w, q, k, v)
    calls = [line.strip() for line in code.splitlines() if "metainfer" in line and "(" in line and "#" not in line]
    assert any(c.startswith("buf") and "= metainfer_direct.add_rmsnorm(" in c for c in calls), calls
    assert any("= metainfer_direct.attention(" in c for c in calls), calls
    assert not any("torch.ops.metainfer.add_rmsnorm.default(" in c or "torch.ops.metainfer.attention.default(" in c
                   for c in calls), calls
    want = _step(x, r, w, q, k, v)  # eager: through the dispatcher
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
