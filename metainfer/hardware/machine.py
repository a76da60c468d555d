"""What machine a measurement was made on: the facts that change how kernels run (the CPU model,
the ISA extensions torch's CPU kernels branch on, the cores; on a GPU its name, SM and driver).
A calibrated target records them (`[machine]`), and optimize() warns when it is used on a
machine that differs, naming what changed (its figures describe another machine); a built-in
target carries the machine its figures came from, and on another one only notes it. Also: the
dtype a CPU should compute a half-precision model in, from its GEMM rates measured now."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

# ISA extensions that change which CPU kernels run (oneDNN / torch's CPU GEMMs): bf16 and AMX
# units make bf16 GEMMs native instead of ~45x slower than fp32 (measured on an EPYC without them)
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


class MachineChanged(UserWarning):
    """A calibrated target is used on a machine other than the one it was measured on."""


@dataclass(frozen=True)
class Machine:
    cpu: str  # the CPU's model name
    flags: tuple[str, ...]  # those of KERNEL_FLAGS it has
    cores: int  # cores this process may run on
    gpu: str = ""  # the GPU's name, SM ("sm_90") and driver, where the target is a GPU's
    sm: str = ""
    driver: str = ""


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:  # not Linux: the platform's word for it
        import platform

        model = platform.processor() or platform.machine()
    return model, flags


@functools.lru_cache(maxsize=2)
def current(gpu: bool = False) -> Machine:
    """This machine; `gpu`: with the first GPU's name, SM and driver (where torch sees one)."""
    model, flags = _cpuinfo()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    name = sm = driver = ""
    if gpu:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            name, sm = p.name, f"sm_{p.major}{p.minor}"
            driver = str(getattr(torch._C, "_cuda_getDriverVersion", lambda: "")() or torch.version.cuda or "")
    return Machine(cpu=model, flags=tuple(f for f in KERNEL_FLAGS if f in flags), cores=cores, gpu=name, sm=sm,
                   driver=driver)


def differences(recorded: Machine, now: Machine) -> list[str]:
    """What differs between the machine a target was calibrated on and this one, in words."""
    out = []
    if recorded.cpu != now.cpu:
        out.append(f"CPU {recorded.cpu!r} -> {now.cpu!r}")
    lost, gained = set(recorded.flags) - set(now.flags), set(now.flags) - set(recorded.flags)
    if lost or gained:
        out.append("ISA flags" + (f" without {', '.join(sorted(lost))}" if lost else "") +
                   (f" with {', '.join(sorted(gained))}" if gained else ""))
    if recorded.cores != now.cores:
        out.append(f"{recorded.cores} -> {now.cores} cores")
    for key in ("gpu", "sm", "driver"):
        a, b = getattr(recorded, key), getattr(now, key)
        if a and a != b:
            out.append(f"{key} {a!r} -> {b!r}")
    return out


def gemm_gflops(dtype, size: int = 256, repeat: int = 3) -> float:
    """GFLOP/s of a size^3 matmul in `dtype` on this CPU, the best of `repeat` timed calls."""
    import time

    import torch

    a = torch.full((size, size), 0.5, dtype=dtype)
    a @ a
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


SLOW_HALF = 2.0  # a half-precision GEMM this many times slower than fp32 is not native here


def cpu_compute_dtype(wanted):
    """The dtype a CPU should compute a `wanted`-dtype model in: bf16 / fp16 where this CPU runs
    their GEMMs at least half as fast as fp32's, else fp32 (a CPU without avx512_bf16 / AMX runs
    bf16 GEMMs tens of times slower: 45x was measured on one EPYC). Returns (dtype, why or None),
    the choice from a measurement made now (256^3 GEMMs, ~0.1 s)."""
    import torch

    if wanted not in (torch.bfloat16, torch.float16):
        return wanted, None
    half, single = gemm_gflops(wanted), gemm_gflops(torch.float32)
    if single < SLOW_HALF * half:
        return wanted, None
    name = str(wanted).removeprefix("torch.")
    here = current()
    native = {"torch.bfloat16": ("avx512_bf16", "amx_bf16"), "torch.float16": ("avx512_fp16", "amx_tile")}[str(wanted)]
    lacks = [f for f in native if f not in here.flags]
    return torch.float32, (
        f"computing in float32, not the model's {name}: a {name} GEMM measured {half:.1f} GFLOP/s on this CPU "
        f"against float32's {single:.1f} ({single / half:.0f}x slower; {here.cpu or 'this CPU'}"
        + (f" lacks {', '.join(lacks)}" if lacks else "") + "); ask for it with --dtype " + name)
