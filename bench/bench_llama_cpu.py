"""Eager vs torch.compile vs metainfer on models/ Llama, on CPU, side by side in one run.

    python bench/bench_llama_cpu.py                      # seq 1024, 4096, 8192
    python bench/bench_llama_cpu.py --seqs 512 2048 --model llama-tiny

Each (mode, length) runs in its own process, with fresh Inductor and metainfer caches (so
compile times are cold for both compilers), and reports:
- peak RSS while a steady-state forward runs (sampled every 2 ms) and its growth over the
  RSS just before that forward (the forward's working memory);
- median wall time of a forward (after the compiling first call);
- compile time: first call minus a steady forward.
Modes: eager; torch.compile (Inductor defaults); metainfer target "cpu" (its default
pipeline); metainfer with every fusion forced ("metainfer-all", to show why the cpu pipeline
leaves the pointwise fusions to Inductor); and, for reference, what a user would do by hand:
the same model rewritten to call SDPA, under torch.compile ("torch.compile+sdpa").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _memory import PeakRSS, rss  # bench/ is the script's directory, on sys.path

MODES = ("eager", "torch.compile", "metainfer", "metainfer-all", "torch.compile+sdpa")


def child(mode: str, model_name: str, seq: int, reps: int) -> dict:
    import torch

    import metainfer
    from metainfer import models

    torch.manual_seed(0)
    model = models.build(model_name, **({"attention": "sdpa"} if mode == "torch.compile+sdpa" else {}))
    (ids,) = models.example_inputs(model_name, batch=1, seq=seq)
    if mode == "eager":
        fn = model
    elif mode in ("torch.compile", "torch.compile+sdpa"):
        fn = torch.compile(model)
    elif mode == "metainfer":
        fn = metainfer.optimize(model, "cpu")
    else:
        fn = metainfer.optimize(model, "cpu", passes=["fuse_attention", "fuse_rope", "fuse_rmsnorm", "fuse_swiglu"])
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(ids)
        first = time.perf_counter() - t0
        times, peak, base = [], 0, 0
        for _ in range(reps):
            base_i = rss()
            with PeakRSS() as p:
                t0 = time.perf_counter()
                fn(ids)
                times.append(time.perf_counter() - t0)
            if p.peak - base_i > peak - base:
                peak, base = p.peak, base_i
    times.sort()
    steady = times[len(times) // 2]
    out = dict(mode=mode, seq=seq, seconds=steady, compile_seconds=max(0.0, first - steady) if mode != "eager" else 0.0,
               peak_rss_mb=peak / 2**20, forward_mb=(peak - base) / 2**20)
    if mode.startswith("metainfer"):
        out["matches"] = {r.name: r.matches for r in fn.report.passes if r.ran}
    return out


def run_child(mode, model_name, seq, reps) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
               "METAINFER_CACHE_DIR": os.path.join(cache, "metainfer")}
        r = subprocess.run([sys.executable, __file__, "--child", mode, "--model", model_name, "--seqs", str(seq),
                            "--reps", str(reps)], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        return dict(mode=mode, seq=seq, error=r.stderr.strip().splitlines()[-1] if r.stderr else "failed")
    return json.loads(r.stdout.strip().splitlines()[-1])


def table(rows: list[dict], model_name: str) -> str:
    lines = [f"models/{model_name}, fp32, batch 1, CPU ({os.cpu_count()} cores). Ratios are against eager at the same length.",
             "", "| seq | mode | forward (s) | vs eager | peak RSS (MB) | forward working memory (MB) | vs eager | compile (s) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for seq in sorted({r["seq"] for r in rows}):
        eager = next((r for r in rows if r["seq"] == seq and r["mode"] == "eager" and "error" not in r), None)
        for r in (r for r in rows if r["seq"] == seq):
            if "error" in r:
                lines.append(f"| {seq} | {r['mode']} | error: {r['error']} | | | | | |")
                continue
            tr = f"{r['seconds'] / eager['seconds']:.2f}x" if eager else "-"
            mr = f"{r['forward_mb'] / max(eager['forward_mb'], 1e-9):.2f}x" if eager else "-"
            comp = f"{r['compile_seconds']:.1f}" if r["mode"] != "eager" else "-"
            lines.append(f"| {seq} | {r['mode']} | {r['seconds']:.3f} | {tr} | {r['peak_rss_mb']:.0f} | "
                         f"{r['forward_mb']:.0f} | {mr} | {comp} |")
    longest = max(r["seq"] for r in rows)
    by = {r["mode"]: r for r in rows if r["seq"] == longest and "error" not in r}
    if {"eager", "metainfer", "torch.compile"} <= set(by):
        lines += ["", f"At seq {longest}: metainfer forward working memory = "
                      f"{by['metainfer']['forward_mb'] / by['eager']['forward_mb']:.3f} x eager's (goal <= 1/3); "
                      f"metainfer compile time = {by['metainfer']['compile_seconds'] / by['torch.compile']['compile_seconds']:.2f}"
                      f" x torch.compile's (goal <= 1.5)."]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", choices=MODES)
    ap.add_argument("--out", help="also write the table to this file")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.model, a.seqs[0], a.reps)))
        return
    rows = []
    for seq in a.seqs:
        for mode in a.modes:
            r = run_child(mode, a.model, seq, a.reps)
            print(json.dumps(r), file=sys.stderr, flush=True)
            rows.append(r)
    text = table(rows, a.model)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
