"""The collective cost model: formulas against hand-computed cases, and the properties any
alpha-beta model must have (hypothesis)."""

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from metainfer.hardware import cost, targets
from metainfer.hardware.fxops import VIEW_NAMES, op_name

MiB = 2**20


def with_links(t, intra_bw=None, inter_bw=None, lat=None):
    topo = t.topology
    intra = dataclasses.replace(topo.intra_island, **({"bandwidth": intra_bw} if intra_bw else {}),
                                **({"latency_s": lat} if lat is not None else {}))
    inter = topo.inter_island and dataclasses.replace(topo.inter_island, **({"bandwidth": inter_bw} if inter_bw else {}),
                                                      **({"latency_s": lat} if lat is not None else {}))
    return dataclasses.replace(t, topology=dataclasses.replace(topo, intra_island=intra, inter_island=inter))


def test_ring_all_reduce_on_pcie8_by_hand():
    t = targets.get("pcie8")  # intra 26 GB/s / 40 us, inter 10 GB/s / 40 us, 2 x 4
    c = cost.collective_cost("all_reduce", 8 * MiB, t, "ring")
    step = 40e-6 + (8 * MiB / 8) / 10e9  # the ring's slowest link is the boundary
    assert c.steps == 14 and c.seconds == pytest.approx(14 * step)
    assert c.bytes_inter == pytest.approx(2 * 14 * MiB)  # 2 crossing edges x 14 steps x 1 MiB
    assert c.bytes_intra == pytest.approx(6 * 14 * MiB)


def test_hierarchical_all_reduce_on_pcie8_by_hand():
    t = targets.get("pcie8")
    M = 8 * MiB
    c = cost.collective_cost("all_reduce", M, t, "hierarchical")
    inside = 6 * (40e-6 + (M / 4) / 26e9)  # RS + AG rings of 4 inside each island
    across = 2 * (40e-6 + 4 * (M / 8) / 10e9)  # 4 rings of 2 share the boundary link
    assert c.seconds == pytest.approx(inside + across)
    assert c.bytes_inter == pytest.approx(2 * M)  # every rank sends its M/8 piece across, twice
    ring = cost.collective_cost("all_reduce", M, t, "ring")
    assert c.bytes_inter / ring.bytes_inter == pytest.approx(4 / 7)  # 2M vs 2 x 14 x M/8


def test_sub_groups_share_the_boundary_with_their_siblings():
    """The hierarchical all-reduce's cross-island step, priced as its own collective (a ring
    of one rank per island), costs what the hierarchical formula charges for it: the four
    position groups cross the boundary at once. A group inside one island never crosses."""
    t = targets.get("pcie8")
    shard = 8 * MiB / 4
    across = cost.collective_cost("all_reduce", shard, t, "ring", ranks=(0, 4))
    assert across.seconds == pytest.approx(2 * (40e-6 + (shard / 2) / (10e9 / 4)))
    whole = cost.collective_cost("all_reduce", 8 * MiB, t, "hierarchical")
    inside = cost.collective_cost("reduce_scatter", 8 * MiB, t, ranks=(0, 1, 2, 3))
    gather = cost.collective_cost("all_gather", 8 * MiB, t, ranks=(0, 1, 2, 3))
    assert inside.seconds + across.seconds + gather.seconds == pytest.approx(whole.seconds)
    assert inside.bytes_inter == 0 and inside.seconds == pytest.approx(3 * (40e-6 + 2 * MiB / 26e9))


def test_one_shot_needs_p2p_and_wins_for_small_messages():
    t = targets.get("pcie8")
    small = {c.algorithm: c for c in cost.candidates("all_reduce", 4096, t)}
    assert cost.best("all_reduce", 4096, t).algorithm == "one_shot"
    assert small["one_shot"].steps == 1 and small["ring"].steps == 14
    nop2p = targets.get("pcie8-nop2p")
    assert "one_shot" not in {c.algorithm for c in cost.candidates("all_reduce", 4096, nop2p)}
    with pytest.raises(ValueError, match="peer-to-peer"):
        cost.collective_cost("all_reduce", 4096, nop2p, "one_shot")


def test_all_gather_reduce_scatter_all_to_all_by_hand():
    t = targets.get("pcie4")  # one island, 26 GB/s, 40 us
    ag = cost.collective_cost("all_gather", 4 * MiB, t)
    assert ag.seconds == pytest.approx(3 * (40e-6 + MiB / 26e9)) and ag.bytes_inter == 0
    assert cost.collective_cost("reduce_scatter", 4 * MiB, t).seconds == ag.seconds
    a2a = cost.collective_cost("all_to_all", 4 * MiB, t)
    assert a2a.seconds == pytest.approx(40e-6 + 3 * MiB / 26e9) and a2a.bytes_intra == pytest.approx(12 * MiB)


def test_single_rank_and_bad_input():
    assert cost.collective_cost("all_reduce", MiB, targets.get("cpu")).seconds == 0
    with pytest.raises(ValueError, match="unknown collective"):
        cost.collective_cost("broadcast", MiB, targets.get("pcie8"))
    with pytest.raises(ValueError, match="no algorithm"):
        cost.collective_cost("all_gather", MiB, targets.get("pcie8"), "hierarchical")
    with pytest.raises(ValueError, match="ranks"):
        cost.collective_cost("all_reduce", MiB, targets.get("pcie8"), ranks=9)


KINDS = [(k, a) for k, algs in cost.ALGORITHMS.items() for a in algs]


def with_shm(t, bandwidth=6e9, latency_s=40e-6):
    """`t` with a shared-memory path for every kind it serves (a CPU host's, as calibrate fits it)."""
    from metainfer.hardware.targets import SHM_KINDS, LinkSpec

    return dataclasses.replace(t, shm_links={k: LinkSpec(bandwidth=bandwidth, latency_s=latency_s) for k in SHM_KINDS})
TARGETS = ["pcie8", "pcie8-nop2p", "pcie8-gen5", "pcie4", "nvlink8"]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(KINDS), st.sampled_from(TARGETS), st.floats(0, 1e9), st.floats(1.0, 4.0))
def test_more_bytes_never_faster(kind_alg, name, nbytes, factor):
    kind, alg = kind_alg
    t = with_shm(targets.get(name))
    if alg == "one_shot" and not t.topology.p2p:
        return
    a = cost.collective_cost(kind, nbytes, t, alg)
    b = cost.collective_cost(kind, nbytes * factor, t, alg)
    assert b.seconds >= a.seconds and b.bytes_inter >= a.bytes_inter


@settings(max_examples=100, deadline=None)
@given(st.floats(1, 1e9), st.sampled_from([2, 4, 8]))
def test_one_island_hierarchical_is_the_flat_ring(nbytes, ranks):
    t = targets.get("nvlink8")  # one island of 8
    h = cost.collective_cost("all_reduce", nbytes, t, "hierarchical", ranks=ranks)
    r = cost.collective_cost("all_reduce", nbytes, t, "ring", ranks=ranks)
    assert h.seconds == pytest.approx(r.seconds) and h.bytes_inter == r.bytes_inter == 0


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(KINDS), st.floats(1, 1e9))
def test_infinite_bandwidth_leaves_latency(kind_alg, nbytes):
    kind, alg = kind_alg
    t = with_shm(with_links(targets.get("pcie8"), intra_bw=1e300, inter_bw=1e300), bandwidth=1e300)
    c = cost.collective_cost(kind, nbytes, t, alg)
    assert c.seconds == pytest.approx(c.steps * 40e-6, rel=1e-9)


# ---- compute ops --------------------------------------------------------------------------

import torch  # noqa: E402

from metainfer.testing import capture_graph, run_pass  # noqa: E402


def _nodes(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target)]


def test_matmul_pointwise_reduction_and_views_by_hand():
    t = targets.get("pcie8")  # bf16 362 TFLOP/s, 864 GB/s, 4 us launch
    gm, _ = capture_graph(lambda x, w: torch.relu(x @ w.t()).sum(-1),
                          torch.randn(256, 512, dtype=torch.bfloat16), torch.randn(1024, 512, dtype=torch.bfloat16))
    (mm,) = _nodes(gm, "aten.mm")
    c = cost.op_cost(mm, t)
    flops, nbytes = 2 * 256 * 1024 * 512, 2 * (256 * 512 + 1024 * 512 + 256 * 1024)
    assert c.flops == flops and c.bytes == nbytes
    assert c.seconds == pytest.approx(max(flops / 362e12, nbytes / 864e9) + 4e-6)
    (relu,) = _nodes(gm, "relu")
    assert cost.op_cost(relu, t).flops == 256 * 1024 and cost.op_cost(relu, t).bound == "launch"
    (perm,) = _nodes(gm, "permute")
    assert cost.op_cost(perm, t).seconds == 0


def test_constant_fills_are_free():
    """full/arange with no tensor input (full_like decomposes to one): Inductor computes them
    inside the kernel that reads them, so they cost nothing of their own; the add reading
    them is priced."""
    t = targets.get("pcie8")
    gm, _ = capture_graph(lambda x: x + torch.full((64, 64), 2.0) + torch.arange(64.0) + torch.full_like(x, 3.0),
                          torch.randn(64, 64))
    fills = _nodes(gm, "aten.full.default") + _nodes(gm, "aten.arange")
    assert len(fills) >= 2
    for n in fills:
        assert cost.op_cost(n, t).seconds == 0 and cost.op_cost(n, t).bound == "free", n
    assert all(cost.op_cost(n, t).seconds > 0 for n in _nodes(gm, "aten.add"))


def test_fused_attention_is_priced_by_its_flops():
    B, H, S, D = 1, 8, 1024, 128
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.bfloat16) for _ in range(3))
    gm, _ = capture_graph(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) * 0.1, -1) @ v, q, k, v)
    after, rec = run_pass("fuse_attention", gm)
    (att,) = _nodes(after, "metainfer.attention")
    c = cost.op_cost(att, targets.get("pcie8"))
    assert c.flops == 2 * B * H * S * S * 2 * D and c.bound == "compute"
    assert c.bytes == 4 * B * H * S * D * 2  # q, k, v read, out written: never the S x S scores


def test_attention_on_a_cpu_is_priced_by_the_path_it_takes():
    """On a CPU device metainfer.attention runs torch's fused SDPA kernel when it computes
    exactly that (Dv == D, no mask with causal), else a chunked path that writes the fp32 score
    matrix and reads it back (scale, causal mask, softmax, p @ v): by hand, 8 passes over
    B H Sq Sk floats, and every score computed (no causal half)."""
    from metainfer.kernels import ops  # noqa: F401  (registers torch.ops.metainfer.*)

    t = targets.get("cpu")  # 126 GFLOP/s fp32, 20.5 GB/s, 5 us a kernel
    B, H, S = 1, 4, 256
    for d, dv, chunked in ((64, 64, False), (48, 32, True)):
        q, k, v = torch.randn(B, H, S, d), torch.randn(B, H, S, d), torch.randn(B, H, S, dv)
        gm, _ = capture_graph(lambda q, k, v: torch.ops.metainfer.attention(q, k, v, None, 0.125, True, 0, False),
                              q, k, v)
        (att,) = _nodes(gm, "metainfer.attention")
        c = cost.op_cost(att, t)
        io = 4 * (B * H * S * (2 * d + dv) + B * H * S * dv)
        scores = B * H * S * S
        if chunked:
            flops, nbytes = 2 * scores * (d + dv), io + 8 * scores * 4
        else:
            flops, nbytes = 2 * scores * (d + dv) / 2, io
        assert (c.flops, c.bytes) == (flops, nbytes)
        assert c.seconds == pytest.approx(max(flops / 126e9, nbytes / 20.5e9) + 5e-6)


def test_windowed_and_soft_capped_attention_prices():
    """A sliding window of W keys: about W keys per query (no causal half) on a GPU target. On
    a CPU a soft-cap or window leaves torch's fused kernel (it has neither): the chunked path,
    whose score matrix a soft-cap reads and writes 6 more times (divide, tanh, multiply); at
    this size one chunk holds every row, so every key is scored. By hand."""
    from metainfer.kernels import ops  # noqa: F401  (registers torch.ops.metainfer.*)

    B, H, S, D, W = 1, 4, 256, 64, 32
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))

    def priced(target, softcap, window):
        gm, _ = capture_graph(lambda q, k, v: torch.ops.metainfer.attention(q, k, v, None, 0.125, True, 0, False,
                                                                            softcap, window), q, k, v)
        (att,) = _nodes(gm, "metainfer.attention")
        return cost.op_cost(att, targets.get(target))

    assert priced("pcie8", 0.0, W).flops == 2 * B * H * S * W * 2 * D
    assert priced("pcie8", 0.0, 0).flops == 2 * B * H * S * S * 2 * D / 2  # causal: half
    io, scores = 4 * B * H * S * 4 * D, B * H * S * S
    assert priced("cpu", 0.0, 0).bytes == io  # the fused kernel: no score matrix
    for softcap, window, passes in ((30.0, 0, 14), (0.0, W, 8), (30.0, W, 14)):
        c = priced("cpu", softcap, window)
        assert (c.flops, c.bytes) == (2 * scores * 2 * D, io + passes * scores * 4), (softcap, window)


@settings(max_examples=50, deadline=None)
@given(st.integers(16, 64), st.integers(16, 64), st.integers(16, 64))  # small dims decompose to mul+sum
def test_bigger_matmul_never_cheaper(m, n, k):
    t = targets.get("pcie8")
    small, _ = capture_graph(lambda a, b: a @ b, torch.randn(m, k), torch.randn(k, n))
    big, _ = capture_graph(lambda a, b: a @ b, torch.randn(2 * m, k), torch.randn(k, n))
    cs, cb = (cost.op_cost(_nodes(g, "aten.mm")[0], t) for g in (small, big))
    assert cb.seconds >= cs.seconds and cb.flops == 2 * cs.flops


# ---- what the lowering emits: fused groups, indexed loads and stores (hand-computed) ---------

def _groups(gm):
    return [[str(n.target).split(".")[1] for n in g if op_name(n)[1] not in VIEW_NAMES]
            for g in cost.fusion_groups(gm.graph)]


def test_a_pointwise_chain_is_one_kernel_reading_and_writing_once():
    t = targets.get("pcie8")  # 864 GB/s, 4 us launch
    N = 1 << 20
    gm, _ = capture_graph(lambda x: torch.relu(x * 2.0 + 1.0), torch.randn(N))
    (k,) = cost.fused_kernels(gm.graph, t)
    assert [n for n in _groups(gm)[0]] == ["mul", "add", "relu"]
    assert k.cost.bytes == 2 * 4 * N and k.cost.flops == 3 * N  # x read once, y written once
    assert k.cost.seconds == pytest.approx(8 * N / 864e9 + 4e-6)
    prices = cost.price_graph(gm.graph, t)
    assert sum(p.seconds for p in prices.values()) == pytest.approx(k.cost.seconds)
    assert prices[k.anchor] == k.cost  # the whole kernel charged where its last node sits


def test_rmsnorm_reads_its_input_and_weight_once():
    t = targets.get("pcie8")
    R, H = 64, 4096
    gm, _ = capture_graph(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
                          torch.randn(R, H), torch.randn(H))
    (k,) = cost.fused_kernels(gm.graph, t)
    assert k.cost.bytes == 4 * (R * H + H + R * H)


def test_no_fusion_through_an_extern_kernel():
    """a = relu(x); b = a @ w; c = a * b: the multiply cannot join relu's kernel (b needs a
    first), so a is written once and read by the matmul and by the multiply's kernel. (With
    an add, Inductor's post-grad passes fold it into the matmul: addmm.)"""
    t = targets.get("pcie8")

    def f(x, w):
        a = torch.relu(x)
        return a * (a @ w)

    gm, _ = capture_graph(f, torch.randn(128, 128), torch.randn(128, 128))
    groups = _groups(gm)
    assert ["relu"] in groups and ["mul"] in groups and len(groups) == 2
    by_op = {tuple(g): k for g, k in zip(groups, cost.fused_kernels(gm.graph, t))}
    assert by_op[("relu",)].cost.bytes == 2 * 4 * 128 * 128
    assert by_op[("mul",)].cost.bytes == 3 * 4 * 128 * 128  # a, b read; c written


def test_a_producer_off_the_extern_path_fuses_into_its_consumer():
    """relu(x) * (x @ w): the relu feeds only the multiply, so it is computed inside its kernel."""
    gm, _ = capture_graph(lambda x, w: torch.relu(x) * (x @ w), torch.randn(64, 64), torch.randn(64, 64))
    assert _groups(gm) == [["relu", "mul"]]


def test_an_embedding_lookup_reads_the_rows_it_touches():
    t = targets.get("pcie8")
    V, D, T = 32000, 512, 6
    gm, _ = capture_graph(lambda table, ids: table[ids] * 2.0, torch.randn(V, D), torch.randint(0, V, (T,)))
    (k,) = cost.fused_kernels(gm.graph, t)
    assert k.cost.bytes == 4 * T * D + 8 * T + 4 * T * D  # rows read, ids read, result written
    assert k.cost.bytes < 4 * V * D / 1000


def test_a_scatter_writes_the_rows_it_touches():
    t = targets.get("pcie8")
    N, D, T = 4096, 256, 8

    def write(cache, idx, new):
        return cache.index_put((idx,), new)

    gm, _ = capture_graph(write, torch.randn(N, D), torch.randint(0, N, (T,)), torch.randn(T, D))
    (k,) = cost.fused_kernels(gm.graph, t)
    assert k.cost.bytes == 4 * T * D + 8 * T + 4 * T * D + 4 * T * D  # rows of cache, idx, new; rows written


def test_views_of_inputs_cost_nothing():
    """x @ w.t(): the transpose is a view the matmul reads strided; no kernel, no bytes."""
    t = targets.get("pcie8")
    gm, _ = capture_graph(lambda x, w: x @ w.t(), torch.randn(64, 128), torch.randn(256, 128))
    prices = cost.price_graph(gm.graph, t)
    (mm,) = _nodes(gm, "aten.mm")
    assert sum(p.seconds for n, p in prices.items() if n is not mm) == 0
    assert prices[mm] == cost.op_cost(mm, t)


def _with_cache(t, mib, gbs):
    return dataclasses.replace(t, device=dataclasses.replace(t.device, cache_bytes=mib * 2**20, cache_bandwidth=gbs * 1e9))


def test_a_graph_that_fits_in_the_cache_level_streams_at_its_bandwidth():
    """A decode-shaped matmul over a 2 MiB weight is memory-bound: priced at a cache level's
    bandwidth (60 GB/s, unlike any real GPU's, so the two cases differ) when the graph's
    footprint (inputs and output, 2 MiB + 12 KiB) fits in its 4 MiB, at memory's 864 GB/s when
    the level holds 1 MiB or the target has none."""
    x, w = torch.randn(2, 512), torch.randn(512, 1024)
    gm, _ = capture_graph(lambda x, w: x @ w, x, w)
    (mm,) = _nodes(gm, "aten.mm")
    footprint = 4 * (2 * 512 + 512 * 1024 + 2 * 1024)
    assert cost.graph_footprint(gm.graph) == footprint
    base = targets.get("pcie8")  # fp32 by its TF32-less peak; memory 864 GB/s; 4 us launch
    fits, too_small = _with_cache(base, 4, 60), _with_cache(base, 1, 60)
    assert cost.price_graph(gm.graph, fits)[mm].seconds == pytest.approx(footprint / 60e9 + 4e-6)
    assert cost.price_graph(gm.graph, too_small)[mm].seconds == pytest.approx(footprint / 864e9 + 4e-6)
    assert cost.price_graph(gm.graph, base)[mm].seconds == pytest.approx(footprint / 864e9 + 4e-6)


def test_memory_time_adds_to_arithmetic_where_it_does_not_overlap():
    """A 128-row matmul over a 1376 x 512 weight on pcie4's numbers (fp32 91.6 TFLOP/s, 864 GB/s,
    4 us launch): the roofline's max where loads overlap the arithmetic, the sum where they do
    not (memory_overlap 0), half the smaller term hidden at 0.5."""
    base = targets.get("pcie4")
    gm, _ = capture_graph(lambda x, w: x @ w, torch.randn(128, 1376), torch.randn(1376, 512))
    (mm,) = _nodes(gm, "aten.mm")
    compute = 2 * 128 * 1376 * 512 / base.device.peak_flops["fp32"]
    memory = 4 * (128 * 1376 + 1376 * 512 + 128 * 512) / 864e9
    for overlap, body in ((1.0, max(compute, memory)), (0.0, compute + memory), (0.5, max(compute, memory) + min(compute, memory) / 2)):
        t = dataclasses.replace(base, device=dataclasses.replace(base.device, memory_overlap=overlap))
        assert cost.op_cost(mm, t).seconds == pytest.approx(body + 4e-6)


def test_a_collective_kind_fitted_on_its_own_is_priced_by_its_fit():
    """gloo's reduce-scatter costs what its all-reduce does: a target that carries its own fit
    for the kind (calibrate writes one) prices it by that link, the others by the topology's.
    Two ranks, 4 MiB: ring reduce-scatter = 1 step of (latency + 2 MiB / bandwidth)."""
    from metainfer.hardware.targets import LinkSpec

    base = dataclasses.replace(targets.get("pcie8"), num_devices=2,
                               topology=dataclasses.replace(targets.get("pcie8").topology, islands=((0, 1),),
                                                            inter_island=None))
    own = dataclasses.replace(base, collective_links={"reduce_scatter": LinkSpec(bandwidth=0.5e9, latency_s=300e-6)})
    mib = 4 * 2**20
    link = base.topology.intra_island
    assert cost.collective_cost("reduce_scatter", mib, own).seconds == pytest.approx(300e-6 + mib / 2 / 0.5e9)
    assert cost.collective_cost("reduce_scatter", mib, base).seconds == pytest.approx(link.latency_s + mib / 2 / link.bandwidth)
    assert cost.collective_cost("all_reduce", mib, own).seconds == cost.collective_cost("all_reduce", mib, base).seconds


def test_the_shared_memory_path_is_priced_by_its_fit_and_offered_only_where_declared():
    from metainfer.hardware.targets import LinkSpec

    base = dataclasses.replace(targets.get("pcie8"), num_devices=2,
                               topology=dataclasses.replace(targets.get("pcie8").topology, islands=((0, 1),),
                                                            inter_island=None))
    shm = dataclasses.replace(base, shm_links={"all_reduce": LinkSpec(bandwidth=4e9, latency_s=10e-6)})
    mib = 4 * 2**20
    assert cost.collective_cost("all_reduce", mib, shm, "shm").seconds == pytest.approx(10e-6 + mib / 4e9)
    assert "shm" in {c.algorithm for c in cost.candidates("all_reduce", mib, shm)}
    assert "shm" not in {c.algorithm for c in cost.candidates("all_gather", mib, shm)}  # no fit for that kind
    assert "shm" not in {c.algorithm for c in cost.candidates("all_reduce", mib, base)}
    with pytest.raises(ValueError, match="no shared-memory path"):
        cost.collective_cost("all_gather", mib, shm, "shm")
    assert cost.collective_cost("all_reduce", 0, shm, "shm").seconds == 0.0
