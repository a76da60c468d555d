"""overlap_collectives and pipeline_collectives on graphs built in one process (their
multi-rank equivalence is in test_distributed.py), and a real-size Llama layer analysed as
rank 0 of pcie8 on torch's fake process group."""

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import metainfer
from metainfer import models
from metainfer.passes import overlap_collectives as oc
from metainfer.testing import run_pass

c10d = torch.ops._c10d_functional


def _graph(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def wait_before_independent_work(x, w1, w2):
    r = c10d.wait_tensor(c10d.all_reduce(x @ w1, "sum", "0"))
    z = torch.relu(x @ w2)  # does not need r
    return r + z


def nothing_independent(x, w1, w2):
    r = c10d.wait_tensor(c10d.all_reduce(x @ w1, "sum", "0"))
    return torch.relu(r @ w2)


def names(gm):
    return [n.name for n in gm.graph.nodes]


def test_overlap_moves_the_wait_behind_independent_compute():
    gm = _graph(wait_before_independent_work, (64, 256), (256, 256), (256, 256))
    after, rec = run_pass("overlap_collectives", gm, "pcie8")
    order = names(after)
    assert rec.matches == 1, rec.near_misses
    assert order.index("all_reduce") < order.index("mm_1") < order.index("relu") < order.index("wait_tensor")
    assert sorted(order) == sorted(names(gm)), "only the order changes"
    assert "2 compute op(s) now between issue and wait (0 before)" in rec.decisions[0]
    # by hand, from pcie8's numbers (fp32 91.6 TFLOP/s, 864 GB/s, 4 us a launch; 40 us and
    # 10 GB/s across its islands): a 64x256x256 matmul reads and writes 393,216 B: 4.4551 us;
    # the 64 KiB ring all-reduce over 8 ranks, 14 steps of 40 us + 8 KiB / 10 GB/s: 571.4688 us;
    # relu and add fused, 196,608 B: 4.2276 us. Before: mm, all-reduce, wait, mm, relu+add;
    # after, the second matmul runs beside the all-reduce and leaves the schedule.
    mm, ar, tail = 4e-6 + 393216 / 864e9, 14 * (40e-6 + 8192 / 10e9), 4e-6 + 196608 / 864e9
    assert rec.predicted_before_s == pytest.approx(2 * mm + ar + tail)
    assert rec.predicted_after_s == pytest.approx(mm + ar + tail)
    assert (rec.exposed_before_s, rec.exposed_after_s) == (pytest.approx(ar), pytest.approx(ar - mm))
    assert "graph re-ordered" in rec.decisions[-1] and "peak live activations" in rec.decisions[-1]
    # equivalence on two gloo ranks, each with its own x, against the sum written out
    from metainfer.parallel import multirank

    for rank, (before, reordered, by_hand) in enumerate(multirank.run(_reordered_on_ranks, 2, timeout_s=240)):
        torch.testing.assert_close(reordered, by_hand)
        torch.testing.assert_close(before, by_hand)


def _reordered_on_ranks(rank: int, world: int):
    """(the graph's output, the re-ordered graph's, the same by hand) on this rank: x differs
    per rank, w1 and w2 are shared."""
    shapes = ((64, 256), (256, 256), (256, 256))
    gm = _graph(wait_before_independent_work, *shapes)
    after, rec = run_pass("overlap_collectives", gm, "pcie8")
    assert rec.matches == 1
    xs = [torch.randn(64, 256, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    w1, w2 = (torch.randn(256, 256, generator=torch.Generator().manual_seed(10 + i)) for i in range(2))
    by_hand = sum(x @ w1 for x in xs) + torch.relu(xs[rank] @ w2)
    args = (xs[rank], w1, w2)
    return gm(*args), after(*args), by_hand


def test_overlap_does_not_fire_without_independent_compute():
    gm = _graph(nothing_independent, (64, 256), (256, 256), (256, 256))
    after, rec = run_pass("overlap_collectives", gm, "pcie8")
    assert rec.matches == 0 and not rec.decisions
    assert names(after) == names(gm)
    assert any("no independent compute" in m or "already the scheduler's" in m for m in rec.near_misses)


def test_overlap_keeps_writes_into_inputs_in_place():
    """An in-place write is a barrier: the independent matmul after it may not move before it,
    so nothing can fill the gap."""
    def fn(x, w1, w2, buf):
        r = c10d.wait_tensor(c10d.all_reduce(x @ w1, "sum", "0"))
        buf.copy_(r)
        return torch.relu(x @ w2) + buf

    gm = _graph(fn, (64, 256), (256, 256), (256, 256), (64, 256))
    after, rec = run_pass("overlap_collectives", gm, "pcie8")
    order = names(after)
    assert order.index("copy_") < order.index("mm_1")
    assert rec.matches == 0


def test_overlap_refuses_a_schedule_over_the_memory_bound():
    gm = _graph(wait_before_independent_work, (64, 256), (256, 256), (256, 256))
    after, rec = run_pass("overlap_collectives", gm, "pcie8", options={"overlap_memory_bytes": 1024})
    assert rec.matches == 0 and names(after) == names(gm)
    assert any("exceeds the memory bound" in m and "bound 0.00 MiB" in m for m in rec.near_misses), rec.near_misses
    with pytest.raises(Exception, match="overlap_memory_bytes must be a non-negative number"):
        run_pass("overlap_collectives", gm, "pcie8", options={"overlap_memory_bytes": -1})


def test_peak_live_bytes_counts_views_as_their_base():
    def fn(x):
        a = x * 2           # 1 KiB, alive until b
        v = a.view(-1)      # shares a
        b = v + 1           # 1 KiB; a freed after this
        return b * 3        # 1 KiB; b freed after this
    gm = _graph(fn, (16, 16))
    order = list(gm.graph.nodes)
    assert oc.peak_live_bytes(order) == 2 * 16 * 16 * 4


def test_pipeline_chunks_pay_for_prefill_and_not_for_decode():
    """A Llama-3-70B-sized row-parallel matmul at tp8 on pcie8: 16k prefill rows give a
    256 MiB all-reduce, and chunks hide the next chunk's GEMM behind it; 64 decode rows a
    GEMM whose weight would be read once per chunk, beside a 1 MiB all-reduce."""
    from metainfer.parallel.distributed import fake_job

    def row_parallel(x, w):
        return c10d.wait_tensor(c10d.all_reduce(x @ w, "sum", dist.group.WORLD.group_name))

    for rows, pays in ((16384, True), (64, False)):
        with fake_job(8):
            x, w = torch.empty(rows, 3584, dtype=torch.bfloat16), torch.empty(3584, 8192, dtype=torch.bfloat16)
            gm = make_fx(row_parallel, tracing_mode="fake")(x, w)
            after, rec = run_pass("pipeline_collectives", gm, "pcie8")
        assert len(rec.decisions) == 1 and f"beside mm {rows}x3584x8192" in rec.decisions[0], rec.decisions
        assert rec.matches == int(pays), rec.decisions
        chunks = sum(1 for n in after.graph.nodes if n.target is c10d.all_reduce.default)
        assert chunks == (int(rec.decisions[0].split(": k=")[1].split()[0]) if pays else 1), rec.decisions


def test_pipelined_all_gather_lowers_through_inductor():
    """The column-parallel form's rewrite reaches Inductor after its decompositions: every op
    it adds must have a lowering there (aten.stack, a decomposition, had none)."""
    from torch._inductor.compile_fx import compile_fx_inner

    from metainfer.parallel.distributed import fake_job

    def fn(x, w1, w2):
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 4, dist.group.WORLD.group_name))
        return g @ w1, g @ w2

    with fake_job(4):
        args = (torch.randn(8, 64), torch.randn(64, 32), torch.randn(64, 48))
        gm = make_fx(fn, tracing_mode="fake")(*args)
        after, rec = run_pass("pipeline_collectives", gm, "pcie4", options={"pipeline_chunks": 2})
        assert rec.matches == 1, rec.near_misses
        compile_fx_inner(after, list(args))  # raised "both a fallback and a decomp" before


def test_pipeline_collectives_needs_a_job():
    gm = _graph(nothing_independent, (64, 256), (256, 256), (256, 256))
    after, rec = run_pass("pipeline_collectives", gm, "pcie8")
    assert rec.matches == 0 and names(after) == names(gm)


def test_real_size_layer_analysed_as_rank_zero_of_pcie8():
    """A Llama-3-70B layer (bf16, meta) sharded tp8 on the fake process group: the graph has
    the per-rank shapes and its collectives; prefill pipelines a row-parallel matmul and the
    scheduler overlaps; the job is gone afterwards."""
    model = models.build("llama3-70b", device="meta", n_layers=1, dtype=torch.bfloat16)
    ids = torch.zeros(4, 4096, dtype=torch.long, device="meta")
    report = metainfer.analyze(model, "pcie8", example_inputs=(ids,), ranks=8, tensor_parallel=8)
    assert not dist.is_initialized()
    assert any("rank 0 of 8" in n for n in report.notes)
    pipe, sel, ov = (report.record(n) for n in ("pipeline_collectives", "select_collectives", "overlap_collectives"))
    halves = report.record("two_batch_overlap").matches  # two micro-batches: each has its own sites
    rows = 16384 // (1 + halves)
    sp = report.record("sequence_parallel").matches  # its reduce-scatters and all-gathers, if it fired
    # a site per all-reduce (2 a layer), or per reduce-scatter and per all-gather that feeds matmuls
    assert len(pipe.decisions) == (2 if not sp else 4) * (1 + halves), pipe.decisions
    kinds = ("all_reduce",) if not sp else ("reduce_scatter", "all_gather")
    assert all(any(f"{k} over 8 ranks beside mm" in d for k in kinds) for d in pipe.decisions), pipe.decisions
    assert all(f"mm {rows}x" in d for d in pipe.decisions), pipe.decisions  # every token of the batch
    assert all(all(f"k={k} step" in d for k in (1, 2, 4, 8)) for d in pipe.decisions), pipe.decisions
    assert ov.matches >= 1 and ov.predicted_after_s < pipe.predicted_before_s
    assert sel.matches >= (0 if sp else 2 + pipe.matches)
    with pytest.raises(ValueError, match="has 8 devices"):
        metainfer.analyze(model, "pcie8", example_inputs=(ids,), ranks=4)


# ---- two_batch_overlap ---------------------------------------------------------------------

from metainfer.passes import two_batch_overlap as tbo  # noqa: E402
from metainfer.passes.lookahead import copy_graph  # noqa: E402
from metainfer.testing import capture_graph, tiny_hf_model  # noqa: E402

KERNEL_PASSES = ("fuse_moe", "mla_prefill", "fuse_attention", "sparse_mla", "fuse_rope", "fuse_rmsnorm", "fuse_swiglu")


def _captured(kind: str, batch: int, seq: int):
    if kind.startswith("hf-"):
        model = tiny_hf_model({"hf-llama": "Llama", "hf-qwen2": "Qwen2"}[kind], attn="eager", layers=2)
        ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))
        fn = lambda t: model(t).logits  # noqa: E731
    else:
        model = models.build(kind)
        ids = models.example_inputs(kind, batch=batch, seq=seq, seed=seq)[0]
        fn = model
    gm, args = capture_graph(fn, ids)
    for p in KERNEL_PASSES:  # the graph as two_batch_overlap sees it in the pipeline
        gm, _ = run_pass(p, gm, "cpu")
    return gm, args


@pytest.mark.parametrize("kind", ["llama-tiny", "deepseek-tiny", "deepseek-v32-tiny", "hf-llama", "hf-qwen2"])
@pytest.mark.parametrize("batch,seq", [(2, 16), (4, 7)])
def test_batch_split_equals_the_whole_batch(kind, batch, seq):
    """The split graph (two micro-batch chains, joined at the output) computes what the
    graph did, on the kernels' graphs of every model: no collective needed to check that."""
    gm, args = _captured(kind, batch, seq)
    split = torch.fx.GraphModule(gm, torch.fx.Graph())
    split.graph = copy_graph(gm.graph)
    trace = tbo.BatchTrace(split.graph)
    assert trace.batch == batch
    duplicated = tbo.split(split.graph, trace)
    split.graph.eliminate_dead_code()
    split.graph.lint()
    split.recompile()
    assert duplicated > 20
    mm = [n for n in split.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert mm and all(n.meta["val"].shape[0] == batch * seq // 2 for n in mm if n.args[0].meta["val"].shape[0] != 1)
    with torch.no_grad():
        torch.testing.assert_close(split(*args), gm(*args), rtol=1e-5, atol=1e-5)


def test_batch_split_refuses_what_it_cannot_trace():
    def reduce_over_batch(ids, w):
        return torch.nn.functional.embedding(ids, w).sum(0)

    gm, _ = capture_graph(reduce_over_batch, torch.randint(0, 8, (2, 4)), torch.randn(8, 4))
    with pytest.raises(tbo.Unsplittable, match="reduces over the batch"):
        tbo.BatchTrace(gm.graph)
    gm, _ = capture_graph(lambda x: x * 2, torch.randn(2, 4))
    with pytest.raises(tbo.Unsplittable, match="no token-id input"):
        tbo.BatchTrace(gm.graph)


def test_sequence_parallel_decides_with_the_later_passes_in_view():
    """Llama-3-70B at tp4 x dp2 (prefill, 2 x 4096 per replica) on pcie8: the step figures the
    pass decides by are the ones the whole pipeline ends with, with the pass forced on and
    with it disabled (separate runs), and it takes the shorter."""
    import re

    ids = torch.zeros(2, 4096, dtype=torch.long, device="meta")

    def analysed(**kw):
        model = models.build("llama3-70b", device="meta", n_layers=1, dtype=torch.bfloat16)
        return metainfer.analyze(model, "pcie8", example_inputs=(ids,), ranks=8, tensor_parallel=4, **kw)

    report = analysed()
    sp = report.record("sequence_parallel")
    said = " ".join(sp.decisions + sp.near_misses)
    with_it, without = (float(x) for x in re.search(r"predicted step (\d+) us with it, (\d+) us without", said).groups())
    assert "after two_batch_overlap, pipeline_collectives, select_collectives, overlap_collectives" in said
    forced = analysed(pass_options={"sequence_parallel": True}).sections[0].prediction["after_s"]
    disabled = analysed(disable=["sequence_parallel"]).sections[0].prediction["after_s"]
    assert (with_it, without) == (pytest.approx(forced * 1e6, abs=1), pytest.approx(disabled * 1e6, abs=1))
    assert sp.matches == (2 if forced < disabled else 0), said
    alone = analysed(passes=["fuse_attention", "sequence_parallel"])
    assert alone.record("sequence_parallel").matches == 2, "with nothing after it, it takes the work saved"


def test_two_batch_overlap_pays_for_prefill_not_decode():
    """Real-size Llama-3-70B layer as rank 0 of pcie8 (tp8): prefill 4 x 4096 splits, decode
    64 x 1 (each micro-batch would read the weights again) and a batch of 1 do not."""
    def run(batch, seq):
        model = models.build("llama3-70b", device="meta", n_layers=1, dtype=torch.bfloat16)
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        report = metainfer.analyze(model, "pcie8", example_inputs=(ids,), ranks=8, tensor_parallel=8)
        return report.record("two_batch_overlap")

    prefill, decode, single = run(4, 4096), run(64, 1), run(1, 4096)
    assert prefill.matches == 1 and "split into 2 micro-batches of 2" in prefill.decisions[0], prefill.near_misses
    assert decode.matches == 0 and any("does not pay" in m for m in decode.near_misses), decode.near_misses
    assert single.matches == 0 and any("batch of 1" in m for m in single.near_misses), single.near_misses
