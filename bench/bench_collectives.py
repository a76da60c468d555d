"""Collective selection: the library's flat ring vs metainfer's choice, predicted on the real
boxes and measured on CPU gloo ranks, in one run.

    python bench/bench_collectives.py [--ranks 4] [--skip-measured]

Predicted (metainfer's cost model, not measured): per transformer layer under tensor
parallelism over 8 devices, the two all-reduces of tokens x hidden (bf16), for Llama-3-70B
(hidden 8192) and DeepSeek-V3 (hidden 7168) shapes, prefill (4 x 4096 tokens) and decode
(64 tokens), on pcie8 and nvlink8: time with the ring vs with the algorithm
select_collectives picks (ring or hierarchical over islands), and bytes across the island
boundary.

Measured: a tiny Hugging Face Llama (hidden 256, 8 heads) sharded over `--ranks` gloo ranks
on 127.0.0.1 with pcie8's topology scaled onto them (2 islands), one forward of 4 x 128
tokens with select_collectives on and off: the bytes each rank actually sent to its own
island and across (kernel socket counters, `ss`), and the outputs' agreement with the
unsharded model.

Paths (`--paths`, on by default): the same collectives between 2 (`--path-ranks`) processes
of this machine through gloo (TCP loopback) and through metainfer's shared-memory path
(kernels/shm_collectives.py): all-reduce, all-gather, reduce-scatter at 4 KiB, 64 KiB, 1 MiB
and 16 MiB (the buffer each rank holds; for all-gather the gathered output), float32. gloo
as a compiled graph issues it (a functional collective and its wait: a fresh output, as the
shm op makes) and, for reference, in place on buffers kept across calls. Each time is the
slowest rank's median per call; the paths alternate in rounds, so a slow spell of the machine
hits all. Each row runs between rank 0's readings of a yardstick (metainfer.hardware.noise) and
again while the machine swings outside its band; one that never held still is marked unstable,
and the swing is printed under the table. With --json the last line is one JSON object: {"results": {"all_reduce 64KiB":
{"gloo": s, "shm": s, "ratio": gloo / shm, "gloo_in_place": s, "ratio_in_place": ...}, ...}}.
"""

from __future__ import annotations

import argparse
import os

from metainfer.hardware import cost, noise, targets

SHAPES = {"llama3-70b": 8192, "deepseek-v3": 7168}
PHASES = {"prefill": 4 * 4096, "decode": 64}


def predicted() -> None:
    print("predicted per layer (2 all-reduces), tensor parallel over 8 devices; a model, not a measurement")
    print("| model | phase | target | message | ring | metainfer | speed-up | across islands: ring -> metainfer |")
    print("|---|---|---|---|---|---|---|---|")
    for model, hidden in SHAPES.items():
        for phase, tokens in PHASES.items():
            nbytes = tokens * hidden * 2
            for name in ("pcie8", "nvlink8"):
                t = targets.get(name)
                ring = cost.collective_cost("all_reduce", nbytes, t, "ring")
                options = [c for c in cost.candidates("all_reduce", nbytes, t) if c.algorithm in ("ring", "hierarchical")]
                chosen = min(options, key=lambda c: c.seconds)
                print(f"| {model} | {phase} | {name} | {nbytes / 2**20:.2f} MiB | {2 * ring.seconds * 1e6:,.0f} us | "
                      f"{2 * chosen.seconds * 1e6:,.0f} us ({chosen.algorithm}) | {ring.seconds / chosen.seconds:.2f}x | "
                      f"{2 * ring.bytes_inter / 2**20:.1f} -> {2 * chosen.bytes_inter / 2**20:.1f} MiB |")


def measured_rank(rank, world, select):
    import torch

    import metainfer
    from metainfer.parallel import multirank
    from metainfer.testing import tiny_hf_model

    model = tiny_hf_model("Llama", attn="eager", layers=2, hidden_size=256, intermediate_size=512,
                          num_attention_heads=8, num_key_value_heads=8)
    ids = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    passes = None if select else ["fuse_moe", "mla_prefill", "fuse_attention", "sparse_mla", "mla_decode", "fp8_gemm"]
    opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, lowering="aot_eager", passes=passes)
    with torch.no_grad():
        opt(ids)  # warm: connections of every group set up
        with multirank.SentBytes() as sent:
            out = opt(ids).logits
    return sent.by_link(opt.report.target.topology.islands), (out - ref).abs().max().item()


def measured(ranks: int) -> None:
    from metainfer.parallel import multirank

    print(f"\nmeasured on {ranks} gloo ranks (pcie8 scaled to 2 islands), one forward of 4 x 128 tokens, "
          "tiny HF Llama (hidden 256, 2 layers): bytes sent per rank")
    print("| collectives | intra-island KiB/rank | inter-island KiB/rank | max |out - unsharded| |")
    print("|---|---|---|---|")
    rows = {}
    for select in (False, True):
        res = multirank.run(measured_rank, ranks, args=(select,), timeout_s=600)
        intra = sum(b["intra"] for b, _ in res) / ranks
        inter = sum(b["inter"] for b, _ in res) / ranks
        rows[select] = inter
        label = "select_collectives (hierarchical)" if select else "library default (ring)"
        print(f"| {label} | {intra / 1024:,.1f} | {inter / 1024:,.1f} | {max(d for _, d in res):.2e} |")
    from metainfer.parallel import distributed

    t = distributed.emulated(targets.get("pcie8"), ranks)
    nbytes = 4 * 128 * 256 * 4
    formula = (cost.collective_cost("all_reduce", nbytes, t, "hierarchical").bytes_inter
               / cost.collective_cost("all_reduce", nbytes, t, "ring").bytes_inter)
    print(f"\nacross islands, selected / ring: measured {rows[True] / rows[False]:.3f}, formula {formula:.3f}")


SIZES = {"4KiB": 4 << 10, "64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def _median_call_s(fn, budget_s: float = 0.25, most: int = 200) -> float:
    """The median of n calls of a collective, n sized to the budget and the same on every rank."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    n = torch.tensor([max(3, min(most, int(budget_s / once)))])
    dist.all_reduce(n, op=dist.ReduceOp.MIN)  # every rank must make as many calls
    n = int(n)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paths_rank(rank, world, rounds):
    import statistics

    import torch
    import torch.distributed as dist

    from metainfer.kernels import shm_collectives

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # each rank its share of the cores
    from metainfer.hardware import noise

    g = dist.group.WORLD.group_name
    shm_collectives.attach(g)
    ops = torch.ops.metainfer
    guard = noise.Yardstick()  # read on rank 0 only, while the others wait at a barrier
    out = {}
    for kind in KINDS:
        for label, nbytes in SIZES.items():
            n = nbytes // 4
            full, part = torch.randn(n), torch.randn(n // world)
            gathered = torch.empty(n)
            fc = torch.ops._c10d_functional
            # as a compiled graph issues them: a functional collective and its wait (a fresh
            # output each call, as the shm op makes), and gloo in place on buffers kept
            fns = {"all_reduce": (lambda: fc.wait_tensor(fc.all_reduce(full, "sum", g)),
                                  lambda: dist.all_reduce(full), lambda: ops.shm_all_reduce(full, g)),
                   "all_gather": (lambda: fc.wait_tensor(fc.all_gather_into_tensor(part, world, g)),
                                  lambda: dist.all_gather_into_tensor(gathered, part),
                                  lambda: ops.shm_all_gather(part, world, g)),
                   "reduce_scatter": (lambda: fc.wait_tensor(fc.reduce_scatter_tensor(full, "sum", world, g)),
                                      lambda: dist.reduce_scatter_tensor(part, full),
                                      lambda: ops.shm_reduce_scatter(full, world, g))}[kind]
            def row():
                times = {"gloo": [], "gloo in place": [], "shm": []}
                for _ in range(rounds):
                    for path, fn in zip(times, fns):  # noqa: B023
                        dist.barrier()
                        times[path].append(_median_call_s(fn))
                return {p: statistics.median(t) for p, t in times.items()}

            out[f"{kind} {label}"] = _guarded_row(guard, row, f"{kind} {label}", rank)
    return {"rows": out, "noise": guard.summary() if rank == 0 else None}


def _guarded_row(guard, row, label: str, rank: int) -> dict:
    """row() on every rank between rank 0's yardstick readings, run again (on every rank) while
    a reading is outside the band, at most guard.tries times; rank 0's verdict is everyone's."""
    import torch
    import torch.distributed as dist

    kept, tries = None, 0
    guard.rows += rank == 0
    while True:
        tries += 1
        dist.barrier()
        before = guard.read() if rank == 0 else 0.0
        dist.barrier()
        value = row()
        dist.barrier()
        after = guard.read() if rank == 0 else 0.0
        worst = max(guard.off_by(before), guard.off_by(after)) if rank == 0 else 0.0
        if kept is None or worst < kept[0]:
            kept = (worst, value)
        verdict = torch.tensor([kept[0] <= guard.band or tries >= guard.tries], dtype=torch.int64)
        dist.broadcast(verdict, 0)
        if int(verdict):
            break
    stable = torch.tensor([kept[0] <= guard.band], dtype=torch.int64)
    dist.broadcast(stable, 0)
    if rank == 0:
        guard.remeasured += tries > 1
        if not int(stable):
            guard.unstable.append(label)
    return {**kept[1], "stable": bool(int(stable))}


def paths(ranks: int, rounds: int) -> dict:
    from metainfer.parallel import multirank

    res = multirank.run(paths_rank, ranks, args=(rounds,), timeout_s=900)
    results = {}
    for key in res[0]["rows"]:
        gloo, in_place, shm = (max(r["rows"][key][p] for r in res) for p in ("gloo", "gloo in place", "shm"))  # the slowest rank's
        results[key] = {"gloo": gloo, "shm": shm, "ratio": gloo / shm, "gloo_in_place": in_place,
                        "ratio_in_place": in_place / shm, "stable": res[0]["rows"][key]["stable"]}
    print(f"\nmeasured: {ranks} processes of this machine, float32, the slowest rank's median per call "
          f"({rounds} alternating rounds); gloo over TCP loopback as a compiled graph issues it (functional "
          "collective + wait, a fresh output) and in place on kept buffers; shm: metainfer's op (a fresh output)")
    print("| collective | size | gloo | gloo in place | shared memory | gloo / shm | in place / shm |")
    print("|---|---|---|---|---|---|---|")
    for key, r in results.items():
        kind, size = key.split()
        print(f"| {kind} | {size} | {r['gloo'] * 1e6:,.1f} us | {r['gloo_in_place'] * 1e6:,.1f} us | "
              f"{r['shm'] * 1e6:,.1f} us | {r['ratio']:.1f}x | {r['ratio_in_place']:.1f}x"
              f"{'' if r['stable'] else ' (unstable)'} |")
    n = res[0]["noise"]
    print(f"rank 0's {noise.swing_words(n)}")
    results["noise"] = n
    return results


def main() -> None:
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--skip-measured", action="store_true", help="skip the island-bytes measurement")
    ap.add_argument("--skip-predicted", action="store_true")
    ap.add_argument("--paths", action=argparse.BooleanOptionalAction, default=True,
                    help="gloo vs the shared-memory path, measured")
    ap.add_argument("--path-ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="the last line: the paths' results as one JSON object")
    a = ap.parse_args()
    if not a.skip_predicted:
        predicted()
    if not a.skip_measured:
        measured(a.ranks)
    if a.paths:
        results = paths(a.path_ranks, a.rounds)
        if a.json:
            print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
