"""The group-quantised int4 GEMM (Triton, under the interpreter on CPU: its GEMV and tiled
kernels) and its CPU path against the float32 reference on hypothesis-drawn shapes, group sizes,
zero points, act-order permutations and biases; packing against a hand-written word; the
quantiser's round-trip error; act-order's permutation against the checkpoint's own columns;
bad inputs refused by name."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import metainfer.kernels  # noqa: F401  (sets TRITON_INTERPRET before the kernel module is imported)
import metainfer.kernels.int4_gemm as K
import metainfer.kernels.ops  # noqa: F401  (registers metainfer::int4_linear)
from metainfer.kernels import KernelInputError

CFG = K.DEFAULT_CONFIGS["interpreter"]
U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SLACK = 1e-4


@st.composite
def problems(draw):
    group = draw(st.sampled_from([16, 32, 64, 128, 48]))  # 48: a multiple of 16, not a power of two
    words = draw(st.integers(1, 40))
    return dict(
        M=draw(st.sampled_from([1, 2, 3, 4, 5, 9, 17, 33])),  # GEMV up to CFG's GEMV_MAX_M, tiles above
        lead3d=draw(st.booleans()),
        N=draw(st.integers(1, 90)), K=8 * words, group=group,
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        symmetric=draw(st.booleans()), perm=draw(st.booleans()), bias=draw(st.booleans()),
        scale_dtype=draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32])),
        seed=draw(st.integers(0, 2**16)),
    )


def make(p):
    g = torch.Generator().manual_seed(p["seed"])
    N, Kd, group = p["N"], p["K"], p["group"]
    # per-group magnitudes 2^-3..2^3: a tile that read the wrong group's scale is far off
    G = math.ceil(Kd / group)
    mag = 2.0 ** torch.randint(-3, 4, (N, G), generator=g).float()
    w = torch.randn(N, Kd, generator=g) * mag.repeat_interleave(group, 1)[:, :Kd] / math.sqrt(Kd)
    q, s, z = K.quantize_weight(w, group, symmetric=p["symmetric"], scale_dtype=p["scale_dtype"])
    x = torch.randn(*((1,) if p["lead3d"] else ()), p["M"], Kd, generator=g).to(p["dtype"])
    perm = torch.randperm(Kd, generator=g).to(torch.int32) if p["perm"] else None
    bias = torch.randn(N, generator=g) if p["bias"] else None
    return x, q, s, z, perm, bias, group


def bound(args, ref):
    x, q, s, z, perm, bias, group = args
    xs = x.float() if perm is None else x.float()[..., perm.long()]
    A = xs.abs() @ K.dequantize(q, s, z, group).abs().T + (0 if bias is None else bias.float().abs())
    return 2 * U[x.dtype] * ref.float().abs() + SLACK * A


def assert_close(out, ref, limit, what):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    err = (out.float() - ref.float()).abs()
    assert not (err > limit).any(), f"{what}: max err {err.max().item():.3g}, worst excess {(err - limit).max():.3g}"


@settings(max_examples=30, deadline=None)
@given(p=problems())
def test_kernel_and_cpu_path_match_the_reference(p):
    args = make(p)
    ref = K.reference(*args)
    limit = bound(args, ref)
    assert_close(K.launch(*args, config=CFG), ref, limit, "triton")
    assert_close(K.cpu_forward(*args), ref, limit, "cpu")
    assert_close(torch.ops.metainfer.int4_linear(*args), ref, limit, "op")


def test_packing_puts_value_k_in_nibble_k_mod_8():
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15, 0, 0, 0, 0, 0, 0, 0, 9]])
    words = K.pack(q)
    assert words.tolist() == [[int("f7654321", 16) - 2**32, 9 << 28 if (9 << 28) < 2**31 else (9 << 28) - 2**32]]
    assert torch.equal(K.unpack(words), q.to(torch.uint8))


@pytest.mark.parametrize("symmetric", [True, False])
def test_round_to_nearest_is_within_half_a_step(symmetric):
    """Rounding is off by half a step at most, but where a value is clipped: a symmetric group's
    largest value sits at +7.5 steps (GPTQ's range, 15 steps over 2 max|w|), an asymmetric
    group's ends move by the rounding of its zero point: one step at most there."""
    w = torch.randn(64, 256)
    q, s, z = K.quantize_weight(w, 64, symmetric=symmetric, scale_dtype=torch.float32)
    err = (K.dequantize(q, s, z, 64) - w).abs() / s.repeat_interleave(64, 1)
    assert err.max() <= 1 + 1e-5
    assert (err <= 0.5 + 1e-5).float().mean() > 0.98


def test_act_order_reads_x_through_the_permutation():
    """A GPTQ act-order checkpoint: column k of the weight belongs to group g_idx[k] (groups
    scattered over K). Put in group order once, the layer is x[:, perm] @ w_perm^T."""
    torch.manual_seed(0)
    N, Kd, group = 24, 128, 32
    w = torch.randn(N, Kd)
    g_idx = torch.randperm(Kd) // group  # each group's columns scattered
    # the checkpoint's quantisation: column k quantised with its group's scale
    order = torch.argsort(g_idx, stable=True)
    qp, s, z = K.quantize_weight(w[:, order], group, symmetric=False)
    q_ckpt = K.pack(K.unpack(qp)[:, torch.argsort(order)])  # back in the checkpoint's column order
    qw, s2, z2, perm = K.act_order(q_ckpt, s, z, g_idx, group)
    x = torch.randn(5, Kd)
    real = K.dequantize(qp, s, z, group)[:, torch.argsort(order)]  # the checkpoint's real weight, its own order
    assert torch.allclose(torch.ops.metainfer.int4_linear(x, qw, s2, z2, perm, None, group), x @ real.T, atol=1e-4)
    assert torch.allclose(K.launch(x, qw, s2, z2, perm, None, group, config=CFG), x @ real.T, atol=1e-4)
    with pytest.raises(KernelInputError, match="g_idx"):
        K.act_order(q_ckpt, s, z, torch.zeros(Kd, dtype=torch.int64), group)


@pytest.mark.parametrize("bad, match", [
    (dict(qweight=torch.zeros(4, 4, dtype=torch.int64)), "qweight must be 2-D int32"),
    (dict(group=24), "group must be a positive multiple of 16"),
    (dict(x=torch.randn(2, 16)), "x's last dim must equal K = 32"),
    (dict(scales=torch.ones(4, 2)), "scales must be"),
    (dict(zeros=torch.zeros(4, 1, dtype=torch.int32)), "zeros must be uint8"),
    (dict(perm=torch.arange(16)), "perm must be"),
    (dict(bias=torch.zeros(5)), "bias shape"),
])
def test_bad_inputs_are_refused_by_name(bad, match):
    args = dict(x=torch.randn(2, 32), qweight=torch.zeros(4, 4, dtype=torch.int32), scales=torch.ones(4, 1),
                zeros=None, perm=None, bias=None, group=32)
    args.update(bad)
    for fn in (K.cpu_forward, K.launch):
        with pytest.raises(KernelInputError, match=match):
            fn(**args)
