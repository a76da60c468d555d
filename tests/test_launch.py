"""metainfer.parallel.launch: the watch over a job's ranks, driven here through a real store in
this process (beats, progress and reports written by the test as ranks would) and real child
processes, and a one-device CPU target split into ranks of its host."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from metainfer.hardware import targets
from metainfer.parallel import distributed, launch


class _Job(launch.Job):
    """A job of `world` ranks whose store lives in this process; `children` as given."""

    def __init__(self, world: int, children=()):
        store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
        super().__init__(0, world, 0, "127.0.0.1", store.port, store, children)


def _watch(job, **kw):
    faults: list = []
    seen = threading.Event()
    w = launch.Watch(job, lambda f: (faults.append(f), seen.set()), poll_s=0.02, **kw)
    w.start()
    return w, faults, seen


def _beat(job, rank: int, progress: int = 0, compiling: int = 0):
    job.store.add(f"{launch.PREFIX}beat/{rank}", 1)
    job.store.set(f"{launch.PREFIX}progress/{rank}", f"{progress} {compiling}")


def test_a_child_that_exits_is_named_with_its_status():
    child = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    job = _Job(2, [child])
    w, faults, seen = _watch(job)
    assert seen.wait(30)
    assert (faults[0].rank, faults[0].kind) == (1, "exited")
    assert "killed by SIGKILL" in str(faults[0])
    w.stop()


def test_the_first_report_names_the_rank_not_those_that_failed_after_it():
    job = _Job(3)
    for rank, text in ((2, "raised in its engine: RuntimeError: boom"), (0, "raised in its engine: gloo: peer gone")):
        launch.Job(rank, 3, rank, job.addr, job.port, job.store).report(text)
    w, faults, seen = _watch(job)
    assert seen.wait(30)
    assert faults[0].rank == 2 and "boom" in faults[0].detail
    w.stop()


def test_a_rank_whose_beat_stops_is_lost_after_the_timeout():
    job = _Job(2)
    w, faults, seen = _watch(job, rank_timeout_s=0.5)
    start = time.monotonic()
    while time.monotonic() - start < 1.0:  # both beat for a while
        _beat(job, 0), _beat(job, 1)
        time.sleep(0.05)
    assert not faults
    stopped = time.monotonic()
    while not seen.wait(0.05):  # rank 1 stops beating
        _beat(job, 0)
        assert time.monotonic() - stopped < 10
    assert (faults[0].rank, faults[0].kind) == (1, "lost")
    assert time.monotonic() - stopped >= 0.4  # not before its timeout (less a poll and a beat)
    w.stop()


def test_a_stalled_loop_names_the_rank_behind_and_a_compile_is_not_a_stall():
    job = _Job(2)
    w, faults, seen = _watch(job, rank_timeout_s=5, step_timeout_s=0.5)
    for i in range(1, 20):  # loops advancing, then both stand still; rank 0 compiles a while first
        _beat(job, 0, i), _beat(job, 1, i)
        time.sleep(0.02)
    start = time.monotonic()
    while time.monotonic() - start < 1.5:
        _beat(job, 0, 20, compiling=1), _beat(job, 1, 20, compiling=1)
        time.sleep(0.05)
    assert not faults, faults  # compiling for 3x the step timeout
    while not seen.wait(0.05):  # rank 1 stuck one iteration behind rank 0, which waits for it
        _beat(job, 0, 21), _beat(job, 1, 20)
        assert time.monotonic() - start < 10
    assert (faults[0].rank, faults[0].kind) == (1, "stalled") and "ranks [0] wait" in faults[0].detail
    w.stop()


def test_a_rank_that_never_beats_is_named_after_the_start_timeout():
    job = _Job(2)
    w, faults, seen = _watch(job, start_timeout_s=0.3)
    while not seen.wait(0.05):
        _beat(job, 0)
    assert (faults[0].rank, faults[0].kind) == (1, "never started")
    w.stop()


def test_children_that_exit_cleanly_during_a_stop_are_not_faults():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    job = _Job(2, [child])
    w, faults, seen = _watch(job)
    w.expect_exit()
    child.wait()
    assert not seen.wait(0.5)
    w.stop()


def test_staleness_counts_from_the_last_change_only_once_it_moved():
    s = launch.Staleness()
    assert not s.stale(0, 1.0, now=0.0) and not s.stale(0, 1.0, now=5.0)  # never moved: starting
    assert not s.stale(3, 1.0, now=6.0)
    assert not s.stale(3, 1.0, now=6.9) and s.stale(3, 1.0, now=7.1)


def test_injected_faults_are_parsed_or_refused(monkeypatch):
    from metainfer.server import ranks

    monkeypatch.setenv(ranks.FAULT_ENV, "raise@1")
    assert ranks.injected(1) == "raise" and ranks.injected(0) is None
    monkeypatch.setenv(ranks.FAULT_ENV, "explode@1")
    with pytest.raises(ValueError, match="expected start@R"):
        ranks.injected(1)


def test_a_cpu_target_splits_into_ranks_of_its_host():
    cpu = targets.get("cpu")
    two = distributed.host_ranks(cpu, 2)
    assert two.num_devices == 2 and two.topology.islands == ((0, 1),)
    assert two.device.peak_flops["fp32"] == pytest.approx(cpu.device.peak_flops["fp32"] / 2)
    assert two.device.memory_bytes == pytest.approx(cpu.device.memory_bytes / 2)
    assert two.topology.intra_island == cpu.topology.intra_island  # the host's own processes' link
    with pytest.raises(ValueError, match="one-device CPU target"):
        distributed.host_ranks(targets.get("pcie8"), 2)


@pytest.mark.parametrize("consequential", [False, True])
def test_a_failure_that_may_follow_a_peers_is_reported_after_the_peer_could_be_named(consequential):
    """A rank whose engine failed in a collective (its peer gone?) reports only after the watch
    could have seen the peer's beat stop; its own failure, at once."""
    job = _Job(2)
    rank1 = launch.Job(1, 2, 1, job.addr, job.port, job.store)
    lost = []
    hb = launch.Heartbeat(rank1, check=lambda: ("raised in its engine: boom", consequential), rank_timeout_s=0.5,
                          on_lost_driver=lost.append)
    hb.start()
    start = time.monotonic()
    while not job.store.check([f"{launch.PREFIX}error/1"]):
        _beat(job, 0)  # rank 0 alive
        time.sleep(0.02)
        assert time.monotonic() - start < 10
    waited = time.monotonic() - start
    assert (waited >= 0.5) == consequential, waited
    assert job.store.get(f"{launch.PREFIX}error/1").decode().endswith("raised in its engine: boom")
    assert not lost
    hb.stop()


def test_a_followers_heartbeat_ends_it_when_rank_0_stops_beating():
    job = _Job(2)
    rank1 = launch.Job(1, 2, 1, job.addr, job.port, job.store)
    lost = []
    hb = launch.Heartbeat(rank1, rank_timeout_s=0.3, on_lost_driver=lost.append)
    hb.start()
    for _ in range(10):
        _beat(job, 0)
        time.sleep(0.03)
    hb.join(timeout=10)  # rank 0 silent: the heartbeat gives up on it
    assert lost and "rank 0's beat stopped" in lost[0]
