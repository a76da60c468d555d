"""Compute-communication overlap on real GPUs: the overlap passes on vs off, each rank's time
per forward, and a profiler trace checked for NCCL kernels running beside compute kernels.

    torchrun --nproc-per-node 4 bench/bench_overlap_gpu.py --target pcie8 [--trace-dir DIR]

Needs several CUDA GPUs (NCCL runs its collectives on its own stream, so a collective issued
before independent compute really runs beside it). A Llama (hidden 2048, 16 heads, 4 layers,
bf16) and a DeepSeek-tiny-shaped MoE model (shared experts beside routed ones) are sharded
tensor parallel over the job's ranks, with the target's topology scaled onto them
(`emulate=True` keeps the GPU device kind's numbers), and optimized twice: the default
pipeline, and with overlap_collectives, pipeline_collectives and two_batch_overlap disabled.
For each: outputs against the unsharded model (bf16 tolerance), median time per forward
(CUDA events), and from a torch.profiler trace the share of NCCL kernel time that ran while
a compute kernel ran on another stream. Traces are written to --trace-dir (Perfetto opens
them). Runs from the source tree with PYTHONPATH=. (torch >= 2.4).
"""

from __future__ import annotations

import argparse
import os

import torch

import torch.distributed as dist
from _cuda_timing import timed  # (bench/ is on sys.path as the script's folder)

OVERLAP = ("overlap_collectives", "pipeline_collectives", "two_batch_overlap")


def overlapped_share(prof) -> tuple[float, float]:
    """(NCCL kernel seconds, the part of it during which a non-NCCL kernel also ran)."""
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    nccl = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    other = sorted((e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower())
    total = hidden = 0.0
    for a, b in nccl:
        total += b - a
        covered, cursor = 0.0, a
        for s, e in other:
            if e <= cursor or s >= b:
                continue
            s = max(s, cursor)
            covered += min(e, b) - s
            cursor = min(e, b)
        hidden += covered
    return total / 1e6, hidden / 1e6  # microseconds -> seconds


def run(model_name: str, target: str, trace_dir: str | None) -> list[str]:
    import metainfer
    from metainfer import models

    rank = dist.get_rank()
    if model_name == "llama":
        model = models.build("llama-small", dim=2048, n_heads=16, n_kv_heads=8, ffn_dim=5632, n_layers=4,
                             dtype=torch.bfloat16, device="cuda")
        ids = models.example_inputs("llama-small", batch=4, seq=2048, device="cuda", seed=1)[0]
    else:
        model = models.build("deepseek-tiny", dim=1024, n_heads=8, dtype=torch.bfloat16, device="cuda")
        ids = models.example_inputs("deepseek-tiny", batch=4, seq=1024, device="cuda", seed=1)[0]
    with torch.no_grad():
        ref = model(ids).float()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    lines = []
    for overlap in (False, True):
        m = type(model)(model.config).to(device="cuda", dtype=torch.bfloat16).eval()
        m.load_state_dict(state)
        opt = metainfer.optimize(m, target, example_inputs=(ids,), emulate=True, tensor_parallel=dist.get_world_size(),
                                 disable=() if overlap else OVERLAP)
        with torch.no_grad():
            out = opt(ids).float()
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            seconds = timed(lambda: opt(ids), repeats=20)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    opt(ids)
                torch.cuda.synchronize()
        comm, hidden = overlapped_share(prof)
        if trace_dir and rank == 0:
            os.makedirs(trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(trace_dir, f"{model_name}_{'on' if overlap else 'off'}.json"))
        fired = {p: opt.report.matches(p) for p in OVERLAP}
        ok = "ok" if err < 3e-2 else "MISMATCH"
        lines.append(f"| {model_name} | {'on' if overlap else 'off'} | {seconds * 1e3:.2f} ms | {err:.1e} {ok} | "
                     f"{comm * 1e3 / 3:.2f} ms | {hidden / comm if comm else 0:.0%} | {fired} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="pcie8")
    ap.add_argument("--trace-dir", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("needs a job over 2 or more CUDA GPUs (torchrun --nproc-per-node N); nothing to measure here")
        return
    from metainfer.hardware import targets
    from metainfer.parallel import distributed

    distributed.start(targets.get(a.target))
    lines = ["| model | overlap passes | time / forward | max error (rel.) | NCCL kernel time / forward | "
             "NCCL time beside compute | fired |", "|---|---|---|---|---|---|---|"]
    for name in ("llama", "deepseek"):
        lines += run(name, a.target, a.trace_dir)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, {torch.cuda.get_device_name()}, target {a.target} scaled onto them")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
