"""The target schema (metainfer/hardware/targets/schema.py) is declared once and drives reading,
writing and `metainfer targets --describe`: any valid target written to TOML reads back as the
same Target, and --describe lists every key of the table."""

import dataclasses
import tomllib

import pytest
from hypothesis import given, settings, strategies as st

from metainfer.hardware import targets
from metainfer.hardware.targets import COLLECTIVE_KINDS, DEVICE_KINDS, SHM_KINDS, schema

# any text, so that the writer must quote and escape it; keys too (bare where they can be)
TEXT = st.text(max_size=12)
KEYS = st.text(min_size=1, max_size=8)
OPS = KEYS.filter(lambda k: k != "default")  # custom_op_overhead_us's `default` is the default, not an op
POSITIVE = st.floats(min_value=0, exclude_min=True, allow_nan=False, allow_infinity=False) | st.integers(1, 10**9)
NON_NEGATIVE = st.floats(min_value=0, allow_nan=False, allow_infinity=False) | st.integers(0, 10**9)
SHARE = st.floats(min_value=0, max_value=1) | st.sampled_from([0, 1])
SCALARS = (st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False) | TEXT)
ANY = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
                   max_leaves=6)
LINK = st.fixed_dictionaries({"bandwidth_gbs": POSITIVE, "latency_us": NON_NEGATIVE})


@st.composite
def target_tables(draw, everything=False):
    """A valid target as TOML's parsed tables: every optional key and table present or absent
    (all present where `everything`: a CPU box of one island, where every key applies)."""
    def given_(strategy):  # an optional key's value, or None where it is left out
        return draw(strategy) if everything or draw(st.booleans()) else None

    def some(keys, values):
        return st.dictionaries(keys, values, min_size=1 if everything else 0, max_size=3)

    kind = "cpu" if everything else draw(st.sampled_from(DEVICE_KINDS))
    n = draw(st.integers(1, 8))
    order = draw(st.permutations(range(n)))
    cuts = [] if everything else sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    islands = [list(order[a:b]) for a, b in zip([0, *cuts], [*cuts, n])]
    single, one_island = n == 1, len(islands) == 1

    def put(table, key, value):
        if value is not None:
            table[key] = value

    rates = {dt: draw(POSITIVE) for dt in ("fp32", "bf16", "fp16")}
    for dt in ("tf32", "fp8"):
        put(rates, dt, draw(POSITIVE) if kind != "cpu" else given_(POSITIVE))
    device = {"kind": kind, "name": draw(TEXT), "peak_tflops": rates, "memory_gib": draw(POSITIVE),
              "memory_bandwidth_gbs": draw(POSITIVE), "launch_overhead_us": draw(NON_NEGATIVE)}
    put(device, "arch", given_(TEXT))
    overheads = NON_NEGATIVE | st.builds(lambda per_op, default: {**per_op, **default}, some(OPS, NON_NEGATIVE),
                                         st.dictionaries(st.just("default"), NON_NEGATIVE))
    put(device, "custom_op_overhead_us", given_(overheads))
    put(device, "custom_op_slowdown", given_(some(OPS, st.floats(min_value=1, allow_nan=False, allow_infinity=False))))
    if given_(st.just(True)):
        device.update(cache_mib=draw(POSITIVE), cache_bandwidth_gbs=draw(POSITIVE))
    put(device, "memory_overlap", given_(SHARE))
    put(device, "stream_bandwidth_gbs", given_(POSITIVE))

    topology = {}  # a one-device box may leave out every key (and the table)
    put(topology, "islands", islands if not single else given_(st.just(islands)))
    put(topology, "p2p", draw(st.booleans()) if not single else given_(st.booleans()))
    put(topology, "intra_island", draw(LINK) if not single else given_(LINK))
    put(topology, "inter_island", draw(LINK) if not one_island else given_(LINK))
    put(topology, "flat_ring_bus_bandwidth_gbs", given_(POSITIVE))
    put(topology, "interconnect", given_(st.sampled_from(("pcie", "nvlink", "host"))))
    collectives = {}
    put(collectives, "backend", draw(st.sampled_from(("nccl", "gloo"))) if not single else
        given_(st.sampled_from(("nccl", "gloo"))))
    put(collectives, "overlap", given_(SHARE))
    if one_island:
        put(collectives, "links", given_(some(st.sampled_from(COLLECTIVE_KINDS), LINK)))
    if kind == "cpu":
        put(collectives, "shm", given_(some(st.sampled_from(SHM_KINDS), LINK)))
    put(collectives, "settings", given_(some(KEYS, TEXT | st.integers(-2**63, 2**63 - 1))))

    data = {"name": draw(TEXT)}
    put(data, "description", given_(TEXT))
    data.update(num_devices=n, device=device)
    for name, table in (("topology", topology), ("collectives", collectives)):
        if table or not single or given_(st.just(True)):
            data[name] = table
    put(data, "kernels", given_(some(KEYS, st.dictionaries(KEYS, ANY, max_size=3))))
    put(data, "passes", given_(some(KEYS, ANY)))
    if given_(st.just(True)):
        machine = {"cores": draw(st.integers(1, 512))}
        for key in ("cpu", "gpu", "sm", "driver"):
            put(machine, key, given_(TEXT))
        put(machine, "flags", given_(st.lists(TEXT, max_size=4)))
        data["machine"] = machine
    return data


def _round_trip(t):
    return targets.from_dict(tomllib.loads(targets.to_toml(t)), t.source)


@settings(max_examples=300, deadline=None)
@given(target_tables())
def test_any_valid_target_reads_back_from_its_toml(data):
    t = targets.from_dict(data, "drawn")
    assert _round_trip(t) == t


def test_every_builtin_target_reads_back_from_its_toml():
    for name, t in targets.builtins().items():
        assert _round_trip(t) == t, name


@settings(max_examples=5, deadline=None)
@given(target_tables(everything=True))
def test_the_drawn_targets_give_every_key_of_the_schema(data):
    """The round trip above covers the whole table: a target with every optional part has a
    value at every key's path (a key added to the schema fails here until it is drawn)."""
    for key in schema.KEYS:
        at = data
        for part in key.path.split("."):
            assert part in at, f"target_tables() never draws {key.path}"
            at = at[part]


def test_the_writer_writes_the_number_that_was_read():
    """0.061 us is held as 0.061 * 1e-6 s, which / 1e-6 gives 0.06099999999999999: the writer
    finds the number that reads back as the value, the shortest."""
    t = targets.get("cpu")
    for latency_us in (0.061, 0.122, 0.239, 1.1, 165, 1e-3):
        link = targets.LinkSpec(bandwidth=1.4e9, latency_s=latency_us * 1e-6)
        moved = dataclasses.replace(t, topology=dataclasses.replace(t.topology, intra_island=link))
        assert _round_trip(moved).topology.intra_island == link
        assert f"latency_us = {latency_us}" in targets.to_toml(moved)


def test_comments_go_above_their_keys_and_unknown_paths_are_refused():
    text = targets.to_toml(targets.get("pcie8"), header=["a header"],
                           notes={"device.memory_gib": ["from the datasheet"], "topology": ["the wiring"]})
    lines = text.splitlines()
    assert lines[0] == "# a header"
    assert lines[lines.index("# from the datasheet") + 1].startswith("memory_gib = ")
    assert lines[lines.index("# the wiring") + 1] == "[topology]"
    with pytest.raises(ValueError, match="device.memroy_gib"):
        targets.to_toml(targets.get("cpu"), notes={"device.memroy_gib": ["typo"]})


def test_describe_lists_every_key_with_its_unit_and_check(capsys):
    from metainfer.cli import main

    assert main(["targets", "--describe"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for key in schema.KEYS:
        (line,) = [line for line in lines if line.startswith(f"{key.path}  ")]
        assert f"[{key.check.unit or '-'}]" in line and key.check.words in line, line
        assert f"Target.{key.attrs[0]}" in out
    for path in schema.TABLES:
        assert not path or f"[{path}]  " in out
