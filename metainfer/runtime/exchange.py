"""The serving engine's per-step exchange between the ranks of a tensor-parallel group.

transformers' continuous batching in tensor-parallel mode (5.25, continuous_batching/
distributed.py) runs the same scheduler on every rank; only the group's rank 0, the driver,
takes requests. Every loop iteration each rank calls its DistributedHelper's

- `tp_all_reduce_state(payload_size, stop_status, pause_requested)`: an all-reduce (MAX) of
  three int64 over a gloo group: how many new requests and cancellations the driver holds, and
  whether any rank asks to stop or pause;
- then, when the driver holds some, `tp_broadcast_object_from_rank_0((new states,
  cancellations))`: `broadcast_object_list`, the RequestState objects pickled whole, two gloo
  broadcasts (size, then bytes).

Over gloo's TCP loopback each call costs hundreds of microseconds on this machine, every step,
which is a large share of a small model's decode step (docs/serving.md has the figures).
`StepExchange` stands in for the engine's helper (every other attribute passes through to it;
the engine is not forked), times both calls (`ExchangeStats`), and, where every rank of the
group is on this host, carries them through a shared-memory segment of metainfer's collectives
(kernels/shm_collectives.py) instead:

- the statuses: one all-gather of three int64 per rank (payload items, stop, pause), each rank
  taking the maxima itself: one barrier;
- the payload: a broadcast from the driver, its first piece (up to FIRST_PIECE bytes, length
  in front) in one barrier, a longer one in a second; what is sent is per-step diffs: each new
  request as its id, prompt ids (packed int32) and the engine's own request config
  (`RequestState.get_request_config`), rebuilt on the other ranks, and the ids cancelled.
  A state that would not rebuild equal (a field the config does not carry) is sent whole.

A rank that dies, gives up or times out inside the exchange raises on the others naming it
(shm_collectives' barrier watches the peers' pids); the engine then hard-stops, and later
calls answer HARD_STOP at once instead of waiting on a group that is gone.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import functools
import pickle
import socket
import struct
import time
from dataclasses import dataclass

import torch

MODES = ("auto", "shm", "gloo")
FIRST_PIECE = 16 << 10  # bytes of a payload broadcast in the same barrier as its length
SLOT_BYTES = 256 << 10  # the exchange segment's slot per rank and parity (payloads are cut in pieces)
_HARD_STOP = 2  # transformers' BackgroundThreadStatus.HARD_STOP


@dataclass
class ExchangeStats:
    """What the exchange cost on this rank: calls and seconds of each kind (waiting for the
    other ranks included: a step's skew between ranks shows up here), payload bytes."""

    transport: str
    status_calls: int = 0
    status_s: float = 0.0
    payload_calls: int = 0
    payload_s: float = 0.0
    payload_bytes: int = 0
    whole_states: int = 0  # new requests sent as pickled RequestStates (no compact form)

    def snapshot(self) -> "ExchangeStats":
        return dataclasses.replace(self)

    def since(self, before: "ExchangeStats") -> dict:
        """Counts and seconds between `before` (a snapshot) and now."""
        return {"transport": self.transport,
                **{f.name: getattr(self, f.name) - getattr(before, f.name)
                   for f in dataclasses.fields(self) if f.name != "transport"}}


def _host_identity() -> str:
    """Ranks with the same answer share a kernel, hence /dev/shm and each other's pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class StepExchange:
    """The engine's DistributedHelper with its two per-step calls timed and, on the shared-
    memory transport, carried through `comm` (a shm_collectives.Communicator over the helper's
    CPU group). Attributes it does not define are the helper's."""

    def __init__(self, helper, comm=None, record: int = 0):
        self._helper = helper
        self._comm = comm
        self.transport = "shm" if comm is not None else "gloo"
        self.stats = ExchangeStats(self.transport)
        # the last `record` status calls' seconds (benchmarks: the ranks make the same calls in the
        # same order, so call i of one rank is call i of the others)
        self.recent = collections.deque(maxlen=record) if record else None

    def __getattr__(self, name):
        return getattr(self._helper, name)

    def close(self) -> None:
        """Drop this rank's mapping of the segment (the engine has stopped)."""
        if self._comm is not None:
            from metainfer.kernels import shm_collectives as shm

            shm.detach(self._comm.group_name)

    # ---- the engine's two calls
    def tp_all_reduce_state(self, payload_size: int, stop_status: int, pause_requested: int = 0):
        start = time.perf_counter()
        self.stats.status_calls += 1  # counted on entry: a rank stuck before it is one call behind the others
        try:
            if self._comm is None:
                return self._helper.tp_all_reduce_state(payload_size, stop_status, pause_requested)
            if self._comm.failed is not None:  # the group is gone: the engine's last call on a hard stop
                return 0, max(int(stop_status), _HARD_STOP), 0
            mine = torch.tensor([payload_size, stop_status, pause_requested], dtype=torch.int64)
            rows = self._comm.all_gather(mine).tolist()  # the maxima in Python: no intra-op threads woken
            return max(rows[0::3]), max(rows[1::3]), max(rows[2::3])
        finally:
            seconds = time.perf_counter() - start
            self.stats.status_s += seconds
            if self.recent is not None:
                self.recent.append(seconds)

    def tp_broadcast_object_from_rank_0(self, obj):
        start = time.perf_counter()
        try:
            out = self._helper.tp_broadcast_object_from_rank_0(obj) if self._comm is None else self._broadcast(obj)
        finally:
            self.stats.payload_calls += 1
            self.stats.payload_s += time.perf_counter() - start
        if self._comm is None and self._helper.is_tp_driver:  # what the engine pickled (counted after the clock)
            self.stats.payload_bytes += len(pickle.dumps(out))
        return out

    def _broadcast(self, obj):
        comm, driver = self._comm, self._helper.is_tp_driver
        message = None
        if driver:
            message, whole = encode(obj)
            self.stats.whole_states += whole
            self.stats.payload_bytes += len(message)
        head = struct.pack("<Q", len(message)) + message[:FIRST_PIECE - 8] if driver else None
        first = comm.broadcast_bytes(head.ljust(FIRST_PIECE, b"\0") if driver else None, FIRST_PIECE, root=0)
        (length,) = struct.unpack_from("<Q", first)
        if length > FIRST_PIECE - 8:
            rest = comm.broadcast_bytes(message[FIRST_PIECE - 8:] if driver else None, length - (FIRST_PIECE - 8), 0)
            data = first[8:] + rest
        else:
            data = first[8:8 + length]
        return obj if driver else decode(data)


# ---- the payload as per-step diffs ------------------------------------------------------------

@functools.cache
def _compared_fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "created_time")


def _comparable(state) -> list:
    return [getattr(state, name) for name in _compared_fields(type(state))]


def _rebuilt(request_id, tokens, config):
    from metainfer.models import transformers_adapter as hf

    return hf.RequestState(request_id=request_id, initial_tokens=tokens, **config)


def encode(payload) -> tuple[bytes, int]:
    """(new request states, cancelled ids) as bytes, the states in their order (the ranks add
    them to their schedulers in it): each as (id, prompt ids packed as int32, its request
    config), or whole where that would not rebuild it equal; returns the bytes and how many
    states went whole."""
    states, cancellations = payload
    entries, whole = [], 0
    for state in states:
        config = state.get_request_config()
        try:
            packed = array.array("i", state.initial_tokens)
        except (OverflowError, TypeError):  # not int32 ids
            packed = None
        if packed is not None and \
                _comparable(_rebuilt(state.request_id, list(state.initial_tokens), config)) == _comparable(state):
            entries.append((state.request_id, packed.tobytes(), config))
        else:
            entries.append(state)
            whole += 1
    return pickle.dumps((entries, list(cancellations)), protocol=5), whole


def decode(data: bytes):
    entries, cancellations = pickle.loads(data)  # noqa: S301 - from the group's driver, this host
    states = [_rebuilt(e[0], array.array("i", e[1]).tolist(), e[2]) if isinstance(e, tuple) else e for e in entries]
    return states, cancellations


# ---- installing it on an engine ------------------------------------------------------------

def install(manager, mode: str = "auto", slot_bytes: int = SLOT_BYTES, record: int = 0) -> StepExchange | None:
    """Put a StepExchange in front of the engine manager's distributed helper, before its batch
    processor is made (which takes the helper then). Collective over the engine's tensor-
    parallel group: every rank calls it in the same order. `mode`: "shm" (refused with the
    reason if the ranks cannot), "gloo" (the engine's own transport, timed), "auto" (shm where
    every rank of the group is on this host and the path is available). None outside TP mode.
    `slot_bytes`: the segment's slot per rank (a longer payload is cut into pieces); `record`:
    keep that many status calls' times (StepExchange.recent)."""
    from metainfer.models import transformers_adapter as hf

    if mode not in MODES:
        raise ValueError(f"exchange mode must be one of {', '.join(MODES)}, not {mode!r}")
    helper = manager.distributed_helper
    if isinstance(helper, StepExchange):
        return helper
    if helper.tp_size <= 1 or helper.cpu_comm_group is None:
        return None
    comm = None
    if mode != "gloo":
        comm, why = _attach(helper, slot_bytes)
        if comm is None and mode == "shm":
            raise RuntimeError(f"the engine's exchange cannot run through shared memory: {why}")
    exchange = StepExchange(helper, comm, record)
    manager.distributed_helper = exchange
    if not helper.is_tp_driver:
        # An idle loop sleeps 0.1 s on an event only add_request and cancel_request set, which a
        # follower never gets: its sleep then made the driver, woken at once by a new request,
        # wait up to 0.1 s for it in the next exchange. A follower waits in the exchange instead
        # (for the driver, asleep in a futex or gloo's recv: no core spent).
        hf.never_idle_sleep(manager)
    return exchange


def _attach(helper, slot_bytes: int):
    """(communicator, None) over the helper's CPU group, or (None, why not), the same verdict on
    every rank."""
    import torch.distributed as dist

    from metainfer.kernels import shm_collectives as shm

    group = helper.cpu_comm_group
    hosts: list = [None] * group.size()
    dist.all_gather_object(hosts, _host_identity(), group=group)
    if len(set(hosts)) > 1:
        return None, f"the group's ranks run on {len(set(hosts))} hosts"
    try:
        return shm.attach(group.group_name, slot_bytes=slot_bytes), None
    except shm.ShmUnavailable as e:
        return None, str(e)
