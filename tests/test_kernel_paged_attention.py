"""Paged varlen attention under the interpreter and its CPU path, against the reference, on
hypothesis-drawn batches: requests of different query and cached lengths, keys scattered over
the pool, GQA groups, head dims that are not block multiples, key splits."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from metainfer.kernels import KernelInputError
from metainfer.kernels import paged_attention as P
from metainfer.kernels.configs import config_for

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def batch(lengths, hkv, group, d, dv, dtype, spare=7, seed=0):
    """Packed queries and a pool whose rows hold each request's keys in a random order of rows."""
    g = torch.Generator().manual_seed(seed)
    len_q = [q for q, _ in lengths]
    len_k = [q + past for q, past in lengths]
    rows = sum(len_k) + spare
    k_pool = torch.randn(rows, hkv, d, generator=g).to(dtype)
    v_pool = torch.randn(rows, hkv, dv, generator=g).to(dtype)
    key_index = torch.randperm(rows, generator=g)[:sum(len_k)]
    q = torch.randn(sum(len_q), hkv * group, d, generator=g).to(dtype)
    cu_q = torch.tensor([0] + len_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + len_k).cumsum(0).to(torch.int32)
    return q, k_pool, v_pool, key_index, cu_q, cu_k, max(len_q), max(len_k)


def close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 30)), min_size=1, max_size=4),
       hkv=st.integers(1, 2), group=st.integers(1, 3), d=st.sampled_from([8, 16, 24, 40]),
       same_dv=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       splits=st.integers(1, 3))
def test_kernel_and_cpu_path_against_reference(lengths, hkv, group, d, same_dv, dtype, splits, interpret):
    q, kp, vp, ki, cu_q, cu_k, mq, mk = batch(lengths, hkv, group, d, d if same_dv else 8, dtype)
    scale = d ** -0.5
    ref = P.reference(q, kp, vp, ki, cu_q, cu_k, scale)
    cfg = {**config_for("paged_attention", q.device), "SPLITS": splits}
    close(P.launch(q, kp, vp, ki, cu_q, cu_k, mq, mk, scale, config=cfg), ref, dtype)
    close(P.cpu_forward(q, kp, vp, ki, cu_q, cu_k, mq, mk, scale), ref, dtype)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 40)), min_size=1, max_size=4),
       hkv=st.integers(1, 2), group=st.integers(1, 3), window=st.integers(0, 24),
       softcap=st.sampled_from([0.0, 0.0, 2.0, 30.0]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       splits=st.integers(1, 3))
def test_sliding_window_and_soft_cap(lengths, hkv, group, window, softcap, dtype, splits, interpret):
    """Each query sees its last `window` positions (Hugging Face's kv > q - W, bottom-right), and
    scores capped at softcap * tanh(s / softcap): the kernel and the CPU path against the
    reference, which builds the band from positions by hand."""
    q, kp, vp, ki, cu_q, cu_k, mq, mk = batch(lengths, hkv, group, 16, 16, dtype)
    ref = P.reference(q, kp, vp, ki, cu_q, cu_k, 0.25, window, softcap)
    cfg = {**config_for("paged_attention", q.device), "SPLITS": splits}
    close(P.launch(q, kp, vp, ki, cu_q, cu_k, mq, mk, 0.25, window, softcap, config=cfg), ref, dtype)
    close(P.cpu_forward(q, kp, vp, ki, cu_q, cu_k, mq, mk, 0.25, window=window, softcap=softcap), ref, dtype)


def test_a_windowed_case_by_hand():
    """One request, one head, d 1: 2 new tokens after 3 cached, window 2. Keys are 0..4 with
    values 0..4 and every score equal, so each query averages the values in its window: query 0
    (position 3) sees keys 2, 3 -> 2.5; query 1 (position 4) sees 3, 4 -> 3.5."""
    k_pool = torch.ones(5, 1, 1)
    v_pool = torch.arange(5.0).view(5, 1, 1)
    q = torch.zeros(2, 1, 1)
    cu_q, cu_k = torch.tensor([0, 2]), torch.tensor([0, 5])
    key_index = torch.arange(5)
    for out in (P.reference(q, k_pool, v_pool, key_index, cu_q, cu_k, 1.0, 2),
                P.cpu_forward(q, k_pool, v_pool, key_index, cu_q, cu_k, 2, 5, 1.0, window=2)):
        assert out.flatten().tolist() == [2.5, 3.5]


@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 20)), min_size=1, max_size=3),
       group=st.integers(1, 3), splits=st.integers(1, 2))
def test_keys_given_in_order(lengths, group, splits, interpret):
    """No key index: K/V hold each request's keys in cu_k order (MLA's decompressed keys)."""
    q, kp, vp, ki, cu_q, cu_k, mq, mk = batch(lengths, 1, group, 24, 16, torch.float32)
    k, v = kp[ki], vp[ki]  # the keys in order
    ref = P.reference(q, kp, vp, ki, cu_q, cu_k, 0.3)
    cfg = {**config_for("paged_attention", q.device), "SPLITS": splits}
    close(P.launch(q, k, v, None, cu_q, cu_k, mq, mk, 0.3, config=cfg), ref, torch.float32)
    close(P.cpu_forward(q, k, v, None, cu_q, cu_k, mq, mk, 0.3), ref, torch.float32)


@settings(max_examples=15, deadline=None)
@given(contexts=st.lists(st.integers(1, 90), min_size=1, max_size=5), group=st.integers(1, 4))
def test_decode_batch_split_over_keys(contexts, group, interpret):
    """One query token per request (decode) over long contexts: the split the launcher picks."""
    q, kp, vp, ki, cu_q, cu_k, mq, mk = batch([(1, c) for c in contexts], 2, group, 16, 16, torch.float32)
    cfg = {**config_for("paged_attention", q.device), "KEYS_PER_SPLIT": 16, "MAX_SPLITS": 8}
    assert P._KeySplits(cfg, mq, cfg["BLOCK_N"])(mk)[0] > 1 or mk <= 16
    close(P.launch(q, kp, vp, ki, cu_q, cu_k, mq, mk, 0.25, config=cfg),
          P.reference(q, kp, vp, ki, cu_q, cu_k, 0.25), torch.float32)


def shared_prefix_batch(groups, chunks, hkv, group, dtype, seed):
    """Decode requests in groups whose keys start with the same pool rows (a cached prefix the
    engine shares), then prompt chunks after cached tokens; rows scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    keys, len_q = [], []
    rows = torch.randperm(4096, generator=g).tolist()
    take = lambda n: [rows.pop() for _ in range(n)]  # noqa: E731
    for prefix, owns in groups:
        shared = take(prefix)
        for own in owns:
            keys.append(shared + take(own))
            len_q.append(1)
    for sq, past in chunks:
        keys.append(take(sq + past))
        len_q.append(sq)
    d = 16
    k_pool = torch.randn(4096, hkv, d, generator=g).to(dtype)
    v_pool = torch.randn(4096, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(len_q), hkv * group, d, generator=g).to(dtype)
    cu_q = torch.tensor([0] + len_q).cumsum(0)
    cu_k = torch.tensor([0] + [len(k) for k in keys]).cumsum(0)
    return q, k_pool, v_pool, torch.tensor(sum(keys, [])), cu_q, cu_k, max(len_q), max(len(k) for k in keys)


@settings(max_examples=20, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(P.MIN_SHARED - 4, P.MIN_SHARED + 40),
                                 st.lists(st.integers(1, 30), min_size=1, max_size=4)), min_size=1, max_size=3),
       chunks=st.lists(st.tuples(st.integers(2, 40), st.integers(0, 50)), max_size=4),
       hkv=st.integers(1, 2), group=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 99))
def test_cpu_path_batches_shared_prefixes_and_short_chunks(groups, chunks, hkv, group, dtype, seed):
    """The CPU path's grouped calls (a shared prefix attended once per group of decode requests,
    short chunks in padded calls) against the reference, per request."""
    args = shared_prefix_batch(groups, chunks, hkv, group, dtype, seed)
    q, kp, vp, ki, cu_q, cu_k, mq, mk = args
    close(P.cpu_forward(*args, 0.3), P.reference(q, kp, vp, ki, cu_q, cu_k, 0.3), dtype)


@settings(max_examples=25, deadline=None)
@given(contexts=st.lists(st.integers(1, 700), min_size=1, max_size=12), hkv=st.integers(1, 2), group=st.integers(1, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 99))
def test_decode_requests_of_very_different_lengths(contexts, hkv, group, dtype, seed):
    """A decode step whose requests' contexts range widely (a long tail): the length classes'
    padded calls against the reference, per request."""
    args = batch([(1, c) for c in contexts], hkv, group, 16, 16, dtype, seed=seed)
    q, kp, vp, ki, cu_q, cu_k, mq, mk = args
    close(P.cpu_forward(*args, 0.3), P.reference(q, kp, vp, ki, cu_q, cu_k, 0.3), dtype)


def test_length_classes_bound_the_padding():
    # by hand, waste 1.25: 10, 11, 12 pad to 36 <= 1.25 x 33; adding 40 would pad to 160 > 1.25 x 73;
    # 40, 41 pad to 82 <= 1.25 x 81; adding 100 would pad to 300 > 1.25 x 181
    assert P.length_classes([100, 41, 10, 12, 40, 11], 1.25) == [[2, 5, 3], [4, 1], [0]]
    assert P.length_classes([7, 7, 7], 1.0) == [[0, 1, 2]]
    assert P.length_classes([], 1.25) == []


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), max_size=40), waste=st.floats(1.0, 4.0))
def test_length_classes_partition_and_respect_the_bound(lengths, waste):
    groups = P.length_classes(lengths, waste)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= waste * sum(lengths[i] for i in g)


def test_shared_prefixes_are_found_from_the_pool_rows():
    """Two groups (shared prefixes of 70 and 64 keys), one request alone, one group below the minimum."""
    q, kp, vp, ki, cu_q, cu_k, mq, mk = shared_prefix_batch(
        [(70, [3, 5, 1]), (64, [2, 2]), (80, [4]), (P.MIN_SHARED - 1, [3, 3])], [], 1, 1, torch.float32, 0)
    starts = cu_k[:-1].tolist()
    lengths = (cu_k[1:] - cu_k[:-1]).tolist()
    assert P._shared_prefixes(ki, starts, lengths) == [([0, 1, 2], 70), ([3, 4], 64)]


def test_one_plan_serves_every_layer_of_a_step():
    """Layers of a step share the indices, not the pool: the plan built by the first layer gives
    every later layer (other keys, other values) the reference's result."""
    args = shared_prefix_batch([(70, [3, 5, 1])], [(5, 9), (7, 12), (300, 4)], 2, 2, torch.float32, 1)
    q, kp, vp, ki, cu_q, cu_k, mq, mk = args
    plans: dict = {}
    for layer in range(3):
        kp, vp, q = kp.roll(layer, dims=0), vp * (layer + 1), q.flip(0)
        out = P.cpu_forward(q, kp, vp, ki, cu_q, cu_k, mq, mk, 0.3, plans=plans)
        close(out, P.reference(q, kp, vp, ki, cu_q, cu_k, 0.3), torch.float32)
    assert len(plans) == 1


def test_keys_gathered_anew_each_step_reuse_the_launch_plan(monkeypatch):
    """The ring-buffer and no-write paths hand the launcher each step's keys as new tensors, their
    row count growing: one launch plan serves every step (the rows stay out of its key)."""
    from metainfer.lowering import aot

    from metainfer.kernels._common import GuardedPlans

    monkeypatch.setattr(P, "_launches", GuardedPlans(vary=P._launches._vary))  # no plan from another test
    builds, keyed = [], []
    real, real_key = P._Launch, P._key
    monkeypatch.setattr(P, "_Launch", lambda *a: builds.append(1) or real(*a))
    monkeypatch.setattr(P, "_key", lambda *a: keyed.append(1) or real_key(*a))
    with aot._recording(89, names_only=True):
        for past in range(10, 15):
            q, kp, vp, ki, cu_q, cu_k, mq, mk = batch([(1, past), (1, 2 * past)], 2, 2, 16, 16, torch.float32,
                                                      spare=0)
            P.launch(q, kp[ki], vp[ki], None, cu_q, cu_k, mq, mk, 0.25)
            P.launch(q, kp, vp, ki, cu_q, cu_k, mq, mk, 0.25)  # a key index one step longer each time
    assert builds == [1, 1], "one plan with a key index, one without"
    assert keyed == [1, 1], "each found by its guard from the second step on"


def test_a_hand_made_case():
    """Two requests, one head: a fresh prompt of 2 tokens and a decode token after 2 cached
    keys. Keys 1 everywhere, values = row number, so each output is the mean of the rows kept."""
    k_pool = torch.ones(6, 1, 4)
    v_pool = torch.arange(6.0)[:, None, None].expand(6, 1, 4).contiguous()
    key_index = torch.tensor([4, 1, 0, 5, 3])  # request 0: rows 4, 1; request 1: rows 0, 5, 3
    cu_q, cu_k = torch.tensor([0, 2, 3]), torch.tensor([0, 2, 5])
    q = torch.ones(3, 1, 4)
    out = P.cpu_forward(q, k_pool, v_pool, key_index, cu_q, cu_k, 2, 3, 1.0)
    torch.testing.assert_close(out[:, 0, 0], torch.tensor([4.0, 2.5, (0 + 5 + 3) / 3]))
    torch.testing.assert_close(out, P.reference(q, k_pool, v_pool, key_index, cu_q, cu_k, 1.0))


def test_bad_inputs_are_named():
    q, kp, vp, ki, cu_q, cu_k, mq, mk = batch([(2, 1)], 1, 1, 8, 8, torch.float32)
    with pytest.raises(KernelInputError, match="query heads \\(3\\) must be a multiple of kv heads \\(2\\)"):
        P.check_inputs(torch.zeros(3, 3, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), ki, cu_q, cu_k, 2, 3, 1.0)
    for bad_index in (ki.float(), ki[None], torch.stack([ki, ki], 1)[:, 0]):  # dtype, 2-D, strided
        with pytest.raises(KernelInputError, match="key_index must be a contiguous 1-D int32/int64 tensor"):
            P.check_inputs(q, kp, vp, bad_index, cu_q, cu_k, mq, mk, 1.0)
    with pytest.raises(KernelInputError, match="cu_q must be a contiguous 1-D int32/int64 tensor"):
        P.check_inputs(q, kp, vp, ki, cu_q.float(), cu_k, mq, mk, 1.0)
    with pytest.raises(KernelInputError, match="cu_q and cu_k must both have n_requests \\+ 1 entries"):
        P.check_inputs(q, kp, vp, ki, cu_q, cu_k[:1], mq, mk, 1.0)
