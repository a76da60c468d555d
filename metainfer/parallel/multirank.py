"""Run a function on N ranks of a gloo process group on this machine, for tests (this
project's and users' own): every rank is a fresh process, all traffic stays on 127.0.0.1,
and nothing hangs.

    results = multirank.run(fn, world_size=4, args=(...,), timeout_s=120)
    # fn(rank, world_size, *args) runs on each rank with the process group started;
    # results[r] is what rank r returned

- The rendezvous store is hosted by the calling process on a port the OS picks, so parallel
  runs never collide; gloo is pinned to the loopback interface.
- Ranks are forked from a server process (multiprocessing's `forkserver`) that imported torch,
  Dynamo, metainfer and transformers once, so a rank starts in milliseconds instead of
  importing them (seconds each, more on a loaded machine). Each rank gets the caller's
  environment as it is at the call; what those modules read from the environment at import
  was read when the server started (the first run in the process).
  METAINFER_RANK_START=spawn starts every rank as a fresh interpreter instead.
- Two clocks. Starting the ranks (spawning, importing torch, the rendezvous) has its own
  budget, `start_timeout_s`: on a loaded machine that alone can take tens of seconds. The
  run's `timeout_s` is counted from the moment every rank has its process group, the point
  from which `fn` runs, so it measures `fn` and not the machine's start-up. Both budgets are
  of an unloaded machine's time: while the 1-minute load average is above the number of cores,
  their clocks run slower by cores / load (measured as the run goes), so a machine busy with
  other jobs stretches them instead of failing a run that is only slow; a hang still ends, later.
- A rank that raises writes its error to the store; every other rank's watchdog sees it and
  exits with "rank R failed: ...", and `run` raises `RankFailure` naming the first failed
  rank and its traceback. A rank that is killed (no chance to write) is named by its exit
  status. Past either budget every rank still running is killed and `RankFailure` says which
  (and, for a hang in `fn`, where each one was).
- Collectives time out after `collective_timeout_s` (default: timeout_s) on every rank.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

FAILED_KEY = "metainfer/failed"
ARRIVED_KEY = "metainfer/arrived"  # ranks that have imported and reached the store
GO_KEY = "metainfer/go"  # set by the caller once every rank has arrived
READY_KEY = "metainfer/ready"  # ranks whose process group is up: fn runs from here


class RankFailure(RuntimeError):
    """A rank of a multi-rank run failed, was killed or timed out. `after_start_s` is how long
    after the ranks' rendezvous it happened (None: before the rendezvous completed); `reports`
    says how each rank ended, one line each."""

    def __init__(self, message: str, rank: int | None = None, after_start_s: float | None = None,
                 reports: dict[int, str] | None = None):
        super().__init__(message)
        self.rank = rank
        self.after_start_s = after_start_s
        self.reports = reports or {}


def _watchdog(store, rank: int, poll_s: float, stack_file) -> None:
    """Exit this rank as soon as another rank has reported a failure, leaving where this one
    was (its stacks) for the caller's report."""
    import faulthandler

    while True:
        time.sleep(poll_s)
        try:
            if store.check([FAILED_KEY]):
                who = store.get(FAILED_KEY).decode(errors="replace")
                if not who.startswith(f"{rank}:"):
                    print(f"metainfer: rank {rank} exiting: rank {who.split(':', 1)[0]} failed "
                          f"({who.split(':', 1)[1][:200]})", flush=True)
                    faulthandler.dump_traceback(file=stack_file, all_threads=True)
                    stack_file.flush()
                    os._exit(3)
        except Exception:  # the store is gone: the caller is tearing the run down
            os._exit(4)


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, collective_timeout_s: float,
           start_timeout_s: float, backend: str, results, stacks: str, env: dict) -> None:
    os.environ.clear()  # the caller's environment now, not the forkserver's when it started
    os.environ.update(env)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("METAINFER_GLOO_IFNAME", "lo")  # loopback only
    import faulthandler

    import torch.distributed as dist

    stack_file = open(stacks, "w")  # noqa: SIM115 - open for the process's life: a hang's stacks land here
    try:  # tqdm's first bar (torch.fx's interpreter makes one) creates a multiprocessing lock, a named
        # semaphore in /dev/shm that a rank killed or ended by the watchdog never removes; a rank's
        # bars need only a thread lock
        import tqdm

        tqdm.tqdm.set_lock(threading.RLock())
    except ImportError:
        pass
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=stack_file, all_threads=True)  # a crash (gloo's abort on a mismatch) says where

    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                          timeout=datetime.timedelta(seconds=start_timeout_s))
    watch = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)  # its own connection
    threading.Thread(target=_watchdog, args=(watch, rank, 0.2, stack_file), daemon=True).start()
    try:
        # every rank waits for the slowest to import, so the process group's connections
        # (bounded by the collective timeout) are made by ranks that are all there
        store.add(ARRIVED_KEY, 1)
        store.wait([GO_KEY])
        if backend == "nccl":  # NCCL: one GPU a rank (two ranks on one device is an NCCL error)
            import torch

            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        store.add(READY_KEY, 1)
        out = fn(rank, world_size, *args)
        results.send((rank, "ok", pickle.dumps(out)))
        results.close()
    except BaseException as e:  # noqa: BLE001 - everything a rank raises is reported
        tb = traceback.format_exc()
        try:
            store.compare_set(FAILED_KEY, "", f"{rank}:{type(e).__name__}: {e}")
        except Exception:
            pass
        results.send((rank, "error", tb))  # the traceback reaches the caller before this process ends
        results.close()
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    os._exit(0)


# What a rank needs before it runs fn, imported once into the forkserver (metainfer first: it
# chooses Triton's mode before torch._dynamo imports triton.language).
_PRELOAD = ("metainfer", "torch", "torch._dynamo", "torch.distributed", "metainfer.api", "metainfer.parallel.distributed",
            "metainfer.testing", "transformers")


def _context():
    """Ranks fork from a server process that has imported torch, Dynamo, metainfer and
    transformers once (`forkserver`), instead of each importing them (seconds per rank, and
    tens of seconds on a loaded machine). METAINFER_RANK_START=spawn starts fresh processes."""
    import importlib.util

    method = os.environ.get("METAINFER_RANK_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([m for m in _PRELOAD if importlib.util.find_spec(m.split(".")[0])])
    return ctx


def run(fn: Callable, world_size: int, *, args: tuple = (), timeout_s: float = 120.0,
        collective_timeout_s: float | None = None, start_timeout_s: float = 300.0,
        backend: str = "gloo") -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` ranks (gloo; "nccl" for ranks on CUDA tensors:
    gloo's CUDA support is broadcast and all_reduce only); returns each rank's result.
    `fn` must be importable (a module-level function) and its result picklable. The ranks
    have `start_timeout_s` to start and meet, then `timeout_s` for `fn`."""
    import torch.distributed as dist

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=start_timeout_s + timeout_s))
    # a pipe per rank for its result (a Queue's locks are named semaphores in /dev/shm, which a
    # run whose ranks are killed left behind)
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    results = [reader for reader, _ in pipes]
    stacks = tempfile.mkdtemp(prefix="metainfer-ranks-")
    procs = [ctx.Process(target=_child, args=(r, world_size, store.port, fn, args, collective_timeout_s or timeout_s,
                                              start_timeout_s, backend, pipes[r][1], os.path.join(stacks, f"rank{r}.txt"),
                                              dict(os.environ)),
                         daemon=True)
             for r in range(world_size)]
    spawned = time.monotonic()
    for p in procs:
        p.start()
    for _, writer in pipes:
        writer.close()  # the ranks hold theirs: a rank that dies closes its end, and its reader sees it
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    started: float | None = None  # when every rank had its process group
    clock, last = 0.0, spawned  # budget seconds used (of an unloaded machine's time, _clock_rate)
    go = False
    ok = False
    try:
        while len(out) < world_size:
            _drain(results, out, errors)
            now = time.monotonic()
            clock, last = clock + (now - last) * _clock_rate(), now
            if started is None:
                if not go and store.add(ARRIVED_KEY, 0) == world_size:
                    store.set(GO_KEY, "1")
                    go = True
                if store.add(READY_KEY, 0) == world_size:
                    started, clock = now, 0.0
            since = None if started is None else now - started
            dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if errors or dead:
                time.sleep(1.0)  # let the others report: the first cause is among them
                _drain(results, out, errors)
                dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                failure = _failure(errors, dead, store, since)
                failure.reports = _reports(procs, out, errors, stacks)
                raise _absent_peers(failure)
            if started is None:
                if clock > start_timeout_s:
                    arrived = store.add(ARRIVED_KEY, 0)
                    raise RankFailure(f"the ranks did not start within {start_timeout_s:g} s: {arrived} of {world_size} "
                                      f"reached the rendezvous, {store.add(READY_KEY, 0)} started their process group "
                                      "(an overloaded machine, or a rank stuck while importing)")
            elif clock > timeout_s:
                running = [r for r, p in enumerate(procs) if p.is_alive() and r not in out]
                where = _stacks(procs, running, stacks)
                raise RankFailure(f"timed out after {timeout_s:g} s (counted from the ranks' rendezvous, "
                                  f"{started - spawned:.1f} s after they were spawned; {since:.0f} s of wall time "
                                  f"with the load average counted); rank(s) {running} still "
                                  f"running ({len(out)} of {world_size} finished){where}",
                                  rank=running[0] if running else None, after_start_s=since,
                                  reports=_reports(procs, out, errors, stacks))
            time.sleep(0.05)
        ok = True
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5 if ok else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for reader in results:
            reader.close()
        shutil.rmtree(stacks, ignore_errors=True)
        del store


def _reports(procs, out: dict, errors: dict, folder: str) -> dict[int, str]:
    """How each rank ended, one line each: its error's last line, or its exit and where it was
    (the stacks it left: a crash, or the watchdog's exit), or still running."""
    said = {0: "finished", 1: "failed", 3: "left when the watchdog saw another rank's failure",
            4: "left when the run's store closed"}
    reports = {}
    for r, p in enumerate(procs):
        if r in errors:
            lines = [line for line in errors[r].strip().splitlines() if line.strip()]
            reports[r] = "raised " + (lines[-1].strip() if lines else "?")
            continue
        if r in out:
            reports[r] = "returned"
            continue
        if p.exitcode is None:
            reports[r] = "still running (killed by the harness)"
        elif p.exitcode < 0:
            reports[r] = f"killed by signal {-p.exitcode}"
        else:
            reports[r] = f"exit status {p.exitcode}: {said.get(p.exitcode, '?')}"
        where = _where(folder, r)
        if where:
            reports[r] += f", at {where}"
    return reports


_IN_A_COLLECTIVE = ("distributed_c10d", "_functional_collectives", "wait_tensor", "_c10d")


def _absent_peers(failure: RankFailure) -> RankFailure:
    """A rank whose collective timed out waited for a peer that never came: where the other
    ranks were away from any collective when it happened, name them (the run's cause) instead."""
    if "Timed out" not in str(failure) and "timed out" not in str(failure).lower():
        return failure
    away = sorted(r for r, line in failure.reports.items()
                  if ", at File" in line and not any(k in line for k in _IN_A_COLLECTIVE))
    if not away or failure.rank in away:
        return failure
    where = "; ".join(f"rank {r} was at {failure.reports[r].split(', at ', 1)[1]}" for r in away)
    return RankFailure(f"rank(s) {away} did not join the collective rank {failure.rank} timed out in ({where})\n"
                       f"{failure}", rank=away[0], after_start_s=failure.after_start_s, reports=failure.reports)


def _where(folder: str, rank: int, frames: int = 4) -> str:
    """The innermost `frames` frames of the main thread in the stacks a rank left, innermost first."""
    try:
        with open(os.path.join(folder, f"rank{rank}.txt")) as f:
            text = f.read()
    except OSError:
        return ""
    # faulthandler's dumps: a block per thread; the watchdog's own thread is not where the rank was,
    # nor a thread with no Python frames (a C++ thread that aborted)
    blocks = [b for b in text.split("\n\n") if "File" in b and "_watchdog" not in b]
    if not blocks:
        return ""
    main = next((b for b in reversed(blocks) if b.lstrip().startswith("Current thread")), blocks[-1])
    return " <- ".join([line.strip() for line in main.splitlines() if line.strip().startswith("File")][:frames])


def _clock_rate() -> float:
    """How fast a run's budget clock runs now: 1 on a machine with a core per runnable task,
    cores / load when the 1-minute load average is higher."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    cores = os.cpu_count() or 1
    return 1.0 if load <= cores else cores / load


def _stacks(procs, running: list[int], folder: str) -> str:
    """Where the hung ranks are: each one's Python stacks (faulthandler, on SIGUSR1), the
    innermost frames of its main thread."""
    for r in running:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(1.0)
    out = [f"rank {r} at: {where}" for r in running if (where := _where(folder, r, frames=8))]
    return ("\n" + "\n".join(out)) if out else ""


def _drain(results: list, out: dict, errors: dict) -> None:
    from multiprocessing.connection import wait

    for reader in wait([r for r in results if not r.closed], timeout=0):
        try:
            rank, status, payload = reader.recv()
        except (EOFError, OSError):  # the rank ended without a result (killed): its exit status tells
            reader.close()
            continue
        if status == "ok":
            out[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload


def _failure(errors: dict[int, str], dead: dict[int, int], store, since: float | None) -> RankFailure:
    """The first cause of a failed run: a rank killed by a signal, else the rank that
    reported first in the store, else the lowest rank with an error."""
    killed = sorted(r for r, code in dead.items() if code < 0)
    if killed:
        r = killed[0]
        why = (" (SIGABRT: gloo aborts a rank on a collective mismatch, e.g. sizes that differ between ranks)"
               if -dead[r] == signal.SIGABRT else "")
        return RankFailure(f"rank {r} was killed (signal {-dead[r]}){why}; the other ranks then failed", rank=r,
                           after_start_s=since)
    first = None
    try:
        if store.check([FAILED_KEY]):
            first = int(store.get(FAILED_KEY).decode().split(":", 1)[0])
    except Exception:
        pass
    if first is None or first not in errors:
        first = min(errors) if errors else min(dead)
    if first in errors:
        return RankFailure(f"rank {first} failed:\n{errors[first]}", rank=first, after_start_s=since)
    return RankFailure(f"rank {first} died (exit status {dead[first]}) without reporting an error", rank=first,
                       after_start_s=since)


class SentBytes:
    """Bytes this rank actually sent to each other rank over TCP (gloo's connections) while
    the block ran, read from the kernel's socket counters (`ss -tinp`, iproute2):

        with SentBytes() as sent:
            ...collectives...
        sent.by_rank   # {peer rank: bytes}; collective: every rank must leave the block

    Leaving the block exchanges the ranks' socket addresses (a small all_gather_object),
    which is how a connection's peer is named; that exchange is not counted."""

    def __enter__(self) -> "SentBytes":
        if shutil.which("ss") is None:
            raise RuntimeError("SentBytes needs the `ss` tool (iproute2)")
        self._before = _socket_bytes()
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        after = _socket_bytes()
        if exc[0] is not None:
            return
        delta = {k: v - self._before.get(k, 0) for k, v in after.items()}
        mine = sorted({local for local, _ in after})
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        owner = {addr: r for r, addrs in enumerate(everyone) for addr in addrs}
        self.by_rank: dict[int, int] = {}
        for (local, peer), n in delta.items():
            r = owner.get(peer)
            if r is not None and r != dist.get_rank() and n > 0:
                self.by_rank[r] = self.by_rank.get(r, 0) + n

    def by_link(self, islands) -> dict[str, int]:
        """{"intra": bytes to ranks of this rank's island, "inter": bytes to other islands}."""
        import torch.distributed as dist

        me = dist.get_rank()
        home = next(set(i) for i in islands if me in i)
        out = {"intra": 0, "inter": 0}
        for r, n in self.by_rank.items():
            out["intra" if r in home else "inter"] += n
        return out


def _normal(addr: str) -> str:
    return addr.replace("[::ffff:", "").replace("]", "")


def _socket_bytes() -> dict[tuple[str, str], int]:
    """(local address, peer address) -> bytes acknowledged by the peer, for this process's
    TCP sockets."""
    import re
    import subprocess

    text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30).stdout
    lines = text.splitlines()
    tag = f"pid={os.getpid()},"
    out = {}
    for i, line in enumerate(lines):
        if tag not in line:
            continue
        parts = line.split()
        info = lines[i + 1] if i + 1 < len(lines) else ""
        m = re.search(r"bytes_acked:(\d+)", info)
        out[(_normal(parts[3]), _normal(parts[4]))] = int(m.group(1)) if m else 0
    return out
