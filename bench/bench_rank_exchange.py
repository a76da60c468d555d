"""The serving engine's per-step exchange between tensor-parallel ranks, over gloo (the
engine's own: an all-reduce of three ints every step, pickled RequestStates broadcast when
requests arrive) and over metainfer's shared-memory path (metainfer/runtime/exchange.py), side
by side in one run on 2 CPU ranks of this host.

    python bench/bench_rank_exchange.py [--models hf-llama-tiny hf-llama-512x4] [--running 1 8 64]
        [--breakdown N] [--target T] [--json F]

Two parts:
- transport alone: both ranks call the exchange back to back (no model): microseconds per
  status exchange, and per payload of 1, 8 and 64 new requests of 512 prompt tokens (bytes
  sent beside it);
- inside the engine: the model at tp2 (target cpu over the 2 ranks), `--running` requests
  decoding together; over a window of decode steps, rank 0's time in the exchange per step
  (waiting for the other rank included), the step's wall time, and the exchange's share of
  it; the step that admitted the requests says what their payload cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

TRANSPORTS = ("gloo", "shm")


def _helper():
    """transformers' DistributedHelper over this job's ranks (its own gloo CPU group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    return DistributedHelper(init_device_mesh("cpu", (torch.distributed.get_world_size(),)), cpu_group_timeout=120)


def _states(n: int, prompt: int = 512):
    from transformers.generation.continuous_batching.requests import RequestState

    g = torch.Generator().manual_seed(n)
    return [RequestState(request_id=f"req_{i}", initial_tokens=torch.randint(3, 32000, (prompt,), generator=g).tolist(),
                         max_new_tokens=128, eos_token_id=[2], streaming=True,
                         logit_processor_kwargs={"temperature": 0.0, "top_p": 1.0, "top_k": 0}) for i in range(n)]


def transport_rank(rank: int, world: int, calls: int):
    from metainfer.kernels import shm_collectives as shm
    from metainfer.runtime.exchange import StepExchange

    torch.set_num_threads(1)
    out = {}
    for transport in TRANSPORTS:
        helper = _helper()
        comm = shm.attach(helper.cpu_comm_group.group_name, slot_bytes=256 << 10) if transport == "shm" else None
        ex = StepExchange(helper, comm)
        for _ in range(20):  # warm
            ex.tp_all_reduce_state(0, 0, 0)
        start = time.perf_counter()
        for _ in range(calls):
            ex.tp_all_reduce_state(0, 0, 0)
        row = {"status_us": (time.perf_counter() - start) / calls * 1e6}
        for n in (1, 8, 64):
            payload = (_states(n), ["req_x"]) if rank == 0 else None
            ex.tp_all_reduce_state(n, 0, 0)
            before = ex.stats.snapshot()
            reps = max(5, calls // (4 * n))
            for _ in range(reps):
                got = ex.tp_broadcast_object_from_rank_0(payload)
            d = ex.stats.since(before)
            assert len(got[0]) == n and got[1] == ["req_x"]
            row[f"payload{n}_us"] = d["payload_s"] / reps * 1e6
            row[f"payload{n}_bytes"] = d["payload_bytes"] / reps if rank == 0 else None
        ex.close()
        helper.destroy_cpu_comm_group()
        out[transport] = row
    return out


def engine_rank(rank: int, world: int, model_name: str, running: list[int], window: int, breakdown: int = 0,
                target: str = "cpu"):
    """Rank 0: one row per (transport, running) with the window's status calls (first, last) and
    times; every rank: its status calls' seconds, call i of one rank being call i of the other."""
    import collections

    from transformers import ContinuousBatchingConfig, GenerationConfig

    import metainfer
    from metainfer import servebench

    torch.set_num_threads(1)  # a core per rank, as `metainfer serve --ranks 2` runs them here
    model = servebench.build_model(model_name)
    opt = metainfer.optimize(model, target, tensor_parallel=world, serve_compile="always")
    gen = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=-1, pad_token_id=0)
    rows, calls = [], {}
    for transport in TRANSPORTS:
        cfg = ContinuousBatchingConfig(num_blocks=2 * max(running) * 12, page_size=16, max_batch_tokens=2048)
        manager = opt.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg, exchange=transport)
        ex = manager.exchange
        ex.recent = collections.deque(maxlen=1 << 20)
        manager.start()
        if rank == 0:
            for measured in (False, True):  # a first pass compiles and warms every shape the second meets
                for n in running:
                    row = _window(manager, ex, n, window if measured else 4, f"{transport}-{measured}-{n}")
                    if measured:
                        rows.append({"model": model_name, "transport": transport, "running": n, **row})
            if breakdown:
                rows[-1]["breakdown"] = _profiled_window(manager, ex, breakdown, window, f"{transport}-profiled")
            manager.stop()
        else:
            while manager.is_running():
                time.sleep(0.05)
            manager.stop()
        calls[transport] = list(ex.recent)
    return rows, calls


def _window(manager, ex, n: int, window: int, tag: str) -> dict:
    ids = [manager.add_request(list(range(3 + i % 7, 19 + i % 7)), max_new_tokens=window + 64, request_id=f"{tag}-{i}")
           for i in range(n)]
    before = ex.stats.snapshot()
    _wait_steps(manager, 2)  # the prefill step, then the first decode step
    admitted = ex.stats.since(before)
    first, steps0, t0 = ex.stats.status_calls, manager.steps.steps, time.perf_counter()
    _wait_steps(manager, window)
    wall, steps, last = time.perf_counter() - t0, manager.steps.steps - steps0, ex.stats.status_calls
    for rid in ids:
        manager.cancel_request(rid)
    _wait_idle(manager)
    return {"calls": (first, last), "wall_s": wall, "steps": steps, "admit_payload_us": admitted["payload_s"] * 1e6,
            "admit_payload_bytes": admitted["payload_bytes"]}


def _profiled_window(manager, ex, n: int, window: int, tag: str) -> dict:
    """Where rank 0's decode steps go with `n` requests running: torch's profiler on the
    engine's thread (started and stopped by its own exchange calls) over `window` steps, each
    step's forward timed; per step: the forward, of it the collectives (the self time of gloo /
    c10d / shm collective ops and their waits), the per-step exchange, and the rest of the loop
    (scheduling, sampling, output delivery)."""
    from torch.profiler import ProfilerActivity, profile

    from metainfer.runtime import serving

    forward = []
    step_call = serving._Step.__call__

    def timed(self, kwargs):  # the forward runs inside the step's context
        import contextlib

        @contextlib.contextmanager
        def around():
            start = time.perf_counter()
            with step_call(self, kwargs):
                yield
            forward.append(time.perf_counter() - start)
        return around()

    ids = [manager.add_request(list(range(3 + i % 7, 19 + i % 7)), max_new_tokens=window + 64, request_id=f"{tag}-{i}")
           for i in range(n)]
    _wait_steps(manager, 3)
    status, state = ex.tp_all_reduce_state, {"calls": 0}
    prof = profile(activities=[ProfilerActivity.CPU])

    def profiled(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] == 1:
            prof.__enter__()
            state["t0"], state["before"] = time.perf_counter(), ex.stats.snapshot()
            serving._Step.__call__ = timed
        elif state["calls"] == window + 1:
            serving._Step.__call__ = step_call
            state["wall"], state["spent"] = time.perf_counter() - state["t0"], ex.stats.since(state["before"])
            prof.__exit__(None, None, None)
        return status(*args, **kwargs)

    ex.tp_all_reduce_state = profiled
    while state["calls"] <= window:
        if not manager.is_running():
            raise RuntimeError("the engine stopped while profiled")
        time.sleep(0.01)
    ex.tp_all_reduce_state = status
    for rid in ids:
        manager.cancel_request(rid)
    _wait_idle(manager)
    collective = sum(e.self_cpu_time_total for e in prof.events()
                     if any(k in e.name for k in ("c10d", "gloo", "shm_all", "shm_reduce", "wait_tensor"))) / 1e6
    steps, wall = window, state["wall"]
    exchange_s = state["spent"]["status_s"] + state["spent"]["payload_s"]
    fwd = sum(forward[:steps])
    return {"running": n, "step_ms": wall / steps * 1e3, "forward_ms": fwd / steps * 1e3,
            "collectives_ms": collective / steps * 1e3, "compute_ms": (fwd - collective) / steps * 1e3,
            "exchange_ms": exchange_s / steps * 1e3, "rest_ms": (wall - fwd - exchange_s) / steps * 1e3}


def _wait_steps(manager, k: int):
    start = manager.steps.steps
    deadline = time.monotonic() + 600
    while manager.steps.steps < start + k:
        if time.monotonic() > deadline:
            raise TimeoutError("the engine made no progress")
        time.sleep(0.001)


def _wait_idle(manager):
    deadline = time.monotonic() + 600
    while manager.kv_blocks()[0] > 0:
        if time.monotonic() > deadline:
            raise TimeoutError("requests did not end")
        time.sleep(0.01)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["hf-llama-tiny", "hf-llama-512x4"])
    ap.add_argument("--running", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--window", type=int, default=40, help="decode steps measured per row")
    ap.add_argument("--calls", type=int, default=2000, help="status exchanges timed in the transport part")
    ap.add_argument("--breakdown", type=int, default=0, metavar="N",
                    help="also profile a window of decode steps with N requests running (0: no)")
    ap.add_argument("--target", default="cpu", help="the ranks' target (a calibrated TOML declares the "
                    "shared-memory collectives the model's forward may take)")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    from metainfer.parallel import multirank

    import bench_rank_exchange as me  # the ranks find the functions by module name

    result = {"transport": multirank.run(me.transport_rank, 2, args=(a.calls,), timeout_s=600)[0]}
    print("transport alone, 2 ranks (rank 0; us per call):")
    print(f"{'':6s} {'status':>8s} " + " ".join(f"{'payload ' + str(n):>12s}" for n in (1, 8, 64)) + "   bytes (1, 8, 64)")
    for t, row in result["transport"].items():
        print(f"{t:6s} {row['status_us']:8.1f} " + " ".join(f"{row[f'payload{n}_us']:12.1f}" for n in (1, 8, 64))
              + "   " + ", ".join(f"{row[f'payload{n}_bytes']:.0f}" for n in (1, 8, 64)))
    result["engine"] = []
    for name in a.models:
        ranks = multirank.run(me.engine_rank, 2, args=(name, a.running, a.window, a.breakdown, a.target),
                              timeout_s=1800)
        rows = ranks[0][0]
        for r in rows:
            first, last = r.pop("calls")
            per_rank = [ranks[k][1][r["transport"]][first:last] for k in range(len(ranks))]
            # per call: the rank that came last waited least; what it spent is the exchange's own cost
            later = [min(c) for c in zip(*per_rank)]
            r.update(step_ms=r["wall_s"] / r["steps"] * 1e3, rank0_us=sum(per_rank[0]) / len(later) * 1e6,
                     exchange_us=sum(later) / len(later) * 1e6, share=sum(later) / r["wall_s"])
        result["engine"] += rows
    print("\ninside the engine, tp2 on 2 CPU ranks: per decode step, rank 0's time in the status exchange (waiting "
          "for rank 1 included)\nand the exchange's own cost (per step, the rank that arrived last), its share of the step:")
    print(f"{'model':16s} {'transport':9s} {'running':>7s} {'step ms':>8s} {'rank0 us':>9s} {'exch us':>8s} {'share':>6s} "
          f"{'admit payload us':>16s} {'bytes':>8s}")
    for r in result["engine"]:
        print(f"{r['model']:16s} {r['transport']:9s} {r['running']:7d} {r['step_ms']:8.2f} {r['rank0_us']:9.1f} "
              f"{r['exchange_us']:8.1f} {r['share']:6.2%} {r['admit_payload_us']:16.1f} {r['admit_payload_bytes']:8d}")
    broken = [r for r in result["engine"] if "breakdown" in r]
    if broken:
        print("\nwhere rank 0's decode step goes (torch's profiler on the engine's thread; the collectives are the "
              "self time of the collective ops and their waits):")
        print(f"{'model':16s} {'transport':9s} {'running':>7s} {'step ms':>8s} {'forward':>8s} {'compute':>8s} "
              f"{'collect.':>8s} {'exchange':>8s} {'rest':>8s}")
        for r in broken:
            b = r["breakdown"]
            print(f"{r['model']:16s} {r['transport']:9s} {b['running']:7d} {b['step_ms']:8.2f} {b['forward_ms']:8.2f} "
                  f"{b['compute_ms']:8.2f} {b['collectives_ms']:8.2f} {b['exchange_ms']:8.2f} {b['rest_ms']:8.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
