"""The routed-experts MoE kernel (Triton, under the interpreter on CPU) and its CPU path, against
the dense reference, on hypothesis-drawn problems: sizes that are not block multiples, plain and
block-FP8 weights, gate/up as views of one gate_up tensor, experts that receive no tokens."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import metainfer.kernels  # noqa: F401  (sets TRITON_INTERPRET before the kernel module is built)
import metainfer.kernels.moe as K
from metainfer.kernels import KernelInputError

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
CFG = K.DEFAULT_CONFIGS["interpreter"]  # decode's few pairs (GEMV_MAX_PAIRS) take the matrix-vector kernels
TILES = {**CFG, "GEMV_MAX_PAIRS": 0}  # the sorted tile kernels at every size
# other tile shapes: tiles wider than the FP8 scale blocks (clamped), several rows per tile; other
# matrix-vector tiles (wider than some scale blocks, clamped too)
CONFIGS = [CFG, TILES, dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1),
           dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, num_warps=2),
           {**CFG, "GEMV_BLOCK_N": 64, "GEMV_BLOCK_K": 16, "GEMV_MAX_PAIRS": 200}]


def quantize(w: torch.Tensor, bn: int, bk: int):
    """Block FP8 (e4m3fn) with amax/448 scales per (bn, bk) block of each expert's (N, K) matrix."""
    E, N, Kd = w.shape
    nb, kb = -(-N // bn), -(-Kd // bk)
    wp = torch.zeros(E, nb * bn, kb * bk)
    wp[:, :N, :Kd] = w.float()
    blocks = wp.view(E, nb, bn, kb, bk)
    s = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0
    q = (blocks / s[:, :, None, :, None]).view(E, nb * bn, kb * bk)[:, :N, :Kd]
    return q.to(torch.float8_e4m3fn), s.contiguous()


@st.composite
def problems(draw):
    E = draw(st.integers(1, 8))
    return dict(
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        T=draw(st.integers(1, 40)), E=E, K=draw(st.integers(1, min(E, 4))),
        H=draw(st.integers(8, 96)), I=draw(st.integers(8, 80)),
        fp8=draw(st.booleans()), block_n=draw(st.sampled_from([16, 32, 128])),
        block_k=draw(st.sampled_from([16, 32, 128])),
        fused=draw(st.booleans()),  # gate/up as the two halves of one (E, 2I, H) tensor
        tw_fp32=draw(st.booleans()), strided=draw(st.booleans()),
        # route only to the first `active` experts of a permutation: the others get no tokens
        active_frac=draw(st.floats(0.0, 1.0)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make(p):
    g = torch.Generator().manual_seed(p["seed"])
    T, E, Kk, H, I, dt = p["T"], p["E"], p["K"], p["H"], p["I"], p["dtype"]
    if p["fp8"] and p["fused"] and p["block_n"] <= 32:  # so the fused scales split at I (see below)
        I = max(p["block_n"], I - I % p["block_n"])
    x = torch.randn(T, H + 3 if p["strided"] else H, generator=g).to(dt)
    x = x[:, 1:H + 1] if p["strided"] else x
    active = max(Kk, round(p["active_frac"] * E))
    perm = torch.randperm(E, generator=g)[:active]
    ids = torch.stack([perm[torch.randperm(active, generator=g)[:Kk]] for _ in range(T)])
    ids = ids.to(torch.int32 if p["seed"] % 2 else torch.int64)
    tw = torch.rand(Kk, T, generator=g).T if p["strided"] else torch.rand(T, Kk, generator=g)
    tw = tw if p["tw_fp32"] else tw.to(dt)
    gu = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    wd = torch.randn(E, H, I, generator=g) / I ** 0.5
    if p["fp8"]:
        bn, bk = p["block_n"], p["block_k"]
        if p["fused"]:
            q, s = quantize(gu, bn, bk)
            # the scale blocks of a fused tensor split at I only when I is a multiple of bn
            if I % bn == 0:
                wg, wu, sg, su = q[:, :I], q[:, I:], s[:, :I // bn], s[:, I // bn:]
            else:
                wg, sg = quantize(gu[:, :I], bn, bk)
                wu, su = quantize(gu[:, I:], bn, bk)
        else:
            wg, sg = quantize(gu[:, :I], bn, bk)
            wu, su = quantize(gu[:, I:], bn, bk)
        wd, sd = quantize(wd, bn, bk)
        return (x, ids, tw, wg, wu, wd, sg, su, sd, bn, bk)
    gu, wd = gu.to(dt), wd.to(dt)
    wg, wu = (gu[:, :I], gu[:, I:]) if p["fused"] else (gu[:, :I].clone(), gu[:, I:].clone())
    return (x, ids, tw, wg, wu, wd)


def check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@settings(max_examples=30, deadline=None)
@given(p=problems(), cfg=st.sampled_from(CONFIGS))
def test_triton_kernel_matches_reference(p, cfg, interpret):
    args = make(p)
    out = K.launch(*args, config=cfg)
    check(out, K.reference(*args), p["dtype"])
    assert out.is_contiguous()


@settings(max_examples=30, deadline=None)
@given(p=problems())
def test_cpu_path_matches_reference(p):
    args = make(p)
    check(K.cpu_forward(*args), K.reference(*args), p["dtype"])


@settings(max_examples=30, deadline=None)
@given(T=st.integers(0, 50), E=st.integers(1, 9), Kk=st.integers(1, 4), bm=st.sampled_from([16, 32, 64]),
       seed=st.integers(0, 2**31 - 1), bad=st.booleans())
def test_align_by_expert(T, E, Kk, bm, seed, bad):
    Kk = min(Kk, E)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, Kk), generator=g)
    if bad and T:  # out-of-range ids are dropped
        ids[0, 0] = E
        ids[-1, -1] = -1
    sorted_pairs, expert_of_block, n_padded = K.align_by_expert(ids, E, bm)
    P = T * Kk
    n_tiles = expert_of_block.numel()
    assert n_tiles == K.max_tiles(P, E, bm) <= -(-P // bm) + E
    assert sorted_pairs.numel() == n_tiles * bm
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    counts = torch.bincount(flat[valid], minlength=E)
    used = int(((counts + bm - 1) // bm * bm).sum())
    assert int(n_padded) == used
    assert (expert_of_block[used // bm:] == E).all() and (expert_of_block[:used // bm] < E).all()
    assert (sorted_pairs[used:] == P).all()
    real = sorted_pairs[sorted_pairs < P].long()
    # every in-range pair exactly once, stable order within an expert, each tile one expert
    assert sorted(real.tolist()) == torch.nonzero(valid).flatten().tolist()
    tiles = sorted_pairs[:used].view(-1, bm)
    for b in range(used // bm):
        rows = tiles[b][tiles[b] < P].long()
        assert rows.numel() > 0 and (flat[rows] == expert_of_block[b]).all()
        assert (rows.diff() > 0).all()


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 80), E=st.integers(1, 40), Kk=st.integers(1, 6), bm=st.sampled_from([16, 32, 64]),
       seed=st.integers(0, 2**31 - 1), bad=st.booleans(), int32=st.booleans(), strided=st.booleans())
def test_align_kernel_matches_the_torch_sort(T, E, Kk, bm, seed, bad, int32, strided, interpret):
    """_moe_align (one program) against align_by_expert's torch ops: the same pair order, padding
    and tile experts, bit for bit; pair counts across its 64-pair steps, more experts than 16,
    out-of-range ids (dropped), int32 ids and a strided (transposed) id tensor."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, Kk), generator=g)
    if bad:
        ids[torch.rand(T, Kk, generator=g) < 0.2] = E + 3
        ids[0, 0] = -1
    ids = ids.to(torch.int32) if int32 else ids
    if strided:
        ids = ids.t().contiguous().t()  # same values, column-major
    want_sorted, want_experts, _ = K.align_by_expert(ids, E, bm)
    got_sorted, got_experts = K.launch_align(ids, E, bm)
    assert torch.equal(got_sorted, want_sorted) and got_sorted.dtype == want_sorted.dtype
    assert torch.equal(got_experts, want_experts)


def test_launch_routes_with_either_align_path(interpret):
    """The one-program align (decode) and the torch ops (ALIGN_MAX_PAIRS 0) give the same output."""
    p = dict(dtype=torch.float32, T=11, E=6, K=3, H=24, I=20, fp8=False, block_n=128, block_k=128, fused=True,
             tw_fp32=True, strided=False, active_frac=1.0, seed=9)
    args = make(p)
    one = K.launch(*args, config=TILES)
    torch_ops = K.launch(*args, config={**TILES, "ALIGN_MAX_PAIRS": 0})
    assert torch.equal(one, torch_ops)
    check(one, K.reference(*args), torch.float32)


def test_out_of_range_ids_contribute_zero(interpret):
    p = dict(dtype=torch.float32, T=7, E=4, K=2, H=24, I=20, fp8=False, block_n=128, block_k=128, fused=True,
             tw_fp32=True, strided=False, active_frac=1.0, seed=3)
    x, ids, tw, wg, wu, wd = make(p)
    bad = ids.clone().long()
    bad[1, 0], bad[4, 1] = 4, -2
    tw0 = tw.clone()
    tw0[1, 0] = tw0[4, 1] = 0.0
    expected = K.reference(x, ids, tw0, wg, wu, wd)
    for out in (K.launch(x, bad, tw, wg, wu, wd, config=CFG), K.launch(x, bad, tw, wg, wu, wd, config=TILES),
                K.cpu_forward(x, bad, tw, wg, wu, wd), K.reference(x, bad, tw, wg, wu, wd)):
        check(out, expected, torch.float32)


def test_refused_decode_kernels_fall_back_to_the_tiles(interpret, monkeypatch):
    """A GPU that refuses the matrix-vector kernels (resources): the signature's plan takes the
    tile kernels from then on, with one warning."""
    from triton.runtime.errors import OutOfResources

    tried = []

    class Refused:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                tried.append(1)
                raise OutOfResources(1 << 20, 1 << 16, "shared memory")
            return run

    monkeypatch.setattr(K, "_moe_gemv_gate_up", Refused())
    p = dict(dtype=torch.float32, T=3, E=5, K=2, H=24, I=20, fp8=False, block_n=128, block_k=128, fused=False,
             tw_fp32=True, strided=False, active_frac=1.0, seed=21)
    args = make(p)
    cfg = {**CFG}  # a plan of this test's own
    with pytest.warns(UserWarning, match="decode kernels refused"):
        check(K.launch(*args, config=cfg), K.reference(*args), torch.float32)
    check(K.launch(*args, config=cfg), K.reference(*args), torch.float32)
    assert tried == [1], "tried once, then the plan takes the tiles"


def test_decode_takes_two_matrix_vector_launches(interpret):
    """Up to GEMV_MAX_PAIRS pairs: two launches (no sort, no per-pair buffer to sum); above, the
    sort and the tile kernels; the two paths agree (float32 sums in another order)."""
    from metainfer.lowering import aot

    p = dict(dtype=torch.float32, T=4, E=16, K=4, H=40, I=24, fp8=True, block_n=16, block_k=32, fused=True,
             tw_fp32=True, strided=True, active_frac=1.0, seed=13)
    args = make(p)
    with aot._recording(89, names_only=True) as launches:
        K.launch(*args, config=CFG)
        gemv = list(launches)
        launches.clear()
        K.launch(*args, config={**CFG, "GEMV_MAX_PAIRS": 15})  # 16 pairs: one too many
        tiles = list(launches)
    assert gemv == ["moe._moe_gemv_gate_up", "moe._moe_gemv_down"]
    assert tiles == ["moe._moe_align", "moe._moe_gate_up", "moe._moe_down", "moe._moe_sum"]
    check(K.launch(*args, config=CFG), K.launch(*args, config=TILES), torch.float32)


def test_decode_steps_find_their_plan_by_its_guard(monkeypatch):
    """Each decode step brings new activations, ids and weights of the pairs (same shapes) to the
    same weights: one plan, found after the first step by the guard alone (no signature read)."""
    from metainfer.lowering import aot

    from metainfer.kernels._common import GuardedPlans

    monkeypatch.setattr(K, "_launches", GuardedPlans())  # no plan from another test
    keyed, real_key = [], K._key
    monkeypatch.setattr(K, "_key", lambda *a: keyed.append(1) or real_key(*a))
    p = dict(dtype=torch.bfloat16, T=4, E=16, K=2, H=40, I=24, fp8=True, block_n=16, block_k=32, fused=True,
             tw_fp32=True, strided=False, active_frac=1.0, seed=3)
    x, ids, tw, *weights = make(p)
    with aot._recording(89, names_only=True) as launches:
        for step in range(5):
            K.launch(x.clone(), ids.clone(), tw.clone(), *weights)
    assert keyed == [1] and launches.count("moe._moe_gemv_down") == 5


def test_more_picks_than_local_experts(interpret):
    """An expert-parallel rank: top-4 over 8 experts, this rank holding experts 2..3 as its
    local 0..1; ids of other ranks' experts fall outside [0, 2) and contribute nothing."""
    p = dict(dtype=torch.float32, T=9, E=8, K=4, H=24, I=20, fp8=False, block_n=128, block_k=128, fused=True,
             tw_fp32=True, strided=False, active_frac=1.0, seed=11)
    x, ids, tw, wg, wu, wd = make(p)
    keep = (ids >= 2) & (ids < 4)
    expected = K.reference(x, ids, tw * keep, wg, wu, wd)  # the whole layer, other experts' picks weighted 0
    local = ids.long() - 2
    for out in (K.launch(x, local, tw, wg[2:4], wu[2:4], wd[2:4], config=CFG),
                K.reference(x, local, tw, wg[2:4], wu[2:4], wd[2:4])):
        check(out, expected, torch.float32)


def test_decode_and_empty(interpret):
    # one token, many experts: the tile bound stays small (not ceil(T*K/M) + E)
    p = dict(dtype=torch.bfloat16, T=1, E=8, K=2, H=32, I=16, fp8=True, block_n=16, block_k=16, fused=False,
             tw_fp32=False, strided=False, active_frac=1.0, seed=5)
    args = make(p)
    assert K.max_tiles(2, 8, 16) == 2  # one tile per expert used, vs ceil(2/16) + 8 = 9
    check(K.launch(*args, config=CFG), K.reference(*args), torch.bfloat16)
    x, ids, tw = args[0][:0], args[1][:0], args[2][:0]
    for fn in (lambda *a: K.launch(*a, config=CFG), K.cpu_forward, K.reference):
        out = fn(x, ids, tw, *args[3:])
        assert out.shape == (0, 32) and out.dtype == torch.bfloat16


def _base():
    T, E, Kk, H, I = 5, 4, 2, 16, 12
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E)[:Kk] for _ in range(T)])
    return dict(x=x, topk_ids=ids, topk_weights=torch.rand(T, Kk), w_gate=torch.randn(E, I, H),
                w_up=torch.randn(E, I, H), w_down=torch.randn(E, H, I), s_gate=None, s_up=None, s_down=None,
                block_n=16, block_k=16)


def _fp8(a):
    for w, s in (("w_gate", "s_gate"), ("w_up", "s_up"), ("w_down", "s_down")):
        a[w], a[s] = quantize(a[w], 16, 16)
    return a


@pytest.mark.parametrize("edit, msg", [
    (lambda a: a.update(x=a["x"][0]), "x must be 2-D"),
    (lambda a: a.update(x=a["x"].long()), "x has dtype"),
    (lambda a: a.update(topk_ids=a["topk_ids"].float()), "int32 or int64"),
    (lambda a: a.update(topk_ids=a["topk_ids"][:3]), r"topk_ids has 3 rows, expected 5"),
    (lambda a: a.update(topk_ids=a["topk_ids"][:, :0], topk_weights=a["topk_weights"][:, :0]), r"top_k = 0"),
    (lambda a: a.update(topk_weights=a["topk_weights"][:, :1]), r"topk_weights has shape \(5, 1\), expected \(5, 2\)"),
    (lambda a: a.update(topk_weights=a["topk_weights"].double()), "topk_weights has dtype"),
    (lambda a: a.update(w_gate=a["w_gate"][0]), "w_gate must be 3-D"),
    (lambda a: a.update(w_down=a["w_down"][:3]), "expert counts differ"),
    (lambda a: a.update(w_up=a["w_up"][:, :, :8]), r"w_up has shape \(4, 12, 8\), expected \(4, 12, 16\)"),
    (lambda a: a.update(w_down=a["w_down"][:, :, :8]), r"w_down has shape .* expected \(4, 16, 12\)"),
    (lambda a: a.update(w_gate=a["w_gate"].half(), w_up=a["w_up"].half(), w_down=a["w_down"].half()),
     r"weights must be x's dtype or FP8 \(supported FP8 formats: torch.float8_e4m3fn\)"),
    (lambda a: a.update(w_gate=a["w_gate"].to(torch.float8_e5m2), w_up=a["w_up"].to(torch.float8_e5m2),
                        w_down=a["w_down"].to(torch.float8_e5m2)), "supported FP8 formats"),
    (lambda a: a.update(w_up=a["w_up"].half()), "dtypes differ"),
    (lambda a: _fp8(a).update(s_down=None), "missing s_down"),
    (lambda a: a.update(s_gate=torch.ones(4, 1, 1)), "only for FP8 weights"),
    (lambda a: _fp8(a).update(s_gate=torch.ones(4, 1, 2)), r"s_gate has shape \(4, 1, 2\), expected \(4, 1, 1\)"),
    (lambda a: _fp8(a).update(block_k=8), "powers of two >= 16"),
    (lambda a: _fp8(a).update(s_up=a["s_up"].bfloat16()), "block scales must be float32"),
    (lambda a: a.update(topk_weights=torch.rand(5, 2, device="meta")), "topk_weights is on meta"),
])
def test_rejects_bad_inputs(edit, msg):
    a = _base()
    edit(a)
    with pytest.raises(KernelInputError, match=msg):
        K.launch(**a, config=CFG)
    with pytest.raises(KernelInputError, match=msg):
        K.cpu_forward(**a)
    with pytest.raises(KernelInputError, match=msg):
        K.check_inputs(**a)


@pytest.mark.parametrize("cfg", [dict(CFG, BLOCK_M=8), dict(CFG, BLOCK_K=24)])
def test_rejects_bad_config(cfg):
    with pytest.raises(KernelInputError, match="power of two >= 16"):
        K.launch(**_base(), config=cfg)
