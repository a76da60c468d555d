"""The block-scaled FP8 GEMM (Triton, under the interpreter on CPU) and its CPU path against the
float32 reference, the W8A16 kernel against the model's dequantise-then-linear fallback, and the
W8A8 result against W8A16 within the activation-quantisation error bound of the module docstring."""

import contextlib
import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

import metainfer.kernels  # noqa: F401  (sets TRITON_INTERPRET before the kernel module is imported)
import metainfer.kernels.fp8_gemm as K
from metainfer.kernels import KernelInputError

CFG = K.DEFAULT_CONFIGS["interpreter"]
BLOCKS = [16, 32, 64, 128]
# block_n 1 and 2: per-channel scales (compressed-tensors' "channel" is block_n 1, block_k >= K);
# 256 / 512 cover whole weights (per-tensor): every map channel_blocks gives
N_BLOCKS = [1, 2, *BLOCKS, 256]
K_BLOCKS = [*BLOCKS, 512]
# unit roundoff of each x dtype; outputs may differ by one ulp = 2u (see the module docstring)
U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SLACK = 1e-4  # times A = |x| @ |w|^T: float32 accumulation-order differences
W8A8_REL_FROBENIUS = 0.04


@st.composite
def problems(draw, max_m=70, max_n=150, max_k=300):
    M = draw(st.integers(1, max_m))
    lead = draw(st.sampled_from(["2d", "3d", "3d-batch2"]))
    return dict(
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        lead=(M,) if lead == "2d" else (1, M) if lead == "3d" else (2, max(1, M // 2)),
        N=draw(st.integers(1, max_n)), K=draw(st.integers(1, max_k)),
        bn=draw(st.sampled_from(N_BLOCKS)), bk=draw(st.sampled_from(K_BLOCKS)),
        bias=draw(st.booleans()), act_quant=draw(st.booleans()),
        padded=draw(st.booleans()),  # x rows strided wider than K, as a slice of a wider buffer
    )


def make(p):
    N, Kd, bn, bk = p["N"], p["K"], p["bn"], p["bk"]
    # per-block magnitudes 2^-3..2^3, so a tile that read the wrong scale would be far off
    wmag = 2.0 ** torch.randint(-3, 4, (math.ceil(N / bn), math.ceil(Kd / bk))).float()
    wmag = wmag.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :Kd]
    w, s = K.quantize_weight(torch.randn(N, Kd) * wmag / math.sqrt(Kd), bn, bk)
    # per-row and per-K-group magnitudes for the activation scales of W8A8
    shape = (*p["lead"], Kd)
    xmag = 2.0 ** torch.randint(-2, 3, (*p["lead"], math.ceil(Kd / bk))).float()
    x = torch.randn(shape) * xmag.repeat_interleave(bk, -1)[..., :Kd]
    if p["padded"]:
        buf = torch.zeros((*p["lead"], Kd + 5))
        buf[..., :Kd] = x
        x = buf[..., :Kd]
    x = x.to(p["dtype"])
    bias = torch.randn(N) if p["bias"] else None
    return x, w, s, bias


def magnitude(x, w, s, bn, bk, bias=None):
    """A = |x| @ |w_real|^T (+ |bias|): the scale of a dot product's rounding errors."""
    A = x.float().abs() @ K.dequantize(w, s, bn, bk, torch.float32).abs().T
    return A if bias is None else A + bias.float().abs()


def assert_within(out, ref, bound, what):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    err = (out.float() - ref.float()).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements out of bound, worst excess "
                           f"{(err - bound).max().item():.3g}, max err {err.max().item():.3g}")


def ref_bound(ref, A, dtype):
    return 2 * U[dtype] * ref.float().abs() + SLACK * A


def w8a8_bound(x, w, s, bn, bk, A):
    """|y8 - y16| <= 2^-4 A + 2^-10 (x_scale @ |w|^T): e4m3 rounding of each activation."""
    _, xs = K.quantize_activations(x, bk)
    xs_full = xs.repeat_interleave(bk, -1)[..., :x.shape[-1]]
    return 2.0**-4 * A + 2.0**-10 * (xs_full @ K.dequantize(w, s, bn, bk, torch.float32).abs().T)


def big_enough(M, N, Kd):
    """Shapes where the W8A8 errors average down enough for the Frobenius bound."""
    return Kd >= 64 and M * N >= 256


def check_launch(p):
    x, w, s, bias = make(p)
    args = (x, w, s, bias, p["bn"], p["bk"], p["act_quant"])
    out = K.launch(*args, config=CFG)
    assert out.shape == (*x.shape[:-1], p["N"]) and out.dtype == x.dtype and out.is_contiguous()
    A = magnitude(x, w, s, p["bn"], p["bk"], bias)
    ref = K.reference(*args)
    assert_within(out, ref, ref_bound(ref, A, p["dtype"]), "launch vs reference")
    return x, w, s, bias, out, A


@settings(max_examples=30, deadline=None)
@given(p=problems())
def test_triton_kernel_matches_reference(p, interpret):
    x, w, s, bias, out, A = check_launch(p)
    bn, bk, dt = p["bn"], p["bk"], p["dtype"]
    if not p["act_quant"]:
        fb = K.fallback(x, w, s, bias, bn, bk)
        # the fallback rounds each weight, the bias and (torch on CPU) x @ w^T to x's dtype; both
        # round the result to x's dtype, whose ulp doubles where one of them crosses a power of 2
        # (fb just below 64 and out 64 in fp16: 0.0625 apart, one ulp of out's binade)
        top = torch.maximum(fb.float().abs(), out.float().abs())
        assert_within(out, fb, 2 * U[dt] * top + (2 * U[dt] + SLACK) * A, "W8A16 vs fallback")
    else:
        # W8A8 against W8A16: the activation quantisation error, elementwise
        y16 = K.reference(x, w, s, bias, bn, bk, False)
        bound = (w8a8_bound(x, w, s, bn, bk, magnitude(x, w, s, bn, bk))
                 + ref_bound(out, A, dt) + ref_bound(y16, A, dt))
        assert_within(out, y16, bound, "W8A8 vs W8A16")
        if bias is None and big_enough(out.numel() // p["N"], p["N"], p["K"]):
            rel = ((out.float() - y16.float()).norm() / y16.float().norm()).item()
            assert rel < W8A8_REL_FROBENIUS, rel


@settings(max_examples=20, deadline=None)
@given(p=problems(max_m=40, max_n=80, max_k=200), triton=st.booleans())
def test_prequantised_activations_give_the_same_result_bit_for_bit(p, triton, interpret):
    """metainfer::fp8_linear_quantized on fp8_quantize_activations(x) computes what a W8A8
    fp8_linear computes from x (its own quantisation is the same function), on the Triton path
    under the interpreter and on the CPU path."""
    import metainfer.kernels.ops  # noqa: F401  (registers the ops)

    x, w, s, bias = make(p)
    bn, bk = p["bn"], p["bk"]
    xq, xs = torch.ops.metainfer.fp8_quantize_activations(x, bk)
    assert torch.equal(xq.float(), K.quantize_activations(x, bk)[0].float())
    if triton:
        ref = K.launch(x, w, s, bias, bn, bk, True, config=CFG)
        out = K.launch(x, w, s, bias, bn, bk, True, config=CFG, activations=(xq, xs))
    else:
        ref = K.cpu_forward(x, w, s, bias, bn, bk, True)
        out = K.cpu_forward(x, w, s, bias, bn, bk, True, activations=(xq, xs))
    assert torch.equal(out, ref)
    assert torch.equal(torch.ops.metainfer.fp8_linear_quantized(x, xq, xs, w, s, bias, bn, bk),
                       torch.ops.metainfer.fp8_linear(x, w, s, bias, bn, bk, True))


def test_prequantised_activations_are_checked():
    x = torch.randn(3, 64)
    w, s = K.quantize_weight(torch.randn(8, 64), 16, 32)
    xq, xs = K.quantize_activations(x, 32)
    for bad, msg in [((xq.float(), xs), "x_fp8 must be float8_e4m3fn"), ((xq[:2], xs), "x_fp8 must be"),
                     ((xq, xs[:, :1]), r"x_scale must be float32 of shape \(3, 2\)"),
                     ((xq, xs.double()), "x_scale must be float32")]:
        with pytest.raises(KernelInputError, match=msg):
            K.cpu_forward(x, w, s, None, 16, 32, True, activations=bad)
    with pytest.raises(KernelInputError, match="W8A16 linear"):
        K.cpu_forward(x, w, s, None, 16, 32, False, activations=(xq, xs))


@settings(max_examples=30, deadline=None)
@given(p=problems())
def test_cpu_path_matches_reference(p):
    x, w, s, bias = make(p)
    args = (x, w, s, bias, p["bn"], p["bk"], p["act_quant"])
    with mock.patch.object(K, "_CPU_CHUNK_BYTES", 4096):  # several chunks even at small sizes
        out = K.cpu_forward(*args)
    ref = K.reference(*args)
    A = magnitude(x, w, s, p["bn"], p["bk"], bias)
    assert_within(out, ref, ref_bound(ref, A, p["dtype"]), "cpu vs reference")


# The two ways GPUs without native e4m3 support are served: reading the weight's bits and
# decoding them in the kernel (pre-sm_89, ROCm), and an fp16 dot on sm_89+ if fp8 dots are off.
@pytest.mark.parametrize("plan", [dict(FP8_NATIVE=False, FP8_DOT=False), dict(FP8_NATIVE=True, FP8_DOT=False)],
                         ids=["decode-bits", "fp16-dot"])
@settings(max_examples=10, deadline=None)
@given(p=problems(max_m=40, max_n=80, max_k=160))
def test_non_native_fp8_paths(plan, p, interpret):
    with mock.patch.object(K, "_plan", lambda device: plan):
        check_launch(p)


def test_decode_every_e4m3_bit_pattern(interpret):
    import triton
    import triton.language as tl

    @triton.jit
    def _decode(B, O):
        r = tl.arange(0, 256)
        tl.store(O + r, K._e4m3_bits_to_f32(tl.load(B + r)))

    bits = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256)
    _decode[(1,)](bits, out)
    ref = bits.view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(ref)  # 0x7F / 0xFF (NaN) decode to +-480; weights never hold them
    assert torch.equal(out[finite], ref[finite])


def test_w8a8_relative_frobenius_error():
    """Gaussian data on shapes where errors average down: ||y8 - y16||_F / ||y16||_F < 0.04
    (measured 0.019-0.029 over 2000 random shapes, median 0.024; 2^-4 is the per-element worst)."""
    g = torch.Generator().manual_seed(1)
    errs = []
    for _ in range(40):
        M, N, Kd = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((4, 71), (64, 151), (64, 301)))
        bn, bk = (BLOCKS[int(i)] for i in torch.randint(0, 4, (2,), generator=g))
        assert big_enough(M, N, Kd)
        w, s = K.quantize_weight(torch.randn(N, Kd, generator=g) / math.sqrt(Kd), bn, bk)
        x = torch.randn(M, Kd, generator=g)
        y16 = K.reference(x, w, s, None, bn, bk, False)
        y8 = K.cpu_forward(x, w, s, None, bn, bk, True)
        errs.append(((y8 - y16).norm() / y16.norm()).item())
    assert max(errs) < W8A8_REL_FROBENIUS, max(errs)
    assert min(errs) > 0.01  # the activations really were quantised


def test_w8a8_kernel_relative_frobenius_error(interpret):
    x = torch.randn(2, 24, 192).to(torch.bfloat16)
    w, s = K.quantize_weight(torch.randn(96, 192) / math.sqrt(192), 32, 64)
    y16 = K.launch(x, w, s, None, 32, 64, False, config=CFG).float()
    y8 = K.launch(x, w, s, None, 32, 64, True, config=CFG).float()
    assert 0.01 < ((y8 - y16).norm() / y16.norm()).item() < W8A8_REL_FROBENIUS


def test_cpu_path_never_dequantises_the_whole_weight():
    x = torch.randn(3, 100)
    w, s = K.quantize_weight(torch.randn(150, 100), 32, 16)
    rows = []
    real = K._expanded_scales
    with mock.patch.object(K, "_CPU_CHUNK_BYTES", 64 * 100 * 4), \
            mock.patch.object(K, "_expanded_scales", lambda s_, r, *a: rows.append(len(r)) or real(s_, r, *a)):
        out = K.cpu_forward(x, w, s, None, 32, 16, False)
    assert rows == [64, 64, 22]  # chunks of 64 rows of float32 weight, the last one partial
    assert_within(out, K.reference(x, w, s, None, 32, 16), 1e-4 * magnitude(x, w, s, 32, 16), "chunked")


def e4m3_round_trip_bound(real, scale_full):
    # normal range: 3 mantissa bits -> 2^-4 relative; subnormal range: half of 2^-9 * scale
    return 2.0**-4 * real.abs() + 2.0**-10 * scale_full


@settings(max_examples=30, deadline=None)
@given(N=st.integers(1, 150), Kd=st.integers(1, 300), bn=st.sampled_from(N_BLOCKS), bk=st.sampled_from(BLOCKS),
       zero_block=st.booleans())
def test_quantize_weight_round_trip(N, Kd, bn, bk, zero_block):
    wr = torch.randn(N, Kd) * 10.0 ** torch.empty(N, Kd).uniform_(-4, 1)  # subnormal e4m3 included
    if zero_block:
        wr[:bn, :bk] = 0
    w, s = K.quantize_weight(wr, bn, bk)
    assert w.dtype == torch.float8_e4m3fn and w.shape == (N, Kd) and w.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (math.ceil(N / bn), math.ceil(Kd / bk))
    s_full = s.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :Kd]
    back = K.dequantize(w, s, bn, bk, torch.float32)
    assert ((back - wr).abs() <= e4m3_round_trip_bound(wr, s_full) * (1 + 1e-6)).all()
    # each block's largest magnitude maps to 448 exactly; an all-zero block has scale 1
    wf = w.float().abs()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = wf[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            if zero_block and i == 0 and j == 0:
                assert s[0, 0] == 1 and (blk == 0).all()
            else:
                assert blk.max() == K.FP8_MAX
    for dt in (torch.bfloat16, torch.float16):  # one rounding of the float32 dequantisation
        assert torch.equal(K.dequantize(w, s, bn, bk, dt), back.to(dt))


@settings(max_examples=20, deadline=None)
@given(lead=st.sampled_from([(1,), (5,), (2, 3)]), Kd=st.integers(1, 300), group=st.sampled_from(BLOCKS),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_quantize_activations(lead, Kd, group, dtype):
    x = (torch.randn(*lead, Kd) * 10.0 ** torch.empty(*lead, Kd).uniform_(-3, 1)).to(dtype)
    x[..., :group] = 0  # an all-zero group: scale 1
    q, xs = K.quantize_activations(x, group)
    G = math.ceil(Kd / group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert xs.dtype == torch.float32 and xs.shape == (*lead, G)
    assert (xs[..., 0] == 1).all() and (q[..., :group].float() == 0).all()
    xs_full = xs.repeat_interleave(group, -1)[..., :Kd]
    xf = x.float()
    assert ((q.float() * xs_full - xf).abs() <= e4m3_round_trip_bound(xf, xs_full) * (1 + 1e-6)).all()
    for g in range(1, G):  # each nonzero group's amax maps to 448
        assert (q[..., g * group:(g + 1) * group].float().abs().amax(-1) == K.FP8_MAX).all()
    # DeepSeek's act_quant, written out: s = amax / 448 per group (1 if 0), q = x / s in e4m3
    xp = torch.nn.functional.pad(xf, (0, G * group - Kd)).unflatten(-1, (G, group))
    amax = xp.abs().amax(-1)
    assert torch.equal(xs, torch.where(amax == 0, torch.ones_like(amax), amax / 448.0))
    assert torch.equal(q.view(torch.uint8), (xf / xs_full).to(torch.float8_e4m3fn).view(torch.uint8))


def test_config_clamped_to_scale_blocks_and_validated(interpret):
    x = torch.randn(20, 70)
    w, s = K.quantize_weight(torch.randn(40, 70), 16, 16)
    big = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128)  # larger than the scale blocks: clamped
    for aq in (False, True):
        ref = K.reference(x, w, s, None, 16, 16, aq)
        out = K.launch(x, w, s, None, 16, 16, aq, config=big)
        assert_within(out, ref, ref_bound(ref, magnitude(x, w, s, 16, 16), torch.float32), "clamped")
    tiles = lambda *shape: tuple(K._clamp(big, *shape)[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))  # noqa: E731
    assert tiles(20, 40, 70, 16, 16) == (32, 64, 16)  # BLOCK_K within a scale group; N tiles read a scale per column
    assert tiles(3, 1000, 4096, 128, 128) == (16, 128, 128)
    for bad in (dict(BLOCK_M=24, BLOCK_N=16, BLOCK_K=16), dict(BLOCK_M=16, BLOCK_N=8, BLOCK_K=16),
                dict(BLOCK_M=16, BLOCK_N=16)):
        with pytest.raises(KernelInputError, match="power of two"):
            K.launch(x, w, s, None, 16, 16, False, config=bad)


def test_fp8_dot_only_on_k_tiles_of_32(interpret):
    """W8A8 dots the FP8 tiles directly only where the K tile is at least 32 (an fp8 tl.dot's
    minimum on sm_89/sm_90); a 16-wide scale block or K of 16 dots them as fp16 (exact for
    e4m3), with the same result."""
    seen = []
    real = K._fp8_gemm_fwd

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **meta):
                seen.append((meta["BLOCK_K"], meta["FP8_DOT"]))
                return real[grid](*args, **meta)
            return run

    x = torch.randn(5, 64)
    with mock.patch.object(K, "_fp8_gemm_fwd", Spy()):
        for bk, kd in ((16, 64), (32, 64), (128, 16)):
            w, s = K.quantize_weight(torch.randn(24, kd), 16, bk)
            xk = x[:, :kd]
            ref = K.reference(xk, w, s, None, 16, bk, True)
            out = K.launch(xk, w, s, None, 16, bk, True, config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64))
            assert_within(out, ref, ref_bound(ref, magnitude(xk, w, s, 16, bk), torch.float32), f"bk {bk} K {kd}")
    assert seen == [(16, False), (32, True), (16, False)]


def test_empty_and_single_rows(interpret):
    w, s = K.quantize_weight(torch.randn(20, 40), 16, 16)
    x1 = torch.randn(40)
    for fn in (lambda *a: K.launch(*a, config=CFG), K.cpu_forward, K.reference):
        assert fn(torch.randn(0, 3, 40), w, s, None, 16, 16, False).shape == (0, 3, 20)
        y = fn(x1, w, s, None, 16, 16, True)
        assert y.shape == (20,)
        assert_within(y, K.reference(x1, w, s, None, 16, 16, True), 1e-4 * magnitude(x1, w, s, 16, 16), "1-D x")


def _inputs():
    w, s = K.quantize_weight(torch.randn(20, 40), 16, 32)  # scale_inv (2, 2)
    return torch.randn(3, 40), w, s, torch.randn(20)


@pytest.mark.parametrize("bad, msg", [
    (lambda x, w, s, b: (x, w.to(torch.float8_e5m2), s, b, 16, 32), "e5m2.*not supported"),
    (lambda x, w, s, b: (x, w.float().to(torch.float8_e4m3fnuz), s, b, 16, 32), "e4m3fnuz.*not supported"),
    (lambda x, w, s, b: (x, w.float().to(torch.bfloat16), s, b, 16, 32), "float8_e4m3fn"),
    (lambda x, w, s, b: (x, w, s[:, :1], b, 16, 32), r"\(2, 2\).*got \(2, 1\)"),
    (lambda x, w, s, b: (x, w, s, b, 16, 16), r"\(2, 3\).*got \(2, 2\)"),
    (lambda x, w, s, b: (x, w, s.bfloat16(), b, 16, 32), "scale_inv has dtype.*float32"),
    (lambda x, w, s, b: (x[:, :30], w, s, b, 16, 32), "last dim"),
    (lambda x, w, s, b: (x.double(), w, s, b, 16, 32), "x has dtype"),
    (lambda x, w, s, b: (x.long(), w, s, b, 16, 32), "x has dtype"),
    (lambda x, w, s, b: (x, w, s, b[:10], 16, 32), "bias shape"),
    (lambda x, w, s, b: (x, w, s, b, 24, 32), "block_n must be a power of two"),
    (lambda x, w, s, b: (x, w, s, b, 16, 8), "block_k must be a power of two"),
    (lambda x, w, s, b: (x, w, s.to("meta"), b, 16, 32), "different devices"),
    (lambda x, w, s, b: (x, w, s, b.to("meta"), 16, 32), "different devices"),
    (lambda x, w, s, b: (x, w[None], s, b, 16, 32), "2-D"),
])
def test_rejects_bad_inputs(bad, msg):
    x, w, s, b = _inputs()
    args = bad(x, w, s, b)
    with pytest.raises(KernelInputError, match=msg):
        K.launch(*args, False, config=CFG)
    with pytest.raises(KernelInputError, match=msg):
        K.cpu_forward(*args, False)


def test_rejects_strided_rows_and_bad_flag():
    x, w, s, b = _inputs()
    with pytest.raises(KernelInputError, match="unit stride"):
        K.launch(torch.randn(40, 3).T, w, s, b, 16, 32, False, config=CFG)
    with pytest.raises(KernelInputError, match="act_quant must be a bool"):
        K.launch(x, w, s, b, 16, 32, 1, config=CFG)


# ---- decode shapes: SMALL_M rows and split-K; triton.autotune's candidates --------------------------

@contextlib.contextmanager
def split_k_sums():
    """Count the split-K reductions launched inside the block."""
    calls, real = [], K._sum_splits

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    with mock.patch.object(K, "_sum_splits", Counting()):
        yield calls


@settings(max_examples=20, deadline=None)
@given(p=problems(max_m=20, max_n=80, max_k=300), splits=st.integers(2, 4))
def test_split_k_matches_reference(p, splits, interpret):
    """K cut over 2-4 programs whose float32 partial sums a second launch adds (+ bias), rounded
    once: the same bound against the reference as one program over K; K and the split not block
    multiples, scale groups of 16-128."""
    x, w, s, bias = make(p)
    args = (x, w, s, bias, p["bn"], p["bk"], p["act_quant"])
    with split_k_sums() as sums:
        out = K.launch(*args, config={**CFG, "SPLITS": splits})
    ref = K.reference(*args)
    assert_within(out, ref, ref_bound(ref, magnitude(x, w, s, p["bn"], p["bk"], bias), p["dtype"]), "split-K")
    if p["bk"] < p["K"]:
        assert len(sums) == 1  # splits start on scale-group boundaries


def test_split_k_of_a_per_channel_weight_cuts_on_k_tiles(interpret):
    """One scale group over all of K (block_k >= K): K is still split, on tile boundaries."""
    bn, bk = K.channel_blocks(40, 300, "channel")
    assert (bn, bk) == (1, 512)
    w, s = K.quantize_weight(torch.randn(40, 300), bn, bk)
    assert s.shape == (40, 1)
    x = torch.randn(1, 300)
    with split_k_sums() as sums:
        out = K.launch(x, w, s, None, bn, bk, False, config={**CFG, "SPLITS": 3})
    ref = K.reference(x, w, s, None, bn, bk)
    assert len(sums) == 1
    assert_within(out, ref, ref_bound(ref, magnitude(x, w, s, bn, bk), torch.float32), "per-channel split-K")


def test_small_m_rows_and_split_k_chosen_by_shape(interpret):
    """M picks the SMALL_M row (decode) or the base row; split-K only for small M over few output
    tiles (the interpreter row pretends to 4 SMs), and only along whole scale groups."""
    from metainfer.kernels.configs import config_for, config_for_arch

    gpu = config_for_arch("fp8_gemm", "sm_90")
    assert [K._row_for_m(gpu, m)[0]["BLOCK_M"] for m in (1, 16, 17, 32, 64, 65, 4096)] == [16, 16, 32, 32, 64, 64, 64]
    assert [K._row_for_m(gpu, m)[1] for m in (1, 20, 65, 5000)] == [16, 32, 128, 4096]
    assert "AUTOTUNE" in K._row_for_m(gpu, 65)[0] and K._row_for_m(gpu, 8)[0]["AUTOTUNE"] != gpu["AUTOTUNE"]
    cfg = config_for("fp8_gemm", torch.device("cpu"))
    assert cfg["SM_COUNT"] == 4
    for (M, N, Kd), split in [((2, 20, 256), True), ((16, 40, 200), True), ((17, 20, 256), False),
                              ((2, 80, 256), False), ((2, 20, 60), False)]:
        w, s = K.quantize_weight(torch.randn(N, Kd), 32, 32)
        x = torch.randn(M, Kd)
        with split_k_sums() as sums:
            out = K.launch(x, w, s, None, 32, 32, False, config=cfg)
        ref = K.reference(x, w, s, None, 32, 32, False)
        assert_within(out, ref, ref_bound(ref, magnitude(x, w, s, 32, 32), torch.float32), str((M, N, Kd)))
        assert bool(sums) == split, (M, N, Kd)


def _candidate_rows():
    from metainfer.kernels.configs import config_for_arch

    gpu = config_for_arch("fp8_gemm", "sm_90")
    return [(f"M<={r['MAX_M']}" if "MAX_M" in r else "base", m) for r, m in
            [(gpu, 100)] + [(r, r["MAX_M"] - 3) for r in gpu["SMALL_M"]]]


@pytest.mark.parametrize("row,M", _candidate_rows())
def test_every_autotune_candidate_matches_reference(row, M, interpret):
    """Each CUDA row's config and AUTOTUNE alternatives (base and SMALL_M rows), as the fixed
    config, with split-K where the row would split on a GPU of 8 SMs."""
    from metainfer.kernels.configs import config_for_arch

    gpu = {**config_for_arch("fp8_gemm", "sm_90"), "SM_COUNT": 8, "SPLIT_MIN": 128}
    chosen, _ = K._row_for_m(gpu, M)
    w, s = K.quantize_weight(torch.randn(136, 520), 128, 128)
    x = torch.randn(M, 520).bfloat16()
    ref = K.reference(x, w, s, None, 128, 128, False)
    A = magnitude(x, w, s, 128, 128)
    for alt in ({}, *chosen["AUTOTUNE"]):
        cfg = {**chosen, **alt, "SMALL_M": ()}
        assert_within(K.launch(x, w, s, None, 128, 128, False, config=cfg), ref,
                      ref_bound(ref, A, torch.bfloat16), f"{row} {alt}")


def test_autotuned_launch_path(interpret, monkeypatch):
    """The tuned launch (as on a GPU) under the interpreter, its benchmark stubbed: each M bucket
    times its row's candidates once, then reuses the choice; split-K goes through the tuner too."""
    from metainfer.kernels import _common
    from metainfer.kernels.configs import config_for_arch

    monkeypatch.setattr(_common, "autotune_enabled", lambda device: True)
    timed = []

    def bench(kernel_call, quantiles):
        kernel_call()
        timed.append(1)
        return [0.5 if len(timed) == 2 else 1.0] * 3

    monkeypatch.setattr(_common, "AUTOTUNE_BENCH", bench)
    gpu = {**config_for_arch("fp8_gemm", "sm_90"), "SM_COUNT": 8, "SPLIT_MIN": 128}
    w, s = K.quantize_weight(torch.randn(72, 520), 128, 128)
    bias = torch.randn(72)
    for M in (3, 5, 40, 100):  # 3 and 5 share the M <= 16 bucket
        x = torch.randn(M, 520).half()
        with split_k_sums() as sums:
            out = K.launch(x, w, s, bias, 128, 128, False, config=gpu)
        ref = K.reference(x, w, s, bias, 128, 128, False)
        assert_within(out, ref, ref_bound(ref, magnitude(x, w, s, 128, 128, bias), torch.float16), str(M))
        assert bool(sums) == (M <= 64)
    assert len(timed) == 9, "three buckets (M <= 16, M <= 64, M 100) of three candidates each"
