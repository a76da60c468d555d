"""The multi-rank half of bench/validate_cost_model.py: tensor-parallel steps on gloo ranks of
this machine, predicted vs measured, and the communication passes' decisions against what
the measurement favours.

A job of 2 or 4 ranks (metainfer.parallel.multirank: processes on 127.0.0.1) runs Hugging Face Llama
(the validation's config with 4 key-value heads, 4 layers, fp32) at tensor parallel over every rank, Inductor
lowering, a 4 x 128-token prefill forward: once with metainfer's default pipeline and once
with the communication passes disabled. Predicted: the simulator's step for each rank's graph
on the calibrated target emulated over the job (`metainfer calibrate --ranks 2 4` fits gloo's
all-reduce on 127.0.0.1 as the link). The ranks share this machine's cores, so each rank's
device is the calibrated one scaled to its share (`rank_target`): its own threads, and time
sliced when there are more ranks than cores. Measured: the median wall time of the graph's
calls on the slowest rank.

Decisions (2 ranks, and 4 where asked): sequence_parallel, two_batch_overlap, the
pipeline_collectives chunk count and the overlap order. The model's choice is what the pass
decided in the default run; the measurement runs each alternative forced (pass options
`sequence_parallel`, `two_batch_overlap`, `pipeline_chunks`) or disabled, the rest of the
pipeline as it is.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

COMMUNICATION = ("sequence_parallel", "two_batch_overlap", "pipeline_collectives", "select_collectives",
                 "overlap_collectives")
CALIBRATED_THREADS = torch.get_num_threads()  # what `metainfer calibrate` ran with in this process
CORES = os.cpu_count() or 1
BATCH, SEQ = 4, 128
CALLS = 7


def rank_target(path: str, world: int, overlap: float, calibrated_threads: int = CALIBRATED_THREADS,
                cores: int = CORES):
    """The calibrated target as `world` devices of one island (the gloo link `metainfer
    calibrate --ranks` fitted), each rank's device its share of the cores:
    cores // world threads (at least one), and time sliced by world x threads / cores when the
    ranks outnumber the cores; the ranks share the cache level too. Collective costs were measured with the ranks sharing the cores
    already (calibrate's gloo fit), so the links are left as measured; `overlap` is the share of
    a collective that runs beside compute with `world` ranks (calibrate's measurement)."""
    from metainfer.hardware import targets

    t = targets.get(path)  # one device; its link is gloo's all-reduce fitted on this machine's ranks
    t = dataclasses.replace(t, num_devices=world, topology=dataclasses.replace(
        t.topology, islands=(tuple(range(world)),), inter_island=None))
    threads = max(1, cores // world)
    sliced = max(1.0, world * threads / cores)
    dev = t.device
    speed = min(1.0, threads / calibrated_threads) / sliced
    dev = dataclasses.replace(dev, peak_flops={k: v * speed for k, v in dev.peak_flops.items()},
                              memory_bandwidth=dev.memory_bandwidth * speed,
                              cache_bandwidth=dev.cache_bandwidth * speed, cache_bytes=dev.cache_bytes / world,
                              stream_bandwidth=dev.stream_bandwidth * speed,
                              launch_overhead_s=dev.launch_overhead_s * sliced,
                              custom_op_overhead_s=None if dev.custom_op_overhead_s is None else
                              dev.custom_op_overhead_s * sliced,
                              custom_op_overheads={k: v * sliced for k, v in dev.custom_op_overheads.items()})
    return dataclasses.replace(t, device=dev, name=f"{t.name} ({threads} thread(s) a rank)",
                               comm_overlap=overlap), threads


def _rank_run(rank: int, world: int, path: str, overlap: float, calibrated_threads: int, disable: tuple,
              options: dict, cache_dir: str, shm: bool = True) -> dict:
    import metainfer
    from validate_cost_model import MODELS  # bench/ is on the path

    from metainfer.testing import tiny_hf_model

    target, threads = rank_target(path, world, overlap, calibrated_threads)
    if not shm:  # the calibrated target as it was before the shared-memory path: gloo only
        target = dataclasses.replace(target, shm_links={})
    torch.set_num_threads(threads)
    # the validation's Llama with 4 key-value heads, so that 4 ranks can split them; the same
    # seed on every rank: the same weights
    arch, fields = MODELS["llama"]
    model = tiny_hf_model(arch, attn="eager", layers=4, **{**fields, "num_key_value_heads": 4})
    ids = torch.randint(3, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    opt = metainfer.optimize(model, target, emulate=True, tensor_parallel=world, disable=disable,
                             pass_options=options or None, cache_dir=os.path.join(cache_dir, f"rank{rank}"))
    opt.record_call_times()
    with torch.no_grad():
        for _ in range(2 + CALLS):
            torch.distributed.barrier()
            opt(ids)
    sections = [s for s in opt.report.sections if s.call_seconds and s.prediction]
    s = max(sections, key=lambda s: statistics.median(s.call_seconds))  # the model's forward
    warm = s.call_seconds[2:]
    q = statistics.quantiles(warm, n=4) if len(warm) > 1 else [warm[0]] * 3
    records = {r.name: {"matches": r.matches, "decisions": r.decisions, "near_misses": r.near_misses,
                        "before_s": r.predicted_before_s, "after_s": r.predicted_after_s}
               for r in s.records if r.name in COMMUNICATION}
    return {"predicted_s": s.prediction["after_s"], "measured_s": statistics.median(warm), "quartiles_s": (q[0], q[2]),
            "records": records}


OVERLAP: dict[int, float] = {}  # ranks -> measured share of a collective hidden beside compute


def measure_overlap(worlds) -> dict[int, float]:
    """calibrate's overlap measurement for each job size (it depends on how many ranks share
    the cores: the TOML holds only the fewest ranks')."""
    from metainfer import calibrate

    measured = calibrate.measure_collectives(list(worlds), quick=True)
    OVERLAP.update({int(k.split()[1]): calibrate.overlap_share(v) for k, v in measured.items()
                    if k.startswith("overlap")})
    return dict(OVERLAP)


SHM = [True]  # whether the jobs may take the target's shared-memory path ([collectives.shm])


GUARD: list = []  # the run's noise.Yardstick, shared with validate_cost_model where it calls in


def _guard():
    if not GUARD:
        from metainfer.hardware import noise

        GUARD.append(noise.Yardstick())
    return GUARD[0]


def _job(world: int, path: str, cache_dir: str, disable=(), options=None) -> dict:
    """One job's slowest rank, run between yardstick readings (in this process, while no rank
    runs) and run again while the machine swings outside the band."""
    from metainfer.parallel import multirank

    if world not in OVERLAP:
        measure_overlap([world])

    def run():
        return multirank.run(_rank_run, world, args=(path, OVERLAP[world], CALIBRATED_THREADS, tuple(disable),
                                                     dict(options or {}), cache_dir, SHM[0]),
                             timeout_s=1200, start_timeout_s=300)

    row = _guard().measure(run, f"tp{world} disable={','.join(disable) or '-'} options={options or '-'}")
    slowest = max(row.value, key=lambda r: r["measured_s"])
    return {"predicted_s": max(r["predicted_s"] for r in row.value), "measured_s": slowest["measured_s"],
            "quartiles_s": slowest["quartiles_s"], "records": row.value[0]["records"], "stable": row.stable,
            "yardstick_s": row.yardstick_s}


def steps(path: str, cache_dir: str, worlds=(2, 4), progress=print) -> tuple[list[dict], dict]:
    """Rows for the graphs (per world: communication passes on and off), and the default runs
    by world (their records say what the passes decided)."""
    rows, default = [], {}
    for world in worlds:
        t0 = time.perf_counter()
        on = _job(world, path, cache_dir)
        off = _job(world, path, cache_dir, disable=COMMUNICATION)
        default[world] = on
        for label, r in (("communication passes on", on), ("off", off)):
            rows.append({"model": "llama", "case": f"tp{world} gloo, prefill {BATCH}x{SEQ}, {label}",
                         "phase": "forward", "predicted_s": r["predicted_s"], "measured_s": r["measured_s"],
                         "error": r["predicted_s"] / r["measured_s"] - 1, "stable": r["stable"],
                         "yardstick_ms": [[x * 1e3 for x in y] for y in r["yardstick_s"]]})
        progress(f"gloo tp{world}: {time.perf_counter() - t0:.0f} s")
    return rows, default


def _chunks(records: dict) -> int:
    """The k pipeline_collectives chose (the largest over its sites; 1 if it kept all whole)."""
    ks = [int(d.split(": k=")[1].split()[0]) for d in records["pipeline_collectives"]["decisions"] if ": k=" in d]
    return max(ks, default=1)


def decisions(path: str, cache_dir: str, default: dict, worlds=(2,), progress=print) -> list[dict]:
    """Each communication decision of the default run against the measured alternative, the
    difference judged against the noise of the two jobs (their calls' quartiles and the
    yardstick around them: noise.decision_noise)."""
    from metainfer.hardware import noise

    rows = []
    for world in worlds:
        t0 = time.perf_counter()
        base = default[world]
        rec = base["records"]

        def row(pass_name, says, on, off, what):
            band = noise.decision_noise(list(on["quartiles_s"]), list(off["quartiles_s"]),
                                        [*on["yardstick_s"], *off["yardstick_s"]])
            favours = (noise.verdict(on["measured_s"], off["measured_s"], band) if on["stable"] and off["stable"]
                       else "unstable")
            rows.append({"model": "llama", "case": f"tp{world} gloo prefill {BATCH}x{SEQ}", "pass": pass_name,
                         "phase": what, "model_says": says, "measured_on_s": on["measured_s"],
                         "measured_off_s": off["measured_s"], "noise": band, "measurement_favours": favours,
                         "agree": favours in ("either", says)})

        for pass_name in ("sequence_parallel", "two_batch_overlap"):
            fired = rec[pass_name]["matches"] > 0
            other = (_job(world, path, cache_dir, disable=(pass_name,)) if fired else
                     _job(world, path, cache_dir, options={pass_name: True}))
            on, off = (base, other) if fired else (other, base)
            row(pass_name, "apply" if fired else "decline", on, off, "forward")
        k = _chunks(rec)
        alt = 2 if k == 1 else 1
        other = (_job(world, path, cache_dir, disable=("pipeline_collectives",)) if alt == 1 else
                 _job(world, path, cache_dir, options={"pipeline_chunks": alt}))
        on, off = (base, other) if k > 1 else (other, base)
        row("pipeline_collectives", "apply" if k > 1 else "decline", on, off, f"k={max(k, alt)} vs whole")
        if any(": shared memory, predicted" in d for d in rec["select_collectives"]["decisions"]):
            other = _job(world, path, cache_dir, disable=("select_collectives",))  # every collective on gloo
            row("select_collectives", "apply", base, other, "shared memory vs gloo")
        if rec["overlap_collectives"]["matches"]:
            other = _job(world, path, cache_dir, disable=("overlap_collectives",))
            row("overlap_collectives", "apply", base, other, "order")
        else:  # nothing was re-ordered: the decision is only measurable where it fires
            progress(f"gloo tp{world}: overlap_collectives kept the order; not measured")
        progress(f"gloo tp{world} decisions: {time.perf_counter() - t0:.0f} s")
    return rows


def main(argv=None) -> int:
    """The multi-rank rows alone, on a calibrated TOML: `--shm both` runs them with the target's
    shared-memory path and with it removed (gloo only), one after the other."""
    import argparse
    import json
    import sys
    import tempfile

    from validate_cost_model import decision_table, summarise, table

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="a calibrated target TOML (metainfer calibrate --ranks 2)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--shm", choices=("on", "off", "both"), default="both")
    a = ap.parse_args(argv)
    summary = {}
    for shm in ((False, True) if a.shm == "both" else (a.shm == "on",)):
        SHM[0] = shm
        label = "with the shm path" if shm else "gloo only"
        with tempfile.TemporaryDirectory() as cache:
            say = lambda s: print(f"[{label}] {s}", file=sys.stderr, flush=True)  # noqa: E731
            rows, default = steps(a.target, cache, a.ranks, progress=say)
            chosen = decisions(a.target, cache, default, a.ranks[:1], progress=say)
        print(f"\n{label}:")
        print(table(rows))
        print()
        print(decision_table(chosen))
        summary[label] = {**summarise(rows, chosen, _guard()), "measured_on_s": {r["case"]: r["measured_s"] for r in rows}}
    print(_guard().line())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
