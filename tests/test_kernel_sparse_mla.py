"""The sparse (DSA top-k) attention and MLA latent-cache kernels (Triton, under the interpreter on
CPU) and their CPU paths, against plain-math references, on hypothesis-drawn shapes including
ones that are not block multiples, -1 padded and out-of-range indices, masks and causal offsets."""

import contextlib
import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

import metainfer.kernels  # noqa: F401  (sets TRITON_INTERPRET before the kernel modules load)
import metainfer.kernels.attention as A
import metainfer.kernels.mla_decode as MLA
import metainfer.kernels.sparse_attention as SA
from metainfer.kernels import KernelInputError

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def cfg(module, **over):
    return {**module.DEFAULT_CONFIGS["interpreter"], **over}


def check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)


def make_indices(gen, B, Sq, Sk, topk, pad_p, dtype, noncontig):
    """Distinct in-range indices per row, some slots replaced by -1 or by out-of-range values,
    -1 padding where topk > Sk, slots shuffled."""
    n = min(topk, Sk)
    idx = torch.rand(B, Sq, Sk, generator=gen).argsort(-1)[..., :n]
    if topk > n:
        idx = torch.cat([idx, torch.full((B, Sq, topk - n), -1, dtype=idx.dtype)], -1)
    r = torch.rand(B, Sq, topk, generator=gen)
    idx = torch.where(r < pad_p / 2, torch.full_like(idx, -1), idx)
    idx = torch.where((r >= pad_p / 2) & (r < pad_p), Sk + (idx.abs() % 3), idx)  # past the end
    idx = idx.gather(-1, torch.rand(B, Sq, topk, generator=gen).argsort(-1)).to(dtype)
    if noncontig:  # stored (B, topk, Sq)
        idx = idx.transpose(1, 2).contiguous().transpose(1, 2)
    return idx


def make_mask(gen, kind, B, H, Sq, Sk, dtype, keep_p):
    if kind == "additive":
        return torch.randn(B, 1, Sq, Sk, generator=gen).to(dtype)
    if kind == "additive-heads":
        return 2 * torch.randn(1, H, Sq, Sk, generator=gen)  # float32 mask on any input dtype
    if kind == "bool-heads":
        return torch.rand(B, H, Sq, Sk, generator=gen) < keep_p
    if kind == "bool-2d":
        return torch.rand(Sq, Sk, generator=gen) < keep_p
    return None


common = dict(
    dtype=st.sampled_from(DTYPES),
    B=st.integers(1, 2),
    Sq=st.integers(1, 24),
    Sk=st.integers(1, 48),
    topk=st.integers(1, 16),
    pad_p=st.sampled_from([0.0, 0.0, 0.3]),
    idx_dtype=st.sampled_from([torch.int32, torch.int64]),
    causal=st.booleans(),
    offset=st.integers(-2, 8),
    mask_kind=st.sampled_from(["none", "additive", "bool-heads", "additive-heads", "bool-2d"]),
    keep_p=st.sampled_from([0.7, 0.25]),  # a low one leaves some rows with no key: NaN or 0
    zero_empty=st.booleans(),
    block_n=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**31 - 1),
)


# head counts are weighted towards several heads: per-head masks must reach the right head

@st.composite
def sparse_problems(draw):
    p = {k: draw(v) for k, v in common.items()}
    p.update(Hkv=draw(st.integers(1, 2)), group=draw(st.integers(1, 2) | st.just(2)),
             D=draw(st.sampled_from([8, 16, 24, 40])), Dv=draw(st.sampled_from([8, 16, 24, 40])))
    return p


@st.composite
def mla_problems(draw):
    p = {k: draw(v) for k, v in common.items()}
    p.update(H=draw(st.integers(1, 4) | st.just(3)), R=draw(st.sampled_from([8, 16, 32, 48, 96])),
             P=draw(st.sampled_from([4, 8, 16])))
    return p


def make_sparse(p):
    g = torch.Generator().manual_seed(p["seed"])
    B, Hkv, Sq, Sk, dt = p["B"], p["Hkv"], p["Sq"], p["Sk"], p["dtype"]
    H = Hkv * p["group"]
    if Sq % 2 == 0:  # (B, S, H, D) storage, as a projection's view+transpose leaves it
        q = torch.randn(B, Sq, H, p["D"], generator=g).to(dt).transpose(1, 2)
    else:
        q = torch.randn(B, H, Sq, p["D"], generator=g).to(dt)
    k = torch.randn(B, Hkv, Sk, p["D"], generator=g).to(dt)
    v = torch.randn(B, Hkv, Sk, p["Dv"], generator=g).to(dt)
    idx = make_indices(g, B, Sq, Sk, p["topk"], p["pad_p"], p["idx_dtype"], noncontig=Sk % 2 == 0)
    mask = make_mask(g, p["mask_kind"], B, H, Sq, Sk, dt, p["keep_p"])
    return (q, k, v, idx, mask, 1.0 / math.sqrt(p["D"]), p["causal"], p["offset"] if p["causal"] else 0,
            p["zero_empty"])


def make_mla(p, sparse):
    g = torch.Generator().manual_seed(p["seed"])
    B, H, Sq, T, R, P, dt = p["B"], p["H"], p["Sq"], p["Sk"], p["R"], p["P"], p["dtype"]
    ql = torch.randn(B, H, Sq, R, generator=g).to(dt)
    if Sq % 2 == 0:
        qp = torch.randn(B, Sq, H, P, generator=g).to(dt).transpose(1, 2)
    else:
        qp = torch.randn(B, H, Sq, P, generator=g).to(dt)
    ckv = torch.randn(B, T, R, generator=g).to(dt)
    kpe = torch.randn(B, T, P, generator=g).to(dt)
    idx = (make_indices(g, B, Sq, T, p["topk"], p["pad_p"], p["idx_dtype"], noncontig=T % 2 == 0)
           if sparse else None)
    mask = make_mask(g, p["mask_kind"], B, H, Sq, T, dt, p["keep_p"])
    # decode form: the causal offset is measured from the end of the cache
    offset = T - Sq + p["offset"] if p["causal"] else 0
    return (ql, qp, ckv, kpe, idx, mask, 1.0 / math.sqrt(R + P), p["causal"], offset, p["zero_empty"])


# ---------------------------------------------------------------- sparse attention

@settings(max_examples=30, deadline=None)
@given(p=sparse_problems())
def test_sparse_kernel_matches_reference(p, interpret):
    args = make_sparse(p)
    out = SA.launch(*args, config=cfg(SA, BLOCK_N=p["block_n"]))
    check(out, SA.reference(*args), p["dtype"])
    assert out.is_contiguous()


@settings(max_examples=30, deadline=None)
@given(p=sparse_problems())
def test_sparse_cpu_path_matches_reference(p):
    args = make_sparse(p)
    with mock.patch.object(SA, "_CPU_CHUNK_BYTES", 4096):  # several chunks even at small sizes
        check(SA.cpu_forward(*args), SA.reference(*args), p["dtype"])


@settings(max_examples=30, deadline=None)
@given(p=sparse_problems(), fill=st.sampled_from([-1e9, torch.finfo(torch.float32).min]))
def test_unselected_rows_on_the_device_match_the_torch_path(p, fill, interpret):
    """Rows whose selected keys are all dropped (padding masks, causal limits, -1 slots): the
    device kernel recomputes them densely with the fill, as `fix_unselected_rows` does, with no
    read-back; float masks here drop keys with a large negative value, as HF's do."""
    q, k, v, idx, mask, scale, causal, offset, _ = make_sparse(p)
    if mask is not None and mask.dtype != torch.bool:
        g = torch.Generator().manual_seed(p["seed"] + 1)
        drop = torch.rand(mask.shape, generator=g) > p["keep_p"]
        mask = mask.masked_fill(drop, torch.finfo(mask.dtype).min)
    out = SA.reference(q, k, v, idx, mask, scale, causal, offset, False)
    want = SA.fix_unselected_rows(out, q, k, v, idx, mask, scale, causal, offset, fill)
    got = SA.launch_unselected_rows(out.clone(), q, k, v, idx, mask, scale, causal, offset, fill)
    check(got, want, p["dtype"])


def test_a_padding_slot_does_not_unselect_key_0(interpret):
    """Hand case (found by the test above): indices [-1, 0, -1] select key 0 only, whose mask
    drops it (float32 min); key 1 is unselected and carries the fill -1e9, far above float32
    min, so the row is exactly key 1's value. The torch path once scattered the -1 slots,
    clamped to 0, over key 0's selection and averaged both keys."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 16, generator=g)
    k, v = torch.randn(1, 1, 2, 16, generator=g), torch.randn(1, 1, 2, 8, generator=g)
    idx = torch.tensor([[[-1, 0, -1]]], dtype=torch.int32)
    mask = torch.tensor([[[[torch.finfo(torch.float32).min, 0.5]]]])
    out = SA.reference(q, k, v, idx, mask, 0.25, False, 0, False)
    for fixed in (SA.fix_unselected_rows(out, q, k, v, idx, mask, 0.25, False, 0, -1e9),
                  SA.launch_unselected_rows(out.clone(), q, k, v, idx, mask, 0.25, False, 0, -1e9)):
        torch.testing.assert_close(fixed[0, 0, 0], v[0, 0, 1])


def test_unselected_rows_read_nothing_back(interpret):
    """The device path decides which rows are empty without a host read (the torch path reads
    `empty.any()` and `nonzero` back, which on a GPU is a sync per layer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                        torch.ops.aten.nonzero.default):
                reads.append(func)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 6, 16, generator=g)
    k, v = torch.randn(1, 1, 10, 16, generator=g), torch.randn(1, 1, 10, 16, generator=g)
    idx = torch.randint(0, 10, (1, 6, 4), generator=g)
    mask = torch.ones(1, 1, 6, 10, dtype=torch.bool)
    mask[..., 0, :] = False  # a padding row
    out = SA.reference(q, k, v, idx, mask, 0.25, False, 0, False)
    with Reads():
        SA.fix_unselected_rows(out, q, k, v, idx, mask, 0.25, False, 0, -1e9)
    assert reads, "the torch path reads back (the check itself works)"
    reads.clear()
    with Reads():
        SA.launch_unselected_rows(out.clone(), q, k, v, idx, mask, 0.25, False, 0, -1e9)
    assert reads == []


def test_grids_fold_or_refuse_past_cudas_y_limit(interpret):
    """CUDA allows 65,535 programs along a grid's y and z. With the limit made 2 here: sparse
    attention (batch x kv heads x head blocks along y) launches its batch in slices of one with
    the same result; attention and MLA decode (batch x heads along x) refuse only a query count
    past it, by name."""
    from metainfer.kernels import _common

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 9, 16, generator=g), torch.randn(3, 2, 11, 16, generator=g), torch.randn(3, 2, 11, 8, generator=g)
    idx = torch.stack([torch.randperm(11, generator=g)[:6] for _ in range(3 * 9)]).view(3, 9, 6)
    mask = torch.randn(3, 1, 9, 11, generator=g)
    args = (q, k, v, idx, mask, 0.25, True, 3, False)
    with mock.patch.object(_common, "GRID_YZ_MAX", 2):  # 2 kv heads x 1 head block: one batch entry a launch
        out = SA.launch(*args, config=cfg(SA))
        with pytest.raises(KernelInputError, match="40 query rows need a launch grid of \\(6, 3, 1\\)"):
            A.launch(torch.randn(3, 2, 40, 16), k[:, :, :8], v[:, :, :8, :], None, 0.25, False, 0,
                     config=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))
    check(out, SA.reference(*args), torch.float32)


def test_sparse_with_every_key_selected_is_dense_attention(interpret):
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 24)
    idx = torch.arange(11).flip(0).expand(2, 9, 11)  # every key, in any order, as a stride-0 view
    mask = torch.randn(2, 1, 9, 11)
    args = (mask, 0.25, True, 3, False)
    dense = A.reference(q, k, v, *args)
    check(SA.launch(q, k, v, idx, *args, config=cfg(SA)), dense, torch.float32)
    check(SA.cpu_forward(q, k, v, idx, *args), dense, torch.float32)


def test_sparse_head_blocks_and_large_head_dims(interpret):
    # a kv group of 17 heads spans two 16-row head tiles; D=256, Dv=128
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 34, 5, 256, generator=g)
    k, v = torch.randn(1, 2, 40, 256, generator=g), torch.randn(1, 2, 40, 128, generator=g)
    idx = make_indices(g, 1, 5, 40, 20, 0.2, torch.int64, False)
    args = (q, k, v, idx, None, 1 / 16, True, 35, False)
    ref = SA.reference(*args)
    check(SA.launch(*args, config=cfg(SA)), ref, torch.float32)
    check(SA.cpu_forward(*args), ref, torch.float32)


def test_sparse_mask_read_only_at_selected_positions(interpret):
    q, k, v = torch.randn(1, 2, 4, 16), torch.randn(1, 1, 10, 16), torch.randn(1, 1, 10, 16)
    idx = torch.tensor([[[0, 2, -1], [1, 3, 5], [9, 4, 12], [7, 8, 6]]], dtype=torch.int32)
    mask = torch.full((1, 1, 4, 10), float("nan"))
    mask.scatter_(-1, idx.clamp(0, 9)[:, None].long(), 0.5)  # finite only where selected (and col 0)
    for out in (SA.launch(q, k, v, idx, mask, 0.25, False, 0, config=cfg(SA)),
                SA.cpu_forward(q, k, v, idx, mask, 0.25, False, 0)):
        assert not out.isnan().any()
        check(out, SA.reference(q, k, v, idx, torch.zeros(1, 1, 4, 10), 0.25), torch.float32)


def test_sparse_duplicate_index_counts_twice(interpret):
    # documented: indices are assumed distinct; a repeated one doubles that key's weight
    q, k, v = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 6, 16), torch.randn(1, 1, 6, 16)
    dup = torch.tensor([[[1, 4, 4]]])
    boost = torch.zeros(1, 1, 1, 6)
    boost[..., 4] = math.log(2.0)
    want = SA.reference(q, k, v, torch.tensor([[[1, 4]]]), boost, 0.25)
    check(SA.launch(q, k, v, dup, None, 0.25, False, 0, config=cfg(SA)), want, torch.float32)
    check(SA.cpu_forward(q, k, v, dup, None, 0.25, False, 0), want, torch.float32)


def test_sparse_empty_rows_nan_or_zero(interpret):
    q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16)
    idx = torch.tensor([[[0, 3], [-1, -1], [4, 7]]])  # row 1 selects nothing
    for fn in (lambda *a: SA.launch(*a, config=cfg(SA)), SA.cpu_forward, SA.reference):
        nan_out = fn(q, k, v, idx, None, 0.25, False, 0, False)
        zero_out = fn(q, k, v, idx, None, 0.25, False, 0, True)
        assert nan_out[:, :, 1].isnan().all() and not nan_out[:, :, [0, 2]].isnan().any()
        assert (zero_out[:, :, 1] == 0).all()


# ---------------------------------------------------------------- MLA

@pytest.mark.parametrize("sparse", [False, True])
@settings(max_examples=20, deadline=None)
@given(p=mla_problems())
def test_mla_kernel_matches_reference(sparse, p, interpret):
    args = make_mla(p, sparse)
    out = MLA.launch(*args, config=cfg(MLA, BLOCK_N=p["block_n"]))
    check(out, MLA.reference(*args), p["dtype"])
    assert out.is_contiguous()


@pytest.mark.parametrize("sparse", [False, True])
@settings(max_examples=20, deadline=None)
@given(p=mla_problems())
def test_mla_cpu_path_matches_reference(sparse, p):
    args = make_mla(p, sparse)
    with mock.patch.object(MLA, "_CPU_CHUNK_BYTES", 4096):
        check(MLA.cpu_forward(*args), MLA.reference(*args), p["dtype"])


@pytest.mark.parametrize("sparse", [False, True])
def test_mla_is_attention_over_the_latent_cache(sparse, interpret):
    # MLA == MQA attention with k = [ckv, kpe], v = ckv, one kv head for all query heads
    g = torch.Generator().manual_seed(2)
    ql, qp = torch.randn(2, 3, 6, 32, generator=g), torch.randn(2, 3, 6, 8, generator=g)
    ckv, kpe = torch.randn(2, 19, 32, generator=g), torch.randn(2, 19, 8, generator=g)
    idx = make_indices(g, 2, 6, 19, 7, 0.0, torch.int32, False) if sparse else None
    mask = torch.rand(2, 1, 6, 19, generator=g) > 0.2
    if sparse:
        mask = mask & SA.index_keep_mask(idx, 19)[:, None]
    want = A.reference(torch.cat([ql, qp], -1), torch.cat([ckv, kpe], -1)[:, None], ckv[:, None],
                       mask, 0.2, True, 13, True)
    args = (ql, qp, ckv, kpe, idx, mask, 0.2, True, 13, True)
    check(MLA.launch(*args, config=cfg(MLA)), want, torch.float32)
    check(MLA.cpu_forward(*args), want, torch.float32)
    check(MLA.reference(*args), want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_deepseek_dims_and_head_blocks(dtype, interpret):
    # R=512, P=64 as in DeepSeek-V3; 17 heads span two 16-row head tiles
    g = torch.Generator().manual_seed(3)
    B, H, Sq, T = 1, 17, 2, 37
    ql, qp = torch.randn(B, H, Sq, 512, generator=g).to(dtype), torch.randn(B, H, Sq, 64, generator=g).to(dtype)
    ckv, kpe = torch.randn(B, T, 512, generator=g).to(dtype), torch.randn(B, T, 64, generator=g).to(dtype)
    for idx in (None, make_indices(g, B, Sq, T, 20, 0.1, torch.int64, False)):
        args = (ql, qp, ckv, kpe, idx, None, 1 / math.sqrt(192), True, T - Sq, False)
        ref = MLA.reference(*args)
        check(MLA.launch(*args, config=cfg(MLA, BLOCK_N=32)), ref, dtype)
        check(MLA.cpu_forward(*args), ref, dtype)


def test_mla_empty_rows_nan_or_zero(interpret):
    ql, qp = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 4)
    ckv, kpe = torch.randn(1, 5, 16), torch.randn(1, 5, 4)
    idx = torch.tensor([[[0, 3], [-1, 5], [4, 1]]])  # row 1 selects nothing
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2] = False  # dense: row 2 keeps nothing
    for fn in (lambda *a: MLA.launch(*a, config=cfg(MLA)), MLA.cpu_forward, MLA.reference):
        for ind, empty, full in ((idx, 1, [0, 2]), (None, 2, [0, 1])):
            m = None if ind is not None else mask
            nan_out = fn(ql, qp, ckv, kpe, ind, m, 0.25, False, 0, False)
            zero_out = fn(ql, qp, ckv, kpe, ind, m, 0.25, False, 0, True)
            assert nan_out[:, :, empty].isnan().all() and not nan_out[:, :, full].isnan().any()
            assert (zero_out[:, :, empty] == 0).all()


@contextlib.contextmanager
def combined():
    """Count the merges of key splits launched inside the block (each call: merge, ws, splits, out)."""
    from metainfer.kernels._flash import SplitMerge

    calls, real = [], SplitMerge.combine
    with mock.patch.object(SplitMerge, "combine", lambda *a, **k: calls.append(a) or real(*a, **k)):
        yield calls


@pytest.mark.parametrize("sparse", [False, True])
@settings(max_examples=8, deadline=None)
@given(p=mla_problems(), splits=st.integers(2, 4))
def test_mla_key_splits_match_reference(sparse, p, splits, interpret):
    """The cache (dense) or the top-k slots (sparse) split over 2-4 programs and merged: causal
    offsets, masks and padded slots that leave rows empty, both empty-row conventions."""
    args = make_mla(p, sparse)
    keys = p["topk"] if sparse else p["Sk"]
    with combined() as calls:
        check(MLA.launch(*args, config=cfg(MLA, BLOCK_N=16, SPLITS=splits)), MLA.reference(*args), p["dtype"])
    assert len(calls) == (keys > 16)  # one block of keys cannot be split


def test_mla_batch1_decode_splits_the_cache(interpret):
    """One query row, one batch, one head block: a single program unless the cache is split; with
    the interpreter row's SM_COUNT (4) and splits of whole 16-key blocks, 70 keys make 3 splits
    of 32 and 40 top-k slots 2 of 32 (at least SPLIT_MIN = 16 each)."""
    from metainfer.kernels.configs import config_for

    g = torch.Generator().manual_seed(4)
    ql, qp = torch.randn(1, 16, 1, 64, generator=g), torch.randn(1, 16, 1, 16, generator=g)
    ckv, kpe = torch.randn(1, 70, 64, generator=g), torch.randn(1, 70, 16, generator=g)
    for idx in (None, make_indices(g, 1, 1, 70, 40, 0.2, torch.int32, False)):
        args = (ql, qp, ckv, kpe, idx, None, 0.1, True, 69, False)
        with combined() as calls:
            check(MLA.launch(*args, config=config_for("mla_decode", ql.device)), MLA.reference(*args), torch.float32)
        assert len(calls) == 1 and calls[0][2] == (3 if idx is None else 2)  # the split count


# ---------------------------------------------------------------- bad inputs

def _sparse_ok():
    return [torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16),
            torch.zeros(1, 8, 4, dtype=torch.int32), None]


@pytest.mark.parametrize("bad, msg", [
    (lambda a: a.__setitem__(3, torch.zeros(1, 8, dtype=torch.int32)), "indices must be 3-D"),
    (lambda a: a.__setitem__(3, torch.zeros(1, 7, 4, dtype=torch.int32)), "does not match"),
    (lambda a: a.__setitem__(3, torch.zeros(2, 8, 4, dtype=torch.int32)), "does not match"),
    (lambda a: a.__setitem__(3, torch.zeros(1, 8, 4)), "indices has dtype"),
    (lambda a: a.__setitem__(3, torch.zeros(1, 8, 0, dtype=torch.int64)), "topk = 0"),
    (lambda a: a.__setitem__(3, None), "indices must be a tensor"),
    (lambda a: a.__setitem__(0, torch.randn(1, 4, 8, 300)), "head dims differ"),
    (lambda a: (a.__setitem__(0, torch.randn(1, 4, 8, 300)), a.__setitem__(1, torch.randn(1, 2, 8, 300))),
     "head dims must be"),
    (lambda a: a.__setitem__(2, torch.randn(1, 2, 8, 257)), "head dims must be"),
    (lambda a: a.__setitem__(2, torch.randn(1, 2, 5, 16)), "does not match k shape"),
    (lambda a: (a.__setitem__(1, torch.randn(1, 3, 8, 16)), a.__setitem__(2, torch.randn(1, 3, 8, 16))),
     "multiple"),
    (lambda a: a.__setitem__(0, a[0].half()), "dtypes differ"),
    (lambda a: a.__setitem__(4, torch.zeros(2, 3)), "broadcast"),
    (lambda a: a.__setitem__(4, torch.zeros(8, 8, dtype=torch.int32)), "mask dtype"),
])
def test_sparse_rejects_bad_inputs(bad, msg):
    a = _sparse_ok()
    bad(a)
    for fn in (lambda *x: SA.launch(*x, 0.25, False, 0, config=cfg(SA)),
               lambda *x: SA.cpu_forward(*x, 0.25, False, 0)):
        with pytest.raises(KernelInputError, match=msg):
            fn(*a)


def _mla_ok():
    return [torch.randn(1, 4, 2, 32), torch.randn(1, 4, 2, 8), torch.randn(1, 10, 32), torch.randn(1, 10, 8),
            torch.zeros(1, 2, 4, dtype=torch.int64), None]


@pytest.mark.parametrize("bad, msg", [
    (lambda a: a.__setitem__(4, torch.zeros(1, 2, dtype=torch.int64)), "indices must be 3-D"),
    (lambda a: a.__setitem__(4, torch.zeros(1, 3, 4, dtype=torch.int64)), "does not match"),
    (lambda a: a.__setitem__(4, torch.zeros(1, 2, 4, dtype=torch.float16)), "indices has dtype"),
    (lambda a: a.__setitem__(4, torch.zeros(1, 2, 0, dtype=torch.int32)), "topk = 0"),
    (lambda a: (a.__setitem__(0, torch.randn(1, 4, 2, 1100)), a.__setitem__(2, torch.randn(1, 10, 1100))),
     "latent dim must be"),
    (lambda a: (a.__setitem__(1, torch.randn(1, 4, 2, 130)), a.__setitem__(3, torch.randn(1, 10, 130))),
     "rope dim must be"),
    (lambda a: a.__setitem__(2, torch.randn(1, 10, 16)), "latent dims differ"),
    (lambda a: a.__setitem__(3, torch.randn(1, 10, 4)), "rope dims differ"),
    (lambda a: a.__setitem__(3, torch.randn(1, 9, 8)), "cache lengths differ"),
    (lambda a: a.__setitem__(1, torch.randn(1, 3, 2, 8)), "q_pe shape"),
    (lambda a: a.__setitem__(2, torch.randn(10, 32)), "ckv must be 3-D"),
    (lambda a: a.__setitem__(2, torch.randn(2, 10, 32)), "batch sizes differ"),
    (lambda a: a.__setitem__(3, a[3].bfloat16()), "dtypes differ"),
    (lambda a: (a.__setitem__(2, torch.randn(1, 0, 32)), a.__setitem__(3, torch.randn(1, 0, 8))), "empty"),
    (lambda a: a.__setitem__(5, torch.zeros(4, 3, 10)), "broadcast"),
])
def test_mla_rejects_bad_inputs(bad, msg):
    a = _mla_ok()
    bad(a)
    for fn in (lambda *x: MLA.launch(*x, 0.25, False, 0, config=cfg(MLA)),
               lambda *x: MLA.cpu_forward(*x, 0.25, False, 0)):
        with pytest.raises(KernelInputError, match=msg):
            fn(*a)


@pytest.mark.parametrize("module, args", [
    (SA, lambda: _sparse_ok()), (MLA, lambda: _mla_ok()),
])
def test_bad_config_and_scalars(module, args):
    a = args()
    with pytest.raises(KernelInputError, match="BLOCK_N must be a power of two >= 16"):
        module.launch(*a, 0.25, False, 0, config=cfg(module, BLOCK_N=8))
    with pytest.raises(KernelInputError, match="BLOCK_H must be a power of two >= 16"):
        module.launch(*a, 0.25, False, 0, config=cfg(module, BLOCK_H=24))
    with pytest.raises(KernelInputError, match="scale must be a finite number"):
        module.cpu_forward(*a, float("inf"), False, 0)
    with pytest.raises(KernelInputError, match="causal_offset must be an int"):
        module.cpu_forward(*a, 0.25, True, 1.5)
