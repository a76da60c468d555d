"""Calibration: measure this machine and write the target TOML the cost model prices it with.

    metainfer calibrate --target cpu [--out cpu-calibrated.toml] [--ranks 2 4] [--quick]

What is measured (each the median of repeated timings after a warm-up):
- matmul throughput (GFLOP/s) by shape class: a large square GEMM (the peak the roofline
  uses), a prefill-shaped one and a decode-shaped one (reported: how far below the peak
  skinny GEMMs run), in float32 and bfloat16;
- memory bandwidth: a large copy, bytes read + written per second;
- a cache level: decode-shaped matmuls (2 rows) streaming sets of weights from 8 MiB to
  512 MiB; where small sets stream clearly faster than the largest, the level holds the
  largest set still streaming at least halfway between the two, at the median rate of the
  sets it holds (a graph whose whole footprint fits is priced at that bandwidth);
- how much of a kernel's memory time hides under its arithmetic: prefill-shaped matmuls
  (128 rows) over a 512 MiB set of weights, against their compute and memory times on the
  figures above (1: the roofline's max; 0: the two add, as when a CPU GEMM packs its weight
  before computing with it);
- per-kernel overhead: the time per kernel of a compiled stack of tiny layers shaped as a
  model's (a linear, a norm-like chain over a view, parameters as graph inputs): what the
  compiled graph's wrapper spends on each kernel it calls;
- per-call overhead of each metainfer custom op (Python dispatch, checks, the CPU path's fixed
  work) on tiny inputs, and for moe_experts the cost of each expert with tokens;
- gloo loopback collectives: all-reduce, all-gather and reduce-scatter over 2 (and 4) ranks on
  127.0.0.1 at sizes from 4 KiB to 16 MiB, each fitted to its ring model t = steps x (alpha +
  chunk / beta): the all-reduce's alpha (latency) and beta (bandwidth) become the target's
  intra-island link, the others' fits its [collectives.links] (gloo's reduce-scatter is no
  cheaper than its all-reduce, which the ring model would price at half); the same three
  through metainfer's shared-memory path (kernels/shm_collectives.py), each fitted to
  t = alpha + bytes / beta, its [collectives.shm]; and how much of
  a 4 MiB all-reduce runs beside a matmul of about its length when issued asynchronously
  before it (the target's [collectives] overlap). Each rank uses its share of the cores.

The calibrated Target (`calibrated`) keeps the base target's structure (the cpu target: one
device) with the measured numbers in place of its own; `to_toml` writes it through the target
schema (targets.to_toml), each figure under a comment saying what was measured and when.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from metainfer.hardware import noise, targets


@dataclass
class Measurements:
    machine: str
    when: str
    torch_threads: int
    matmul_gflops: dict[str, float] = field(default_factory=dict)  # "fp32 large" -> GFLOP/s
    copy_gbs: float = 0.0
    stream_gbs: dict[str, float] = field(default_factory=dict)  # weight set MiB -> GB/s a decode matmul streams it
    cache_mib: float = 0.0  # 0: no cache level found
    cache_gbs: float = 0.0
    stream_gbs_beyond_cache: float = 0.0  # decode matmuls' streaming rate over the sets the cache level does not hold
    memory_overlap: float = 1.0  # share of a kernel's memory time hidden under its arithmetic
    kernel_overhead_us: float = 0.0
    custom_op_overhead_us: dict[str, float] = field(default_factory=dict)  # op -> us per call
    custom_op_slowdown: dict[str, float] = field(default_factory=dict)  # op -> measured work / roofline
    collectives: dict[str, dict] = field(default_factory=dict)  # "all_reduce 2" -> {alpha_us, beta_gbs, points}
    comm_overlap: dict[str, float] = field(default_factory=dict)  # ranks -> share of a collective hidden
    fingerprint: dict = field(default_factory=dict)  # metainfer.hardware.machine.Machine's fields: where measured
    noise: dict = field(default_factory=dict)  # metainfer.hardware.noise.Yardstick.summary(): the machine's swing

    def to_dict(self) -> dict:
        return asdict(self)


def _guarded(guard, fn, label: str):
    """fn()'s value, measured between yardstick readings where a guard is given (re-measured
    while the machine swings; an unstable row is kept but named in the guard's summary)."""
    return fn() if guard is None else guard.measure(fn, label).value


def _median_seconds(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


MATMUL_SHAPES = {  # class -> (M, K, N)
    "large": (2048, 2048, 2048),
    "prefill": (512, 2048, 2048),
    "decode": (8, 2048, 2048),
}


def measure_matmuls(quick: bool = False, guard=None) -> dict[str, float]:
    import torch

    out = {}
    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for cls, (m, k, n) in MATMUL_SHAPES.items():
            if label == "bf16" and cls == "large" and quick:
                continue
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            probe = _median_seconds(lambda: a @ b, 1, warmup=1)
            repeat = max(3, min(50, int(0.5 / max(probe, 1e-6))))  # ~0.5 s of timing per shape
            if probe > 2.0:  # a dtype without a fast GEMM here (bf16 on most CPUs): one timing
                repeat = 1
            seconds = _guarded(guard, lambda: _median_seconds(lambda: a @ b, repeat, warmup=0),  # noqa: B023
                               f"matmul {label} {cls}")
            out[f"{label} {cls}"] = 2 * m * k * n / seconds / 1e9
    return out


def measure_copy(quick: bool = False) -> float:
    """GB/s of a large tensor copy, counting the bytes read and the bytes written."""
    import torch

    n = (64 if quick else 256) * 2**20 // 4
    src, dst = torch.randn(n), torch.empty(n)
    seconds = _median_seconds(lambda: dst.copy_(src), 5 if quick else 10)
    return 2 * src.numel() * 4 / seconds / 1e9


CACHE_SWEEP_MIB = (8, 16, 32, 64, 96, 128, 192, 256, 512)


def measure_weight_streaming(quick: bool = False, guard=None) -> dict[int, float]:
    """GB/s at which decode-shaped linears (2 rows x 512 in, 1024 out) read each of a set of
    1024 x 512 fp32 weights, by the set's total MiB: how fast memory-bound work runs when the
    program touches that many bytes per call. The weights lie as nn.Linear keeps them (out x
    in: the GEMM reads them transposed), which streams ~1.8x slower here than the same bytes
    laid in x out (4.5-5.7 against 8.2-10.2 GB/s on this project's EPYC VM, 2026-12-06)."""
    import torch

    x = torch.full((2, 512), 0.5)

    def stream(weights):
        for w in weights:
            torch.nn.functional.linear(x, w)

    out = {}
    for mib in ((16, 64, 128, 512) if quick else CACHE_SWEEP_MIB):
        weights = [torch.full((1024, 512), 0.5) for _ in range(mib // 2)]
        seconds = _guarded(guard, lambda: _median_seconds(lambda: stream(weights), 5 if quick else 10),  # noqa: B023
                           f"streaming {mib} MiB")
        out[mib] = mib * 2**20 / seconds / 1e9
    return out


def cache_level(stream_gbs: dict[int, float]) -> tuple[float, float]:
    """(MiB, GB/s) of the cache level a streaming sweep shows, or (0, 0) where no set streams
    1.3x as fast as the largest (no level worth modelling). The level holds the sets from the
    smallest up to the last before one streams below halfway between the fastest rate and the
    largest set's (a noisy fast reading further up does not count); its bandwidth is the
    median rate of the sets it holds (the smallest pay more per call)."""
    sizes = sorted(stream_gbs)
    near, far = max(stream_gbs.values()), stream_gbs[sizes[-1]]
    if near < 1.3 * far or stream_gbs[sizes[0]] < (near + far) / 2:
        return 0.0, 0.0
    fits = []  # the sizes from the smallest up to the first that streams below halfway
    for s in sizes:
        if stream_gbs[s] < (near + far) / 2:
            break
        fits.append(s)
    return float(fits[-1]), statistics.median(stream_gbs[s] for s in fits)


def streaming_beyond(stream_gbs: dict[int, float], cache_mib: float) -> float:
    """GB/s a matmul streams weights that do not fit the cache level: the median rate of the
    sweep's sets larger than it (every set where no level was found)."""
    beyond = [v for k, v in stream_gbs.items() if k > cache_mib]
    return statistics.median(beyond) if beyond else min(stream_gbs.values())


def measure_memory_overlap(peak_gflops: float, memory_gbs: float, quick: bool = False) -> float:
    """The share of a matmul's memory time that runs beside its arithmetic, in [0, 1]: 128-row
    linears over a 512 MiB set of 512 x 1376 fp32 weights (nn.Linear's layout; read from
    memory, not a cache), each time t against t_c = FLOPs / peak and t_m = weight bytes /
    bandwidth (the streaming rate the cost model gives a matmul's operands):
    1 - (t - max(t_c, t_m)) / min(t_c, t_m), clamped."""
    import torch

    rows, k, n = 128, 1376, 512
    weights = [torch.full((n, k), 0.5) for _ in range((128 if quick else 512) * 2**20 // (k * n * 4))]
    x = torch.full((rows, k), 0.5)
    t = _median_seconds(lambda: [torch.nn.functional.linear(x, w) for w in weights], 3 if quick else 7) / len(weights)
    t_c, t_m = 2 * rows * k * n / (peak_gflops * 1e9), k * n * 4 / (memory_gbs * 1e9)
    return min(1.0, max(0.0, 1 - (t - max(t_c, t_m)) / min(t_c, t_m)))


def measure_kernel_overhead(layers: int = 32, size: int = 16) -> float:
    """Microseconds per kernel of an Inductor-compiled stack of `layers` tiny layers shaped as
    a model's are (a linear with its bias, then a norm-like chain over a transposed view, its
    weight a parameter): the wrapper's work per kernel (the extern call or fused C++ kernel,
    input checks, buffer allocation, views), on 16 x 16 tensors whose arithmetic is noise.
    Timed inside the backend, as the validation times graphs: Dynamo's guards are outside."""
    import torch
    from torch._inductor.compile_fx import compile_fx

    from metainfer.lowering.backend import timed

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linears = torch.nn.ModuleList(torch.nn.Linear(size, size) for _ in range(layers))
            self.scales = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(size)) for _ in range(layers))

        def forward(self, x):
            for linear, scale in zip(self.linears, self.scales):
                h = linear(x)
                h = h.view(2, size // 2, size).transpose(0, 1).reshape(size, size)
                x = x + h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
            return x

    seconds = []

    def backend(gm, example_inputs):
        return timed(compile_fx(gm, example_inputs), seconds)

    model = Stack().eval()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    x = torch.full((size, size), 0.1)
    with torch.no_grad():
        for _ in range(20):
            compiled(x)
        del seconds[:]
        for _ in range(200):
            compiled(x)
    torch._dynamo.reset()
    # two kernels a layer: the matmul (extern) and the fused chain after it
    return statistics.median(seconds) / (2 * layers) * 1e6


def _per_call_us(fn, args, calls: int) -> float:
    """Microseconds per call of `fn` chained `calls` times (its output is its first input) in
    an Inductor-compiled graph."""
    import torch

    def chain(x, *rest):
        for _ in range(calls):
            x = fn(x, *rest)
        return x

    compiled = torch.compile(chain, backend="inductor", dynamic=False)
    seconds = _median_seconds(lambda: compiled(*args), 50, warmup=3)
    torch._dynamo.reset()
    return seconds / calls * 1e6


def measure_custom_op_overheads(calls: int = 16) -> dict[str, float]:
    """Microseconds per call of each of metainfer's custom ops on tiny inputs from a compiled
    graph: Python dispatch, input checks and the CPU path's fixed work around a kernel, which
    a fused ATen kernel does not pay. For moe_experts, also the cost of each expert that
    received tokens (its CPU path loops over them on the host): `moe_experts_per_expert`."""
    import torch

    import metainfer.kernels.ops  # noqa: F401  (registers the ops)

    ops, f32 = torch.ops.metainfer, torch.float32
    r = lambda *shape: torch.randn(*shape)  # noqa: E731
    out = {
        "rmsnorm": _per_call_us(lambda x, w: ops.rmsnorm(x, w, 1e-6, 0.0, f32), (r(1, 16), r(16)), calls),
        "swiglu": _per_call_us(lambda x, u: ops.swiglu(x, u), (r(1, 16), r(1, 16)), calls),
        "rope": _per_call_us(lambda x, c, s: ops.rope(x, c, s), (r(1, 1, 1, 16), r(1, 1, 1, 16), r(1, 1, 1, 16)),
                             calls),
        "attention": _per_call_us(lambda q, k, v: ops.attention(q, k, v, None, 0.25, False, 0, False),
                                  (r(1, 2, 1, 16), r(1, 1, 4, 16), r(1, 1, 4, 16)), calls),
        "mla_decode": _per_call_us(lambda q, p, c, k: ops.mla_decode(q, p, c, k, None, None, 0.2, False, 0, False),
                                   (r(1, 2, 1, 16), r(1, 2, 1, 8), r(1, 4, 16), r(1, 4, 8)), calls),
    }

    def experts(n: int) -> float:
        E, H, I = 8, 16, 16
        ids = torch.arange(n, dtype=torch.int64)[None] % E  # one token routed to n experts
        return _per_call_us(lambda x, i, w, g, u, d: ops.moe_experts(x, i, w, g, u, d, None, None, None, 128, 128),
                            (r(1, H), ids, torch.rand(1, n), r(E, I, H), r(E, I, H), r(E, H, I)), calls)

    one, eight = experts(1), experts(8)
    out["moe_experts_per_expert"] = max(0.0, (eight - one) / 7)
    out["moe_experts"] = max(0.0, one - out["moe_experts_per_expert"])
    out.update(_hf_grouped_mm_overheads(calls))
    return out


def _hf_grouped_mm_overheads(calls: int) -> dict[str, float]:
    """Hugging Face's `grouped_mm_fallback` (the experts' form a library-default MoE compiles to
    on CPU: a host loop of one matmul per expert with tokens), as for moe_experts: per call and
    per expert. Empty where transformers does not provide it."""
    import torch

    try:
        import transformers.integrations.moe  # noqa: F401  (registers the op)

        op = torch.ops.transformers.grouped_mm_fallback
    except (ImportError, AttributeError):
        return {}
    E, H = 8, 16

    def experts(n: int) -> float:  # n tokens, one per expert
        offs = torch.tensor([min(i + 1, n) for i in range(E)], dtype=torch.int32)
        return _per_call_us(lambda x, w, o: op(x, w, o), (torch.randn(n, H), torch.randn(E, H, H), offs), calls)

    one, eight = experts(1), experts(8)
    per_expert = max(0.0, (eight - one) / 7)
    return {"grouped_mm_fallback": max(0.0, one - per_expert), "grouped_mm_fallback_per_expert": per_expert}


def _large_op_calls():
    """(op name, fn, args) at sizes where the work dominates the call."""
    import torch

    ops, f32, r = torch.ops.metainfer, torch.float32, torch.randn
    return [
        ("rmsnorm", lambda x, w: ops.rmsnorm(x, w, 1e-6, 0.0, f32), (r(2048, 1024), r(1024))),
        ("swiglu", lambda x, u: ops.swiglu(x, u), (r(2048, 2816), r(2048, 2816))),
        ("rope", lambda x, c, s: ops.rope(x, c, s), (r(1, 8, 2048, 64), r(1, 1, 2048, 64), r(1, 1, 2048, 64))),
        ("attention", lambda q, k, v: ops.attention(q, k, v, None, 0.125, True, 0, False),
         (r(1, 8, 1024, 64), r(1, 2, 1024, 64), r(1, 2, 1024, 64))),
        ("mla_decode", lambda q, p, c, k: ops.mla_decode(q, p, c, k, None, None, 0.1, True, 1023, False),
         (r(4, 16, 1, 128), r(4, 16, 1, 32), r(4, 1024, 128), r(4, 1024, 32))),
        # 1024 tokens, top-2 of 8 experts (every expert gets tokens), hidden 512, width 256
        ("moe_experts", lambda x, i, w, g, u, d: ops.moe_experts(x, i, w, g, u, d, None, None, None, 128, 128),
         (r(1024, 512), torch.randint(0, 8, (1024, 2)), torch.rand(1024, 2), r(8, 256, 512), r(8, 256, 512),
          r(8, 512, 256))),
    ]


def measure_custom_op_slowdowns(target, overheads: dict[str, float]) -> dict[str, float]:
    """How many times its roofline (on `target`, the numbers measured above) each custom op's
    work takes on this machine, from one call at a size where the work dominates: on CPU an
    op runs its CPU path (eager torch, several passes over the data), not a fused kernel."""
    import dataclasses

    import torch

    from metainfer.hardware import cost
    from metainfer.testing import capture_graph

    bare = dataclasses.replace(target, device=dataclasses.replace(
        target.device, launch_overhead_s=0.0, custom_op_overhead_s=0.0, custom_op_overheads={}))
    out = {}
    for name, fn, args in _large_op_calls():
        fixed = overheads.get(name, 0.0) + (8 * overheads.get("moe_experts_per_expert", 0.0) if name == "moe_experts"
                                            else 0.0)  # the call's own overhead (every expert has tokens)
        measured = _per_call_us(fn, args, 4) - fixed
        gm, _ = capture_graph(fn, *args)
        (node,) = [n for n in gm.graph.nodes if f"metainfer.{name}" in str(n.target)]
        body = cost.price_graph(gm.graph, bare)[node].seconds * 1e6
        out[name] = max(1.0, measured / body) if body > 0 else 1.0
        torch._dynamo.reset()
    return out


def _collective_timings(rank: int, world: int, sizes: list[int], repeat: int) -> dict:
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # each rank its share of the cores
    out = {"all_reduce": {}, "all_gather": {}, "reduce_scatter": {}}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        gathered = torch.empty(world * (nbytes // 4 // world))
        part = torch.ones(nbytes // 4 // world)
        for kind, fn in (("all_reduce", lambda: dist.all_reduce(x)),
                         ("all_gather", lambda: dist.all_gather_into_tensor(gathered, part)),
                         ("reduce_scatter", lambda: dist.reduce_scatter_tensor(part, x))):
            dist.barrier()
            out[kind][nbytes] = _median_seconds(fn, repeat)
    out["shm"] = _shm_timings(world, sizes, repeat)
    out["overlap"] = _overlap(repeat)
    return out


def _shm_timings(world: int, sizes: list[int], repeat: int) -> "dict | str":
    """The shared-memory path's times at the same sizes and message definitions as gloo's
    (kernels/shm_collectives.py), or why it cannot run here."""
    import torch
    import torch.distributed as dist

    from metainfer.kernels import shm_collectives

    g = dist.group.WORLD.group_name
    why = shm_collectives.reserve(g)
    if why is not None:
        return why
    ops = torch.ops.metainfer
    out = {"all_reduce": {}, "all_gather": {}, "reduce_scatter": {}}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        part = torch.ones(nbytes // 4 // world)
        for kind, fn in (("all_reduce", lambda: ops.shm_all_reduce(x, g)),
                         ("all_gather", lambda: ops.shm_all_gather(part, world, g)),
                         ("reduce_scatter", lambda: ops.shm_reduce_scatter(x, world, g))):
            dist.barrier()
            out[kind][nbytes] = _median_seconds(fn, repeat)
    return out


def _overlap(repeat: int) -> dict:
    """Times of a 4 MiB all-reduce alone, a matmul sized to take about as long alone, and the
    all-reduce issued asynchronously, the matmul run, then the wait: the median of five rounds."""
    import torch
    import torch.distributed as dist

    x = torch.ones(1 << 20)

    def reduce():
        dist.all_reduce(x)

    comm = _median_seconds(reduce, repeat)
    n = 64
    while True:  # the smallest power-of-two square matmul at least as long as the all-reduce
        a = torch.randn(n, n)
        compute = _median_seconds(lambda: a @ a, 3)
        if compute >= comm or n >= 4096:
            break
        n *= 2
    # every rank must run the same sizes: the largest any rank chose
    size = torch.tensor([n])
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    a = torch.randn(int(size), int(size))
    compute = _median_seconds(lambda: a @ a, repeat)

    def both():
        work = dist.all_reduce(x, async_op=True)
        a @ a
        work.wait()

    rounds = []  # alternated, so that a slow spell of the machine hits all three alike
    for _ in range(5):
        dist.barrier()
        rounds.append({"comm_s": _median_seconds(reduce, repeat, 1), "compute_s": _median_seconds(lambda: a @ a, repeat, 1),
                       "both_s": _median_seconds(both, repeat, 1)})
    return sorted(rounds, key=overlap_share)[len(rounds) // 2]  # the median round


def overlap_share(t: dict) -> float:
    """The share of the shorter of the two that ran beside the other: 1 if together they took
    the longer one's time, 0 if they took the sum of both."""
    hidden = t["comm_s"] + t["compute_s"] - t["both_s"]
    return min(1.0, max(0.0, hidden / min(t["comm_s"], t["compute_s"])))


def fit_line(points: dict[float, float]) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) of t = alpha + x / beta over points x -> t, least squares.
    Latency-bound at every size (a loaded machine): bandwidth from the largest point."""
    xs, ys = list(points), list(points.values())
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if slope <= 0:
        big = max(points)
        return min(ys), big / points[big]
    return max(0.0, my - slope * mx), 1.0 / slope


def fit_ring(points: dict[int, float], world: int, kind: str) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) of t = steps (alpha + (M / n) / beta), least squares;
    steps = 2(n-1) for all-reduce, n-1 for all-gather and reduce-scatter (M the whole buffer)."""
    steps = 2 * (world - 1) if kind == "all_reduce" else world - 1
    return fit_line({m / world: t / steps for m, t in points.items()})


def measure_collectives(ranks: list[int], quick: bool = False, guard=None) -> dict[str, dict]:
    from metainfer.parallel import multirank

    sizes = [4 << 10, 64 << 10, 1 << 20, 4 << 20] + ([] if quick else [16 << 20])
    out = {}
    for world in ranks:
        results = _guarded(guard, lambda: multirank.run(_collective_timings, world_size=world,  # noqa: B023
                                                        args=(sizes, 5 if quick else 10), timeout_s=300),
                           f"collectives over {world} ranks")
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            # the slowest rank's time at each size: a collective ends when its last rank does
            points = {m: max(r[kind][m] for r in results) for m in sizes}
            alpha, beta = fit_ring(points, world, kind)
            out[f"{kind} {world}"] = {"alpha_us": alpha * 1e6, "beta_gbs": beta / 1e9,
                                      "points_us": {str(m): t * 1e6 for m, t in points.items()}}
            shm = [r["shm"] for r in results]
            if all(isinstance(r, dict) for r in shm):  # t = alpha + M / beta, M as for gloo's
                points = {m: max(r[kind][m] for r in shm) for m in sizes}
                alpha, beta = fit_line(points)
                out[f"shm {kind} {world}"] = {"alpha_us": alpha * 1e6, "beta_gbs": beta / 1e9,
                                              "points_us": {str(m): t * 1e6 for m, t in points.items()}}
            else:
                out[f"shm unavailable {world}"] = next(r for r in shm if isinstance(r, str))
        # the slowest rank's times: it is the one the others wait for
        out[f"overlap {world}"] = max((r["overlap"] for r in results), key=lambda t: t["both_s"])
    return out


def measure(base: "targets.Target", ranks: list[int] = (2,), quick: bool = False, progress=print,
            guard: "noise.Yardstick | None" = None) -> Measurements:
    """This machine's numbers; `base` is the target they will replace numbers of (its other
    fields price the custom ops while the calibration runs). Every row is measured between
    readings of `guard`'s yardstick (a fresh one by default): re-measured while the machine
    swings outside its band, and named unstable in `noise` where it never held still."""
    import torch

    from metainfer.hardware import machine, noise, targets

    guard = guard or noise.Yardstick()
    m = Measurements(machine=f"{platform.node()} ({platform.processor() or platform.machine()})",
                     when=datetime.date.today().isoformat(), torch_threads=torch.get_num_threads(),
                     fingerprint=asdict(machine.current(gpu=targets.required(base, "calibrate").device.kind == "cuda")))
    progress("matmuls ...")
    m.matmul_gflops = measure_matmuls(quick, guard)
    progress("memory bandwidth ...")
    m.copy_gbs = _guarded(guard, lambda: measure_copy(quick), "copy")
    progress("cache level ...")
    streamed = measure_weight_streaming(quick, guard)
    m.stream_gbs = {str(k): v for k, v in streamed.items()}
    m.cache_mib, m.cache_gbs = cache_level(streamed)
    m.stream_gbs_beyond_cache = streaming_beyond(streamed, m.cache_mib)
    # against the rate the cost model gives a matmul's weights (streaming, not a copy's)
    m.memory_overlap = _guarded(guard, lambda: measure_memory_overlap(m.matmul_gflops["fp32 large"],
                                                                      m.stream_gbs_beyond_cache, quick),
                                "memory overlap")
    progress("per-kernel overhead ...")
    m.kernel_overhead_us = _guarded(guard, measure_kernel_overhead, "per-kernel overhead")
    m.custom_op_overhead_us = _guarded(guard, measure_custom_op_overheads, "custom-op overheads")
    progress("custom ops against their roofline ...")
    provisional = calibrated(m, base, "calibration in progress")
    m.custom_op_slowdown = _guarded(guard, lambda: measure_custom_op_slowdowns(provisional, m.custom_op_overhead_us),
                                    "custom ops against their roofline")
    if ranks:
        progress(f"gloo collectives over {', '.join(map(str, ranks))} ranks ...")
        measured = measure_collectives(list(ranks), quick, guard)
        m.comm_overlap = {k.split()[1]: overlap_share(measured.pop(k)) for k in list(measured) if k.startswith("overlap")}
        m.collectives = measured
    m.noise = guard.summary()
    progress(guard.line())
    return m


def _default_overhead(per_op: dict[str, float]) -> float:
    pointwise = sorted(per_op[k] for k in ("rmsnorm", "swiglu", "rope") if k in per_op)
    return pointwise[len(pointwise) // 2] if pointwise else 0.0


def _shown(x: float, digits: int) -> float:
    """`x` as the TOML shows it: `digits` significant digits."""
    return float(f"{x:.{digits}g}")


def _link_fit(m: Measurements) -> "tuple[int, dict] | None":
    """(ranks, fit) of the all-reduce fit over the fewest ranks (the others share the cores it has)."""
    fits = sorted((int(k.split()[1]), v) for k, v in m.collectives.items() if k.startswith("all_reduce "))
    return fits[0] if fits else None


def calibrated(m: Measurements, base: "targets.Target", source: str = "measured by metainfer calibrate"
               ) -> "targets.Target":
    """The base target with the measured numbers in place of its own, each rounded as the TOML
    shows it. It keeps the base's name (with -calibrated), device name, memory size, islands,
    P2P, interconnect and backend; a figure not measured keeps the base's link or takes its
    default."""
    from metainfer.hardware import targets
    from metainfer.hardware.machine import Machine

    t = targets.required(base, "calibrate")

    def link(fit: dict) -> "targets.LinkSpec":
        return targets.LinkSpec(bandwidth=_shown(fit["beta_gbs"], 4) * 1e9, latency_s=_shown(fit["alpha_us"], 3) * 1e-6)

    fp32 = _shown(m.matmul_gflops["fp32 large"] / 1e3, 6) * 1e12
    half = _shown(max(v for k, v in m.matmul_gflops.items() if k.startswith("bf16")) / 1e3, 6) * 1e12
    device = targets.DeviceSpec(
        kind=t.device.kind, name=t.device.name,
        # tf32 and fp8: a CPU runs both as fp32 (calibrate measures CPUs)
        peak_flops={"fp32": fp32, "tf32": fp32, "bf16": half, "fp16": half, "fp8": fp32},
        memory_bytes=_shown(t.device.memory_bytes / 2**30, 4) * 2**30,
        memory_bandwidth=_shown(m.copy_gbs, 4) * 1e9,
        launch_overhead_s=_shown(m.kernel_overhead_us, 3) * 1e-6,
        custom_op_overhead_s=_shown(_default_overhead(m.custom_op_overhead_us), 3) * 1e-6,
        custom_op_overheads={k: _shown(v, 3) * 1e-6 for k, v in m.custom_op_overhead_us.items()},
        custom_op_slowdown={k: _shown(v, 3) for k, v in m.custom_op_slowdown.items()},
        cache_bytes=_shown(m.cache_mib, 4) * 2**20 if m.cache_mib else 0.0,
        cache_bandwidth=_shown(m.cache_gbs, 4) * 1e9 if m.cache_mib else 0.0,
        memory_overlap=_shown(m.memory_overlap, 3),
        stream_bandwidth=_shown(m.stream_gbs_beyond_cache, 4) * 1e9 if m.stream_gbs_beyond_cache else 0.0,
    )
    fit = _link_fit(m)
    base_link = t.topology.intra_island
    topology = targets.Topology(
        islands=t.topology.islands, p2p=t.topology.p2p, interconnect=t.topology.interconnect,
        intra_island=link(fit[1]) if fit else targets.LinkSpec(bandwidth=_shown(base_link.bandwidth / 1e9, 4) * 1e9,
                                                                latency_s=_shown(base_link.latency_s * 1e6, 3) * 1e-6),
        inter_island=t.topology.inter_island)
    # the other kinds fitted on their own, over the same ranks as the link (sorted, as a TOML reads)
    world = fit[0] if fit else None
    own = {kind: link(m.collectives[f"{kind} {world}"]) for kind in ("all_gather", "reduce_scatter")
           if f"{kind} {world}" in m.collectives}
    shm = {kind: link(m.collectives[f"shm {kind} {world}"]) for kind in ("all_gather", "all_reduce", "reduce_scatter")
           if f"shm {kind} {world}" in m.collectives}
    fp = m.fingerprint
    return targets.Target(
        name=f"{t.name}-calibrated", description=f"{t.description}, calibrated {m.when}", num_devices=t.num_devices,
        device=device, topology=topology, collective_backend=t.collective_backend, source=source,
        # the fewest ranks', as for the link
        comm_overlap=_shown(m.comm_overlap[min(m.comm_overlap, key=int)], 3) if m.comm_overlap else 1.0,
        collective_links=own, shm_links=shm,
        machine=Machine(**{**fp, "flags": tuple(fp["flags"])}) if fp else None)


def provenance(m: Measurements, base: "targets.Target") -> tuple[list[str], dict[str, list[str]]]:
    """The comments of a calibrated target's TOML: header lines, and lines above each key by its
    path, saying what was measured."""
    header = [f"{base.name} calibrated by `metainfer calibrate` on {m.machine}, {m.when},",
              f"torch with {m.torch_threads} threads. Every number below was measured then.",
              *([_noise_words(m.noise)] if m.noise else [])]
    classes = ", ".join(f"{k} {v:.1f}" for k, v in m.matmul_gflops.items())
    notes = {
        "device.peak_tflops": [f"GEMM GFLOP/s by class ({classes}); the peak is the large square GEMM's"],
        "device.memory_bandwidth_gbs": ["a large copy, bytes read + written per second"],
        "device.cache_mib": [
            f"a cache level: decode matmuls stream weight sets at "
            f"({', '.join(f'{k} MiB {v:.1f}' for k, v in m.stream_gbs.items())}) GB/s; the level holds the",
            "largest set streaming at least halfway between the fastest and the largest set, at the median",
            "rate of the sets it holds"],
        "device.stream_bandwidth_gbs": [
            "decode matmuls streaming weight sets larger than the cache level (the median of those sets'",
            "rates): how fast a matmul reads operands from memory, which a copy's rate overstates"],
        "device.memory_overlap": ["share of a 128-row matmul's weight reads (512 MiB of weights) hidden under its "
                                  "arithmetic"],
        "device.launch_overhead_us": ["per kernel of an Inductor-compiled stack of tiny model-shaped layers (its "
                                      "wrapper's work per kernel)"],
        "device.custom_op_overhead_us": [
            "per call of each metainfer custom op from a compiled graph, on tiny inputs (default: the",
            "pointwise ops' median); *_per_expert: each expert with tokens (a host loop on CPU); grouped_mm_fallback:",
            "Hugging Face's experts op on CPU (the library default)"],
        "device.custom_op_slowdown": ["each custom op's work measured at a size where it dominates, over its roofline "
                                      "on these numbers"],
        "machine": ["the machine these figures were measured on"],
    }
    fit = _link_fit(m)
    if fit:
        fits = "; ".join(f"{k}: alpha {v['alpha_us']:.1f} us, beta {v['beta_gbs']:.3g} GB/s"
                         for k, v in m.collectives.items() if not k.startswith("shm"))
        notes["topology.intra_island"] = [f"gloo on 127.0.0.1 fitted to the ring model ({fits})"]
        notes["collectives.links"] = [f"each kind fitted to its ring model on its own ({fit[0]} ranks)"]
        notes["collectives.shm"] = [
            f"metainfer's shared-memory path between the ranks of this host ({fit[0]} ranks), each kind",
            "fitted to t = latency + bytes / bandwidth (bytes: the buffer; all-gather: its output)"]
    if m.comm_overlap:
        notes["collectives.overlap"] = [
            f"share of an all-reduce that ran beside a matmul of its length ({min(m.comm_overlap, key=int)} ranks; "
            "by rank count: " + ", ".join(f"{k}: {v:.2f}" for k, v in m.comm_overlap.items()) + ")"]
    return header, notes


def to_toml(m: Measurements, base: "targets.Target") -> str:
    """The calibrated target's TOML (written through the target schema), each measured figure
    under a comment saying what was measured."""
    from metainfer.hardware import targets

    header, notes = provenance(m, base)
    return targets.to_toml(calibrated(m, base), header=header, notes=notes)


def _noise_words(n: dict) -> str:
    from metainfer.hardware import noise

    return noise.swing_words(n) + ("; the unstable rows were measured while the machine swung: treat them with doubt"
                                   if n["unstable"] else "")


def table(m: Measurements) -> str:
    rows = [f"matmul {k}: {v:.1f} GFLOP/s" for k, v in m.matmul_gflops.items()]
    rows.append(f"copy: {m.copy_gbs:.1f} GB/s (read + write)")
    rows += [f"decode matmuls streaming {k} MiB of weights: {v:.1f} GB/s" for k, v in m.stream_gbs.items()]
    rows.append(f"cache level: {m.cache_mib:.0f} MiB at {m.cache_gbs:.1f} GB/s" if m.cache_mib else "cache level: none found")
    if m.stream_gbs_beyond_cache:
        rows.append(f"matmuls streaming from memory (beyond the cache level): {m.stream_gbs_beyond_cache:.1f} GB/s "
                    f"(a copy: {m.copy_gbs:.1f})")
    rows.append(f"memory time hidden under a matmul's arithmetic: {m.memory_overlap:.0%}")
    rows.append(f"per-kernel overhead (compiled): {m.kernel_overhead_us:.2f} us")
    rows += [f"per call of {'transformers' if k.startswith('grouped_mm') else 'metainfer'}::{k} (compiled): {v:.1f} us"
             for k, v in m.custom_op_overhead_us.items()]
    rows += [f"metainfer::{k} work: {v:.2f}x its roofline" for k, v in m.custom_op_slowdown.items()]
    for k, v in m.collectives.items():
        if k.startswith("shm unavailable"):
            rows.append(f"shared-memory path over {k.split()[-1]} ranks: not measured ({v})")
        else:
            lib = "shared memory" if k.startswith("shm ") else "gloo"
            rows.append(f"{lib} {k.removeprefix('shm ')} ranks: alpha {v['alpha_us']:.1f} us, beta {v['beta_gbs']:.3g} GB/s")
    rows += [f"gloo all-reduce beside a matmul, {k} ranks: {v:.0%} of it hidden" for k, v in m.comm_overlap.items()]
    if m.noise:
        rows.append(_noise_words(m.noise))
    return "\n".join(rows)
