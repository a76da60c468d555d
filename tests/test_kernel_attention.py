"""The attention kernel (Triton, under the interpreter on CPU) and its CPU path, against the
plain-math reference, on hypothesis-drawn shapes including ones that are not block multiples."""

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from metainfer.kernels import KernelInputError
from metainfer.kernels import attention as A
from metainfer.lowering.kernel_configs import config_for

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@st.composite
def problems(draw, max_seq=40):
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    Sq = draw(st.integers(1, max_seq))
    Sk = draw(st.integers(1, max_seq))
    D = draw(st.sampled_from([8, 16, 24, 40, 64]))
    Dv = draw(st.sampled_from([D, 8, 40]))
    causal = draw(st.booleans())
    offset = draw(st.integers(0, 8)) if causal else 0
    mask_kind = draw(st.sampled_from(["none", "additive", "bool", "additive-heads"]))
    zero_empty = draw(st.booleans())
    return dict(dtype=dtype, B=B, Hkv=Hkv, group=group, Sq=Sq, Sk=Sk, D=D, Dv=Dv, causal=causal,
                offset=offset, mask_kind=mask_kind, zero_empty=zero_empty)


def make(p, device="cpu", noncontig=False):
    B, H, Hkv, Sq, Sk = p["B"], p["Hkv"] * p["group"], p["Hkv"], p["Sq"], p["Sk"]
    dt = p["dtype"]
    if noncontig:  # (B, S, H, D) storage, as a projection's view+transpose leaves it
        q = torch.randn(B, Sq, H, p["D"], dtype=dt, device=device).transpose(1, 2)
        k = torch.randn(B, Sk, Hkv, p["D"], dtype=dt, device=device).transpose(1, 2)
    else:
        q = torch.randn(B, H, Sq, p["D"], dtype=dt, device=device)
        k = torch.randn(B, Hkv, Sk, p["D"], dtype=dt, device=device)
    v = torch.randn(B, Hkv, Sk, p["Dv"], dtype=dt, device=device)
    mask = None
    if p["mask_kind"] == "additive":
        mask = torch.randn(B, 1, Sq, Sk, dtype=dt, device=device)
    elif p["mask_kind"] == "additive-heads":
        mask = torch.randn(1, H, Sq, Sk, dtype=torch.float32, device=device)
    elif p["mask_kind"] == "bool":
        mask = torch.rand(B, 1, Sq, Sk, device=device) > 0.3
    return q, k, v, mask, 1.0 / math.sqrt(p["D"])


def check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)


@settings(max_examples=40, deadline=None)
@given(p=problems())
def test_triton_kernel_matches_reference(p, interpret):
    q, k, v, mask, scale = make(p, noncontig=p["Sq"] % 2 == 0)
    args = (q, k, v, mask, scale, p["causal"], p["offset"], p["zero_empty"])
    out = A.launch(*args, config=config_for("attention", q.device, head_dim=max(p["D"], p["Dv"]), dtype=q.dtype))
    check(out, A.reference(*args), p["dtype"])
    assert out.is_contiguous()


@settings(max_examples=40, deadline=None)
@given(p=problems(max_seq=70))
def test_cpu_path_matches_reference(p):
    q, k, v, mask, scale = make(p, noncontig=p["Sk"] % 2 == 0)
    args = (q, k, v, mask, scale, p["causal"], p["offset"], p["zero_empty"])
    with mock.patch.object(A, "_CPU_CHUNK_BYTES", 4096):  # several chunks even at small sizes
        check(A.cpu_forward(*args), A.reference(*args), p["dtype"])


@pytest.mark.parametrize("D,Dv", [(256, 256), (192, 128), (128, 64)])
def test_large_and_distinct_head_dims(D, Dv, interpret):
    p = dict(dtype=torch.float32, B=1, Hkv=1, group=2, Sq=33, Sk=33, D=D, Dv=Dv, causal=True, offset=0,
             mask_kind="none", zero_empty=False)
    q, k, v, mask, scale = make(p)
    args = (q, k, v, mask, scale, True, 0, False)
    out = A.launch(*args, config=config_for("attention", q.device, head_dim=D))
    check(out, A.reference(*args), torch.float32)
    check(A.cpu_forward(*args), A.reference(*args), torch.float32)


def test_empty_rows_nan_or_zero(interpret):
    q, k, v = torch.randn(1, 1, 3, 16), torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    cfg = config_for("attention", q.device)
    for fn in (lambda *a: A.launch(*a, config=cfg), A.cpu_forward, A.reference):
        nan_out = fn(q, k, v, mask, 0.25, False, 0, False)
        zero_out = fn(q, k, v, mask, 0.25, False, 0, True)
        assert torch.isnan(nan_out[0, 0, 1]).all() and not torch.isnan(nan_out[0, 0, [0, 2]]).any()
        assert (zero_out[0, 0, 1] == 0).all()


def test_sdpa_path_used_where_it_applies(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    A.cpu_forward(q, k, v, None, 0.25, True, 0)
    assert calls, "equal head dims, causal at offset 0: torch's fused CPU kernel"
    calls.clear()
    A.cpu_forward(q, k, torch.randn(1, 2, 8, 8), None, 0.25, True, 0)
    assert not calls, "Dv != D: the chunked path (SDPA's CPU flash kernel would fall back to math)"


@pytest.mark.parametrize("bad, msg", [
    (lambda q, k, v: (q.long(), k, v, None), "dtype"),
    (lambda q, k, v: (q, k.double(), v, None), "dtype"),
    (lambda q, k, v: (q[0], k, v, None), "4-D"),
    (lambda q, k, v: (q, k[..., :8], v, None), "head dims differ"),
    (lambda q, k, v: (q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16), None), "multiple"),
    (lambda q, k, v: (q, k, v[:, :, :5], None), "does not match"),
    (lambda q, k, v: (q, k, v, torch.zeros(2, 3)), "broadcast"),
    (lambda q, k, v: (q, k, v, torch.zeros(8, 8, dtype=torch.int32)), "mask dtype"),
    (lambda q, k, v: (torch.randn(1, 4, 8, 300), torch.randn(1, 2, 8, 300), v, None), "head dims"),
])
def test_launcher_rejects_bad_inputs(bad, msg):
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    qq, kk, vv, mm = bad(q, k, v)
    with pytest.raises(KernelInputError, match=msg):
        A.launch(qq, kk, vv, mm, 0.25, False, 0, config=config_for("attention", q.device))
    with pytest.raises(KernelInputError, match=msg):
        A.cpu_forward(qq, kk, vv, mm, 0.25, False, 0)
