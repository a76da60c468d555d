"""metainfer::shm_* collectives (kernels/shm_collectives.py) on gloo ranks of this machine:
results against a float64 sum of every rank's input (regenerated on each rank from its seed,
not through any collective), every rank's bits equal, messages cut into many pieces, mismatched
collectives, a rank killed or late, and a rank that cannot take the path."""

from __future__ import annotations

import glob
import os
import signal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metainfer.kernels import shm_collectives as shm
from metainfer.parallel import multirank

TIMEOUT_S = int(os.environ.get("METAINFER_TEST_RANK_TIMEOUT", 240))

pytestmark = pytest.mark.skipif(shm.unavailable_reason() is not None, reason=str(shm.unavailable_reason()))

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32}
EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10, "float64": 2.0**-52, "int64": 0, "int32": 0}


def _input(rank: int, seed: int, rows: int, cols: int, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 64 + rank)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 8
    return x.round().to(DTYPES[dtype]) if dtype.startswith("int") else x.to(DTYPES[dtype])


def _cases_rank(rank: int, world: int, cases: list, slot_bytes: int) -> list:
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))  # its own segment, with the slot size asked
    shm.attach(group.group_name, slot_bytes=slot_bytes)
    out = []
    for seed, rows, cols, dtype in cases:
        x = _input(rank, seed, rows * world, cols, dtype)
        out.append((torch.ops.metainfer.shm_all_reduce(x, group.group_name),
                    torch.ops.metainfer.shm_all_gather(x, world, group.group_name),
                    torch.ops.metainfer.shm_reduce_scatter(x, world, group.group_name)))
    return out


case = st.tuples(st.integers(0, 10**6), st.integers(0, 40), st.integers(1, 700), st.sampled_from(sorted(DTYPES)))


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases=st.lists(case, min_size=6, max_size=6), world=st.sampled_from([2, 3]),
       slot_kib=st.sampled_from([64, 256, 4096]))
def test_collectives_match_a_float64_reference_and_agree_across_ranks(cases, world, slot_kib):
    _check(cases, world, slot_kib << 10)


def _check(cases: list, world: int, slot_bytes: int) -> None:
    results = multirank.run(_cases_rank, world, args=(cases, slot_bytes), timeout_s=120)
    for i, (seed, rows, cols, dtype) in enumerate(cases):
        inputs = [_input(r, seed, rows * world, cols, dtype) for r in range(world)]
        total = sum(x.double() for x in inputs)
        bound = EPS[dtype] * sum(x.double().abs() for x in inputs) * world + (0 if dtype.startswith("int") else 1e-300)
        for r in range(world):
            ar, ag, rs = results[r][i]
            assert ar.dtype == DTYPES[dtype] and ar.shape == inputs[r].shape
            assert torch.equal(ar, results[0][i][0]), "every rank must hold the same bits"
            assert bool(((ar.double() - total).abs() <= bound).all()), (dtype, (ar.double() - total).abs().max())
            assert torch.equal(ag, torch.cat(inputs))
            n = rows
            assert rs.shape == (n, cols)
            assert bool(((rs.double() - total[r * n:(r + 1) * n]).abs() <= bound[r * n:(r + 1) * n]).all())


def test_many_pieces_and_the_one_shot_boundary():
    # 64 KiB slots; sizes on both sides of the one-shot limit and of a piece's edge
    sizes = [(1, 64 * 256 // 2 - 1), (1, 64 * 256 // 2), (1, 64 * 256 // 2 + 1), (5, 64 * 256 + 3)]
    cases = [(7 + i, rows, cols, "float32") for i, (rows, cols) in enumerate(sizes)]
    _check(cases, 2, 64 << 10)


def _mismatch_rank(rank: int, world: int) -> str:
    import torch.distributed as dist

    g = dist.group.WORLD.group_name
    shm.attach(g)
    try:
        torch.ops.metainfer.shm_all_reduce(torch.ones(10 + rank), g)
    except shm.ShmCollectiveError as e:
        first = str(e)
    else:
        return "no error"
    try:  # the group's path stays ended
        torch.ops.metainfer.shm_all_reduce(torch.ones(10), g)
    except shm.ShmCollectiveError as e:
        return first + " | " + str(e)
    return first + " | no error"


def test_ranks_entering_different_collectives_both_fail_and_say_so():
    reports = multirank.run(_mismatch_rank, 2, timeout_s=60)
    assert "rank 1 entered another collective (all_reduce of 44 bytes float32)" in reports[0]
    assert "rank 0 entered another collective (all_reduce of 40 bytes float32)" in reports[1]
    assert all("| shm all_reduce (group '0'): the group's shared-memory path failed earlier" in r for r in reports)


def _segments() -> set[str]:
    return set(glob.glob(str(shm.SHM_DIR / "metainfer-*")))


def _killed_rank(rank: int, world: int) -> None:
    import torch.distributed as dist

    g = dist.group.WORLD.group_name
    shm.attach(g)
    torch.ops.metainfer.shm_all_reduce(torch.ones(1000), g)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    torch.ops.metainfer.shm_all_reduce(torch.ones(1000), g)


def test_a_rank_killed_mid_job_is_named_and_no_segment_is_left():
    before = _segments()
    with pytest.raises(multirank.RankFailure) as info:
        multirank.run(_killed_rank, 2, timeout_s=60)
    assert info.value.rank == 1
    assert "rank 1 (pid" in info.value.reports[0] and "exited before reaching it" in info.value.reports[0]
    assert "step 2" in info.value.reports[0]
    assert _segments() <= before


def _late_rank(rank: int, world: int) -> str:
    import time

    import torch.distributed as dist

    g = dist.group.WORLD.group_name
    shm.attach(g)
    if rank == 1:
        time.sleep(6)
        return "slept"
    try:
        torch.ops.metainfer.shm_all_reduce(torch.ones(4), g)
    except shm.ShmCollectiveError as e:
        return str(e)
    return "no error"


def test_a_late_rank_ends_in_the_groups_timeout():
    reports = multirank.run(_late_rank, 2, timeout_s=60, collective_timeout_s=2)
    assert "rank 1 did not reach it within the group's timeout of 2 s" in reports[0]


def _one_rank_cannot(rank: int, world: int) -> str:
    import torch.distributed as dist

    if rank == 1:
        shm.unavailable_reason = lambda: "no /dev/shm in this container"
    try:
        shm.attach(dist.group.WORLD.group_name)
    except shm.ShmUnavailable as e:
        return str(e)
    return "attached"


def test_every_rank_declines_when_one_cannot_map_the_segment():
    before = _segments()
    reports = multirank.run(_one_rank_cannot, 2, timeout_s=60)
    assert reports == ["member 1 (rank 1) of group '0': no /dev/shm in this container"] * 2
    assert _segments() <= before


def test_a_segment_smaller_than_asked_where_dev_shm_is_small():
    assert shm.slot_bytes_for(2, 1 << 30) == shm.SLOT_BYTES
    assert shm.slot_bytes_for(8, 64 << 20) == 1 << 20  # a container's 64 MiB /dev/shm, 8 ranks
    assert shm.slot_bytes_for(8, 1 << 20) == 0


def test_the_ops_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(6, 5, dtype=torch.bfloat16)
        assert torch.ops.metainfer.shm_all_reduce(x, "g").shape == (6, 5)
        assert torch.ops.metainfer.shm_all_gather(x, 3, "g").shape == (18, 5)
        assert torch.ops.metainfer.shm_reduce_scatter(x, 3, "g").shape == (2, 5)


# ---- select_collectives picking the path ----------------------------------------------------

def cpu_ranks_target(world: int, shm_latency_us: "float | None"):
    """CPU ranks of one host: gloo's loopback link as calibrate measured it on this machine
    (alpha ~165 us, beta ~1.4 GB/s), and where `shm_latency_us` is given a shared-memory path
    with that latency and 10 GB/s."""
    from metainfer.hardware import targets

    link = {"bandwidth_gbs": 1.4, "latency_us": 165}
    data = {"name": f"cpu{world}", "num_devices": world,
            "device": {"kind": "cpu", "name": "host", "peak_tflops": {"fp32": 0.1, "bf16": 0.001, "fp16": 0.001},
                       "memory_gib": 8, "memory_bandwidth_gbs": 20, "launch_overhead_us": 5},
            "topology": {"islands": [list(range(world))], "p2p": False, "intra_island": link},
            "collectives": {"backend": "gloo"}}
    if shm_latency_us is not None:
        shm_link = {"bandwidth_gbs": 10.0, "latency_us": shm_latency_us}
        data["collectives"]["shm"] = {k: shm_link for k in ("all_reduce", "all_gather", "reduce_scatter")}
    return targets.from_dict(data, "test")


def _tp_rank(rank: int, world: int, shm_latency_us, sequence_parallel: bool):
    import metainfer
    from metainfer.testing import tiny_hf_model

    model = tiny_hf_model("Llama", attn="eager", layers=2, num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids).logits
    passes = ["fuse_attention"] + (["sequence_parallel"] if sequence_parallel else []) + ["select_collectives"]
    opt = metainfer.optimize(model, cpu_ranks_target(world, shm_latency_us), example_inputs=(ids,),
                             lowering="aot_eager", passes=passes, tensor_parallel=world,
                             pass_options={"sequence_parallel": True} if sequence_parallel else None)
    with torch.no_grad():
        out = opt(ids).logits
    rec = opt.report.record("select_collectives")
    final = rec.graph_after or opt.report.record("fuse_attention").graph_after  # the graph the lowering got
    return ((out - ref).abs().max().item(), rec.matches, rec.decisions, rec.near_misses,
            final.count("metainfer.shm_"), "_c10d_functional" in final)


def test_select_collectives_takes_the_shared_memory_path_where_it_is_predicted_faster():
    results = multirank.run(_tp_rank, 2, args=(10.0, False), timeout_s=TIMEOUT_S)
    for diff, matches, decisions, near, shm_ops, c10d in results:
        assert diff < 1e-4
        assert matches == 4 == len(decisions) and shm_ops >= 4  # two row-parallel all-reduces a layer
        assert all("all_reduce" in d and ": shared memory, predicted" in d and "vs flat ring" in d for d in decisions)
        assert not c10d, "no library collective left in the graph"
    assert results[0][2] == results[1][2], "every rank decides the same"


def test_sequence_parallel_collectives_take_it_too():
    results = multirank.run(_tp_rank, 2, args=(10.0, True), timeout_s=TIMEOUT_S)
    for diff, matches, decisions, near, shm_ops, c10d in results:
        assert diff < 1e-4
        kinds = sorted({d.split(": ")[1].split()[0] for d in decisions})
        assert kinds == ["all_gather", "reduce_scatter"] and matches == len(decisions) > 0
        assert all(": shared memory, predicted" in d for d in decisions) and not c10d


def test_it_is_not_taken_where_the_target_has_no_such_path_or_it_is_predicted_slower():
    for latency in (None, 5000.0):  # no [collectives.shm]; a path slower than gloo's ring
        for diff, matches, decisions, near, shm_ops, c10d in multirank.run(_tp_rank, 2, args=(latency, False),
                                                                            timeout_s=TIMEOUT_S):
            assert diff < 1e-4 and matches == 0 and shm_ops == 0 and c10d
            assert all("flat ring" in d and "(kept)" in d for d in decisions)
            assert ("shared memory 5" in decisions[0]) == (latency is not None)  # priced, not taken


def _unavailable_rank(rank: int, world: int):
    if rank == 1:
        shm.unavailable_reason = lambda: "no /dev/shm in this container"
    return _tp_rank(rank, world, 10.0, False)


def test_when_a_rank_cannot_map_the_segment_every_rank_keeps_the_library_and_says_why():
    for diff, matches, decisions, near, shm_ops, c10d in multirank.run(_unavailable_rank, 2, timeout_s=TIMEOUT_S):
        assert diff < 1e-4 and shm_ops == 0 and c10d
        assert any("all_reduce not shared memory: member 1 (rank 1)" in n and "no /dev/shm" in n for n in near)
