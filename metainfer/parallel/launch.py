"""The ranks of one long-running job on this host (`metainfer serve --ranks N`): started with
torchrun's environment, watched while they run, ended together.

    job = launch.Job.spawn(world, argv)   # in the first process: ranks 1..N-1 as `python -m metainfer argv`
    job = launch.Job.from_environment()   # in a rank process (spawned above, or under torchrun)
    job.join(backend)                     # the default process group (gloo on 127.0.0.1, or nccl)
    Heartbeat(job, progress).start()      # every rank: alive, and how far its work got
    Watch(job, on_fault).start()          # rank 0: a rank that exits, raises, stops beating or stalls

- Spawned ranks get torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  MASTER_ADDR=127.0.0.1, MASTER_PORT: the first process's store, on a port the OS picked), the
  CPU's cores split between them (OMP_NUM_THREADS, unless set), and die with the first process
  (Linux's parent-death signal): a killed server leaves no rank behind. Under torchrun nothing
  is spawned: torchrun's agent owns the processes and ends the job when one fails.
- Every rank beats on its own connection to the job's store (a wait on the main connection
  cannot delay it) with a progress counter: the engine loop's iterations and whether it is
  compiling. A rank that raises says so in the store before it exits.
- The watch (rank 0) names the first fault: a rank that exited (its exit status; spawned ranks
  only), that reported an error, whose beat stopped for `rank_timeout_s` (a stopped or wedged
  process), whose progress stood still for `step_timeout_s` while not compiling (a loop stuck
  in a step), or that never started within `start_timeout_s`. Time is its own clock: no rank's
  clock is compared with another's.
- Ranks other than 0 watch rank 0's beat in turn and exit when it stops (under torchrun, where
  no parent-death signal links them).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

log = logging.getLogger("metainfer.ranks")

# keys of this attempt of the job (torchrun restarts a failed job in the same store)
PREFIX = f"metainfer/job/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
BEAT_S = 0.25
RANK_TIMEOUT_S = 3.0  # a rank whose beat stops this long is lost (the issue asks for faults within 5 s)
STEP_TIMEOUT_S = 120.0  # an engine loop that does not advance this long, while not compiling
START_TIMEOUT_S = 900.0  # a rank has this long to load and build its model before its first beat
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Fault:
    """What went wrong with which rank, in words for a client and a log."""

    rank: int
    kind: str  # "exited", "raised", "lost", "stalled", "never started"
    detail: str

    def __str__(self) -> str:
        return f"rank {self.rank} {self.detail}"


class Job:
    """This process's place in the job: rank, world, and the store every rank reaches."""

    def __init__(self, rank: int, world: int, local_rank: int, addr: str, port: int, store=None, children=()):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.addr, self.port = addr, port
        self.store = store  # the master store in a process that spawned the job
        self.children: list[subprocess.Popen] = list(children)  # ranks 1..N-1 where this process spawned them

    @property
    def spawned(self) -> bool:
        return bool(self.children)

    @classmethod
    def from_environment(cls) -> "Job":
        """The job torchrun (or Job.spawn) described in this process's environment."""
        env = os.environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise RuntimeError(f"not a rank of a job: {', '.join(missing)} unset (start it with torchrun, or "
                               "`metainfer serve --ranks N`)")
        rank = int(env["RANK"])
        if env.get("METAINFER_PARENT_PID"):
            _die_with_parent(int(env["METAINFER_PARENT_PID"]))
        return cls(rank, int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", rank)), env["MASTER_ADDR"],
                   int(env["MASTER_PORT"]))

    @classmethod
    def spawn(cls, world: int, argv: list[str], start_timeout_s: float = START_TIMEOUT_S) -> "Job":
        """This process as rank 0 of `world` ranks on this host, and ranks 1..world-1 started as
        `python -m metainfer *argv` with torchrun's environment."""
        if world < 2:
            raise ValueError(f"a job of {world} rank(s) needs no launcher")
        store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=start_timeout_s))
        threads = str(max(1, (os.cpu_count() or 1) // world))
        common = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(store.port), "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        os.environ.update(common, RANK="0", LOCAL_RANK="0")
        os.environ.setdefault("OMP_NUM_THREADS", threads)
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # this process imported torch already
        children = []
        for r in range(1, world):
            env = {**os.environ, **common, "RANK": str(r), "LOCAL_RANK": str(r), "METAINFER_PARENT_PID": str(os.getpid()),
                   "PYTHONUNBUFFERED": "1"}
            # -P: not the working directory first on sys.path (a checkout's kernels/ would shadow
            # the `kernels` package transformers imports)
            children.append(subprocess.Popen([sys.executable, "-P", "-m", "metainfer", *argv], env=env))
        return cls(0, world, 0, "127.0.0.1", store.port, store, children)

    def connect(self, timeout_s: float = START_TIMEOUT_S):
        """A connection of its own to the job's store."""
        return dist.TCPStore(self.addr, self.port, None, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))

    def join(self, backend: str, timeout_s: float = 300.0) -> None:
        """Start the default process group of the job (its collectives time out after `timeout_s`)."""
        if backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = self.store if self.store is not None else self.connect()
        dist.init_process_group(backend, store=dist.PrefixStore("pg/", store), rank=self.rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        if backend == "nccl":
            import torch

            torch.cuda.set_device(self.local_rank)

    def report(self, text: str, store=None) -> None:
        """Tell the watch this rank failed (before it exits)."""
        try:
            s = store or self.store or self.connect(10)
            order = s.add(f"{PREFIX}errors", 1)  # which report came first: a rank's fault makes others fail after it
            s.set(f"{PREFIX}error/{self.rank}", f"{order}:{text[:4000]}")
        except Exception:  # noqa: BLE001 - the store is gone: the exit status will speak
            log.exception("rank %d could not report its failure", self.rank)

    def stop_children(self, grace_s: float = 0.0) -> dict[int, int | None]:
        """Wait up to `grace_s` for the spawned ranks to exit, then kill the rest; their exit statuses."""
        deadline = time.monotonic() + grace_s
        for p in self.children:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.children:
            if p.poll() is None:
                p.kill()
        return {r: p.wait() for r, p in enumerate(self.children, start=1)}


def _die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when the process that spawned it ends."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it ended before the signal was armed
        os._exit(1)


def exit_status(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals.__members__.values() else str(-code)
        return f"killed by {name}" + (" (by someone, or the kernel's out-of-memory killer)" if -code == signal.SIGKILL else "")
    return f"exit status {code}"


class Heartbeat(threading.Thread):
    """This rank's beat in the store every BEAT_S, with `progress()` (an int: work done so far)
    and whether it is compiling; `check()` (None, a failure in words, or (failure, consequential))
    is reported once: at once, or, for a failure that may follow another rank's (a collective
    whose peer is gone), after `rank_timeout_s` and a beat, so that the watch names the peer
    first. On a rank other than 0, a beat of rank 0 that stops for `rank_timeout_s` ends this
    process (`on_lost_driver`, which rank 0's own heartbeat calls when the store is gone)."""

    def __init__(self, job: Job, progress: Callable[[], int] = lambda: 0, check: Callable[[], str | None] = lambda: None,
                 rank_timeout_s: float = RANK_TIMEOUT_S, on_lost_driver: Callable[[str], None] | None = None):
        super().__init__(name=f"metainfer-heartbeat-{job.rank}", daemon=True)
        self.job, self.progress, self.check = job, progress, check
        self.rank_timeout_s = rank_timeout_s
        self.on_lost_driver = on_lost_driver or _exit_lost_driver
        self._halt = threading.Event()  # (Thread has a _stop of its own)

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        import torch

        store = self.job.connect()
        key = f"{PREFIX}beat/{self.job.rank}"
        driver = Staleness()
        reported, failed_at = False, None
        while not self._halt.wait(BEAT_S):
            try:
                store.set(f"{PREFIX}progress/{self.job.rank}",
                          f"{self.progress()} {int(torch.compiler.is_compiling())}")
                store.add(key, 1)
                found = None if reported else self.check()
                if found is not None:
                    why, consequential = found if isinstance(found, tuple) else (found, False)
                    failed_at = failed_at or time.monotonic()
                    if not consequential or time.monotonic() - failed_at > self.rank_timeout_s + BEAT_S:
                        self.job.report(why, store)
                        reported = True
                if self.job.rank != 0 and driver.stale(store.add(f"{PREFIX}beat/0", 0), self.rank_timeout_s):
                    self.on_lost_driver(f"rank 0's beat stopped for {self.rank_timeout_s:g} s")
                    return
            except Exception as e:  # noqa: BLE001 - the store (held by rank 0 or torchrun) is gone
                if self._halt.is_set():
                    return
                self.on_lost_driver(f"the job's store is gone ({type(e).__name__}: {e})")
                return


def _exit_lost_driver(why: str) -> None:
    log.error("rank %s exiting: %s", os.environ.get("RANK", "?"), why)
    logging.shutdown()
    os._exit(3)


class Staleness:
    """Whether a counter read now and then has stood still for longer than a limit, by this
    process's clock; a counter never seen to move is not stale until it has moved once."""

    def __init__(self):
        self.value: int | None = None
        self.since = time.monotonic()
        self.moved = False

    def stale(self, value: int, limit_s: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if value != self.value:
            self.moved = self.moved or self.value is not None or value > 0
            self.value, self.since = value, now
            return False
        return self.moved and now - self.since > limit_s

    def still_for(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.since


class Watch(threading.Thread):
    """Rank 0's watch over the job (itself included): calls `on_fault(Fault)` once, for the
    first fault it sees (see the module docstring). `expect_exit()` before a normal stop: ranks
    that then exit with status 0 are not faults."""

    def __init__(self, job: Job, on_fault: Callable[[Fault], None], *, rank_timeout_s: float = RANK_TIMEOUT_S,
                 step_timeout_s: float = STEP_TIMEOUT_S, start_timeout_s: float = START_TIMEOUT_S, poll_s: float = 0.1):
        super().__init__(name="metainfer-watch", daemon=True)
        self.job, self.on_fault = job, on_fault
        self.rank_timeout_s, self.step_timeout_s, self.start_timeout_s = rank_timeout_s, step_timeout_s, start_timeout_s
        self.poll_s = poll_s
        self.fault: Fault | None = None
        self._exiting = False
        self._halt = threading.Event()  # (Thread has a _stop of its own)

    def expect_exit(self) -> None:
        self._exiting = True

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        store = self.job.connect()
        started = time.monotonic()
        beats = {r: Staleness() for r in range(self.job.world)}
        loops = {r: Staleness() for r in range(self.job.world)}
        while not self._halt.wait(self.poll_s):
            try:
                fault = self._look(store, started, beats, loops)
            except Exception as e:  # noqa: BLE001 - the store is this process's own (or torchrun's): gone means torn down
                if self._halt.is_set():
                    return
                fault = Fault(self.job.rank, "lost", f"lost the job's store ({type(e).__name__}: {e})")
            if fault is not None:
                self.fault = fault
                log.error("%s", fault)
                self.on_fault(fault)
                return

    def _look(self, store, started: float, beats: dict, loops: dict) -> Fault | None:
        now = time.monotonic()
        for r, p in enumerate(self.job.children, start=1):
            code = p.poll()
            if code is not None and not (self._exiting and code == 0):
                time.sleep(0.2)  # a rank that raised reports before it exits: prefer its own words
                return self._reported(store, only=r) or Fault(r, "exited", f"exited, {exit_status(code)}")
        if store.add(f"{PREFIX}errors", 0) > 0:
            return self._reported(store)
        if self._exiting:  # draining: loops stop and ranks end their beats on purpose
            return None
        stalled = {}
        for r in range(self.job.world):
            beat = beats[r]
            if beat.stale(store.add(f"{PREFIX}beat/{r}", 0), self.rank_timeout_s, now):
                return Fault(r, "lost", f"stopped answering: no heartbeat for {beat.still_for(now):.1f} s "
                                        "(the process is stopped, wedged or gone)")
            if not beat.moved and now - started > self.start_timeout_s:
                return Fault(r, "never started", f"did not start within {self.start_timeout_s:g} s")
            key = f"{PREFIX}progress/{r}"
            if not store.check([key]):
                continue
            count, compiling = (int(v) for v in store.get(key).decode().split())
            loop = loops[r]
            if compiling:
                loop.since = now  # a compile is progress
            elif loop.stale(count, self.step_timeout_s, now):
                stalled[r] = (count, loop.still_for(now))
        # ranks in lockstep stall together: a verdict once every rank's loop stands still (a
        # rank's loop is seen to stop up to a beat after another's), and never while a beat is
        # late (a stopped process stops its loop too: its heartbeat names it)
        late_beat = any(b.still_for(now) > 2 * BEAT_S + self.poll_s for b in beats.values())
        if stalled and (len(stalled) < len(loops) or late_beat):
            return None
        if stalled:
            # one rank behind the others (fewer loop iterations entered) is the one they wait
            # for; all at the same iteration, a rank stuck inside a step holds the others in its
            # collectives, and which one cannot be told from here
            behind = min(count for count, _ in stalled.values())
            late = sorted(k for k, (count, _) in stalled.items() if count == behind)
            r, others = late[0], sorted(k for k in stalled if k not in late)
            seconds = max(s for _, s in stalled.values())
            if len(late) > 1:
                return Fault(r, "stalled", f"stalled with ranks {late[1:]}: their engine loops have not advanced for "
                                           f"{seconds:.0f} s, all at iteration {behind} (a rank stuck inside a step "
                                           "holds the others in its collectives)")
            return Fault(r, "stalled", f"stalled: its engine loop has not advanced for {seconds:.0f} s (at iteration "
                                       f"{behind}" + (f"; ranks {others} wait for it" if others else "") + ")")
        return None

    def _reported(self, store, only: int | None = None) -> Fault | None:
        """The first failure a rank reported (of rank `only`, if given)."""
        reports = []
        for r in range(self.job.world) if only is None else (only,):
            key = f"{PREFIX}error/{r}"
            if store.check([key]):
                order, _, text = store.get(key).decode(errors="replace").partition(":")
                reports.append((int(order), r, text))
        if not reports:
            return None
        _, r, text = min(reports)
        return Fault(r, "raised", text)
