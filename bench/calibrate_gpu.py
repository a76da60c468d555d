"""Measure the constants metainfer's cost model rests on, on the GPU(s) at hand, and compare
them with a target's numbers.

    python bench/calibrate_gpu.py --target cuda                 # one GPU
    torchrun --nproc-per-node 8 bench/calibrate_gpu.py --target pcie8   # plus collectives

Measures (CUDA events, median of repeats): dense GEMM throughput in bf16 (and FP8 where
torch._scaled_mm runs), memory bandwidth (a large copy), kernel launch overhead (many tiny
kernels), and with several ranks NCCL all-reduce time over message sizes, fitted to
alpha + bytes / beta (ring bus bandwidth). Prints each measured figure beside the target's
and their ratio, and a TOML fragment with the measured values to paste into a target file.
Runs from the source tree with PYTHONPATH=. on torch >= 2.4; needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from _cuda_timing import timed  # (bench/ is on sys.path as the script's folder)


def gemm_tflops(dtype_name: str, n: int = 8192) -> float | None:
    dev = "cuda"
    if dtype_name == "fp8":
        if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
            return None
        a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=dev)
        try:
            fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
            fn()
        except Exception as e:  # FP8 GEMMs need sm_89+
            print(f"  fp8 GEMM not measured: {type(e).__name__}: {e}")
            return None
    else:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
        a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
        fn = lambda: torch.mm(a, b)  # noqa: E731
    return 2 * n**3 / timed(fn) / 1e12


def memory_gbs(nbytes: int = 2 << 30) -> float:
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    return 2 * nbytes / timed(lambda: y.copy_(x)) / 1e9  # read + write


def launch_us(n: int = 2000) -> float:
    x = torch.zeros(1, device="cuda")

    def many():
        for _ in range(n):
            x.add_(1)

    return timed(many, repeats=5) / n * 1e6


def all_reduce_fit(sizes=(1 << 13, 1 << 16, 1 << 20, 1 << 24, 1 << 27)) -> tuple[float, float, list]:
    """(alpha seconds, bus bandwidth bytes/s, [(bytes, seconds)]) of NCCL's all-reduce."""
    import torch.distributed as dist

    n = dist.get_world_size()
    points = []
    for s in sizes:
        x = torch.ones(s // 2, dtype=torch.bfloat16, device="cuda")
        points.append((s, timed(lambda: dist.all_reduce(x), repeats=10)))
    # ring: t = 2(n-1) alpha' + 2(n-1)/n * bytes / busbw; fit the line t = a + bytes * b
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    busbw = 2 * (n - 1) / n / b if b > 0 else float("inf")
    return a / (2 * (n - 1)), busbw, points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="cuda", help="target whose numbers to compare with")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("calibrate_gpu.py needs a CUDA GPU")
    from metainfer.hardware import targets

    t = targets.get(a.target)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = 0
    if distributed:
        import torch.distributed as dist

        rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl")
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    measured = {}
    for dt in ("bf16", "fp8", "fp32"):
        measured[f"peak_tflops.{dt}"] = gemm_tflops(dt)
    measured["memory_bandwidth_gbs"] = memory_gbs()
    measured["launch_overhead_us"] = launch_us()
    if distributed:
        alpha, busbw, points = all_reduce_fit()
        measured["all_reduce_latency_us"] = alpha * 1e6
        measured["flat_ring_bus_bandwidth_gbs"] = busbw / 1e9
    if rank != 0:
        return
    expected = {f"peak_tflops.{k}": v / 1e12 for k, v in t.device.peak_flops.items()}
    expected["memory_bandwidth_gbs"] = t.device.memory_bandwidth / 1e9
    expected["launch_overhead_us"] = t.device.launch_overhead_s * 1e6
    expected["all_reduce_latency_us"] = t.topology.intra_island.latency_s * 1e6
    ring = t.topology.flat_ring_bus_bandwidth
    expected["flat_ring_bus_bandwidth_gbs"] = ring / 1e9 if ring else None
    print(f"device: {name}; torch {torch.__version__}; compared with target {t.name} ({t.device.name})")
    print("| constant | measured | target | measured / target |")
    print("|---|---|---|---|")
    for k, v in measured.items():
        e = expected.get(k)
        ratio = f"{v / e:.2f}" if v is not None and e else "-"
        print(f"| {k} | {'-' if v is None else f'{v:.3g}'} | {'-' if e is None else f'{e:.3g}'} | {ratio} |")
    print("\n# measured on this machine, for a target TOML:")
    peaks = {k.split(".")[1]: round(v, 1) for k, v in measured.items() if k.startswith("peak_tflops") and v}
    print(f"# peak_tflops (measured dense GEMM, n=8192) = {peaks}")
    print(f"memory_bandwidth_gbs = {measured['memory_bandwidth_gbs']:.0f}")
    print(f"launch_overhead_us = {measured['launch_overhead_us']:.1f}")
    if distributed:
        print(f"flat_ring_bus_bandwidth_gbs = {measured['flat_ring_bus_bandwidth_gbs']:.1f}")
        print(f"# all-reduce alpha per ring step: {measured['all_reduce_latency_us']:.1f} us")


if __name__ == "__main__":
    main()
