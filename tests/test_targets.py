"""Targets: built-ins, TOML loading and its errors."""

import pytest

from metainfer.hardware import targets
from metainfer.hardware.targets import TargetError

REQUIRED = {"cpu", "cuda", "pcie4", "pcie8", "pcie8-nop2p", "pcie8-gen5", "nvlink8"}


def test_builtins():
    assert REQUIRED <= set(targets.names())
    p8 = targets.get("pcie8")
    assert p8.num_devices == 8 and p8.device.kind == "cuda"
    assert [len(i) for i in p8.topology.islands] == [4, 4]
    assert p8.topology.inter_island.bandwidth < p8.topology.intra_island.bandwidth
    assert targets.get("nvlink8").topology.intra_island.bandwidth > 10 * p8.topology.intra_island.bandwidth
    assert targets.get("cpu").device.kind == "cpu"
    nop2p, gen5 = targets.get("pcie8-nop2p"), targets.get("pcie8-gen5")
    assert not nop2p.topology.p2p and nop2p.topology.intra_island.bandwidth < p8.topology.intra_island.bandwidth
    assert gen5.topology.p2p and gen5.topology.intra_island.bandwidth > p8.topology.intra_island.bandwidth


def test_every_number_cites_a_source():
    """Each hardware number sits under a comment (its source) in the same block of lines."""
    keys = ("tflops", "bandwidth", "memory_gib", "latency", "launch_overhead")
    for name in targets.names():
        lines = open(targets.get(name).source).read().splitlines()
        for i, line in enumerate(lines):
            if not any(k in line for k in keys) or line.lstrip().startswith("#"):
                continue
            j = i - 1
            while j >= 0 and lines[j].strip() and not lines[j].lstrip().startswith(("#", "[")):
                j -= 1
            assert j >= 0 and lines[j].lstrip().startswith("#"), f"{name}: no source comment for {line!r}"


def test_unknown_name():
    with pytest.raises(ValueError, match="known targets: cpu, cuda"):
        targets.get("h100x16")


def _write(tmp_path, text):
    p = tmp_path / "t.toml"
    p.write_text(text)
    return p


BASE = open(targets.get("pcie4").source).read()


def test_missing_field_is_named(tmp_path):
    p = _write(tmp_path, BASE.replace("memory_bandwidth_gbs = 864\n", ""))
    with pytest.raises(TargetError, match="'device.memory_bandwidth_gbs' is missing"):
        targets.load(p)


def test_a_cache_level_needs_its_size_and_its_bandwidth(tmp_path):
    both = targets.load(_write(tmp_path, BASE.replace("memory_bandwidth_gbs = 864\n",
                                                      "memory_bandwidth_gbs = 864\ncache_mib = 50\ncache_bandwidth_gbs = 5000\n")))
    assert both.device.cache_bytes == 50 * 2**20 and both.device.cache_bandwidth == 5e12
    assert targets.get("pcie4").device.cache_bytes == 0  # built-ins model none
    p = _write(tmp_path, BASE.replace("memory_bandwidth_gbs = 864\n", "memory_bandwidth_gbs = 864\ncache_mib = 50\n"))
    with pytest.raises(TargetError, match="'device.cache_mib' needs its partner"):
        targets.load(p)


def test_collective_links_are_checked(tmp_path):
    one_island = open(targets.get("cpu").source).read()  # it has a [collectives] table
    ok = one_island + "\n[collectives.links]\nreduce_scatter = { bandwidth_gbs = 0.7, latency_us = 250 }\n"
    t = targets.load(_write(tmp_path, ok))
    assert t.collective_links["reduce_scatter"].bandwidth == 0.7e9
    bad = ok.replace("reduce_scatter =", "broadcast =")
    with pytest.raises(TargetError, match="'collectives.links.broadcast' is not one of the collectives"):
        targets.load(_write(tmp_path, bad))
    two_islands = open(targets.get("pcie8").source).read() + \
        "\n[collectives.links]\nreduce_scatter = { bandwidth_gbs = 0.7, latency_us = 250 }\n"
    with pytest.raises(TargetError, match="for one-island targets"):
        targets.load(_write(tmp_path, two_islands))


def test_negative_bandwidth_is_named(tmp_path):
    p = _write(tmp_path, BASE.replace("bandwidth_gbs = 26", "bandwidth_gbs = -26"))
    with pytest.raises(TargetError, match="'topology.intra_island.bandwidth_gbs' must be positive"):
        targets.load(p)


def test_islands_must_cover_devices(tmp_path):
    p = _write(tmp_path, BASE.replace("islands = [[0, 1, 2, 3]]", "islands = [[0, 1, 2]]"))
    with pytest.raises(TargetError, match="cover devices 0..3"):
        targets.load(p)


def test_two_islands_need_an_inter_island_link(tmp_path):
    p = _write(tmp_path, BASE.replace("islands = [[0, 1, 2, 3]]", "islands = [[0, 1], [2, 3]]"))
    with pytest.raises(TargetError, match="inter_island' is missing"):
        targets.load(p)


def test_kernel_overrides(tmp_path):
    from metainfer.kernels import configs as kernel_configs

    t = targets.load(_write(tmp_path, BASE + "\n[kernels.attention]\nBLOCK_M = 32\n"))
    assert t.kernels["attention"]["BLOCK_M"] == 32
    bad = targets.load(_write(tmp_path, BASE + "\n[kernels.flashy]\nBLOCK_M = 32\n"))
    with pytest.raises(ValueError, match="unknown kernels"):
        kernel_configs.activate(bad)


def test_collective_settings_follow_the_topology(tmp_path):
    pcie8 = targets.get("pcie8").collective_settings()
    assert pcie8["NCCL_P2P_LEVEL"][0] == "PXB" and pcie8["NCCL_PROTO"][0] == "LL,Simple"
    assert targets.get("pcie8-nop2p").collective_settings()["NCCL_P2P_DISABLE"][0] == "1"
    assert targets.get("nvlink8").collective_settings() == {}, "NCCL's own tuning is made for NVLink"
    assert targets.get("cpu").collective_settings() == {}
    over = targets.load(_write(tmp_path, BASE + '\n[collectives.settings]\nNCCL_MIN_NCHANNELS = 4\n'))
    assert over.collective_settings()["NCCL_MIN_NCHANNELS"] == ("4", "set in the target's [collectives.settings]")
    with pytest.raises(TargetError, match="'topology.interconnect' must be one of"):
        targets.load(_write(tmp_path, BASE.replace("p2p = true", 'p2p = true\ninterconnect = "infiniband"')))


LAPTOP = '''name = "laptop"
num_devices = 1
[device]
kind = "cpu"
name = "my laptop"
peak_tflops = { fp32 = 0.5, bf16 = 0.25, fp16 = 0.25 }
memory_gib = 16
memory_bandwidth_gbs = 50
launch_overhead_us = 5
'''


def test_a_cpu_needs_no_tf32_fp8_topology_or_backend(tmp_path):
    """Fields that cannot apply to a one-device CPU box are optional: TF32 and FP8 run as
    fp32 there, and one device has no links to describe."""
    t = targets.load(_write(tmp_path, LAPTOP))
    assert t.device.peak_flops["tf32"] == t.device.peak_flops["fp32"] == 0.5e12
    assert t.device.peak_flops["fp8"] == 0.5e12 and t.device.peak_flops["bf16"] == 0.25e12
    assert t.topology.islands == ((0,),) and not t.topology.p2p and t.topology.inter_island is None
    assert t.topology.intra_island.bandwidth == 50e9, "one device: its memory stands in for a link"
    assert t.collective_backend == "gloo"
    given = targets.load(_write(tmp_path, LAPTOP.replace("fp16 = 0.25", "fp16 = 0.25, fp8 = 0.1")))
    assert given.device.peak_flops["fp8"] == 0.1e12, "a rate that is given is used"


def test_a_gpu_still_needs_its_tf32_and_fp8_rates(tmp_path):
    p = _write(tmp_path, BASE.replace("tf32 = 183, ", ""))
    with pytest.raises(TargetError, match="'device.peak_tflops.tf32' is missing"):
        targets.load(p)


def test_every_problem_is_reported_at_once(tmp_path):
    text = (LAPTOP.replace("memory_gib = 16\n", "").replace("launch_overhead_us = 5\n", "launch_overhead_us = -1\n")
            .replace("fp16 = 0.25", "fp16 = 0.25, bf8 = 1").replace('kind = "cpu"', 'kind = "cpu"\nmemory_bandwidth_gbs = "fast"'))
    text = text.replace('memory_bandwidth_gbs = 50\n', '')
    with pytest.raises(TargetError) as e:
        targets.load(_write(tmp_path, text))
    assert e.value.problems == ["field 'device.peak_tflops.bf8' is not one of the dtypes ('fp32', 'tf32', 'bf16', "
                                "'fp16', 'fp8')",
                                "field 'device.memory_gib' is missing",
                                "field 'device.memory_bandwidth_gbs' must be a number, got 'fast'",
                                "field 'device.launch_overhead_us' must be >= 0, got -1.0"]
    assert "4 problem(s)" in str(e.value)


def test_a_multi_device_box_must_describe_its_topology(tmp_path):
    text = BASE[:BASE.index("[topology]")]
    with pytest.raises(TargetError) as e:
        targets.load(_write(tmp_path, text))
    assert e.value.problems == ["field 'topology' is missing", "field 'collectives' is missing"]


def test_custom_op_costs_in_a_target_file():
    """custom_op_overhead_us as one number or per op (with a default), custom_op_slowdown per
    op; bad values are named."""
    import pytest

    from metainfer.hardware import targets as T

    base = dict(name="x", num_devices=1, device=dict(kind="cpu", name="c", peak_tflops=dict(fp32=1.0, bf16=1.0, fp16=1.0),
                                                     memory_gib=1, memory_bandwidth_gbs=10, launch_overhead_us=1))
    one = T.from_dict({**base, "device": {**base["device"], "custom_op_overhead_us": 30}})
    assert one.device.custom_op_overhead_s == pytest.approx(30e-6) and not one.device.custom_op_overheads
    per = T.from_dict({**base, "device": {**base["device"], "custom_op_overhead_us": {"default": 20, "attention": 90},
                                          "custom_op_slowdown": {"rmsnorm": 2.5}}})
    assert per.device.custom_op_overhead_s == pytest.approx(20e-6)
    assert per.device.custom_op_overheads == {"attention": pytest.approx(90e-6)}
    assert per.device.custom_op_slowdown == {"rmsnorm": 2.5}
    assert T.from_dict(base).device.custom_op_overhead_s is None  # built-in targets: no custom-op cost

    with pytest.raises(T.TargetError, match="custom_op_overhead_us.*bad: \\['rope'\\]"):
        T.from_dict({**base, "device": {**base["device"], "custom_op_overhead_us": {"rope": -1}}})
    with pytest.raises(T.TargetError, match="custom_op_slowdown' must map op names to factors >= 1"):
        T.from_dict({**base, "device": {**base["device"], "custom_op_slowdown": {"rope": 0.5}}})


def test_a_shared_memory_path_is_read_per_kind_and_refused_where_it_cannot_apply():
    import tomllib

    from metainfer.hardware import targets as t

    cpu = tomllib.loads((t._BUILTIN_DIR / "cpu.toml").read_text())
    cpu["collectives"]["shm"] = {"all_reduce": {"bandwidth_gbs": 4, "latency_us": 7}}
    got = t.from_dict(cpu, "cpu+shm")
    assert got.shm_links["all_reduce"].bandwidth == 4e9 and got.shm_links["all_reduce"].latency_s == pytest.approx(7e-6)
    assert t.get("cpu").shm_links == {}
    cpu["collectives"]["shm"]["all_to_all"] = {"bandwidth_gbs": 4, "latency_us": 7}
    with pytest.raises(t.TargetError, match="collectives.shm.all_to_all"):
        t.from_dict(cpu, "bad kind")
    gpu = tomllib.loads((t._BUILTIN_DIR / "pcie8.toml").read_text())
    gpu["collectives"]["shm"] = {"all_reduce": {"bandwidth_gbs": 4, "latency_us": 7}}
    with pytest.raises(t.TargetError, match="CPU ranks on one host"):
        t.from_dict(gpu, "gpu+shm")
