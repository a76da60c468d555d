"""CUDA-event timing shared by the GPU scripts in bench/ (torch >= 2.4; no newer APIs)."""

from __future__ import annotations

import statistics

import torch


def timed(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() on the current stream, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)
