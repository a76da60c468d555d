"""Host cost per call of each metainfer op on its GPU launch path, with the Triton launch itself
stubbed out: what a decode step pays in Python before any kernel runs.

    python bench/launch_overhead.py [--calls 400] [--repeats 5] [--json]

Each op is called two ways: as Inductor's wrapper calls it (`kernels.ops.direct.*`, the plain
function, lowering/direct_calls.py) and through the dispatcher (`torch.ops.metainfer.*`, as eager
code and the aot_eager lowering call it); the paged kernel through its launcher (its op reads the
engine's pool). Decode-sized CPU tensors; the attention ops see a contiguous
context one key longer at each call (16 lengths in turn), as decode steps over a cache grown by
concatenation do (its length and strides move every step), with the
launchers deciding as on an sm_89 GPU (lowering/aot.py's recording: every `kernel[grid](...)`
is dropped, only its kernel's name kept, so what is timed is dispatch, input checks, config
lookup, grid and workspace set-up). The first line is a yardstick: an op with an empty body, the dispatcher's floor (this
VM's speed moves by tens of percent between runs). Median over `--repeats` runs of `--calls` calls, in microseconds per call; the
machine and its load are printed beside them. `--json`: the last line is
{"ops": {"op name": microseconds as Inductor calls it, ...}, "dispatch": {...}, "yardstick_us": ...}.

On a GPU these costs add up per layer per step unless the step is replayed from a CUDA graph;
a CPU's figures are an upper bound of a GPU host's (faster cores), not a GPU measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("METAINFER_TRITON_INTERPRET", "1")  # launch paths on CPU tensors

import torch  # noqa: E402

from metainfer import kernels  # noqa: E402
from metainfer.kernels import paged_attention  # noqa: E402
from metainfer.kernels import ops  # noqa: E402  (registers torch.ops.metainfer; ops.direct)
from metainfer.lowering import aot  # noqa: E402
from metainfer.kernels.configs import config_for  # noqa: E402


def cases(mi) -> dict:
    """op name -> a call of one decode-sized step of it (batch 4, one new token each), calling
    the ops through `mi` (torch.ops.metainfer or kernels.ops.direct)."""
    g = torch.Generator().manual_seed(0)
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn

    def randn(*shape, dtype=bf16):
        return torch.randn(*shape, generator=g).to(dtype)

    B, H, Hkv, D, S, STEPS = 4, 32, 8, 128, 1024, 16
    q = randn(B, H, 1, D)
    k, v = randn(B, Hkv, S + STEPS, D), randn(B, Hkv, S + STEPS, D)
    x, h, w = randn(B, 4096), randn(B, 4096), randn(4096)  # h: the residual stream
    cos, sin = randn(1, 1, 1, D), randn(1, 1, 1, D)
    wq, sq = randn(4096, 4096, dtype=e4m3), torch.rand(32, 32, generator=g)
    E, K, I = 16, 2, 256
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)]).to(torch.int32)
    wg, sg = randn(E, I, 1024, dtype=e4m3), torch.rand(E, I // 128, 1024 // 128, generator=g)
    wu, su = randn(E, I, 1024, dtype=e4m3), torch.rand(E, I // 128, 1024 // 128, generator=g)
    wd, sd = randn(E, 1024, I, dtype=e4m3), torch.rand(E, 1024 // 128, I // 128, generator=g)
    xm, tw = randn(B, 1024), torch.ones(B, K)
    R, P, T = 512, 64, 2048
    ql, qp, ckv, kpe = randn(B, 16, 1, R), randn(B, 16, 1, P), randn(B, T + STEPS, R), randn(B, T + STEPS, P)
    idx = torch.randint(0, S, (B, 1, 64), generator=g, dtype=torch.int32)
    pool_k, pool_v = randn(8192, Hkv, D), randn(8192, Hkv, D)
    cu_q = torch.arange(B + 1, dtype=torch.int32)
    qp_flat = randn(B, H, D)
    paged_cfg = config_for("paged_attention", torch.device("cpu"))

    def paged_step(step):
        lens = [700 + step, 90 + step, 1500 + step, 333 + step]
        cu_k = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        key_index = torch.randperm(8192, generator=g)[:sum(lens)].to(torch.int32)
        return lambda: paged_attention.launch(qp_flat, pool_k, pool_v, key_index, cu_q, cu_k, 1, max(lens),
                                              D ** -0.5, config=paged_cfg)

    def decode(step_call):
        """A decode step's call: the context grows by one key each call (STEPS distinct lengths
        in turn, their views built beforehand), so nothing keyed on the context length is
        reused, as in a real decode."""
        return rotating([step_call(s) for s in range(STEPS)])

    def ctx(t, n):  # the first n keys of a cache, contiguous: grown by concatenation (transformers'
        # DynamicCache), its strides move with its length, so nothing keyed on them is reused either
        return (t[:, :, :n] if t.dim() == 4 else t[:, :n]).contiguous()

    return {
        "attention (decode, 1024 keys)": decode(lambda s: (lambda kk=ctx(k, S + s), vv=ctx(v, S + s): mi.attention(
            q, kk, vv, None, D ** -0.5, True, S + s - 1, False))),
        "rmsnorm": lambda: mi.rmsnorm(x, w, 1e-6, 0.0, bf16),
        "add_rmsnorm": lambda: mi.add_rmsnorm(x, h, w, 1e-6, 0.0, bf16),
        "swiglu": lambda: mi.swiglu(x, h),
        "rope": lambda: mi.rope(q, cos, sin),
        "fp8_linear (M=4)": lambda: mi.fp8_linear(x, wq, sq, None, 128, 128, False),
        "moe_experts (4 tokens, top-2 of 16)": lambda: mi.moe_experts(xm, ids, tw, wg, wu, wd, sg, su, sd,
                                                                      128, 128),
        "sparse_attention (top-64)": decode(lambda s: (lambda kk=ctx(k, S + s), vv=ctx(v, S + s): mi.sparse_attention(
            q, kk, vv, idx, None, D ** -0.5, True, S + s - 1, False, float("-inf")))),
        "mla_decode (2048 latents)": decode(lambda s: (lambda c=ctx(ckv, T + s), p=ctx(kpe, T + s): mi.mla_decode(
            ql, qp, c, p, None, None, 0.04, True, T + s - 1, False))),
        "paged_attention launch (4 requests)": decode(paged_step),
    }


def rotating(calls: list):
    """One callable that makes the calls in turn."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def yardstick(calls: int, repeats: int) -> float:
    """Microseconds per call of an op with two arguments and an empty body, defined as
    kernels/ops.py defines metainfer's: the dispatcher's own floor on this host, printed
    beside the figures since a shared 2-core VM's speed moves between runs."""
    lib = torch.library.Library("launch_overhead_yardstick", "FRAGMENT")
    out = torch.empty(1)

    def nothing(x: torch.Tensor, eps: float) -> torch.Tensor:
        return out

    lib.define("nothing" + torch.library.infer_schema(nothing, mutates_args=()))
    lib.impl("nothing", nothing, "CompositeExplicitAutograd")
    op, x = torch.ops.launch_overhead_yardstick.nothing, torch.empty(4)
    return measure(lambda: op(x, 1e-6), calls, repeats, [])


def measure(call, calls: int, repeats: int, launches: list) -> float:
    for _ in range(20):
        call()
    runs = []
    for _ in range(repeats):
        launches.clear()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="last line: {\"ops\": {name: microseconds}}")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"host: {os.cpu_count()} CPUs, load {load:.2f}, torch {torch.__version__}, {a.threads} thread(s); "
          f"launches stubbed, decisions as on sm_89")
    floor = round(yardstick(a.calls, a.repeats), 2)
    print(f"  {'(yardstick: an empty two-argument op)':40s} {floor:8.2f} us/call", flush=True)
    print(f"  {'us per call':40s} {'direct':>8s} {'dispatch':>9s}  (direct: as Inductor's wrapper calls the op)")
    results, dispatched = {}, {}
    with kernels.interpret(True), aot._recording(89, names_only=True) as launches:
        direct, dispatch = cases(ops.direct), cases(torch.ops.metainfer)
        for name in direct:
            results[name] = round(measure(direct[name], a.calls, a.repeats, launches), 1)
            dispatched[name] = round(measure(dispatch[name], a.calls, a.repeats, launches), 1)
            print(f"  {name:40s} {results[name]:8.1f} {dispatched[name]:9.1f}", flush=True)
    if a.json:
        print(json.dumps({"ops": results, "dispatch": dispatched, "yardstick_us": floor}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
