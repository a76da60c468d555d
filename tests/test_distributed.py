"""metainfer inside a torch.distributed job, on gloo ranks of this machine (127.0.0.1):
tensor-parallel equivalence with the unsharded eager model on every rank, select_collectives
(fires, equivalence, bytes across the island boundary measured), bad input and rank
failures. The 8-rank tier is marked `ranks8` (pytest -m ranks8)."""

import os
import shutil
import signal
import time

import pytest
import torch
import torch.distributed as dist

import metainfer
from metainfer.parallel import distributed, multirank
from metainfer import models
from metainfer.hardware import targets
from metainfer.passes import ranks
from metainfer.testing import tiny_hf_model

TIMEOUT_S = int(os.environ.get("METAINFER_TEST_RANK_TIMEOUT", 240))


# ---- what each rank runs (module level: the ranks import this file) ----------------------

def _model(kind: str, kv_heads: int):
    heads = max(4, kv_heads)
    if kind in ("models-deepseek", "models-deepseek-v32"):
        name = "deepseek-tiny" if kind == "models-deepseek" else "deepseek-v32-tiny"
        model = models.build(name, n_heads=heads)
        return model, models.example_inputs(name, batch=2, seq=16)[0], lambda out: out
    if kind == "models-llama":
        model = models.build("llama-tiny", n_heads=heads, n_kv_heads=kv_heads)
        return model, models.example_inputs("llama-tiny", batch=2, seq=16)[0], lambda out: out
    arch = {"hf-llama": "Llama", "hf-qwen2": "Qwen2"}[kind]
    model = tiny_hf_model(arch, attn="eager", layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, ids, lambda out: out.logits


def tp_equivalence(rank, world, kind, kv_heads, passes=None):
    """The unsharded model's output (computed here before sharding, the same weights on every
    rank), then optimize() on the job; the largest difference and the pass records."""
    model, ids, logits = _model(kind, kv_heads)
    with torch.no_grad():
        ref = logits(model(ids))
    opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, lowering="aot_eager",
                             passes=passes, tensor_parallel=world,  # tiny models: the planner would replicate
                             expert_parallel=False)  # expert parallelism: its own test
    with torch.no_grad():
        out = logits(opt(ids))
    rec = {r.name: (r.matches, r.decisions) for r in opt.report.passes}
    return (out - ref).abs().max().item(), rec, opt.report.target.name, opt.report.notes


def sequence_parallel_run(rank, world, target, kind, chunks=None):
    """sequence_parallel (and with `chunks`, pipeline_collectives forced to that k on the
    reduce-scatters and all-gathers it makes)."""
    model, ids, logits = _model(kind, 4)
    with torch.no_grad():
        ref = logits(model(ids))
    passes = ["fuse_attention", "sequence_parallel"] + (["pipeline_collectives"] if chunks else []) + ["select_collectives"]
    opt = metainfer.optimize(model, target, example_inputs=(ids,), emulate=True, lowering="aot_eager",
                             passes=passes, tensor_parallel=world, expert_parallel=False,
                             pass_options={"pipeline_chunks": chunks} if chunks else None)
    with torch.no_grad():
        out = logits(opt(ids))
    sp, sel = opt.report.record("sequence_parallel"), opt.report.record("select_collectives")
    if chunks:
        pipe = opt.report.record("pipeline_collectives")
        return (out - ref).abs().max().item(), sp.matches, pipe.matches, pipe.decisions
    return (out - ref).abs().max().item(), sp.matches, sp.decisions, sp.near_misses, sel.matches


def expert_parallel_run(rank, world, experts=8, groups=4):
    model = models.build("deepseek-tiny", n_routed_experts=experts, n_expert_groups=groups,
                         n_limited_groups=min(2, groups))
    ids = models.example_inputs("deepseek-tiny", batch=2, seq=16)[0]
    with torch.no_grad():
        ref = model(ids)
    opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, lowering="aot_eager",
                             expert_parallel=True)
    with torch.no_grad():
        out = opt(ids)
    local = [m.w1.shape[0] for m in model.modules() if hasattr(m, "shard_experts")]
    return ((out - ref).abs().max().item(), local, opt.report.matches("fuse_moe"),
            opt.report.matches("select_collectives"), opt.report.notes)


def mtp_speculation_run(rank, world):
    """models/ DeepSeek drafting with its MTP layer under tp + ep: every rank runs the same
    loop (replicated logits: the same accepted drafts everywhere, so the same collectives)."""
    model = models.build("deepseek-tiny", n_mtp_layers=1)
    ids = models.example_inputs("deepseek-tiny", seq=12)[0]
    greedy = model.generate(ids, 12)
    opt = metainfer.optimize(model, "pcie8", emulate=True, lowering="aot_eager", expert_parallel=True)
    out = opt.generate(ids, 12, draft_length=2)
    local = [m.w1.shape[0] for m in model.mtp.modules() if hasattr(m, "shard_experts")]
    phases = [s.phase for s in model.mtp.__dict__["_metainfer_drafter"].report.sections]
    return torch.equal(out, greedy), local, phases


def degrees_run(rank, world, tensor_parallel):
    """optimize() with the degree left to the planner (None) or fixed; each data-parallel
    replica gets its own inputs (the ranks of one tensor-parallel group the same ones)."""
    model, _, logits = _model("hf-llama", 2)
    tp = tensor_parallel or 1
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 + rank // tp))
    with torch.no_grad():
        ref = logits(model(ids))
    opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, lowering="aot_eager",
                             tensor_parallel=tensor_parallel,
                             disable=("sequence_parallel",))  # keep the all-reduces for select_collectives to judge
    with torch.no_grad():
        out = logits(opt(ids))
    rec = opt.report.record("select_collectives")
    graphs = "".join(r.graph_after or "" for r in opt.report.passes)
    return ((out - ref).abs().max().item(), opt.report.notes, rec.decisions if rec else [],
            "_c10d_functional" in graphs, ids[0, :4].tolist())


def pipelined_run(rank, world, chunks):
    """The default pipeline with pipeline_collectives' k forced (the tiny model's matmuls are
    too small for chunks to pay, so the cost model alone would keep them whole)."""
    model, ids, logits = _model("hf-llama", world)
    with torch.no_grad():
        ref = logits(model(ids))
    opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, lowering="aot_eager",
                             tensor_parallel=world, pass_options={"pipeline_chunks": chunks})
    with torch.no_grad():
        out = logits(opt(ids))
    rec = {n: opt.report.record(n) for n in ("pipeline_collectives", "select_collectives", "overlap_collectives")}
    return (out - ref).abs().max().item(), {n: (r.matches, r.decisions) for n, r in rec.items()}


def two_batch_run(rank, world, kind, expert_parallel):
    """The default pipeline with two_batch_overlap forced (on tiny models the cost model
    declines: two micro-batches of one sequence do not pay)."""
    model, ids, logits = _model(kind, world)
    with torch.no_grad():
        ref = logits(model(ids))
    opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, lowering="aot_eager",
                             tensor_parallel=world, expert_parallel=expert_parallel,
                             pass_options={"two_batch_overlap": True})
    with torch.no_grad():
        out = logits(opt(ids))
    tb, ov = opt.report.record("two_batch_overlap"), opt.report.record("overlap_collectives")
    return (out - ref).abs().max().item(), tb.matches, tb.decisions, ov.matches


def inductor_run(rank, world):
    """The default lowering (Inductor) in a job, with overlap_collectives and without: the
    output and, per all-reduce in Inductor's generated code, the calls between its issue and
    its wait."""
    import re

    from torch._inductor.utils import run_and_get_code

    def build(disable):
        model, ids, logits = _model("models-deepseek", 2)
        with torch.no_grad():
            ref = logits(model(ids))
        opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, tensor_parallel=world,
                                 expert_parallel=False, disable=disable)
        with torch.no_grad():
            return opt, (logits(opt(ids)) - ref).abs().max().item()

    out = {}
    for disable in ((), ("overlap_collectives",)):
        (opt, diff), codes = run_and_get_code(build, disable)
        lines = [line.strip() for code in codes for line in code.splitlines()]
        between = []
        for i, line in enumerate(lines):
            issued = re.match(r"torch\.ops\._c10d_functional\.all_reduce_\.default\((\w+)", line)
            if issued:
                wait = next(j for j in range(i, len(lines)) if lines[j].startswith(
                    f"torch.ops._c10d_functional.wait_tensor.default({issued.group(1)}"))
                between.append([ln for ln in lines[i + 1:wait] if "(" in ln and not ln.startswith(("#", "del ", "assert"))])
        out["on" if not disable else "off"] = (diff, opt.report.matches("overlap_collectives"), between)
    return out


def test_inductor_lowering_keeps_the_overlap():
    """overlap_collectives orders the graph Inductor receives; Inductor's scheduler must keep
    what it gained: with the pass, more of the generated code's calls run between an
    all-reduce's issue and its wait than without (and never fewer). Outputs equal the
    unsharded model's either way."""
    for rank in multirank.run(inductor_run, 2, timeout_s=TIMEOUT_S):
        (diff_on, matches, on), (diff_off, _, off) = rank["on"], rank["off"]
        assert diff_on < 1e-4 and diff_off < 1e-4 and matches >= 1
        assert len(on) == len(off) > 0
        gained = [len(x) - len(y) for x, y in zip(on, off)]
        assert min(gained) >= 0 and max(gained) > 0, (gained, on, off)


def exchange_run(rank, world, absent):
    """Each rank offers a value through ranks.exchange on the whole job and on a
    sub-group; `absent` skips the second round, so the others must time out naming it.
    Also the pass pipeline's key, which must differ per rank."""
    from datetime import timedelta

    from metainfer.passes import PassManager, resolve

    dist.distributed_c10d._get_default_store().set_timeout(timedelta(seconds=3))
    world_group = dist.group.WORLD.group_name
    pair = dist.new_group([0, 1])
    first = ranks.exchange({"rank": rank, "square": rank * rank}, world_group)
    second = None
    if rank in (0, 1):
        second = ranks.exchange(rank + 10, pair.group_name)
    timeout = None
    if rank != absent:
        try:
            ranks.exchange("again", world_group)
        except TimeoutError as e:
            timeout = str(e)
    target = targets.get("pcie8")
    uuid = PassManager(resolve(target, None, ())[0], target).uuid()
    return first, second, timeout, uuid


def test_exchange_passes_objects_through_the_store_and_names_absent_ranks():
    """The order agreement's transport: every member's object in member order, also on a
    sub-group; a member that never comes is named in a TimeoutError, not a hang."""
    results = multirank.run(exchange_run, 3, args=(2,), timeout_s=TIMEOUT_S)
    for r, (first, second, timeout, _) in enumerate(results):
        assert first == [{"rank": q, "square": q * q} for q in range(3)]
        assert second == ([10, 11] if r < 2 else None)
        if r == 2:
            assert timeout is None
        else:
            assert "rank(s) [2] of group [0, 1, 2]" in timeout, timeout
    assert len({uuid for *_, uuid in results}) == 3, "ranks must not share compiled artifacts"


def order_mismatch_run(rank, world):
    """Rank 1 pretends its schedule issues the collectives in another order: every rank must
    refuse the re-ordering (and still compute the right thing)."""
    from metainfer.passes import overlap_collectives as oc

    if rank == 1:
        real = oc.collective_signature
        oc.collective_signature = lambda order: list(reversed(real(order)))
    model, ids, logits = _model("models-deepseek", 2)
    with torch.no_grad():
        ref = logits(model(ids))
    opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, lowering="aot_eager",
                             tensor_parallel=world, expert_parallel=False)
    with torch.no_grad():
        out = logits(opt(ids))
    rec = opt.report.record("overlap_collectives")
    return (out - ref).abs().max().item(), rec.matches, rec.near_misses


def degree_mismatch(rank, world):
    model, ids, _ = _model("hf-llama", 2)
    metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, tensor_parallel=3)


def symmetric_memory_selection(rank, world, available, refusing_rank=None):
    """The pass's choice where P2P kernels would be available (pretended here: the graph is
    only analysed, never run, since the op has no CPU implementation) and where not; with
    `refusing_rank`, that rank's symmetric buffer cannot be allocated (a container refusing IPC)."""
    from metainfer.kernels import symm_mem
    from metainfer.passes import select_collectives as sc

    sc._symmetric_memory_available = lambda target: available

    def reserve(group_name, dtype, numel, device=None):
        return "RuntimeError: CUDA IPC refused" if rank == refusing_rank else None

    symm_mem.reserve = reserve
    model, ids, _ = _model("hf-llama", 2)
    t, _ = distributed.prepare(model, targets.get("pcie8"), emulate=True, tensor_parallel=world)
    report = metainfer.analyze(model, t, example_inputs=(ids,), passes=["select_collectives"])
    rec = report.record("select_collectives")
    return rec.decisions, rec.graph_after or "", rec.near_misses, rec.resources


def low_precision_run(rank, world):
    model, ids, logits = _model("hf-llama", 2)
    with torch.no_grad():
        ref = logits(model(ids))
    opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, lowering="aot_eager",
                             passes=["select_collectives"], pass_options={"all_reduce_dtype": "bf16"},
                             tensor_parallel=world)
    with torch.no_grad():
        out = logits(opt(ids))
    rec = opt.report.record("select_collectives")
    return ((out - ref).abs().max().item(), ref.abs().max().item()), rec.matches, rec.decisions


def bf16_sum_error(rank, world):
    """The error of summing in bf16 (what the transport option sends) against float32, and
    the bound docs/passes.md gives: 2 n 2^-8 sum_i |x_i| per element."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1 << 16, generator=g) * torch.logspace(-3, 3, 1 << 16)
    exact, absolute = x.clone(), x.abs()
    dist.all_reduce(exact)
    dist.all_reduce(absolute)
    low = x.to(torch.bfloat16)
    dist.all_reduce(low)
    err = (low.float() - exact).abs()
    return (err / absolute).max().item(), bool(torch.all(err <= 2 * world * 2.0 ** -8 * absolute))


def all_reduce_bytes(rank, world, algorithm, nbytes):
    """Bytes this rank sends to its own island and across, for one all-reduce of `nbytes`
    run as the flat ring or as the hierarchical rewrite's three collectives, and whether
    the result is right."""
    t = distributed.emulated(targets.get("pcie8"), world)
    groups = ranks.island_groups(t)
    k = len(groups.islands[0])
    intra = dist.distributed_c10d._resolve_process_group(groups.intra_for(rank))
    cross = dist.distributed_c10d._resolve_process_group(groups.cross_for(rank))

    def run():
        x = torch.full((nbytes // 4,), float(rank + 1))
        if algorithm == "ring":
            dist.all_reduce(x)
            return x
        shard = torch.empty(x.numel() // k)
        dist.reduce_scatter_tensor(shard, x, group=intra)
        dist.all_reduce(shard, group=cross)
        dist.all_gather_into_tensor(x, shard, group=intra)
        return x

    run()  # connections set up before counting
    with multirank.SentBytes() as sent:
        y = run()
    return sent.by_link(t.topology.islands), bool(torch.all(y == world * (world + 1) / 2))


def raising_rank(rank, world):
    dist.barrier()  # every rank has started: the failure is one of fn's, timed from the start
    model = models.build("llama-tiny")
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    metainfer.optimize(model, "pcie8", example_inputs=models.example_inputs("llama-tiny", seq=8), emulate=True,
                       lowering="aot_eager")
    time.sleep(60)


def killed_rank(rank, world):
    dist.barrier()
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.ones(4)
    dist.all_reduce(x)
    time.sleep(60)


def bad_heads(rank, world):
    model = models.build("llama-tiny", dim=96, n_heads=6, n_kv_heads=2)  # 6 heads: not over 4 ranks
    metainfer.optimize(model, "pcie8", example_inputs=models.example_inputs("llama-tiny", seq=8), emulate=True,
                       tensor_parallel=4)


def no_plan(rank, world):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    metainfer.optimize(model, "pcie8", example_inputs=(torch.randn(2, 8),), emulate=True)


def world_mismatch(rank, world):
    metainfer.optimize(models.build("llama-tiny"), "pcie8", example_inputs=models.example_inputs("llama-tiny"))


# ---- tiers ---------------------------------------------------------------------------------

# models/ DeepSeek-V3.2 adds the DSA indexer, which stays whole under the plan: the slow tier (28 s)
# the slow tier also: Qwen2 (Llama's plan with biases) and models/ Llama (HF Llama's plan)
@pytest.mark.parametrize("kind", ["hf-llama", pytest.param("hf-qwen2", marks=pytest.mark.slow),
                                  pytest.param("models-llama", marks=pytest.mark.slow), "models-deepseek",
                                  pytest.param("models-deepseek-v32", marks=pytest.mark.slow)])
def test_two_ranks_equal_the_unsharded_model(kind):
    results = multirank.run(tp_equivalence, 2, args=(kind, 2), timeout_s=TIMEOUT_S)
    for diff, rec, target, notes in results:
        assert diff < 1e-4, diff
        assert target == "pcie8@2x1" and any("emulated" in n for n in notes)
        assert any("tensor parallel over ranks [0, 1]" in n for n in notes)
        fused = rec["fuse_attention"][0] + rec["mla_prefill"][0] + rec["sparse_mla"][0]
        assert fused >= 2  # attention over each rank's own heads still fuses
        if kind == "models-deepseek":  # the shared experts' all-reduce runs beside the routed experts
            matches, lines = rec["overlap_collectives"]
            assert any("shared_experts" in d and "compute op(s) now between" in d for d in lines), lines


def test_the_planner_picks_the_degrees_by_default():
    """A tiny model on pcie8@2x1: the planner's decode plan is two replicas (tp1 dp2), so
    nothing is sharded and the forward has no collective."""
    results = multirank.run(degrees_run, 2, args=(None,), timeout_s=TIMEOUT_S)
    for diff, notes, decisions, has_collectives, _ in results:
        assert diff < 1e-4, diff
        assert any(n.startswith("degrees: tp1 dp2: the planner's fastest plan") for n in notes), notes
        assert any("data parallel: 2 replicas" in n for n in notes)
        assert not has_collectives and not decisions


def test_tensor_parallel_groups_inside_data_parallel_replicas():
    """tp2 x dp2 on pcie8@2x2: ranks {0,1} and {2,3} each hold one sharded replica on their
    own island and serve their own inputs; their all-reduces stay inside the island, so the
    library's ring is kept."""
    results = multirank.run(degrees_run, 4, args=(2,), timeout_s=TIMEOUT_S)
    for r, (diff, notes, decisions, has_collectives, _) in enumerate(results):
        assert diff < 1e-4, diff
        group = [0, 1] if r < 2 else [2, 3]
        assert any(f"tensor parallel over ranks {group}" in n and "2 data-parallel replicas" in n for n in notes)
        assert has_collectives and len(decisions) == 4
        assert all("over 2 ranks: flat ring" in d and "(kept)" in d and "across islands 0.0 KiB" in d
                   for d in decisions), decisions
    assert results[0][4] == results[1][4] != results[2][4] == results[3][4], "replicas served different inputs"


def test_pipelined_collectives_equal_the_unsharded_model():
    results = multirank.run(pipelined_run, 4, args=(4,), timeout_s=TIMEOUT_S)
    for diff, rec in results:
        assert diff < 1e-4, diff
        matches, lines = rec["pipeline_collectives"]
        assert matches == 4 and all("all_reduce over 4 ranks beside mm 32x" in d and "k=4 chunks" in d
                                    for d in lines), lines
        assert rec["select_collectives"][0] == 16, "each chunk's all-reduce is selected on its own"
        assert rec["overlap_collectives"][0] >= 1
    assert all(r[1] == results[0][1] for r in results), "every rank decides the same"


@pytest.mark.parametrize("kind,world,ep", [pytest.param("hf-llama", 4, False, marks=pytest.mark.slow),  # 27 s
                                             ("models-deepseek", 2, True)])
def test_two_micro_batches_equal_the_unsharded_model(kind, world, ep):
    results = multirank.run(two_batch_run, world, args=(kind, ep), timeout_s=TIMEOUT_S)
    for diff, matches, decisions, overlapped in results:
        assert diff < 1e-4, diff
        assert matches == 1 and "split into 2 micro-batches of 1" in decisions[0], decisions
        assert overlapped >= 2, "the scheduler interleaves the two micro-batches"


def test_overlap_is_refused_when_ranks_would_order_collectives_differently():
    results = multirank.run(order_mismatch_run, 2, timeout_s=TIMEOUT_S)
    for diff, matches, near in results:
        assert diff < 1e-4 and matches == 0
        assert any("collective order differs between ranks" in m for m in near), near


def test_a_degree_that_does_not_divide_the_job_is_refused():
    with pytest.raises(multirank.RankFailure, match="tensor_parallel=3 does not match the job's 2 ranks"):
        multirank.run(degree_mismatch, 2, timeout_s=TIMEOUT_S)


def test_choose_degrees_keeps_to_plans_metainfer_executes():
    """Llama-3-70B on pcie8: the planner's decode choice has pipeline stages; the job runs
    its fastest plan without them, and says so."""
    model = models.build("llama3-70b", device="meta")
    d = distributed.choose_degrees(model, targets.get("pcie8"), 8)
    assert d.why.startswith(f"degrees: tp{d.tp}") and "needs pipeline stages" in d.why, d.why
    assert d.tp in (4, 8) and not d.expert_parallel
    fixed = distributed.choose_degrees(model, targets.get("pcie8"), 8, tensor_parallel=8)
    assert fixed.tp == 8 and "within what was asked" in fixed.why
    for bad in (3, 0, True, 2.0):
        with pytest.raises(ValueError, match="tensor_parallel"):
            distributed.choose_degrees(model, targets.get("pcie8"), 8, tensor_parallel=bad)


@pytest.mark.parametrize("kind", ["hf-llama", pytest.param("models-llama", marks=pytest.mark.slow),
                                  pytest.param("models-deepseek", marks=pytest.mark.slow)])
def test_four_ranks_hierarchical_all_reduce(kind):
    results = multirank.run(tp_equivalence, 4, args=(kind, 4), timeout_s=TIMEOUT_S)
    decisions = [rec["select_collectives"] for _, rec, _, _ in results]
    for diff, rec, target, _ in results:
        assert diff < 1e-4, diff
        assert target == "pcie8@2x2"
    matches, lines = decisions[0]
    assert matches == 4, lines  # the attention output and the (shared-expert) MLP of 2 layers
    assert all("hierarchical" in line for line in lines)
    assert all(d == decisions[0] for d in decisions), "every rank decides the same"


def test_select_collectives_does_not_fire_outside_the_pipeline():
    """Naming the passes without it keeps the library's ring (and the outputs)."""
    passes = ["fuse_attention"]
    results = multirank.run(tp_equivalence, 4, args=("hf-llama", 4, passes), timeout_s=TIMEOUT_S)
    for diff, rec, _, _ in results:
        assert diff < 1e-4 and "select_collectives" not in rec


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss to read socket counters")
def test_hierarchical_sends_fewer_bytes_across_islands_measured():
    nbytes = 4 << 20
    ring = multirank.run(all_reduce_bytes, 4, args=("ring", nbytes), timeout_s=TIMEOUT_S)
    hier = multirank.run(all_reduce_bytes, 4, args=("hierarchical", nbytes), timeout_s=TIMEOUT_S)
    assert all(ok for _, ok in ring + hier)
    ring_inter = sum(b["inter"] for b, _ in ring)
    hier_inter = sum(b["inter"] for b, _ in hier)
    from metainfer.hardware import cost

    t = distributed.emulated(targets.get("pcie8"), 4)
    predicted = (cost.collective_cost("all_reduce", nbytes, t, "hierarchical").bytes_inter
                 / cost.collective_cost("all_reduce", nbytes, t, "ring").bytes_inter)
    measured = hier_inter / ring_inter
    print(f"bytes across islands, hierarchical / ring: measured {measured:.3f}, formula {predicted:.3f}")
    assert measured < 0.8
    assert measured == pytest.approx(predicted, rel=0.1)


# A box whose memory is slow next to its links: the token-wise work sequence parallelism
# divides matters more than the collectives it reshapes, so the cost model takes it.
SLOW_MEMORY = """
name = "slow-memory4"
description = "4 devices, one island, slow memory (sequence parallelism pays)"
num_devices = 4
[device]
kind = "cuda"
name = "test device"
peak_tflops = { fp32 = 1, tf32 = 1, bf16 = 1, fp16 = 1, fp8 = 1 }
memory_gib = 16
memory_bandwidth_gbs = 0.05
launch_overhead_us = 0
[topology]
islands = [[0, 1, 2, 3]]
p2p = false
intra_island = { bandwidth_gbs = 26, latency_us = 40 }
[collectives]
backend = "nccl"
"""


@pytest.mark.parametrize("kind", ["hf-llama", pytest.param("models-deepseek", marks=pytest.mark.slow)])
def test_sequence_parallel_fires_where_it_pays(tmp_path, kind):
    path = tmp_path / "slow.toml"
    path.write_text(SLOW_MEMORY)
    results = multirank.run(sequence_parallel_run, 4, args=(str(path), kind), timeout_s=TIMEOUT_S)
    for diff, matches, decisions, near, selected in results:
        assert diff < 1e-4, diff
        assert matches == 4, (decisions, near)  # both all-reduces of both layers
        assert "token-wise op(s)" in decisions[0] and "of 32 tokens" in decisions[0]
        assert selected == 0, "no all-reduce left for select_collectives"


@pytest.mark.parametrize("kind", ["hf-llama"])  # DeepSeek's all-gathers: docs/passes.md (2 of them pipelined)
def test_pipelined_reduce_scatter_and_all_gather_equal_the_unsharded_model(tmp_path, kind):
    """Under sequence parallelism: each row-parallel matmul + reduce-scatter and each
    all-gather + column-parallel matmuls in 2 chunks (forced: too small to pay here)."""
    path = tmp_path / "slow.toml"
    path.write_text(SLOW_MEMORY)
    results = multirank.run(sequence_parallel_run, 4, args=(str(path), kind, 2), timeout_s=TIMEOUT_S)
    for diff, sp, pipelined, decisions in results:
        assert diff < 1e-4, diff
        assert sp == 4
        kinds = [d.split(": ")[1].split(" over")[0] for d in decisions if "k=2 chunks" in d]
        assert kinds.count("reduce_scatter") == 4 and kinds.count("all_gather") >= 2, decisions
        assert pipelined == len(kinds)
    assert all(r[3] == results[0][3] for r in results)


def test_sequence_parallel_declines_where_an_island_aware_all_reduce_is_cheaper():
    results = multirank.run(sequence_parallel_run, 4, args=("pcie8", "hf-llama"), timeout_s=TIMEOUT_S)
    for diff, matches, decisions, near, selected in results:
        assert diff < 1e-4 and matches == 0 and selected == 4
        assert any("sequence_parallel not applied on pcie8@2x2" in n for n in near)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: the slow tier (49 s)
def test_expert_parallel_deepseek(world):
    results = multirank.run(expert_parallel_run, world, timeout_s=TIMEOUT_S)
    for diff, local, fused, selected, notes in results:
        assert diff < 1e-4, diff
        assert local == [8 // world], "each rank keeps its share of the routed experts"
        assert fused == 1, "the local experts still become one grouped GEMM (other ranks' ids contribute zero)"
        assert any("expert parallel over" in n for n in notes)
    if world == 4:  # 2 layers x attention + (dense MLP | shared experts), plus the routed experts' sum
        assert results[0][3] == 5


@pytest.mark.slow  # ~1 min; the MTP loop's single-process tests are in the default tier (tests/test_mtp.py)
def test_mtp_speculation_under_tensor_and_expert_parallelism():
    for same, local, phases in multirank.run(mtp_speculation_run, 2, timeout_s=TIMEOUT_S):
        assert same, "greedy tokens equal the unsharded model's"
        assert local == [4], "the MTP layer's routed experts are spread like the main layers'"
        assert phases and set(phases) == {"draft"}


def test_experts_that_do_not_split_are_refused():
    with pytest.raises(multirank.RankFailure, match="6 experts do not split over 4 ranks"):
        multirank.run(expert_parallel_run, 4, args=(6, 3), timeout_s=TIMEOUT_S)


def test_one_shot_only_where_symmetric_memory_exists():
    pretend = multirank.run(symmetric_memory_selection, 2, args=(True,), timeout_s=TIMEOUT_S)
    decisions, graph, _, resources = pretend[0]
    assert all("one-shot" in d.split(": ", 2)[2].split(",")[0] for d in decisions), decisions
    assert "metainfer.symm_mem_all_reduce" in graph and "_c10d_functional.all_reduce" not in graph
    # each buffer the rewritten graph needs, recorded for a warm start from Inductor's cache
    assert len(resources) == len(decisions) and all(r[0] == "symm_mem" and r[2] == "float32" for r in resources)
    real = multirank.run(symmetric_memory_selection, 2, args=(False,), timeout_s=TIMEOUT_S)
    assert not any("one-shot, predicted" in d for d in real[0][0]), "never selected on CPU"


def test_symmetric_memory_that_cannot_be_allocated_is_declined_by_every_rank():
    """The buffer is allocated and exchanged at pass time: where one rank's allocation fails,
    every rank keeps off one-/two-shot and says why."""
    results = multirank.run(symmetric_memory_selection, 2, args=(True, 1), timeout_s=TIMEOUT_S)
    for decisions, graph, near, resources in results:
        assert "metainfer.symm_mem_all_reduce" not in graph and resources == []
        assert not any("one-shot, predicted" in d for d in decisions)
        declined = [n for n in near if "not one-shot" in n]
        assert declined and all("failed on member 1 of the group: RuntimeError: CUDA IPC refused" in n
                                for n in declined), near


def test_low_precision_transport_is_opt_in_and_bounded():
    results = multirank.run(low_precision_run, 2, timeout_s=TIMEOUT_S)
    for (diff, scale), matches, decisions in results:
        assert matches == 4 and all("sent as bfloat16" in d for d in decisions)
        assert diff < 2e-2 * scale, (diff, scale)
    bounds = multirank.run(bf16_sum_error, 4, timeout_s=TIMEOUT_S)
    assert all(ok for _, ok in bounds), bounds
    print(f"bf16 all-reduce over 4 ranks: max |error| / sum|x_i| = {max(r for r, _ in bounds):.2e} "
          f"(bound {2 * 4 * 2.0 ** -8:.2e})")


# ---- bad input and failures -------------------------------------------------------------

def test_heads_that_do_not_split_fail_before_any_collective():
    with pytest.raises(multirank.RankFailure, match="6 attention heads / 2 key-value heads do not split over "
                                                     "tensor-parallel degree 4"):
        multirank.run(bad_heads, 4, timeout_s=TIMEOUT_S)


@pytest.mark.slow  # the mechanism runs in the default tier on HF models (tests/test_tp_matrix.py)
def test_models_llama_replicates_kv_heads_over_more_ranks():
    """models/ Llama, 4 heads / 2 KV heads on 4 ranks: each rank keeps one whole KV head."""
    for diff, rec, _, notes in multirank.run(tp_equivalence, 4, args=("models-llama", 2), timeout_s=TIMEOUT_S):
        assert diff < 1e-4 and rec["fuse_attention"][0] == 2, (diff, rec["fuse_attention"])


def test_model_without_a_plan_is_refused():
    with pytest.raises(multirank.RankFailure, match="has no tensor-parallel plan"):
        multirank.run(no_plan, 2, timeout_s=TIMEOUT_S)


def test_world_size_must_match_the_target_unless_emulated():
    with pytest.raises(multirank.RankFailure, match="emulate=True"):
        multirank.run(world_mismatch, 2, timeout_s=TIMEOUT_S)


def test_emulate_outside_a_job_is_refused():
    with pytest.raises(ValueError, match="start a process group"):
        metainfer.optimize(models.build("llama-tiny"), "pcie8", emulate=True)


def test_a_rank_that_raises_fails_the_run_naming_it():
    with pytest.raises(multirank.RankFailure, match="deliberate failure on rank 1") as e:
        multirank.run(raising_rank, 2, timeout_s=TIMEOUT_S)
    assert e.value.rank == 1  # its own error (the match), not the timeout's


def test_a_killed_rank_fails_the_run_naming_it():
    with pytest.raises(multirank.RankFailure, match="rank 0 was killed") as e:
        multirank.run(killed_rank, 4, timeout_s=TIMEOUT_S)
    assert e.value.rank == 0  # named by its exit status (the match), not at the timeout


def test_a_hang_times_out():
    """The 5 s budget starts at the ranks' rendezvous: spawning and importing torch on a
    loaded machine do not eat into it."""
    with pytest.raises(multirank.RankFailure, match="timed out after 5 s") as e:
        multirank.run(killed_rank_sleeps, 2, timeout_s=5)
    assert e.value.after_start_s >= 5  # later under load: the budget's clock slows (multirank._clock_rate)
    assert "rank 0 at: File" in str(e.value) and "killed_rank_sleeps" in str(e.value), "where each rank hung"


def test_ranks_that_cannot_start_in_time_are_named_as_such(monkeypatch):
    monkeypatch.setenv("METAINFER_RANK_START", "spawn")  # fresh interpreters: importing torch alone takes longer
    t0 = time.monotonic()
    with pytest.raises(multirank.RankFailure, match="did not start within 0.05 s") as e:
        multirank.run(killed_rank_sleeps, 2, timeout_s=5, start_timeout_s=0.05)
    assert e.value.after_start_s is None and time.monotonic() - t0 < 30


def killed_rank_sleeps(rank, world):
    time.sleep(60)


@pytest.mark.ranks8
def test_eight_ranks_pcie8_topology():
    results = multirank.run(tp_equivalence, 8, args=("hf-llama", 8), timeout_s=600)
    for diff, rec, target, _ in results:
        assert diff < 1e-4 and target == "pcie8@2x4"


def test_start_applies_the_targets_collective_settings(python_c):
    """start() sets the target's NCCL settings (a user's own values win) before the process
    group starts; a one-rank gloo job here."""
    code = (
        "import os, socket\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port),\n"
        "                  NCCL_PROTO='Simple')\n"
        "from metainfer.parallel import distributed\n"
        "from metainfer.hardware import targets\n"
        "applied = distributed.start(targets.get('pcie8-nop2p'), backend='gloo', timeout_s=30)\n"
        "import torch.distributed as dist\n"
        "print(sorted(applied), os.environ['NCCL_PROTO'], dist.get_backend())\n")
    stdout = python_c(code)
    assert "NCCL_P2P_DISABLE=1" in stdout and "NCCL_ALGO=Ring" in stdout
    assert "Simple gloo" in stdout, "the user's NCCL_PROTO is kept"


def test_sequence_parallel_region_rules():
    """What may join the token-wise region (single process, no job needed): a pointwise op
    on the activation does; a bit reinterpretation, an in-place op and an op with a per-rank
    scalar do not."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from metainfer.passes.sequence_parallel import _joins, _Region

    def f(h, w_shard):
        scale = torch.mm(h.reshape(-1, 8), w_shard).abs().amax()  # differs per rank
        return h * 2.0, h.view(torch.int32), h * scale, h.mul_(3.0)

    g = make_fx(f)(torch.randn(2, 4, 8), torch.randn(8, 8)).graph
    h = next(iter(g.nodes))
    region = _Region(tokens=8)
    region.members.add(h)  # h stands for an all-reduced activation
    aten = torch.ops.aten

    def users(target):
        return [n for n in h.users if n.target is target]

    def joins(n):
        return _joins(n, region)

    doubled = [n for n in users(aten.mul.Tensor) if n.args[1] == 2.0]
    scaled = [n for n in users(aten.mul.Tensor) if isinstance(n.args[1], torch.fx.Node)]
    assert doubled and joins(doubled[0])
    assert users(aten.view.dtype) and not joins(users(aten.view.dtype)[0])
    assert users(aten.mul_.Tensor) and not joins(users(aten.mul_.Tensor)[0])
    assert scaled and not joins(scaled[0])


def tp_serving(rank, world, prompts, kv_heads):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = tiny_hf_model("Llama", attn="sdpa", layers=2, num_key_value_heads=kv_heads)
    gen = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=-1, pad_token_id=0)
    opt = metainfer.optimize(model, "pcie8", emulate=True, tensor_parallel=world, lowering="aot_eager")
    out = opt.generate_batch(prompts, generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(
        num_blocks=32, page_size=16, max_batch_tokens=64))
    return [o.generated_tokens for o in out.values()], opt.report.notes


@pytest.mark.parametrize("world,kv_heads", [(2, 2), (2, 1), pytest.param(4, 4, marks=pytest.mark.slow)])
def test_serving_in_a_tensor_parallel_job_gives_the_single_process_tokens(world, kv_heads):
    """Continuous batching on metainfer's graphs inside a job: the model sharded by DTensor, the
    engine in its tensor-parallel mode over the same mesh, its per-step exchange through shared
    memory; every rank's tokens equal the plain engine's in one process. With one KV head at
    tp 2 each rank keeps it whole, and the engine's pool holds that one head (it split the
    config's heads by the degree and refused before)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 17, 33, 9)]
    model = tiny_hf_model("Llama", attn="sdpa", layers=2, num_key_value_heads=kv_heads)
    gen = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=-1, pad_token_id=0)
    plain = [o.generated_tokens for o in model.generate_batch(prompts, generation_config=gen, continuous_batching_config=
                                                              ContinuousBatchingConfig(num_blocks=32, page_size=16,
                                                                                       max_batch_tokens=64)).values()]
    for tokens, notes in multirank.run(tp_serving, world, args=(prompts, kv_heads), timeout_s=TIMEOUT_S):
        assert tokens == plain
        assert any("tensor-parallel mode over ranks" in n for n in notes)
        assert any("per-step exchange between ranks (statuses, new requests) goes through a shared-memory" in n
                   for n in notes), notes
