"""Multi-rank faults, injected into a tensor-parallel job (a tiny Hugging Face Llama optimized
with tensor_parallel=2 on gloo ranks on 127.0.0.1, metainfer.parallel.multirank), and how the
job ends: which rank the error names, what every rank reported, how long after the fault the
run was over, and whether anything was left behind (rank processes, zombies, listening ports,
files in /dev/shm).

    python bench/faults.py [--json]

Faults: a rank killed (SIGKILL) while forwards run (with gloo, and with the collectives on the
shared-memory path, kernels/shm_collectives.py); a rank that never joins the job's
collectives (it sleeps before its first one); a rank whose optimize() raises in a pass; two
ranks issuing mismatched collectives (different sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

TIMEOUT_S = 60  # the job's budget after the rendezvous


def _job(rank: int, world: int, target="pcie8", emulate: bool = True):
    """The optimized TP model on this rank and its input (pcie8 emulated on the ranks by default)."""
    import metainfer
    from metainfer.testing import tiny_hf_model

    model = tiny_hf_model("Llama", "sdpa", layers=2)
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    opt = metainfer.optimize(model, target, example_inputs=(ids,), emulate=emulate, lowering="aot_eager",
                             tensor_parallel=world)
    return opt, ids


def _mark(folder: str, rank: int) -> None:
    with open(os.path.join(folder, "fault_at"), "w") as f:
        f.write(f"{time.time()} {rank}")


def _forwards_until_rank1_is_killed(opt, ids, rank, folder):
    if rank == 1:  # killed from a timer while this rank's forwards run (and its peer waits on them)
        def kill():
            _mark(folder, rank)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.3, kill).start()
    with torch.no_grad():
        for _ in range(100_000):
            opt(ids)


def killed_mid_forward(rank, world, folder):
    _forwards_until_rank1_is_killed(*_job(rank, world), rank, folder)


def never_joins(rank, world, folder):
    if rank == 1:
        _mark(folder, rank)
        time.sleep(3600)  # never reaches the job's first collective
    opt, ids = _job(rank, world)
    with torch.no_grad():
        opt(ids)


def raising_pass(folder):
    """A pass that raises on rank 1 (what a bug in one rank's compile looks like)."""
    from metainfer.passes import Pass, PassResult

    class RaisesOnRank1(Pass):
        name = "raises_on_rank_1"

        def run(self, gm, ctx):
            if dist.get_rank() == 1:
                _mark(folder, 1)
                raise RuntimeError("deliberate failure in a pass on rank 1")
            return PassResult(modified=False)

    return RaisesOnRank1()


def raises_in_a_pass(rank, world, folder):
    import metainfer
    from metainfer.testing import tiny_hf_model

    model = tiny_hf_model("Llama", "sdpa", layers=2)
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    from metainfer.passes.pipeline import default_pipeline
    from metainfer.hardware import targets

    passes = list(default_pipeline(targets.get("pcie8"))) + [raising_pass(folder)]
    opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, lowering="aot_eager",
                             tensor_parallel=world, passes=passes)
    with torch.no_grad():
        opt(ids)


def mismatched_collective(rank, world, folder):
    dist.barrier()
    if rank == 1:
        _mark(folder, rank)
    x = torch.ones(4 if rank == 0 else 8)
    dist.all_reduce(x)  # sizes differ between the ranks
    time.sleep(3600)


def killed_mid_shm_forward(rank, world, folder):
    """As killed_mid_forward, on a CPU target whose collectives take the shared-memory path."""
    import dataclasses

    from metainfer.hardware import targets
    from metainfer.hardware.targets import SHM_KINDS, LinkSpec

    base = targets.get("pcie8")
    t = dataclasses.replace(base, name="cpu2+shm", num_devices=world,
                            device=dataclasses.replace(base.device, kind="cpu"),
                            topology=dataclasses.replace(base.topology, islands=(tuple(range(world)),), inter_island=None),
                            collective_backend="gloo",
                            shm_links={k: LinkSpec(bandwidth=10e9, latency_s=5e-6) for k in SHM_KINDS})
    opt, ids = _job(rank, world, t, emulate=False)
    assert opt.report.matches("select_collectives") > 0, "the job should run its collectives through shared memory"
    _forwards_until_rank1_is_killed(opt, ids, rank, folder)


FAULTS = {
    "rank 1 killed mid-forward": killed_mid_forward,
    "rank 1 killed mid-forward, collectives through shared memory": killed_mid_shm_forward,
    "rank 1 never joins the job's collectives": never_joins,
    "rank 1 raises in a pass": raises_in_a_pass,
    "mismatched collective (all_reduce of 4 vs 8 elements)": mismatched_collective,
}


def _leftovers(before_shm: set, rank_pids: set) -> list[str]:
    import gc

    import psutil

    gc.collect()  # the run's queue and its semaphores go when nothing refers to them
    me = psutil.Process()
    found = []
    alive = [pid for pid in rank_pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    if alive:
        found.append(f"rank processes alive: {alive}")
    zombies = [p.pid for p in me.children(recursive=True) if p.status() == psutil.STATUS_ZOMBIE]
    if zombies:
        found.append(f"zombies: {zombies}")
    listening = [c.laddr.port for c in me.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    if listening:
        found.append(f"ports still listening: {listening}")
    shm = set(os.listdir("/dev/shm")) - before_shm if os.path.isdir("/dev/shm") else set()
    if shm:  # what another job on the machine (a test beside this one) holds is not this run's
        ours = {me.pid, *rank_pids, *(p.pid for p in me.children(recursive=True))}
        own_segments = {n for n in shm if any(n.startswith(f"metainfer-{pid}-") for pid in ours)}
        shm -= _shm_held_by_others(ours) - own_segments
    if shm:
        found.append(f"new files in /dev/shm: {sorted(shm)[:5]}")
    return found


def _shm_held_by_others(ours: set[int]) -> set[str]:
    """Names in /dev/shm that a live process outside `ours` maps or holds open, that process not
    an orphan (a helper a killed rank left behind is reparented to init: its files stay ours)."""
    held: set[str] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in ours:
            continue
        try:
            with open(os.path.join(entry.path, "stat")) as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == 1:  # parent pid: an orphan
                    continue
            with open(os.path.join(entry.path, "maps")) as f:
                held.update(line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line)
            fds = list(os.scandir(os.path.join(entry.path, "fd")))
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                target = os.readlink(fd.path)
            except OSError:  # closed since
                continue
            if target.startswith("/dev/shm/"):
                held.add(target[len("/dev/shm/"):].split()[0])
    return held


def _forkserver_pid() -> int | None:
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def inject(name: str, world: int = 2, timeout_s: float = TIMEOUT_S) -> dict:
    import psutil

    from metainfer.parallel import multirank

    fn = FAULTS[name]
    before_shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    rank_pids: set[int] = set()
    stop = threading.Event()

    def watch():  # the rank processes: the forkserver's children while the run lasts
        while not stop.is_set():
            server = _forkserver_pid()
            if server is not None and psutil.pid_exists(server):
                rank_pids.update(p.pid for p in psutil.Process(server).children())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.time()
        try:
            multirank.run(fn, world, args=(folder,), timeout_s=timeout_s, collective_timeout_s=timeout_s / 2)
            raised, message, rank, reports, after = None, "the run finished without an error", None, {}, None
        except multirank.RankFailure as e:
            raised, message, rank, reports, after = "RankFailure", str(e), e.rank, e.reports, e.after_start_s
        ended = time.time()
        try:
            with open(os.path.join(folder, "fault_at")) as f:
                fault_at = float(f.read().split()[0])
        except OSError:
            fault_at = None
    stop.set()
    watcher.join()
    return {"fault": name, "raised": raised, "named_rank": rank, "first_line": message.splitlines()[0][:300],
            "reports": {str(r): v[:300] for r, v in reports.items()},
            "seconds_after_fault": None if fault_at is None else round(ended - fault_at, 1),
            "seconds_after_start": None if after is None else round(after, 1), "wall_s": round(ended - t0, 1),
            "left_behind": _leftovers(before_shm, rank_pids)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="the job's budget; collectives time out at half")
    ap.add_argument("--fault", choices=sorted(FAULTS), action="append", help="only these (default: all)")
    a = ap.parse_args(argv)
    rows = [inject(name, timeout_s=a.timeout) for name in (a.fault or FAULTS)]
    print("| fault | the run's error | what each rank reported | s after the fault | left behind |")
    print("|---|---|---|---|---|")
    for r in rows:
        reports = "; ".join(f"rank {k}: {v}" for k, v in sorted(r["reports"].items()))
        print(f"| {r['fault']} | {r['first_line'][:120]} | {reports} | {r['seconds_after_fault']} | "
              f"{', '.join(r['left_behind']) or 'nothing'} |")
    if a.json:
        print(json.dumps({"faults": rows}))
    # a mismatch has no culprit: either rank may be the one gloo aborts
    ok = all(r["raised"] and (r["named_rank"] == 1 or r["fault"].startswith("mismatched")) and not r["left_behind"]
             for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
