"""The target TOML's schema, declared once.

KEYS lists every key a target TOML may hold: its path in the TOML, its unit there, what a value
must be (its check), what an absent key means (its default), a line on what it is for, and the
Target attribute it fills (in SI units: FLOP/s, bytes, bytes/s, s). TABLES says which tables
must be present. The table drives reading (`read`, behind targets.from_dict), writing
(`to_toml`) and `metainfer targets --describe` (`describe`), so a field is added in one place.
"""

from __future__ import annotations

import copy
import datetime
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from metainfer.hardware.machine import Machine
from metainfer.hardware.targets import (COLLECTIVE_KINDS, DEVICE_KINDS, DTYPES, SHM_KINDS, DeviceSpec, LinkSpec,
                                        Target, TargetError, Topology)

__all__ = ["KEYS", "TABLES", "read", "to_toml", "describe"]

# a unit as the TOML writes it -> (its size in the Target's SI unit, that unit)
UNITS = {"": (1, ""), "TFLOP/s": (1e12, "FLOP/s"), "GiB": (2**30, "bytes"), "MiB": (2**20, "bytes"),
         "GB/s": (1e9, "bytes/s"), "us": (1e-6, "s")}


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()  # what a default gives where the key must be present


@dataclass(frozen=True)
class Default:
    """What an absent key (or table) means: `of(values)` gives the attribute's value from the
    attributes read before it (REQUIRED where the key must be given); `words` says it for
    --describe. A table's default is {} (read as empty), None (absent: its object is None) or
    REQUIRED."""

    words: str
    of: Callable[[Mapping[str, Any]], Any]


def _fixed(value: Any, words: str) -> Default:
    return Default(words, lambda values: copy.deepcopy(value))  # a Target's own {}, not one shared


def _one_device(value: Callable[[Mapping[str, Any]], Any], words: str) -> Default:
    """A default for one-device boxes (nothing to wire); required on any other."""
    return Default(f"{words} where num_devices = 1; else required",
                   lambda values: value(values) if values["num_devices"] == 1 else REQUIRED)


MUST = Default("required", lambda values: REQUIRED)


# ---------------------------------------------------------------------------------------------
# Checks: what a present value must be. `read` returns the attribute's value, naming any problem
# in `problems` (and then a stand-in, so that one pass finds every problem); `write` gives the
# TOML's value back.

def _problem(problems: list[str], path: str, what: str) -> None:
    problems.append(f"field '{path}' {what}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _in_unit(value: float, scale: float) -> float:
    """The shortest number that reads back as exactly `value` (read: number * scale): value /
    scale can be an ulp off the number that was read (0.061 us: 0.06099999999999999)."""
    guess = value / scale
    if scale == 1 or not math.isfinite(guess):
        return guess
    near = [guess]
    for direction in (math.inf, -math.inf):
        x = guess
        for _ in range(3):
            x = math.nextafter(x, direction)
            near.append(x)
    exact = [x for x in near if x * scale == value]
    return min(exact, key=lambda x: (len(repr(x)), abs(x - guess))) if exact else guess


class Check:
    unit = ""  # of the TOML's value
    words = ""  # what a value must be, for --describe
    stand_in: Any = None  # the value a bad one reads as

    def read(self, raw: Any, path: str, problems: list[str], values: Mapping[str, Any]) -> Any:
        raise NotImplementedError

    def write(self, value: Any) -> Any:
        return value


class Text(Check):
    words, stand_in = "string", ""

    def read(self, raw, path, problems, values):
        if not isinstance(raw, str):
            _problem(problems, path, f"must be a string, got {raw!r}")
            return ""
        return raw


class Choice(Check):
    def __init__(self, options: tuple[str, ...]):
        self.options, self.stand_in = options, options[0]
        self.words = "one of " + ", ".join(options)

    def read(self, raw, path, problems, values):
        if raw not in self.options:
            _problem(problems, path, f"must be one of {self.options}, got {raw!r}")
            return self.options[0]
        return raw


class Flag(Check):
    words, stand_in = "true or false", False

    def read(self, raw, path, problems, values):
        if not isinstance(raw, bool):
            _problem(problems, path, f"must be true or false, got {raw!r}")
            return False
        return raw


class Count(Check):
    def __init__(self, minimum: int):
        self.minimum = self.stand_in = minimum
        self.words = f"integer >= {minimum}"

    def read(self, raw, path, problems, values):
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < self.minimum:
            _problem(problems, path, f"must be an integer >= {self.minimum}, got {raw!r}")
            return self.minimum
        return raw


class Number(Check):
    """A number in `unit`, held as number x the unit's size; `what` says its bounds as errors do."""

    def __init__(self, unit: str, what: str, test: Callable[[float], bool]):
        self.unit, self.what, self.test = unit, what, test
        self.scale = UNITS[unit][0]
        self.words, self.stand_in = f"number, {what}", self.scale

    def read(self, raw, path, problems, values):
        if not _is_number(raw):
            _problem(problems, path, f"must be a number, got {raw!r}")
            return self.stand_in
        if not self.test(raw):
            _problem(problems, path, f"must be {self.what}, got {float(raw)!r}")
            return self.stand_in
        return float(raw) * self.scale

    def write(self, value):
        x = _in_unit(value, self.scale)
        return int(x) if x.is_integer() and abs(x) < 2**53 else x  # "864", not "864.0"


def _positive(unit: str) -> Number:
    return Number(unit, "positive", lambda v: v > 0)


def _non_negative(unit: str) -> Number:
    return Number(unit, ">= 0", lambda v: v >= 0)


SHARE = Number("", "in [0, 1]", lambda v: 0 <= v <= 1)


class Islands(Check):
    words, stand_in = "list of device lists covering 0..num_devices-1 once each", ((0,),)

    def read(self, raw, path, problems, values):
        whole = (tuple(range(values["num_devices"])),)
        if not (isinstance(raw, list) and raw and all(isinstance(i, list) and i for i in raw)):
            _problem(problems, path, f"must be a non-empty list of non-empty device lists, got {raw!r}")
            return whole
        devices = [d for island in raw for d in island]
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in devices) or \
                sorted(devices) != list(range(values["num_devices"])):
            _problem(problems, path, f"must cover devices 0..{values['num_devices'] - 1} exactly once, got {raw!r}")
            return whole
        return tuple(tuple(island) for island in raw)

    def write(self, value):
        return [list(island) for island in value]


class Link(Check):
    """A link: { bandwidth_gbs, latency_us } -> LinkSpec."""

    unit, words = "GB/s, us", "{ bandwidth_gbs = number > 0, latency_us = number >= 0 }"
    parts = (("bandwidth", "bandwidth_gbs", _positive("GB/s")), ("latency_s", "latency_us", _non_negative("us")))
    stand_in = LinkSpec(bandwidth=1e9, latency_s=1e-6)

    def read(self, raw, path, problems, values):
        if not isinstance(raw, Mapping):
            _problem(problems, path, f"must be a table, got {type(raw).__name__}")
            return self.stand_in
        got = {}
        for attr, key, check in self.parts:
            if raw.get(key) is None:
                _problem(problems, f"{path}.{key}", "is missing")
                got[attr] = check.stand_in
            else:
                got[attr] = check.read(raw[key], f"{path}.{key}", problems, values)
        return LinkSpec(**got)

    def write(self, value):
        return _Inline({key: check.write(getattr(value, attr)) for attr, key, check in self.parts})


LINK = Link()


class LinksByKind(Check):
    """A table of collective kind -> link."""

    def __init__(self, kinds: tuple[str, ...]):
        self.kinds, self.stand_in = kinds, {}
        self.unit, self.words = LINK.unit, f"table of kind ({', '.join(kinds)}) -> {LINK.words}"

    def read(self, raw, path, problems, values):
        if not isinstance(raw, Mapping):
            _problem(problems, path, f"must be a table, got {type(raw).__name__}")
            return {}
        links = {}
        for kind in sorted(raw):
            if kind not in self.kinds:
                _problem(problems, f"{path}.{kind}", f"is not one of the collectives {self.kinds}")
            else:
                links[kind] = LINK.read(raw[kind], f"{path}.{kind}", problems, values)
        return links

    def write(self, value):
        return {kind: LINK.write(link) for kind, link in value.items()}


class CustomOpOverheads(Check):
    """One number (every custom op), or a table of op name -> us with an optional `default`:
    -> (the default in s or None, {op: s})."""

    unit, stand_in = "us", (None, {})
    words = "number >= 0, or table of op -> number >= 0 with an optional default"

    def read(self, raw, path, problems, values):
        if not isinstance(raw, Mapping):
            return _non_negative("us").read(raw, path, problems, values), {}
        bad = [k for k, v in raw.items() if not _is_number(v) or v < 0]
        if bad:
            _problem(problems, path, f"must map op names to microseconds >= 0; bad: {bad}")
            return self.stand_in
        per_op = {k: float(v) * 1e-6 for k, v in raw.items() if k != "default"}
        return (float(raw["default"]) * 1e-6 if "default" in raw else None), per_op

    def write(self, value):
        default, per_op = value
        us = _non_negative("us").write
        if not per_op and default is not None:
            return us(default)
        return _Inline({**({} if default is None else {"default": us(default)}),
                        **{op: us(s) for op, s in per_op.items()}})


class Factors(Check):
    unit, words, stand_in = "", "table of op -> number >= 1", {}

    def read(self, raw, path, problems, values):
        if not isinstance(raw, Mapping) or not all(_is_number(v) and v >= 1 for v in raw.values()):
            _problem(problems, path, f"must map op names to factors >= 1, got {raw!r}")
            return {}
        return {k: float(v) for k, v in raw.items()}

    def write(self, value):
        return _Inline(value)


class Settings(Check):
    words, stand_in = "table of NAME = string or integer", {}

    def read(self, raw, path, problems, values):
        if not isinstance(raw, Mapping) or not all(isinstance(v, (str, int)) for v in raw.values()):
            _problem(problems, path, f"must be a table of NAME = value, got {raw!r}")
            return {}
        return {k: str(v) for k, v in raw.items()}

    def write(self, value):
        return dict(value)


class Tables(Check):
    """A table read as it is (what it holds is checked where it is used)."""

    stand_in = {}

    def __init__(self, what: str):
        self.what = self.words = what

    def read(self, raw, path, problems, values):
        if not isinstance(raw, Mapping):
            _problem(problems, path, f"must be {self.what}, got {raw!r}")
            return {}
        return dict(raw)

    def write(self, value):
        return dict(value)


class Strings(Check):
    words, stand_in = "list of strings", ()

    def read(self, raw, path, problems, values):
        if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
            _problem(problems, path, f"must be a list of strings, got {raw!r}")
            return ()
        return tuple(raw)

    def write(self, value):
        return list(value)


# ---------------------------------------------------------------------------------------------
# The table

@dataclass(frozen=True)
class Key:
    path: str  # in the TOML: "device.memory_gib"
    attr: "str | tuple[str, ...]"  # on the Target: "device.memory_bytes" (a tuple: the check returns one value each)
    check: Check
    default: Default
    doc: str
    partner: "tuple[str, str] | None" = None  # (a key of the same table given with this one or neither, why)
    only_where: "tuple[Callable[[Mapping[str, Any]], bool], str] | None" = None  # where a given value may apply

    @property
    def attrs(self) -> tuple[str, ...]:
        return self.attr if isinstance(self.attr, tuple) else (self.attr,)


@dataclass(frozen=True)
class Table:
    path: str
    default: Default
    doc: str
    closed: str = ""  # words naming the keys it holds, where it refuses others
    inline: bool = False  # written as { ... } on its key's line


_FP32_ON_A_CPU = Default("fp32's rate on a cpu (which runs it as fp32); else required",
                        lambda v: v["device.peak_flops.fp32"] if v["device.kind"] == "cpu" else REQUIRED)


_DEFAULT_BACKEND = {"cpu": "gloo", "cuda": "nccl"}
_MACHINE_KEYS = ("cpu", "flags", "cores", "gpu", "sm", "driver")

TABLES = {t.path: t for t in (
    Table("", MUST, "the box"),
    Table("device", MUST, "one device (every device of the box is alike)"),
    Table("device.peak_tflops", MUST, "dense peak rates by dtype", closed=f"the dtypes {DTYPES}", inline=True),
    Table("topology", _one_device(lambda v: {}, "defaults"), "how the devices are wired"),
    Table("collectives", _one_device(lambda v: {}, "defaults"), "the collective library"),
    Table("machine", Default("absent: no machine recorded", lambda v: None),
          "the machine a calibrated target's figures were measured on (optimize() notes or warns where this one "
          "differs)", closed=", ".join(_MACHINE_KEYS)),
)}

KEYS = (
    Key("name", "name", Text(), MUST, "the target's name"),
    Key("description", "description", Text(), Default("the name", lambda v: v["name"]), "one line on what the box is"),
    Key("num_devices", "num_devices", Count(1), MUST, "devices in the box (ranks of a multi-device run)"),
    Key("device.kind", "device.kind", Choice(DEVICE_KINDS), MUST, "the torch device type the target drives"),
    *(Key(f"device.peak_tflops.{dt}", f"device.peak_flops.{dt}", _positive("TFLOP/s"),
          _FP32_ON_A_CPU if dt in ("tf32", "fp8") else MUST, f"dense {dt} GEMM peak per device")
      for dt in DTYPES),
    Key("device.name", "device.name", Text(), MUST, "the device's model name"),
    Key("device.memory_gib", "device.memory_bytes", _positive("GiB"), MUST, "memory per device"),
    Key("device.memory_bandwidth_gbs", "device.memory_bandwidth", _positive("GB/s"), MUST,
        "the memory's bandwidth, bytes read + written per second"),
    Key("device.launch_overhead_us", "device.launch_overhead_s", _non_negative("us"), MUST,
        "what one kernel costs beyond its work (a launch; calibrated: a compiled graph's wrapper per kernel)"),
    Key("device.arch", "device.arch", Text(), _fixed("", '""'),
        'the GPU architecture ("sm_89"): selects kernel block sizes (kernels/configs.py)'),
    Key("device.custom_op_overhead_us", ("device.custom_op_overhead_s", "device.custom_op_overheads"),
        CustomOpOverheads(), _fixed((None, {}), "absent: a custom op's call costs a kernel's launch"),
        "what a call of a metainfer custom op from a compiled graph costs beyond its work (calibrated); where "
        "given, the fusion passes are gated by the cost model"),
    Key("device.custom_op_slowdown", "device.custom_op_slowdown", Factors(), _fixed({}, "absent: 1 for every op"),
        "each custom op's measured work over its roofline (calibrated)"),
    Key("device.cache_mib", "device.cache_bytes", _positive("MiB"), _fixed(0.0, "absent: no cache level"),
        "a cache level a graph's whole footprint can stay in between calls: its size",
        partner=("cache_bandwidth_gbs", "a cache level takes both cache_mib and cache_bandwidth_gbs")),
    Key("device.cache_bandwidth_gbs", "device.cache_bandwidth", _positive("GB/s"), _fixed(0.0, "absent: no cache level"),
        "the bandwidth memory-bound work gets from that cache level",
        partner=("cache_mib", "a cache level takes both cache_mib and cache_bandwidth_gbs")),
    Key("device.memory_overlap", "device.memory_overlap", SHARE, _fixed(1.0, "1"),
        "the share of a kernel's memory time that runs beside its arithmetic (1: the roofline's max; 0: they add)"),
    Key("device.stream_bandwidth_gbs", "device.stream_bandwidth", _positive("GB/s"),
        _fixed(0.0, "absent: memory_bandwidth_gbs"),
        "how fast a matmul streams its operands from memory beyond the cache level (calibrated)"),
    Key("topology.islands", "topology.islands", Islands(), _one_device(lambda v: ((0,),), "[[0]]"),
        "devices behind one PCIe switch / NUMA node"),
    Key("topology.p2p", "topology.p2p", Flag(), _one_device(lambda v: False, "false"),
        "whether devices reach each other's memory directly"),
    Key("topology.intra_island", "topology.intra_island", LINK,
        _one_device(lambda v: LinkSpec(bandwidth=v["device.memory_bandwidth"], latency_s=0.0),
                    "the device's memory bandwidth and no latency"),
        "the link between two devices of one island, one direction"),
    Key("topology.inter_island", "topology.inter_island", LINK,
        Default("absent where there is one island; else required",
                lambda v: None if len(v["topology.islands"]) == 1 else REQUIRED),
        "the link between devices of two islands, one direction"),
    Key("topology.flat_ring_bus_bandwidth_gbs", "topology.flat_ring_bus_bandwidth", _positive("GB/s"),
        _fixed(None, "absent"), "measured bus bandwidth of a flat ring over all devices, for calibration"),
    Key("topology.interconnect", "topology.interconnect", Choice(("pcie", "nvlink", "host")),
        Default("host on a cpu, else pcie", lambda v: "host" if v["device.kind"] == "cpu" else "pcie"),
        "what links the devices"),
    Key("collectives.backend", "collective_backend", Choice(("nccl", "gloo")),
        _one_device(lambda v: _DEFAULT_BACKEND[v["device.kind"]], "gloo on a cpu, nccl on a cuda device"),
        "the collective library"),
    Key("collectives.overlap", "comm_overlap", SHARE, _fixed(1.0, "1"),
        "the share of a collective's time that can run beside compute (calibrated for CPU ranks)"),
    Key("collectives.links", "collective_links", LinksByKind(COLLECTIVE_KINDS), _fixed({}, "absent"),
        "the link a collective of one kind sees, fitted on its own where the library does not run the ring the "
        "topology implies (calibrated for gloo)",
        only_where=(lambda v: len(v["topology.islands"]) == 1,
                    "is for one-island targets (the fits are of one link class)")),
    Key("collectives.shm", "shm_links", LinksByKind(SHM_KINDS), _fixed({}, "absent: the path is not offered"),
        "metainfer's shared-memory path between CPU ranks of one host, per kind: t = latency + bytes / bandwidth",
        only_where=(lambda v: v["device.kind"] == "cpu",
                    "is for CPU ranks on one host (a GPU box's host-staged path is not implemented)")),
    Key("collectives.settings", "collective_overrides", Settings(), _fixed({}, "absent"),
        "environment for the collective library, over the settings computed from the topology"),
    Key("kernels", "kernels", Tables("a table of per-kernel tables"), _fixed({}, "absent"),
        "per-kernel overrides of the architecture's kernel config ([kernels.attention] BLOCK_M = 64)"),
    Key("machine.cpu", "machine.cpu", Text(), _fixed("", '""'), "the CPU's model name (/proc/cpuinfo)"),
    Key("machine.flags", "machine.flags", Strings(), _fixed((), "[]"),
        "the ISA extensions it has that change which CPU kernels run"),
    Key("machine.cores", "machine.cores", Count(1), MUST, "cores the process could run on"),
    Key("machine.gpu", "machine.gpu", Text(), _fixed("", '""'), "the GPU's name (a GPU target's)"),
    Key("machine.sm", "machine.sm", Text(), _fixed("", '""'), 'the GPU\'s architecture ("sm_90")'),
    Key("machine.driver", "machine.driver", Text(), _fixed("", '""'), "the GPU driver's version"),
    Key("passes", "pass_options", Tables("a table of pass options"), _fixed({}, "absent"),
        "defaults for pass options (optimize()'s pass_options= overrides them)"),
)

# the Target's parts built from the attributes under their name; the rest are the Target's own
_PARTS = {"device": DeviceSpec, "topology": Topology, "machine": Machine}


# ---------------------------------------------------------------------------------------------
# Reading

@dataclass
class _Opened:
    data: "Mapping[str, Any] | None"  # None: absent, its keys not read
    problems: list[str]  # where its keys' problems go (a throwaway list under a missing or bad table)


def _open(path: str, opened: dict[str, _Opened], values: Mapping[str, Any]) -> _Opened:
    if path in opened:
        return opened[path]
    parent_path, _, leaf = path.rpartition(".")
    parent = _open(parent_path, opened, values)
    table = TABLES[path]
    raw = None if parent.data is None else parent.data.get(leaf)
    if raw is None:
        default = table.default.of(values)  # {}: read as empty; None: absent
        if default is REQUIRED:
            _problem(parent.problems, path, "is missing")
        # a missing or bad table reads as an empty one whose keys' problems are not reported
        state = _Opened({}, []) if default is REQUIRED else _Opened(default, parent.problems)
    elif not isinstance(raw, Mapping):
        _problem(parent.problems, path, f"must be a table, got {type(raw).__name__}")
        state = _Opened({}, [])
    else:
        state = _Opened(raw, parent.problems)
        if table.closed:
            allowed = {k.path.rpartition(".")[2] for k in KEYS if k.path.rpartition(".")[0] == path}
            for unknown in sorted(set(raw) - allowed):
                _problem(state.problems, f"{path}.{unknown}", f"is not one of {table.closed}")
    opened[path] = state
    return state


def read(data: Mapping[str, Any], source: str) -> Target:
    """The Target a parsed TOML describes; every problem in it is named in one TargetError."""
    problems: list[str] = []
    values: dict[str, Any] = {}  # attribute path -> value, in the Target's units
    opened = {"": _Opened(data, problems)}
    for key in KEYS:
        table_path, _, leaf = key.path.rpartition(".")
        table = _open(table_path, opened, values)
        if table.data is None:
            continue
        raw = table.data.get(leaf)
        if raw is None:
            value = key.default.of(values)
            if value is REQUIRED:
                _problem(table.problems, key.path, "is missing")
                value = key.check.stand_in
        elif key.partner and table.data.get(key.partner[0]) is None:
            _problem(table.problems, key.path, f"needs its partner: {key.partner[1]}")
            value = key.default.of(values)
        else:
            value = key.check.read(raw, key.path, table.problems, values)
            if key.only_where and value != key.default.of(values) and not key.only_where[0](values):
                _problem(table.problems, key.path, key.only_where[1])
        values.update(zip(key.attrs, value if isinstance(key.attr, tuple) else (value,)))
    if problems:
        listed = "".join(f"\n  - {p}" for p in problems)
        raise TargetError(f"{source}: {len(problems)} problem(s) in the target description:{listed}", problems)
    return _build(values, source)


def _build(values: Mapping[str, Any], source: str) -> Target:
    nested: dict[str, Any] = {}
    for attr, value in values.items():
        *parents, leaf = attr.split(".")
        at = nested
        for part in parents:
            at = at.setdefault(part, {})
        at[leaf] = value
    parts = {name: cls(**nested.pop(name)) if name in nested else None for name, cls in _PARTS.items()}
    return Target(**nested, **parts, source=source)


# ---------------------------------------------------------------------------------------------
# Writing

class _Inline(dict):
    """A table written { ... } on its key's line; a plain dict is written as a [section]."""


def _attribute(target: Target, attr: str) -> Any:
    at: Any = target
    for part in attr.split("."):
        if at is None:
            return _ABSENT
        at = at.get(part, _ABSENT) if isinstance(at, Mapping) else getattr(at, part)
    return at


_ABSENT = object()


def to_toml(target: Target, header: "tuple[str, ...] | list[str]" = (),
            notes: "Mapping[str, list[str] | tuple[str, ...]] | None" = None) -> str:
    """The TOML text of `target`: every key whose value is not what its absence means (which
    reads back as the same Target). `header`: comment lines on top; `notes`: comment lines
    above a key or table, by its path ("device.memory_bandwidth_gbs"), e.g. where a figure
    came from."""
    notes = dict(notes or {})
    known = {k.path for k in KEYS} | set(TABLES)
    if set(notes) - known:
        raise ValueError(f"notes for keys the schema does not have: {sorted(set(notes) - known)}")
    values = {attr: _attribute(target, attr) for key in KEYS for attr in key.attrs}
    values = {attr: v for attr, v in values.items() if v is not _ABSENT}
    doc: dict[str, Any] = {}
    for key in KEYS:
        if any(attr not in values for attr in key.attrs):  # under an absent part (no machine)
            continue
        value = tuple(values[a] for a in key.attr) if isinstance(key.attr, tuple) else values[key.attr]
        if value == key.default.of(values):  # reads back as it is
            continue
        *tables, leaf = key.path.split(".")
        at = doc
        for depth, part in enumerate(tables):
            at = at.setdefault(part, _Inline() if TABLES[".".join(tables[:depth + 1])].inline else {})
        at[leaf] = key.check.write(value)
    lines = [f"# {line}".rstrip() for line in header]
    _write_table(doc, (), notes, lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _write_table(table: Mapping[str, Any], path: tuple[str, ...], notes, lines: list[str]) -> None:
    def is_section(v):
        return isinstance(v, dict) and not isinstance(v, _Inline)

    plain = [(k, v) for k, v in table.items() if not is_section(v)]
    sections = [(k, v) for k, v in table.items() if is_section(v)]
    dotted = ".".join(path)
    if path and (plain or not sections or dotted in notes):
        lines += ["", *(f"# {n}".rstrip() for n in notes.get(dotted, ())), "[" + ".".join(map(_key, path)) + "]"]
    for k, v in plain:
        lines += [f"# {n}".rstrip() for n in notes.get(".".join((*path, k)), ())]
        lines.append(f"{_key(k)} = {_value(v)}")
    for k, v in sections:
        _write_table(v, (*path, k), notes, lines)


def _key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _string(k)


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _string(s: str) -> str:
    return '"' + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                         for c in s) + '"'


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(_value, v)) + "]"
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }" if v else "{}"
    if isinstance(v, (datetime.date, datetime.time)):
        return v.isoformat()
    raise TypeError(f"no TOML form for {type(v).__name__} {v!r}")


# ---------------------------------------------------------------------------------------------
# Describing

def describe() -> str:
    """Every key of a target TOML: its unit, its check, what its absence means, what it is for
    and the Target attribute it fills (`metainfer targets --describe`)."""
    lines = ["Keys of a target TOML (docs/targets.md). unit: as written; the Target holds SI units.", ""]
    shown = set()
    for key in KEYS:
        table_path = key.path.rpartition(".")[0]
        if table_path and table_path not in shown:
            shown.add(table_path)
            table = TABLES[table_path]
            lines += ["", f"[{table_path}]  {table.doc}; {table.default.words}"]
        unit = key.check.unit
        attrs = ", ".join(f"{a} ({UNITS[unit][1]})" if unit in UNITS and unit else a for a in key.attrs)
        default = "required" if key.default is MUST else f"default: {key.default.words}"
        lines += [f"{key.path}  [{unit or '-'}]  {key.check.words}; {default}",
                  f"    {key.doc}", f"    -> Target.{attrs}"]
    return "\n".join(lines)
