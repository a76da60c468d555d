"""Overlap and pipelining: predicted throughput stage by stage on pcie8, and measured wall time
per forward on CPU gloo ranks with the passes on and off, in one run.

    python bench/bench_overlap.py [--models llama3-70b,deepseek-v3] [--ranks 4] [--skip-measured]

Predicted (metainfer's cost model and simulator, not measured): one transformer layer of
Llama-3-70B and of DeepSeek-V3 (an MoE layer; bf16 weights, since tensor parallelism over
FP8 block scales is not supported yet) sharded as rank 0 of an 8-device job on torch's fake
process group, captured on the meta device, its graph run through the passes of each stage
and simulated on pcie8. Prefill: 4 x 4096 tokens; decode: 64 sequences x 1 token at 4096 of
context (KV cache). A layer's time is the graph with two layers minus the graph with one
(steady state: embedding, head, the first layer's fill and the last one's drain cancel),
and throughput is tokens / (layers x layer time), the replicas of a plan side by side:

  (a) baseline: the library default, tensor parallel over all 8 devices for both phases
      (one plan), flat-ring all-reduces, no overlap, no kernel passes (DeepSeek: each rank
      holds 1/8 of the routed experts, as with the libraries' TP-sharded experts, and they
      are fused, since the reference loop's tokens per expert are data a meta graph does not
      have)
  (b) + the kernel passes (attention, MLA, MoE, RMSNorm, RoPE, SwiGLU fusions)
  (c) + collective selection (sequence_parallel, select_collectives)
  (d) + overlap and pipelining (two_batch_overlap, pipeline_collectives, overlap_collectives)
  (p) (d) with the phase's own plan: the planner's fastest plan metainfer executes for the
      phase (tp x dp replicas; DeepSeek-V3 planned on a 141 GiB what-if of pcie8, as its
      weights do not fit 48 GiB devices)
  (e) the floor of (p): max(compute, communication on the best algorithm)

Measured: tensor parallel over `--ranks` gloo ranks on 127.0.0.1 (pcie8 scaled onto them),
aot_eager lowering, fp32: a DeepSeek-tiny-shaped MoE model (hidden 512, 8 heads, 2 layers,
4 x 128 tokens; its shared experts' all-reduce can run beside the routed experts) with the
passes deciding by pcie8's numbers, and a Llama (hidden 512, 8 heads, 2 layers, 4 x 256
tokens) with two_batch_overlap and pipeline_collectives forced (at this size the cost model
declines them): median wall time per forward with overlap_collectives, pipeline_collectives
and two_batch_overlap on and disabled. The ranks share this machine's cores, so this says
what the re-ordering costs or gains on gloo, not what a GPU would do.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
import types

import torch
import torch.fx.experimental._config  # noqa: F401  (meta_nonzero_assume_all_nonzero)

from metainfer.parallel import distributed
from metainfer import models
from metainfer.hardware import targets
from metainfer.passes import PassManager, get_pass
from metainfer.passes.pipeline import DEFAULT_ORDER
from metainfer.hardware.simulate import simulate
from metainfer.testing import capture_graph

KERNELS = ["fuse_moe", "mla_prefill", "fuse_attention", "sparse_mla", "mla_decode", "fp8_gemm", "fuse_rope",
           "fuse_rmsnorm", "fuse_swiglu"]
COLLECTIVES = ["sequence_parallel", "select_collectives"]
OVERLAP = ["two_batch_overlap", "pipeline_collectives", "overlap_collectives"]
STAGES = {k: [p for p in DEFAULT_ORDER if p in chosen]  # each stage in the default pipeline's order
          for k, chosen in {"a": [], "b": KERNELS, "c": KERNELS + COLLECTIVES,
                            "d": KERNELS + COLLECTIVES + OVERLAP}.items()}
# the reference MoE loop's per-expert token counts are data (nonzero), which a graph on meta
# does not have; its baseline is taken with the experts fused (priced at uniform load)
MOE_BASELINE = ["fuse_moe"]
WORKLOAD = {"prefill": (4, 4096), "decode": (64, 4096)}
LAYERS = {"llama3-70b": 80, "deepseek-v3": 61}
WHAT_IF_GIB = 141


def _model(name: str, layers: int):
    extra = {"n_dense_layers": 0} if name.startswith("deepseek") else {}
    cfg = {"fp8": False} if name.startswith("deepseek") else {}
    return models.build(name, device="meta", dtype=torch.bfloat16, n_layers=layers, **extra, **cfg)


def _graph(name: str, layers: int, phase: str, target, tp: int, ep: bool):
    """rank 0's captured graph of `name` with `layers` layers under tp (the rest replicas),
    routed experts spread over the tp group if `ep`."""
    batch, seq = WORKLOAD[phase]
    model = _model(name, layers)
    with distributed.fake_job(target.num_devices):
        distributed.prepare(model, target, emulate=False, tensor_parallel=tp, expert_parallel_on=ep)
        dp = target.num_devices // tp
        rows = -(-batch // dp)
        # the MoE loop's nonzero on meta: a stand-in size (the fused experts replace the loop)
        with torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True):
            if phase == "prefill":
                ids = torch.zeros(rows, seq, dtype=torch.long, device="meta")
                gm, _ = capture_graph(model, ids)
            else:
                model.setup_cache(rows, seq + 1)
                ids = torch.zeros(rows, 1, dtype=torch.long, device="meta")
                gm, _ = capture_graph(lambda t: model(t, start_pos=seq), ids)
        times = {}
        for stage, passes in STAGES.items():
            g = copy.deepcopy(gm)
            if name.startswith("deepseek") and stage == "a":
                passes = MOE_BASELINE
            if passes:
                PassManager([get_pass(p) for p in passes], target, explicit=True, simulate=False)(g.graph)
            times[stage] = simulate(g, target)
    return times


def predicted(names: list[str]) -> list[str]:
    lines = ["predicted on pcie8 (a model, not a measurement); tok/s of the layers (embedding and head excluded)",
             "| model | phase | (a) baseline tp8 | (b) kernels | (c) + collectives | (d) + overlap | (p) phase plan "
             "| (e) floor | b/a | c/a | d/a | p/a | p/floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    pcie8 = targets.get("pcie8")
    for name in names:
        plan_target = pcie8
        if name.startswith("deepseek"):
            dev = dataclasses.replace(pcie8.device, memory_bytes=WHAT_IF_GIB * 2**30)
            plan_target = dataclasses.replace(pcie8, name=f"pcie8@{WHAT_IF_GIB}GiB", device=dev)
        for phase, (batch, seq) in WORKLOAD.items():
            t0 = time.perf_counter()
            tokens = batch * (seq if phase == "prefill" else 1)
            # the planner reads the whole model's shape; its layers say how experts shard
            full = types.SimpleNamespace(config=models.config(name), modules=_model(name, 1).modules)
            deg = distributed.choose_degrees(full, plan_target, 8, phase=phase)
            moe = name.startswith("deepseek")  # the baseline's experts: 1/8 of them per rank, as TP-sharded experts are
            base = {k: _layer(v2, v1) for (k, v2), v1 in zip(_graph(name, 2, phase, pcie8, 8, moe).items(),
                                                             _graph(name, 1, phase, pcie8, 8, moe).values())}
            if deg.tp == 8 and deg.expert_parallel == moe:
                own = base["d"]
            else:
                two = _graph(name, 2, phase, pcie8, deg.tp, deg.expert_parallel)
                one = _graph(name, 1, phase, pcie8, deg.tp, deg.expert_parallel)
                own = _layer(two["d"], one["d"])
            dp = 8 // deg.tp
            rate = {k: tokens / (LAYERS[name] * v[0]) for k, v in base.items()}
            p_rate = tokens / (LAYERS[name] * own[0])  # dp replicas take batch/dp each, side by side
            floor_rate = tokens / (LAYERS[name] * own[1])
            lines.append(
                f"| {name} | {phase} | {rate['a']:,.0f} | {rate['b']:,.0f} | {rate['c']:,.0f} | {rate['d']:,.0f} | "
                f"{p_rate:,.0f} (tp{deg.tp} dp{dp}{' ep' + str(deg.tp) if deg.expert_parallel else ''}) | {floor_rate:,.0f} | {rate['b'] / rate['a']:.2f} | "
                f"{rate['c'] / rate['a']:.2f} | {rate['d'] / rate['a']:.2f} | {p_rate / rate['a']:.2f} | "
                f"{own[0] / own[1]:.2f} |")
            print(f"  {name} {phase}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return lines


def _layer(two, one) -> tuple[float, float]:
    """(step, floor) of one layer in steady state: the graph with two layers minus the graph
    with one (embedding, head, and the first layer's fill and last layer's drain cancel)."""
    floor = max(two.compute_seconds - one.compute_seconds, two.comm_floor_seconds - one.comm_floor_seconds)
    return two.step_seconds - one.step_seconds, floor


MEASURED = {  # model, what the passes are left to decide
    "deepseek": "as the cost model decides (pcie8's numbers)",
    "llama": "two_batch_overlap and pipeline_collectives (k=2) forced",
}


def _measured_model(kind: str):
    if kind == "deepseek":
        model = models.build("deepseek-tiny", dim=512, inter_dim=1024, moe_inter_dim=256, n_heads=8)
        return model, models.example_inputs("deepseek-tiny", batch=4, seq=128, seed=1)[0], {}
    model = models.build("llama-small", dim=512, n_heads=8, n_kv_heads=8, ffn_dim=1408)
    return (model, models.example_inputs("llama-small", batch=4, seq=256, seed=1)[0],
            {"two_batch_overlap": True, "pipeline_chunks": 2})


def measured_rank(rank, world, kind: str, overlap: bool, repeats: int):
    import metainfer

    model, ids, forced = _measured_model(kind)
    with torch.no_grad():
        ref = model(ids)
    opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, lowering="aot_eager",
                             tensor_parallel=world, expert_parallel=False, disable=() if overlap else tuple(OVERLAP),
                             pass_options=forced if overlap else None)
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            out = opt(ids)
            times.append(time.perf_counter() - t0)
    fired = {p: opt.report.matches(p) for p in OVERLAP}
    return statistics.median(times), (out - ref).abs().max().item(), fired


def measured(ranks: int, repeats: int) -> list[str]:
    from metainfer.parallel import multirank

    lines = [f"measured on CPU gloo, {ranks} ranks sharing this machine's cores, tensor parallel, median of "
             f"{repeats} forwards (slowest rank)", "| model | overlap passes | wall time / forward | max diff vs "
             "unsharded | matches (two-batch, pipeline, overlap) |", "|---|---|---|---|---|"]
    for kind, how in MEASURED.items():
        rows = []
        for overlap in (False, True):
            res = multirank.run(measured_rank, ranks, args=(kind, overlap, repeats), timeout_s=900)
            rows.append((max(r[0] for r in res), max(r[1] for r in res), res[0][2]))
        for overlap, (t, diff, fired) in zip((False, True), rows):
            lines.append(f"| {kind} | {how if overlap else 'off (disabled)'} | {t * 1e3:.1f} ms | {diff:.1e} | "
                         f"{tuple(fired.values())} |")
        lines.append(f"| {kind} | on / off | {rows[1][0] / rows[0][0]:.2f}x | | |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama3-70b,deepseek-v3")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-measured", action="store_true")
    a = ap.parse_args()
    out = predicted([m for m in a.models.split(",") if m])
    if not a.skip_measured:
        out += [""] + measured(a.ranks, a.repeats)
    print("\n".join(out))


if __name__ == "__main__":
    main()
