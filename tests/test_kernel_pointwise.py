"""RMSNorm(+residual), SwiGLU and RoPE kernels under the interpreter, and their CPU paths,
against the references on hypothesis-drawn shapes."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from metainfer.kernels import KernelInputError
from metainfer.kernels import rmsnorm as R
from metainfer.kernels import rope as P
from metainfer.kernels import glu as G
from metainfer.kernels.configs import config_for

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@settings(max_examples=30, deadline=None)
@given(dtype=DTYPES, rows=st.lists(st.integers(1, 5), min_size=1, max_size=3), n=st.integers(1, 300),
       offset=st.sampled_from([0.0, 1.0]), residual=st.booleans(), out_f32=st.booleans())
def test_rmsnorm(dtype, rows, n, offset, residual, out_f32, interpret):
    x = torch.randn(*rows, n, dtype=dtype)
    w = torch.randn(n, dtype=dtype)
    r = torch.randn(*rows, n, dtype=dtype) if residual else None
    out_dtype = torch.float32 if out_f32 else dtype
    cfg = config_for("rmsnorm", x.device)
    got = R.launch(x, w, 1e-6, offset, out_dtype, residual=r, config=cfg)
    ref = R.reference(x, w, 1e-6, offset, out_dtype, residual=r)
    cpu = R.cpu_forward(x, w, 1e-6, offset, out_dtype, residual=r)
    if residual:
        close(got[0], ref[0], dtype)
        close(got[1], ref[1], dtype)
        close(cpu[0], ref[0], dtype)
    else:
        close(got, ref, dtype)
        close(cpu, ref, dtype)


@settings(max_examples=30, deadline=None)
@given(dtype=DTYPES, rows=st.lists(st.integers(1, 6), min_size=1, max_size=3), n=st.integers(1, 200),
       packed=st.booleans(), activation=st.sampled_from(G.ACTIVATIONS))
def test_glu(dtype, rows, n, packed, activation, interpret):
    if packed:  # the two halves of one fused gate_up projection: strided views
        gate, up = torch.randn(*rows, 2 * n, dtype=dtype).chunk(2, dim=-1)
    else:
        gate, up = torch.randn(*rows, n, dtype=dtype), torch.randn(*rows, n, dtype=dtype)
    got = G.launch(gate, up, config=config_for("glu", gate.device), activation=activation)
    close(got, G.reference(gate, up, activation), dtype)
    close(G.cpu_forward(gate, up, activation), G.reference(gate, up, activation), dtype)


def test_glu_gelu_tanh_saturates_like_torch():
    """Large |gate|: the kernel's tanh from exp must give gate * up and 0, not NaN."""
    gate, up = torch.tensor([[-60.0, -8.0, 0.0, 8.0, 60.0]]), torch.ones(1, 5)
    got = G.launch(gate, up, config=config_for("glu", gate.device), activation="gelu_tanh")
    close(got, torch.nn.functional.gelu(gate, approximate="tanh"), torch.float32)


@settings(max_examples=30, deadline=None)
@given(dtype=DTYPES, b=st.integers(1, 2), h=st.integers(1, 3), s=st.integers(1, 20),
       half=st.integers(1, 40), transposed=st.booleans(), cos_rank=st.sampled_from([2, 3, 4]))
def test_rope(dtype, b, h, s, half, transposed, cos_rank, interpret):
    d = 2 * half
    x = torch.randn(b, s, h, d, dtype=dtype).transpose(1, 2) if transposed else torch.randn(b, h, s, d, dtype=dtype)
    cshape = {2: (s, d), 3: (1, s, d), 4: (b, 1, s, d)}[cos_rank]
    cos, sin = torch.randn(cshape, dtype=dtype), torch.randn(cshape, dtype=dtype)
    got = P.launch(x, cos, sin, config=config_for("rope", x.device))
    close(got, P.reference(x, cos, sin), dtype)
    close(P.cpu_forward(x, cos, sin), P.reference(x, cos, sin), dtype)
    assert got.is_contiguous()


def test_rope_reference_is_rotate_half():
    x = torch.arange(8.0).view(1, 1, 1, 8)
    cos, sin = torch.zeros(8), torch.ones(8)
    assert P.reference(x, cos, sin).flatten().tolist() == [-4.0, -5.0, -6.0, -7.0, 0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("call, msg", [
    (lambda: R.launch(torch.randn(4, 8), torch.randn(7), 1e-6, 0.0, torch.float32, config={}), "weight shape"),
    (lambda: R.launch(torch.randn(4, 8).long(), torch.randn(8), 1e-6, 0.0, torch.float32, config={}), "dtype"),
    (lambda: R.launch(torch.randn(8, 4).t(), torch.randn(8), 1e-6, 0.0, torch.float32, config={}), "unit stride"),
    (lambda: R.launch(torch.randn(4, 8), torch.randn(8), 1e-6, 0.0, torch.float32,
                      residual=torch.randn(4, 9), config={}), "residual shape"),
    (lambda: G.launch(torch.randn(4, 8), torch.randn(4, 9), config=config_for("glu", torch.device("cpu"))), "shape"),
    (lambda: G.launch(torch.randn(4, 8), torch.randn(4, 8), config=config_for("glu", torch.device("cpu")),
                      activation="relu"), "activation"),
    (lambda: P.launch(torch.randn(2, 7), torch.randn(7), torch.randn(7), config=config_for("rope", torch.device("cpu"))), "even"),
    (lambda: P.launch(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), config=config_for("rope", torch.device("cpu"))), "broadcast"),
])
def test_launchers_reject_bad_inputs(call, msg):
    with pytest.raises(KernelInputError, match=msg):
        call()
