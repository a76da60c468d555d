"""`metainfer serve` over several ranks of one host: one endpoint for a model sharded across them.

    metainfer serve --model M --ranks 2           # spawns ranks 1..N-1, this process is rank 0
    torchrun --nproc-per-node 2 -m metainfer serve --model M    # the same, torchrun's processes

Every rank loads the model, shards it (metainfer.optimize inside the job: tensor parallel over
every rank, experts spread where the planner or --ep says) and runs transformers' continuous
batching engine in its tensor-parallel mode; rank 0 also holds the HTTP app, and its engine is
the group's driver: it takes the requests, and each step every rank's engine receives them
through the per-step exchange (metainfer.runtime.exchange: shared memory on one host). The
other ranks only follow until rank 0's engine stops.

Faults (metainfer.parallel.launch watches the job from rank 0): a rank that exits, raises,
stops answering or stalls makes the server fail every request in flight with a 503 naming the
rank, answer 503 on /ready and to new requests, stop listening, kill the other ranks and exit
with status 1, within seconds, not after the collectives' timeout. A rank that cannot start is
an error at start-up naming the rank and why, with the same exit.

METAINFER_SERVE_FAULT injects a fault for tests: "start@R" makes rank R fail while starting;
"raise@R" and "hang@R" make rank R's engine raise, or stop in its loop, at the first loop
iteration after the rank receives SIGUSR2 (so a test chooses the moment).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from metainfer.parallel import distributed, launch

log = logging.getLogger("metainfer.server")

FAULT_ENV = "METAINFER_SERVE_FAULT"
EXIT_FAILED = 1


@dataclass(frozen=True)
class Parallel:
    """How the served model is spread over the job's ranks, and why (for /v1/models, /metrics
    and the log)."""

    ranks: int
    tp: int
    ep: bool
    exchange: str  # the engine's per-step exchange: "shm", "gloo", or "" (one rank)
    why: str

    def as_dict(self) -> dict:
        return {"ranks": self.ranks, "tensor_parallel": self.tp, "expert_parallel": self.ep,
                "exchange": self.exchange, "why": self.why}


def parallel_of(opt, engine, job: launch.Job | None) -> Parallel:
    """Parallel from the report of `opt` (its degrees note) and the engine's exchange."""
    notes = opt.report.notes
    why = next((n for n in notes if n.startswith("degrees:")), "one rank: nothing to spread")
    ep = any(n.startswith("expert parallel over") for n in notes)
    ranks = job.world if job is not None else 1
    exchange = getattr(engine.manager, "exchange", None)
    return Parallel(ranks, ranks, ep, exchange.transport if exchange is not None else "", why)


class Rank0:
    """Rank 0's side of the job: the watch over every rank, its own heartbeat, and what a fault
    does before the HTTP app serves (print, end the job, exit) and while it serves (fail the
    engine's requests; the app then stops the server, and `finish` ends the job)."""

    def __init__(self, job: launch.Job, rank_timeout_s: float, step_timeout_s: float):
        self.job = job
        self.engine = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fault: launch.Fault | None = None
        self._lock = threading.Lock()
        self.watch = launch.Watch(job, self._on_fault, rank_timeout_s=rank_timeout_s, step_timeout_s=step_timeout_s)
        self.heartbeat = None
        self.progress: Progress | None = None
        self.watch.start()

    def beat(self, progress, check) -> None:
        self.heartbeat = launch.Heartbeat(self.job, progress, check, self.watch.rank_timeout_s,
                                          on_lost_driver=lambda why: self._on_fault(launch.Fault(0, "lost", why)))
        self.heartbeat.start()

    def serving(self, engine, loop) -> None:
        """From now on a fault fails `engine` (on `loop`), whose app then stops serving."""
        if self.progress is not None:
            self.progress.manager = engine.manager
        inject(engine.manager, 0)
        with self._lock:
            self.engine, self.loop = engine, loop
            fault = self.fault
        if fault is not None:
            loop.call_soon_threadsafe(engine.fail, str(fault))

    def _on_fault(self, fault: launch.Fault) -> None:
        with self._lock:
            if self.fault is not None:
                return
            self.fault = fault
            loop, engine = self.loop, self.engine
        if loop is None:
            end_job(self.job, str(fault), started=False)
        log.error("failing every request and shutting down: %s", fault)
        try:
            loop.call_soon_threadsafe(engine.fail, str(fault))
        except RuntimeError:  # the loop has closed: the server stopped; finish() ends the job
            pass

    def expect_exit(self) -> None:
        self.watch.expect_exit()

    def finish(self, failed=None) -> int:
        """After the HTTP server returned: the exit status, the other ranks gone. After a fault
        (or `failed`, the engine's own) it does not return: the engine's loop may be stuck in a
        collective with a dead rank, so the process exits at once."""
        if self.fault is not None or failed is not None:
            end_job(self.job, str(self.fault) if self.fault is not None else failed.message, started=True)
        statuses = self.job.stop_children(grace_s=30)
        self.watch.stop()
        bad = {r: launch.exit_status(c) for r, c in statuses.items() if c != 0}
        if bad:
            log.error("ranks that did not end cleanly: %s", bad)
            return EXIT_FAILED
        return 0


def end_job(job: launch.Job, why: str, started: bool) -> None:
    """Rank 0 gives up: say why, kill the other ranks, exit with EXIT_FAILED without waiting for
    threads that may be stuck in a collective."""
    what = "the server failed" if started else "the server could not start"
    print(f"metainfer: error: {what}: {why}", file=sys.stderr, flush=True)
    statuses = job.stop_children(grace_s=0)
    log.error("%s: %s; ranks ended: %s", what, why, {r: launch.exit_status(c) for r, c in statuses.items()})
    logging.shutdown()
    sys.stdout.flush()
    os._exit(EXIT_FAILED)


# ---- every rank ------------------------------------------------------------------------------

def serve(*, world: int, argv: list[str], load, target, lowering: str | None, expert_parallel: bool | None,
          cb_config, run_options: dict, rank_timeout_s: float = launch.RANK_TIMEOUT_S,
          step_timeout_s: float = launch.STEP_TIMEOUT_S) -> int:
    """This process's part of `metainfer serve` over `world` ranks: rank 0 (spawning the others
    with `argv` unless torchrun started them) serves HTTP; the others follow. `load(device)`
    returns (model, tokenizer, served name) on that device. Returns the exit status."""
    import metainfer
    from metainfer.server import app
    from metainfer.server.protocol import ModelInfo

    in_job = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    job = launch.Job.from_environment() if in_job else launch.Job.spawn(world, argv)
    if job.world != world:
        raise ValueError(f"--ranks {world}, but the job has {job.world} ranks (WORLD_SIZE)")
    for handler in logging.getLogger().handlers:  # which rank said it
        handler.setFormatter(logging.Formatter(f"%(asctime)s rank{job.rank} %(name)s %(levelname)s %(message)s"))
    rank0 = Rank0(job, rank_timeout_s, step_timeout_s) if job.rank == 0 else None
    progress = Progress()
    try:
        start_fault(job.rank)
        cuda = target.device.kind == "cuda"
        # transformers asks for it before the process group of a tensor-parallel engine (its CUDA
        # graphs with NCCL); set here, it also spares every rank its warning
        os.environ.setdefault("NCCL_GRAPH_MIXING_SUPPORT", "0")
        applied = distributed.apply_collective_settings(target)
        if applied and job.rank == 0:
            log.info("collective settings from target %s: %s", target.name, ", ".join(applied))
        job.join("nccl" if cuda else "gloo")
        if rank0 is not None:
            rank0.beat(progress, progress.check)
        else:
            launch.Heartbeat(job, progress, progress.check, rank_timeout_s).start()
        model, tokenizer, name = load(f"cuda:{job.local_rank}" if cuda else "cpu")
        opt = metainfer.optimize(model, target, lowering=lowering, serve_compile="always", tensor_parallel=job.world,
                                 expert_parallel=expert_parallel)
    except BaseException as e:  # noqa: BLE001 - every start-up failure is named with its rank
        if rank0 is not None:
            traceback.print_exc()
            end_job(job, f"rank 0: {type(e).__name__}: {e}", started=False)
        report_start_failure(job, e)
        return EXIT_FAILED
    if rank0 is None:
        try:
            return follow(opt, cb_config, job, progress, run_options.get("max_running"),
                          run_options.get("speculation"))
        except BaseException as e:  # noqa: BLE001
            report_start_failure(job, e)
            return EXIT_FAILED
    rank0.progress = progress
    info = ModelInfo(name=name, vocab_size=model.config.vocab_size,
                     max_positions=getattr(model.config, "max_position_embeddings", None), tokenizer=tokenizer)
    try:
        return app.run(opt, info, cb_config=cb_config, rank0=rank0, **run_options)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the engine or the app could not be built, or uvicorn
        # could not start (it exits: a port in use, a failed start-up)
        traceback.print_exc()
        end_job(job, f"rank 0: {type(e).__name__}: {e}", started=False)
        return EXIT_FAILED  # (end_job does not return)


# ---- a rank other than 0 -------------------------------------------------------------------

def follow(opt, cb_config, job: launch.Job, heartbeat_progress, max_running: int | None = None,
           speculation=None) -> int:
    """Run this rank's engine, following rank 0's, until rank 0 stops it; the exit status."""
    from metainfer.server.engine import engine_manager

    for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 drains the job; this rank follows it
        signal.signal(sig, lambda s, _f: log.info("rank %d: %s: following rank 0's drain", job.rank,
                                                  signal.Signals(s).name))
    manager = engine_manager(opt, cb_config, max_running, speculation)  # the pool rank 0 plans (agreed as the minimum)
    heartbeat_progress.manager = manager
    inject(manager, job.rank)
    manager.start()
    while manager.is_running():
        time.sleep(0.1)
    error = manager.background_thread_status.fatal_error
    if error is not None:
        job.report(f"raised in its engine: {type(error).__name__}: {error}")
        return EXIT_FAILED
    manager.stop()
    return 0


class Progress:
    """A rank's progress for its heartbeat: its engine loop's iterations (the per-step exchange's
    calls), and the engine's fatal error once it has one."""

    def __init__(self):
        self.manager = None

    def __call__(self) -> int:
        exchange = getattr(self.manager, "exchange", None)
        return exchange.stats.status_calls if exchange is not None else 0

    def check(self) -> tuple[str, bool] | None:
        """(the engine's fatal error in words, whether it is a collective's: a failure that may
        only follow another rank's), or None."""
        status = getattr(self.manager, "background_thread_status", None)
        error = None if status is None else status.fatal_error
        if error is None:
            return None
        return f"raised in its engine: {type(error).__name__}: {error}", collective_error(error)


def collective_error(error: BaseException) -> bool:
    """Whether `error` came from a collective (a peer gone, late or out of step): torch's
    distributed errors, gloo's and NCCL's, metainfer's shared-memory path."""
    import torch.distributed as dist

    from metainfer.kernels.shm_collectives import ShmCollectiveError

    text = str(error)
    return isinstance(error, (ShmCollectiveError, dist.DistError)) or any(
        k in text for k in ("gloo", "NCCL", "Connection reset by peer", "Connection closed by peer"))


# ---- injected faults (tests) -----------------------------------------------------------------

def injected(rank: int) -> str | None:
    """The fault METAINFER_SERVE_FAULT asks of this rank ("start", "raise", "hang"), if any."""
    spec = os.environ.get(FAULT_ENV, "")
    kind, _, who = spec.partition("@")
    if not spec:
        return None
    if kind not in ("start", "raise", "hang") or not who.isdigit():
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected start@R, raise@R or hang@R")
    return kind if int(who) == rank else None


def inject(manager, rank: int) -> None:
    """Arm a "raise" or "hang" fault on this rank's engine loop: it fires at the first loop
    iteration after SIGUSR2."""
    kind = injected(rank)
    if kind not in ("raise", "hang") or getattr(manager, "exchange", None) is None:
        return
    armed = threading.Event()
    signal.signal(signal.SIGUSR2, lambda *_: armed.set())
    exchange = manager.exchange
    status = exchange.tp_all_reduce_state

    def faulty(*args, **kwargs):
        if armed.is_set():
            if kind == "raise":
                armed.clear()
                raise RuntimeError(f"injected fault ({FAULT_ENV}={kind}@{rank})")
            while True:  # hang: the loop never comes back
                time.sleep(3600)
        return status(*args, **kwargs)

    exchange.tp_all_reduce_state = faulty
    log.warning("rank %d: %s armed: a %r fault on SIGUSR2", rank, FAULT_ENV, kind)


def start_fault(rank: int) -> None:
    if injected(rank) == "start":
        raise RuntimeError(f"injected fault ({FAULT_ENV}=start@{rank})")


def report_start_failure(job: launch.Job, error: BaseException) -> None:
    traceback.print_exc()
    job.report(f"could not start: {type(error).__name__}: {error}")
