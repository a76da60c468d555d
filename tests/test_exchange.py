"""The serving engine's per-step exchange (metainfer.runtime.exchange): the per-request diffs
rebuild the engine's own RequestStates exactly, and over 2 gloo ranks of this machine the
shared-memory transport gives every rank what the engine's gloo transport gives it (statuses
as maxima over the ranks, the driver's payload), long payloads cut into pieces; a peer that
dies inside the exchange is named. The engine serving through it: test_distributed.py and
test_server_ranks.py."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metainfer.kernels import shm_collectives as shm
from metainfer.parallel import multirank
from metainfer.runtime import exchange

TIMEOUT_S = int(os.environ.get("METAINFER_TEST_RANK_TIMEOUT", 240))
needs_shm = pytest.mark.skipif(shm.unavailable_reason() is not None, reason=str(shm.unavailable_reason()))


def _state(i: int, prompt: list[int], **kw):
    from transformers.generation.continuous_batching.requests import RequestState

    kw = {"max_new_tokens": 7, "eos_token_id": [2, 5], "streaming": True,
          "logit_processor_kwargs": {"temperature": 0.5, "top_k": 3, "seed": 11}, **kw}
    return RequestState(request_id=f"req_{i}", initial_tokens=prompt, **kw)


def _fields(state) -> list:
    return exchange._comparable(state)


@settings(max_examples=20, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=50), min_size=0, max_size=5),
       cancelled=st.lists(st.text(max_size=8), max_size=3))
def test_diffs_rebuild_the_engines_request_states(prompts, cancelled):
    states = [_state(i, p) for i, p in enumerate(prompts)]
    data, whole = exchange.encode((states, cancelled))
    got, got_cancelled = exchange.decode(data)
    assert whole == 0 and got_cancelled == cancelled
    assert [_fields(s) for s in got] == [_fields(s) for s in states]


def test_a_state_the_config_does_not_describe_is_sent_whole_in_its_place():
    changed = _state(0, [3, 4])
    changed.generated_tokens.append(9)  # not a fresh request: what get_request_config leaves out
    big = _state(2, [2**31])  # not an int32 id
    sent = [_state(1, [1]), changed, _state(3, [5, 6]), big, _state(4, [7])]
    data, whole = exchange.encode((sent, ["x"]))
    states, _ = exchange.decode(data)
    assert whole == 2
    # in the order sent: every rank adds them to its scheduler in that order
    assert [_fields(s) for s in states] == [_fields(s) for s in sent]


def _transports_rank(rank: int, world: int, payload_tokens: list[int], slot_bytes: int):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    out = {}
    for transport in ("gloo", "shm"):
        helper = DistributedHelper(init_device_mesh("cpu", (world,)), cpu_group_timeout=60)
        comm = shm.attach(helper.cpu_comm_group.group_name, slot_bytes=slot_bytes) if transport == "shm" else None
        ex = exchange.StepExchange(helper, comm)
        statuses = [ex.tp_all_reduce_state(3 if rank == 0 else 0, rank % 2, int(rank == world - 1))
                    for _ in range(3)]
        payload = ([_state(i, payload_tokens) for i in range(3)], ["gone"]) if rank == 0 else None
        states, cancelled = ex.tp_broadcast_object_from_rank_0(payload)
        out[transport] = (statuses, [_fields(s) for s in states], cancelled, ex.stats.status_calls)
        ex.close()
        helper.destroy_cpu_comm_group()
    return out


@needs_shm
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_shared_memory_gives_each_rank_what_gloo_gives_it(world):
    prompt = list(range(3, 40_003))  # 120 KB of prompt ids a request: the payload in pieces of 64 KiB
    for out in multirank.run(_transports_rank, world, args=(prompt, 64 << 10), timeout_s=TIMEOUT_S):
        assert out["shm"] == out["gloo"]
        statuses = out["shm"][0]
        assert statuses == [(3, 1, 1)] * 3  # maxima: rank 0's items, an odd rank's stop, the last rank's pause
        assert out["shm"][1] == [_fields(_state(i, prompt)) for i in range(3)]


def _killed_peer_rank(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    helper = DistributedHelper(init_device_mesh("cpu", (world,)), cpu_group_timeout=60)
    ex = exchange.StepExchange(helper, shm.attach(helper.cpu_comm_group.group_name, slot_bytes=64 << 10))
    ex.tp_all_reduce_state(0, 0, 0)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(shm.ShmCollectiveError, match=r"rank 1 \(pid \d+\) exited before reaching it"):
        ex.tp_all_reduce_state(0, 0, 0)
    # the engine's last call on its way to a hard stop: answered at once, no wait on the dead group
    return ex.tp_all_reduce_state(0, 0, 0)


@needs_shm
def test_a_peer_that_dies_in_the_exchange_is_named_and_the_engine_told_to_stop():
    with pytest.raises(multirank.RankFailure) as e:  # rank 1 killed; rank 0's answer is checked inside
        multirank.run(_killed_peer_rank, 2, timeout_s=TIMEOUT_S)
    assert e.value.rank == 1 and "killed by signal 9" in e.value.reports[1]
    assert e.value.reports[0] == "returned", e.value.reports  # its checks passed


def _broadcast_rank(rank: int, world: int, sizes: list[int], root: int, slot_bytes: int):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    comm = shm.attach(group.group_name, slot_bytes=slot_bytes)
    out = []
    for n in sizes:
        data = bytes((i * 7 + n) % 251 for i in range(n)) if rank == root else None
        out.append(comm.broadcast_bytes(data, n, root=root))
    return out


@needs_shm
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(sizes=st.lists(st.integers(0, 300_000), min_size=1, max_size=5), root=st.integers(0, 1),
       slot_kib=st.sampled_from([64, 256]))
def test_broadcast_bytes_reach_every_rank(sizes, root, slot_kib):
    for out in multirank.run(_broadcast_rank, 2, args=(sizes, root, slot_kib << 10), timeout_s=TIMEOUT_S):
        assert out == [bytes((i * 7 + n) % 251 for i in range(n)) for n in sizes]


def _mismatched_broadcast_rank(rank: int, world: int):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    comm = shm.attach(group.group_name, slot_bytes=64 << 10)
    n = 100 if rank == 0 else 200  # the members were told different sizes
    with pytest.raises(shm.ShmCollectiveError) as e:
        comm.broadcast_bytes(b"x" * n if rank == 0 else None, n, root=0)
    return str(e.value)


@needs_shm
def test_a_broadcast_the_members_disagree_on_is_refused_naming_it():
    for message in multirank.run(_mismatched_broadcast_rank, 2, timeout_s=TIMEOUT_S):
        assert "broadcast of 100 bytes from member 0" in message and "broadcast of 200 bytes" in message, message
