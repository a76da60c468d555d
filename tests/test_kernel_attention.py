"""The attention kernel (Triton, under the interpreter on CPU) and its CPU path, against the
plain-math reference, on hypothesis-drawn shapes including ones that are not block multiples."""

import contextlib
import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from metainfer.kernels import KernelInputError
from metainfer.kernels import attention as A
from metainfer.kernels._flash import SplitMerge
from metainfer.kernels.configs import config_for

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
    # soft-capping (2.0 caps random scores hard) and a sliding window (causal only) half the time
    softcap = draw(st.sampled_from([0.0, 0.0, 2.0, 30.0]))
    window = draw(st.integers(1, 20)) if causal and draw(st.booleans()) else 0
    return dict(dtype=dtype, B=B, Hkv=Hkv, group=group, Sq=Sq, Sk=Sk, D=D, Dv=Dv, causal=causal,
                offset=offset, mask_kind=mask_kind, zero_empty=zero_empty, softcap=softcap, window=window)


def op_args(p, q, k, v, mask, scale):
    """The op's arguments in order (softcap and window last, as optional)."""
    return (q, k, v, mask, scale, p["causal"], p["offset"], p["zero_empty"], p.get("softcap", 0.0),
            p.get("window", 0))


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
    args = op_args(p, q, k, v, mask, scale)
    out = A.launch(*args, config=config_for("attention", q.device, head_dim=max(p["D"], p["Dv"]), dtype=q.dtype))
    check(out, A.reference(*args), p["dtype"])
    assert out.is_contiguous()


@settings(max_examples=40, deadline=None)
@given(p=problems(max_seq=70))
def test_cpu_path_matches_reference(p):
    q, k, v, mask, scale = make(p, noncontig=p["Sk"] % 2 == 0)
    args = op_args(p, q, k, v, mask, scale)
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


@pytest.mark.parametrize("softcap,window", [(5.0, 0), (0.0, 6), (5.0, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_and_window_with_gqa(softcap, window, dtype, interpret):
    """4 query heads per kv head, sizes off the 16-row block, a bottom-right offset: kernel and
    CPU path against the reference."""
    p = dict(dtype=dtype, B=2, Hkv=2, group=4, Sq=23, Sk=41, D=40, Dv=24, causal=True, offset=18,
             mask_kind="none", zero_empty=False, softcap=softcap, window=window)
    args = op_args(p, *make(p))
    cfg = config_for("attention", args[0].device, head_dim=40, dtype=dtype)
    check(A.launch(*args, config=cfg), A.reference(*args), dtype)
    with mock.patch.object(A, "_CPU_CHUNK_BYTES", 4096):
        check(A.cpu_forward(*args), A.reference(*args), dtype)


@pytest.mark.parametrize("Sq,Sk,offset,window", [(16, 16, 0, 4), (9, 30, 21, 5), (1, 50, 49, 16), (12, 12, 0, 1)])
def test_window_is_hugging_face_sliding_window(Sq, Sk, offset, window, interpret):
    """window W keeps what transformers' sliding-window causal mask keeps (kv > q - W and
    kv <= q, the query at position offset + i): the op without a mask against the reference
    given that mask, built by transformers itself."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    keep_fn = sliding_window_causal_mask_function(window)
    i = torch.arange(Sq)[:, None] + offset
    j = torch.arange(Sk)[None, :]
    hf_keep = keep_fn(0, 0, i, j).expand(Sq, Sk)
    q, k, v = torch.randn(1, 2, Sq, 16), torch.randn(1, 1, Sk, 16), torch.randn(1, 1, Sk, 16)
    want = A.reference(q, k, v, hf_keep, 0.25)
    cfg = config_for("attention", q.device)
    check(A.launch(q, k, v, None, 0.25, True, offset, False, 0.0, window, config=cfg), want, torch.float32)
    with mock.patch.object(A, "_CPU_CHUNK_BYTES", 512):
        check(A.cpu_forward(q, k, v, None, 0.25, True, offset, False, 0.0, window), want, torch.float32)


def test_softcap_is_gemma2_soft_capping():
    """softcap c: softmax(c * tanh(q k^T * scale / c)) v, written out here as Gemma 2 does it."""
    q, k, v = torch.randn(1, 2, 10, 16) * 3, torch.randn(1, 2, 10, 16) * 3, torch.randn(1, 2, 10, 16)
    s = q @ k.transpose(-1, -2) * 0.25 / 4.0
    want = torch.softmax(torch.tanh(s) * 4.0, dim=-1) @ v
    check(A.reference(q, k, v, None, 0.25, softcap=4.0), want, torch.float32)
    check(A.cpu_forward(q, k, v, None, 0.25, False, 0, False, 4.0), want, torch.float32)


def test_window_skips_key_blocks_before_it(interpret):
    """Keys in 16-key blocks wholly before every query's window are never read: NaN there
    leaves the output finite (a kernel that loaded them would multiply NaN values by p = 0)."""
    Sq, Sk, offset, window = 3, 70, 67, 9  # the rows see keys 59..69; blocks 0..47 are skipped
    q, k, v = torch.randn(1, 2, Sq, 16), torch.randn(1, 1, Sk, 16), torch.randn(1, 1, Sk, 16)
    want = A.reference(q, k, v, None, 0.25, True, offset, False, 2.0, window)
    kp, vp = k.clone(), v.clone()
    kp[:, :, :48], vp[:, :, :48] = float("nan"), float("nan")
    cfg = config_for("attention", q.device)
    for splits in (1, 3):  # one program, and splits (the first one wholly before the window)
        out = A.launch(q, kp, vp, None, 0.25, True, offset, False, 2.0, window, config={**cfg, "SPLITS": splits})
        check(out, want, torch.float32)
    vp[:, :, 48] = float("nan")  # inside the block the window starts in: read, so NaN shows
    assert torch.isnan(A.launch(q, kp, vp, None, 0.25, True, offset, False, 2.0, window, config=cfg)).all()


@pytest.mark.parametrize("softcap,window,causal,msg", [
    (-1.0, 0, True, "softcap"), (float("inf"), 0, True, "softcap"), (True, 0, True, "softcap"),
    (0.0, -2, True, "window"), (0.0, 2.5, True, "window"), (0.0, 4, False, "needs causal"),
])
def test_launcher_rejects_bad_softcap_or_window(softcap, window, causal, msg):
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(KernelInputError, match=msg):
        A.launch(q, k, v, None, 0.25, causal, 0, False, softcap, window, config=config_for("attention", q.device))
    with pytest.raises(KernelInputError, match=msg):
        A.cpu_forward(q, k, v, None, 0.25, causal, 0, False, softcap, window)


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


# ---- decode key splits (flash-decoding) and the shared combine -----------------------------------

@contextlib.contextmanager
def spy(module, name):
    """Count the calls of a module's function inside the block (the launch path a shape took)."""
    calls, real = [], getattr(module, name)
    with mock.patch.object(module, name, lambda *a, **k: calls.append(a) or real(*a, **k)):
        yield calls


@st.composite
def decode_problems(draw):
    p = draw(problems(max_seq=70))
    p.update(Sq=draw(st.integers(1, 5)), splits=draw(st.integers(2, 5)),
             offset=draw(st.integers(-3, 8)) if p["causal"] else 0)
    return p


@settings(max_examples=20, deadline=None)
@given(p=decode_problems())
def test_key_splits_match_reference(p, interpret):
    """A few query rows with the keys split over 2-5 programs and merged: causal offsets (negative
    ones leave rows with no key), masks, windows (splits wholly before one are skipped), both
    empty-row conventions, key counts that are not multiples of the block or of the split."""
    q, k, v, mask, scale = make(p, noncontig=p["Sq"] % 2 == 0)
    args = op_args(p, q, k, v, mask, scale)
    cfg = {**config_for("attention", q.device, head_dim=max(p["D"], p["Dv"]), dtype=q.dtype), "SPLITS": p["splits"]}
    with spy(SplitMerge, "combine") as combined:
        check(A.launch(*args, config=cfg), A.reference(*args), p["dtype"])
    assert len(combined) == (p["Sk"] > cfg["BLOCK_N"])  # one key block cannot be split


def test_launcher_splits_only_few_programs_over_long_keys(interpret):
    """The interpreter row pretends to a GPU of 4 SMs: a decode step of fewer (batch x head)
    programs over keys enough for two 16-key splits is split; more programs, a prefill (several
    query blocks) or short keys are not."""
    cfg = config_for("attention", torch.device("cpu"))
    assert cfg["SM_COUNT"] == 4
    for (B, Hq, Sq, Sk), split in [((1, 2, 1, 64), True), ((1, 3, 7, 40), True), ((2, 2, 1, 64), False),
                                    ((1, 2, 40, 64), False), ((1, 2, 1, 31), False)]:
        q, k, v = torch.randn(B, Hq, Sq, 16), torch.randn(B, 1, Sk, 16), torch.randn(B, 1, Sk, 16)
        with spy(SplitMerge, "combine") as combined:
            check(A.launch(q, k, v, None, 0.25, True, Sk - Sq, config=cfg),
                  A.reference(q, k, v, None, 0.25, True, Sk - Sq), torch.float32)
        assert bool(combined) == split, (B, Hq, Sq, Sk)


def test_split_count_rule():
    from metainfer.kernels._common import split_count

    cfg = dict(SM_COUNT=132, SPLIT_MIN=256, MAX_SPLITS=16)
    assert split_count(cfg, 32, 16384, 64) == (5, 3328)  # 5 x 32 programs fill 132 SMs
    assert split_count(cfg, 1, 16384, 64) == (16, 1024)  # capped by MAX_SPLITS
    assert split_count(cfg, 8, 700, 64) == (2, 384)  # at least SPLIT_MIN keys each
    assert split_count(cfg, 132, 16384, 64) == (1, 16384)  # the GPU is full already
    assert split_count({**cfg, "SPLITS": 4}, 500, 100, 16) == (4, 32)  # forced; splits of whole blocks
    assert split_count({**cfg, "SPLITS": 9}, 1, 20, 16) == (2, 16)  # no more splits than key blocks
    assert split_count({}, 1, 1 << 20, 64) == (1, 1 << 20)  # no SM_COUNT: no split


@pytest.mark.parametrize("dim", [8, 40, 130])
@pytest.mark.parametrize("zero_empty", [False, True])
def test_combine_merges_partial_softmax_states(dim, zero_empty, interpret):
    """_flash.SplitMerge's combine against the merge written in torch: splits with no key (max -inf,
    sum 0), rows no split kept a key for (NaN, or 0), row counts not a multiple of its block."""
    splits, rows = 3, 37
    out = torch.empty(rows, dim + 3)[:, :dim]  # rows strided wider than dim
    merge = SplitMerge(rows, dim, zero_empty, row_stride=out.stride(0))
    ws = merge.workspace(splits, torch.empty(0))  # accumulators, then (max, sum) per row
    assert ws.shape == (splits * rows * (dim + 2),)
    acc, ml = ws[:splits * rows * dim], ws[splits * rows * dim:]
    m, l = torch.randn(splits, rows) * 3, torch.rand(splits, rows) + 0.5
    empty = torch.rand(splits, rows) < 0.3
    empty[:, :2] = True  # rows 0 and 1: no key in any split
    m, l = m.masked_fill(empty, float("-inf")), l.masked_fill(empty, 0.0)
    acc = acc.view(splits, rows, dim).copy_(torch.randn(splits, rows, dim).masked_fill(empty[..., None], 0.0))
    ml.view(splits, rows, 2).copy_(torch.stack([m, l], -1))
    w = torch.exp(m - m.amax(0).nan_to_num(neginf=0.0))
    want = (w[..., None] * acc).sum(0) / (w * l).sum(0)[:, None]
    if zero_empty:
        want = want.nan_to_num(nan=0.0)
    merge.combine(ws, splits, out)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.isnan(out[:2]).all() != zero_empty


# ---- triton.autotune (CUDA only): the launch path through the tuner, every candidate --------------

def _gpu_rows():
    from metainfer.kernels.configs import _ATTENTION

    return [(arch, limit) for arch in ("sm_89", "sm_90") for limit, _ in _ATTENTION[arch]]


@pytest.mark.parametrize("arch,width", _gpu_rows())
def test_every_autotune_candidate_matches_reference(arch, width, interpret):
    """Each CUDA row's config and AUTOTUNE alternatives, run as the fixed config: a prefill-sized
    and a decode-sized (query tile clamped to 16 rows, keys split) problem."""
    from metainfer.kernels.configs import config_for_arch

    row = config_for_arch("attention", arch, head_dim=width)
    D = min(width, 64)  # a narrower head keeps the interpreter quick; the row's tiles are what vary
    for alt in ({}, *row["AUTOTUNE"]):
        cfg = {**row, **alt}
        for B, Hq, Sq, Sk in ((1, 2, 70, 75), (1, 2, 1, 300)):
            q, k, v = torch.randn(B, Hq, Sq, D), torch.randn(B, 1, Sk, D), torch.randn(B, 1, Sk, D)
            args = (q, k, v, None, D ** -0.5, True, Sk - Sq, False)
            check(A.launch(*args, config={**cfg, "SM_COUNT": 8, "SPLIT_MIN": 64}), A.reference(*args),
                  torch.float32)


def test_autotuned_launch_path(interpret, monkeypatch):
    """The tuned launch (as on a GPU) under the interpreter, its benchmark stubbed: every candidate
    is timed once per shape bucket and the one the stub calls fastest computes the result."""
    from metainfer.kernels import _common
    from metainfer.kernels.configs import config_for_arch

    assert not _common.autotune_enabled(torch.device("cpu"))
    monkeypatch.setattr(_common, "AOT_CAPABILITY", (9, 0))
    assert not _common.autotune_enabled(torch.device("cuda")), "the AOT compile keeps one config"
    monkeypatch.setattr(_common, "AOT_CAPABILITY", None)
    monkeypatch.setattr(_common, "autotune_enabled", lambda device: True)
    row = config_for_arch("attention", "sm_90", head_dim=128)
    timed = []

    def bench(kernel_call, quantiles):
        kernel_call()
        timed.append(1)
        return [1.0 if len(timed) % 3 else 0.5] * 3  # the third candidate of each tuning wins

    monkeypatch.setattr(_common, "AUTOTUNE_BENCH", bench)
    for B, Hq, Sq, Sk, runs in ((1, 2, 20, 40, 2), (1, 2, 1, 600, 1)):
        q, k, v = torch.randn(B, Hq, Sq, 32), torch.randn(B, 1, Sk, 32), torch.randn(B, 1, Sk, 32)
        args = (q, k, v, None, 0.2, True, Sk - Sq, False)
        timed.clear()
        for _ in range(runs):  # the second call of a bucket reuses the choice
            check(A.launch(*args, config={**row, "SM_COUNT": 8}), A.reference(*args), torch.float32)
        assert len(timed) == 4, "sm_90's d128 row has four candidates, each timed once"


def test_target_overrides_pin_the_config(monkeypatch):
    """A target's block override means that config: the row's AUTOTUNE (and fp8_gemm's SMALL_M)
    are dropped unless it gives its own; SM_COUNT comes from the device on a GPU."""
    from types import SimpleNamespace

    from metainfer.kernels import configs as KC

    monkeypatch.setattr(KC, "_active", {})
    monkeypatch.setattr(KC, "_device_sms", lambda device: 66)
    gpu = torch.device("cuda")

    def activate(kernels):
        KC.activate(SimpleNamespace(name="t", device=SimpleNamespace(kind="cuda", arch="sm_90"), kernels=kernels))

    activate({})
    row = KC.config_for("attention", gpu, head_dim=128)
    assert row["AUTOTUNE"] and row["SM_COUNT"] == 66 and KC.config_for("fp8_gemm", gpu)["SMALL_M"]
    activate({"attention": {"BLOCK_N": 32}, "fp8_gemm": {"num_stages": 2, "SMALL_M": []}})
    pinned = KC.config_for("attention", gpu, head_dim=128)
    assert pinned["BLOCK_N"] == 32 and "AUTOTUNE" not in pinned and pinned["SPLIT_MIN"] == row["SPLIT_MIN"]
    fp8 = KC.config_for("fp8_gemm", gpu)
    assert fp8["SMALL_M"] == [] and "AUTOTUNE" not in fp8
    activate({"attention": {"SM_COUNT": 10, "AUTOTUNE": [{"BLOCK_M": 64}]}})
    assert KC.config_for("attention", gpu, head_dim=128)["SM_COUNT"] == 10
    assert KC.config_for("attention", gpu, head_dim=128)["AUTOTUNE"] == [{"BLOCK_M": 64}]
    assert KC.config_for_arch("attention", "sm_80")["SM_COUNT"] == 108  # no arch row: A100's count
