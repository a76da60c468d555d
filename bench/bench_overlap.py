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
      (one plan), flat-ring all-reduces, no overlap, no kernel passes
  (b) + the kernel passes (attention, MLA, MoE, RMSNorm, RoPE, SwiGLU fusions)
  (c) + collective selection (sequence_parallel, select_collectives)
  (d) + overlap and pipelining (two_batch_overlap, pipeline_collectives, overlap_collectives)
  (p) (d) with the phase's own plan: the planner's fastest plan metainfer executes for the
      phase (tp x dp replicas; DeepSeek-V3 planned on a 141 GiB what-if of pcie8, as its
      weights do not fit 48 GiB devices)
  (e) the floor of (p): max(compute, communication on the best algorithm)

Measured: a Llama (hidden 512, 8 heads, 2 layers, fp32) sharded tp over `--ranks` gloo ranks
on 127.0.0.1 (pcie8 scaled onto them), batch 4 x 256 tokens, aot_eager lowering: median wall
time per forward with the default pipeline, and with overlap_collectives,
pipeline_collectives and two_batch_overlap disabled. CPU ranks share 2 cores here, so this
says what the re-ordering costs or gains on gloo, not what a GPU would do.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from metainfer import distributed, models, targets  # noqa: E402
from metainfer.passes import PassManager, get_pass  # noqa: E402
from metainfer.passes.pipeline import DEFAULT_ORDER  # noqa: E402
from metainfer.simulate import simulate  # noqa: E402
from metainfer.testing import capture_graph  # noqa: E402

KERNELS = ["fuse_moe", "mla_prefill", "fuse_attention", "sparse_mla", "mla_decode", "fp8_gemm", "fuse_rope",
           "fuse_rmsnorm", "fuse_swiglu"]
COLLECTIVES = ["sequence_parallel", "select_collectives"]
OVERLAP = ["two_batch_overlap", "pipeline_collectives", "overlap_collectives"]
STAGES = {k: [p for p in DEFAULT_ORDER if p in chosen]  # each stage in the default pipeline's order
          for k, chosen in {"a": [], "b": KERNELS, "c": KERNELS + COLLECTIVES,
                            "d": KERNELS + COLLECTIVES + OVERLAP}.items()}
WORKLOAD = {"prefill": (4, 4096), "decode": (64, 4096)}
LAYERS = {"llama3-70b": 80, "deepseek-v3": 61}
WHAT_IF_GIB = 141


def _model(name: str, layers: int):
    extra = {"n_dense_layers": 0} if name.startswith("deepseek") else {}
    cfg = {"fp8": False} if name.startswith("deepseek") else {}
    return models.build(name, device="meta", dtype=torch.bfloat16, n_layers=layers, **extra, **cfg)


def _graph(name: str, layers: int, phase: str, target, tp: int):
    """rank 0's captured graph of `name` with `layers` layers under tp (the rest replicas)."""
    batch, seq = WORKLOAD[phase]
    model = _model(name, layers)
    with distributed.fake_job(target.num_devices):
        distributed.prepare(model, target, emulate=False, tensor_parallel=tp, expert_parallel_on=False)
        dp = target.num_devices // tp
        rows = -(-batch // dp)
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
            full = types.SimpleNamespace(config=models.config(name))  # the planner reads the whole model's shape
            deg = distributed.choose_degrees(full, plan_target, 8, phase=phase, expert_parallel=False)
            base = {k: _layer(v2, v1) for (k, v2), v1 in zip(_graph(name, 2, phase, pcie8, 8).items(),
                                                             _graph(name, 1, phase, pcie8, 8).values())}
            if deg.tp == 8:
                own = base["d"]
            else:
                two, one = _graph(name, 2, phase, pcie8, deg.tp), _graph(name, 1, phase, pcie8, deg.tp)
                own = _layer(two["d"], one["d"])
            dp = 8 // deg.tp
            rate = {k: tokens / (LAYERS[name] * v[0]) for k, v in base.items()}
            p_rate = tokens / (LAYERS[name] * own[0])  # dp replicas take batch/dp each, side by side
            floor_rate = tokens / (LAYERS[name] * own[1])
            lines.append(
                f"| {name} | {phase} | {rate['a']:,.0f} | {rate['b']:,.0f} | {rate['c']:,.0f} | {rate['d']:,.0f} | "
                f"{p_rate:,.0f} (tp{deg.tp} dp{dp}) | {floor_rate:,.0f} | {rate['b'] / rate['a']:.2f} | "
                f"{rate['c'] / rate['a']:.2f} | {rate['d'] / rate['a']:.2f} | {p_rate / rate['a']:.2f} | "
                f"{own[0] / own[1]:.2f} |")
            print(f"  {name} {phase}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return lines


def _layer(two, one) -> tuple[float, float]:
    """(step, floor) of one layer in steady state: the graph with two layers minus the graph
    with one (embedding, head, and the first layer's fill and last layer's drain cancel)."""
    floor = max(two.compute_seconds - one.compute_seconds, two.comm_floor_seconds - one.comm_floor_seconds)
    return two.step_seconds - one.step_seconds, floor


def measured_rank(rank, world, overlap: bool, repeats: int):
    import metainfer

    model = models.build("llama-small", dim=512, n_heads=8, n_kv_heads=8, ffn_dim=1408)
    ids = models.example_inputs("llama-small", batch=4, seq=256, seed=1)[0]
    with torch.no_grad():
        ref = model(ids)
    disable = () if overlap else tuple(OVERLAP)
    opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, lowering="aot_eager",
                             tensor_parallel=world, disable=disable)
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
    from metainfer import multirank

    rows = []
    for overlap in (False, True):
        res = multirank.run(measured_rank, ranks, args=(overlap, repeats), timeout_s=600)
        rows.append((overlap, max(r[0] for r in res), max(r[1] for r in res), res[0][2]))
    off, on = rows[0][1], rows[1][1]
    lines = [f"measured on CPU gloo, {ranks} ranks on this machine's cores, median of {repeats} forwards "
             "(slowest rank)", "| passes | wall time / forward | max diff vs unsharded | overlap passes fired |",
             "|---|---|---|---|"]
    for overlap, t, diff, fired in rows:
        lines.append(f"| {'on' if overlap else 'off (overlap, pipeline, two-batch disabled)'} | {t * 1e3:.1f} ms | "
                     f"{diff:.1e} | {fired} |")
    lines.append(f"on / off: {on / off:.2f}x")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama3-70b,deepseek-v3")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--skip-measured", action="store_true")
    a = ap.parse_args()
    out = predicted([m for m in a.models.split(",") if m])
    if not a.skip_measured:
        out += [""] + measured(a.ranks, a.repeats)
    print("\n".join(out))


if __name__ == "__main__":
    main()
