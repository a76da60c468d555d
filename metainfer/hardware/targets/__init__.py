"""Hardware targets: what metainfer compiles for, loaded from TOML.

A target describes one box: the device kind and its peak rates, memory, and how the
devices are wired (islands of devices behind one PCIe switch / NUMA node, links inside
and across islands, whether P2P works). Built-ins live beside this file as `<name>.toml`,
each number with its source in a comment; users pass their own TOML path.

Units in TOML are the ones datasheets use (TFLOP/s, GiB, GB/s, us); the `Target` object
holds SI units (FLOP/s, bytes, bytes/s, s).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["Target", "DeviceSpec", "LinkSpec", "Topology", "TargetError", "names", "get", "load", "builtins", "required"]

_BUILTIN_DIR = Path(__file__).resolve().parent
DEVICE_KINDS = ("cpu", "cuda")
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


class TargetError(ValueError):
    """A target description is missing fields or has invalid values; `problems` lists each."""

    def __init__(self, message: str, problems: "list[str] | None" = None):
        super().__init__(message)
        self.problems = list(problems or [message])


COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
SHM_KINDS = ("all_reduce", "all_gather", "reduce_scatter")  # what kernels/shm_collectives.py implements


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # "cpu" | "cuda": the torch device type this target drives
    name: str
    peak_flops: Mapping[str, float]  # FLOP/s per dtype name in DTYPES
    memory_bytes: float
    memory_bandwidth: float  # bytes/s
    launch_overhead_s: float
    arch: str = ""  # e.g. "sm_89"; selects kernel block sizes in lowering/
    # a call of one of metainfer's custom ops from a compiled graph (Python dispatch around
    # the kernel): the default, and per op name; None: the same as any kernel's launch
    custom_op_overhead_s: float | None = None
    custom_op_overheads: Mapping[str, float] = field(default_factory=dict)
    # measured work of each custom op over its roofline (its CPU path is eager torch, not a fused kernel)
    custom_op_slowdown: Mapping[str, float] = field(default_factory=dict)
    # a cache level a graph's whole footprint can stay in between calls (0: not modelled):
    # its size, and the bandwidth memory-bound work gets from it
    cache_bytes: float = 0.0
    cache_bandwidth: float = 0.0
    # the share of a kernel's memory time that runs beside its arithmetic: 1 (the roofline's
    # max) where loads overlap compute; 0 where they add (a CPU GEMM packs its weight first)
    memory_overlap: float = 1.0

    # bytes/s at which a matmul streams its operands from memory beyond the cache level (a
    # calibrated CPU: decode-shaped matmuls over weight sets larger than the cache); 0: the
    # memory bandwidth. A copy's rate overstates it where the GEMM library does not stream at
    # the memory's speed (3.8x on this project's EPYC VM)
    stream_bandwidth: float = 0.0

    def bandwidth(self, footprint: "float | None" = None, stream: bool = False) -> float:
        """Bytes/s memory-bound work gets when the program it belongs to touches `footprint`
        bytes per call (None: not known). `stream`: a matmul's operands (the GEMM streaming
        rate beyond the cache level); else element-wise work and copies (the memory's rate). A
        footprint that fits the cache level gets its bandwidth, or memory's where that is faster
        (the level was measured with matmuls: element-wise work is never slower in a cache)."""
        beyond = self.stream_bandwidth if stream and self.stream_bandwidth > 0 else self.memory_bandwidth
        if footprint is not None and self.cache_bandwidth > 0 and footprint <= self.cache_bytes:
            return self.cache_bandwidth if stream else max(self.cache_bandwidth, self.memory_bandwidth)
        return beyond

    @property
    def knows_custom_op_costs(self) -> bool:
        """Whether the target says what a custom-op call costs (a calibrated one does)."""
        return self.custom_op_overhead_s is not None or bool(self.custom_op_overheads)


@dataclass(frozen=True)
class LinkSpec:
    bandwidth: float  # bytes/s, one direction
    latency_s: float


@dataclass(frozen=True)
class Topology:
    islands: tuple[tuple[int, ...], ...]
    p2p: bool
    intra_island: LinkSpec
    inter_island: LinkSpec | None = None
    flat_ring_bus_bandwidth: float | None = None  # bytes/s, measured, for calibration
    interconnect: str = "pcie"  # "pcie", "nvlink" or "host": what links the devices


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    num_devices: int
    device: DeviceSpec
    topology: Topology
    collective_backend: str
    kernels: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # per-kernel overrides
    pass_options: Mapping[str, Any] = field(default_factory=dict)  # [passes]: defaults for pass options
    source: str = ""  # where it was loaded from
    collective_overrides: Mapping[str, str] = field(default_factory=dict)  # [collectives.settings]
    # [collectives] overlap: the share of a collective's time that can run beside compute (1: all
    # of it, a GPU's copy engines / NCCL's own SMs; 0: none, CPU ranks whose collectives take
    # the cores the compute needs), as `metainfer calibrate` measures it
    comm_overlap: float = 1.0
    # [collectives.links]: the link a collective of one kind sees, fitted on its own where the
    # library's implementation of it is not the ring the topology implies (gloo's reduce-scatter
    # costs what its all-reduce does); one-island targets only
    collective_links: Mapping[str, "LinkSpec"] = field(default_factory=dict)
    # [collectives.shm]: the ranks share one host and may exchange through shared memory
    # (metainfer's shm path, kernels/shm_collectives.py): per kind, t = latency + bytes / bandwidth
    # as `metainfer calibrate` fits it; absent: the path is not offered
    shm_links: Mapping[str, "LinkSpec"] = field(default_factory=dict)
    # [machine]: the machine a calibrated target's figures were measured on (metainfer.hardware.machine)
    machine: "Any" = None

    def collective_settings(self) -> dict[str, tuple[str, str]]:
        """Environment settings for the collective library, computed from the topology, with
        the TOML's [collectives.settings] on top: name -> (value, why)."""
        out: dict[str, tuple[str, str]] = {}
        topo = self.topology
        if self.collective_backend == "nccl" and self.num_devices > 1:
            if not topo.p2p:
                out["NCCL_P2P_DISABLE"] = ("1", "no GPU peer-to-peer on this box: stage through host memory")
            elif len(topo.islands) > 1 and topo.interconnect == "pcie":
                out["NCCL_P2P_LEVEL"] = ("PXB", "P2P through the PCIe switch inside an island; across the CPU "
                                                 "boundary through host memory")
            if topo.interconnect == "pcie":
                out["NCCL_PROTO"] = ("LL,Simple", "LL128 relies on NVLink's write ordering; not for PCIe")
                out["NCCL_ALGO"] = ("Ring", "metainfer picks two-shot / hierarchical itself as separate collectives; "
                                            "each library call stays the flat ring the cost model prices")
        for k, v in self.collective_overrides.items():
            out[k] = (v, "set in the target's [collectives.settings]")
        return out

    @property
    def device_kind(self) -> str:
        return self.device.kind

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return f"{self.name} ({self.description})"


def capability(arch: str) -> tuple[int, int] | None:
    """A GPU architecture name as a compute capability: "sm_89" -> (8, 9), "sm_100" -> (10, 0);
    None for no or another name."""
    if not arch.startswith("sm_") or not arch[3:].isdigit() or len(arch) < 5:
        return None
    return int(arch[3:-1]), int(arch[-1])


def for_device(target: "Target", device_capability: tuple[int, int] | None,
               arches_with_rows: tuple[str, ...] = ()) -> tuple["Target", str | None]:
    """The target as the GPU it will run on allows: a device older than the target's architecture
    (an A100, sm_80, under a target written for sm_89) makes kernels and passes decide for the
    device's; a newer one (an H100 under the sm_89 `cuda` target) does too where the kernel
    tables have rows for it (`arches_with_rows`; else the declared rows, which it also runs).
    Returns the target and a note for the report (None if unchanged)."""
    if target.device.kind != "cuda" or device_capability is None:
        return target, None
    declared = capability(target.device.arch)
    arch = f"sm_{device_capability[0]}{device_capability[1]}"
    if declared is not None and tuple(device_capability) == declared:
        return target, None
    if declared is not None and tuple(device_capability) > declared:
        if arch not in arches_with_rows:
            return target, None
        note = (f"target {target.name} declares {target.device.arch}; this GPU is {arch}, newer, with kernel rows of "
                f"its own: kernels and passes use {arch}'s")
    else:
        note = (f"target {target.name} declares {target.device.arch or 'no architecture'}; this GPU is {arch}: "
                f"kernels and passes decide for {arch}")
    return dataclasses.replace(target, device=dataclasses.replace(target.device, arch=arch)), note


def names() -> list[str]:
    """Names of the built-in targets."""
    return sorted(p.stem for p in _BUILTIN_DIR.glob("*.toml"))


def is_builtin(target: Target) -> bool:
    """Whether `target` was read from one of the built-in TOMLs (or derived from one, as the
    per-rank and per-device variants are: they keep its source)."""
    from pathlib import Path

    try:
        return Path(target.source).resolve().parent == _BUILTIN_DIR.resolve()
    except (TypeError, ValueError, OSError):
        return False


def builtins() -> dict[str, Target]:
    """Every built-in target, by name (what `metainfer targets` lists)."""
    return {name: load(_BUILTIN_DIR / f"{name}.toml") for name in names()}


def required(target: Any, who: str) -> Target:
    """`target`, which must already be a Target: names and TOML paths are resolved once, where a
    user hands them to metainfer (metainfer.api.resolve_target, metainfer.targets.get), and
    everything below takes the object."""
    if not isinstance(target, Target):
        raise TypeError(f"{who} takes a Target, not {type(target).__name__} {target!r}: resolve a name or TOML "
                        "path first with metainfer.targets.get()")
    return target


def get(target: "str | Path | Target") -> Target:
    """A Target from a built-in name, a path to a TOML file, or a Target (returned as is)."""
    if isinstance(target, Target):
        return target
    if isinstance(target, Path) or (isinstance(target, str) and target.endswith(".toml")):
        return load(target)
    if not isinstance(target, str):
        raise TypeError(f"target must be a name, a TOML path or a Target, not {type(target).__name__}")
    if target not in names():
        raise ValueError(f"unknown target {target!r}; known targets: {', '.join(names())} "
                         "(or pass a path to a .toml file)")
    return load(_BUILTIN_DIR / f"{target}.toml")


def load(path: "str | Path") -> Target:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"target file {str(path)!r} does not exist")
    with path.open("rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise TargetError(f"{path}: not valid TOML: {e}") from e
    return from_dict(data, source=str(path))


def from_dict(data: Mapping[str, Any], source: str = "<dict>") -> Target:
    """A Target from a parsed TOML table. Every missing or invalid field is reported at once,
    in one TargetError. Fields that cannot apply to the device are optional: a CPU has no TF32
    mode and no FP8 units (both run as fp32 there), and a one-device box has no topology to
    describe (its [topology] may be left out) and a default collective backend."""
    errors: list[str] = []
    r = _Reader(data, source, errors)
    name = r.str("name")
    num_devices = r.int("num_devices", minimum=1)
    dev = r.table("device")
    kind = dev.choice("kind", DEVICE_KINDS)
    tflops = dev.table("peak_tflops")
    derived = _CPU_DERIVED_RATES if kind == "cpu" else {}
    for unknown in sorted(set(tflops.data) - set(DTYPES)):
        errors.append(f"field 'device.peak_tflops.{unknown}' is not one of the dtypes {DTYPES}")
    given = {dt: tflops.positive(dt) * 1e12 for dt in DTYPES if dt not in derived or tflops.get(dt) is not None}
    peak = {dt: given[dt] if dt in given else given.get(derived[dt], 1.0) for dt in DTYPES}
    device = DeviceSpec(
        kind=kind,
        name=dev.str("name"),
        peak_flops=peak,
        memory_bytes=dev.positive("memory_gib") * 2**30,
        memory_bandwidth=dev.positive("memory_bandwidth_gbs") * 1e9,
        launch_overhead_s=dev.non_negative("launch_overhead_us") * 1e-6,
        arch=dev.str("arch", default=""),
        **_custom_op_overheads(dev, errors),
        custom_op_slowdown=_slowdowns(dev, errors),
        **_cache_level(dev, errors),
        memory_overlap=dev._number("memory_overlap", lambda v: 0 <= v <= 1, "in [0, 1]")
        if dev.get("memory_overlap") is not None else 1.0,
        stream_bandwidth=dev.positive("stream_bandwidth_gbs") * 1e9 if dev.get("stream_bandwidth_gbs") is not None
        else 0.0,
    )
    single = num_devices == 1
    topo = r.table("topology", optional=single)
    islands = topo.islands("islands", num_devices, default=((0,),) if single else None)
    ring = topo.get("flat_ring_bus_bandwidth_gbs")
    # one device: nothing crosses a link; its own memory stands in where a figure is asked for
    own_memory = LinkSpec(bandwidth=device.memory_bandwidth, latency_s=0.0)
    topology = Topology(
        islands=islands,
        p2p=topo.bool("p2p", default=False if single else None),
        intra_island=topo.link("intra_island", required=not single) or own_memory,
        inter_island=topo.link("inter_island", required=len(islands) > 1),
        flat_ring_bus_bandwidth=None if ring is None else topo.positive("flat_ring_bus_bandwidth_gbs") * 1e9,
        interconnect=topo.choice("interconnect", ("pcie", "nvlink", "host"), default="host" if kind == "cpu" else "pcie"),
    )
    coll = r.table("collectives", optional=single)
    backend = coll.choice("backend", ("nccl", "gloo"), default=_DEFAULT_BACKEND[kind] if single else None)
    overlap = coll._number("overlap", lambda v: 0 <= v <= 1, "in [0, 1]") if coll.get("overlap") is not None else 1.0
    collective_links = _links_by_kind(coll, "links", COLLECTIVE_KINDS, errors)
    if collective_links and len(islands) > 1:
        errors.append("field 'collectives.links' is for one-island targets (the fits are of one link class)")
    shm_links = _links_by_kind(coll, "shm", SHM_KINDS, errors)
    if shm_links and device.kind != "cpu":
        errors.append("field 'collectives.shm' is for CPU ranks on one host (a GPU box's host-staged path is not "
                      "implemented)")
    overrides = coll.get("settings") or {}
    if not isinstance(overrides, Mapping) or not all(isinstance(v, (str, int)) for v in overrides.values()):
        errors.append(f"field 'collectives.settings' must be a table of NAME = value, got {overrides!r}")
        overrides = {}
    kernels = data.get("kernels", {})
    if not isinstance(kernels, Mapping):
        errors.append(f"field 'kernels' must be a table of per-kernel tables, got {kernels!r}")
        kernels = {}
    machine = _machine(data.get("machine"), errors)
    pass_options = data.get("passes", {})
    if not isinstance(pass_options, Mapping):
        errors.append(f"field 'passes' must be a table of pass options, got {pass_options!r}")
        pass_options = {}
    if errors:
        listed = "".join(f"\n  - {e}" for e in errors)
        raise TargetError(f"{source}: {len(errors)} problem(s) in the target description:{listed}", errors)
    return Target(name=name, description=r.str("description", default=name), num_devices=num_devices,
                  device=device, topology=topology, collective_backend=backend, kernels=dict(kernels),
                  pass_options=dict(pass_options), source=source,
                  collective_overrides={k: str(v) for k, v in overrides.items()}, comm_overlap=overlap,
                  collective_links=collective_links, shm_links=shm_links, machine=machine)


def _machine(table, errors: list[str]):
    """[machine] (cpu, flags, cores; gpu, sm, driver where a GPU's), or None where absent."""
    from metainfer.hardware.machine import Machine

    if table is None:
        return None
    if not isinstance(table, Mapping):
        errors.append(f"field 'machine' must be a table, got {table!r}")
        return None
    unknown = sorted(set(table) - {"cpu", "flags", "cores", "gpu", "sm", "driver"})
    strings = {k: table.get(k, "") for k in ("cpu", "gpu", "sm", "driver")}
    flags, cores = table.get("flags", []), table.get("cores")
    problems = [f"field 'machine.{k}' is not one of cpu, flags, cores, gpu, sm, driver" for k in unknown]
    problems += [f"field 'machine.{k}' must be a string" for k, v in strings.items() if not isinstance(v, str)]
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        problems.append(f"field 'machine.flags' must be a list of strings, got {flags!r}")
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        problems.append(f"field 'machine.cores' must be a positive integer, got {cores!r}")
    errors.extend(problems)
    return None if problems else Machine(flags=tuple(flags), cores=cores, **strings)


def _links_by_kind(coll: "_Reader", table: str, kinds: tuple[str, ...], errors: list[str]) -> dict[str, "LinkSpec"]:
    """[collectives.<table>]: a link per collective kind, each one of `kinds`."""
    links = coll.table(table, optional=True)
    out = {}
    for kind in sorted(links.data):
        if kind not in kinds:
            errors.append(f"field 'collectives.{table}.{kind}' is not one of the collectives {kinds}")
        else:
            out[kind] = links.link(kind, required=True)
    return out


def _cache_level(dev: "_Reader", errors: list[str]) -> dict[str, float]:
    """[device] cache_mib and cache_bandwidth_gbs, both or neither."""
    given = [k for k in ("cache_mib", "cache_bandwidth_gbs") if dev.get(k) is not None]
    if not given:
        return {}
    if len(given) == 1:
        errors.append(f"field 'device.{given[0]}' needs its partner: a cache level takes both cache_mib "
                      "and cache_bandwidth_gbs")
        return {}
    return {"cache_bytes": dev.positive("cache_mib") * 2**20, "cache_bandwidth": dev.positive("cache_bandwidth_gbs") * 1e9}


def _slowdowns(dev: "_Reader", errors: list[str]) -> dict:
    raw = dev.get("custom_op_slowdown")
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 1
                                           for v in raw.values()):
        errors.append(f"field 'device.custom_op_slowdown' must map op names to factors >= 1, got {raw!r}")
        return {}
    return {k: float(v) for k, v in raw.items()}


def _custom_op_overheads(dev: "_Reader", errors: list[str]) -> dict:
    """[device] custom_op_overhead_us: a number (every custom op), or a table of op name ->
    microseconds with an optional `default`."""
    raw = dev.get("custom_op_overhead_us")
    if raw is None:
        return {}
    if isinstance(raw, Mapping):
        bad = [k for k, v in raw.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0]
        if bad:
            errors.append(f"field 'device.custom_op_overhead_us' must map op names to microseconds >= 0; bad: {bad}")
            return {}
        per_op = {k: v * 1e-6 for k, v in raw.items() if k != "default"}
        return {"custom_op_overhead_s": raw["default"] * 1e-6 if "default" in raw else None, "custom_op_overheads": per_op}
    return {"custom_op_overhead_s": dev.non_negative("custom_op_overhead_us") * 1e-6}


# On a CPU: torch runs TF32 math as plain fp32, and FP8 GEMMs as fp32 matmuls of the
# dequantised values (kernels/fp8_gemm.py's CPU path); a missing rate takes that dtype's.
_CPU_DERIVED_RATES = {"tf32": "fp32", "fp8": "fp32"}
_DEFAULT_BACKEND = {"cpu": "gloo", "cuda": "nccl"}
_ABSENT = object()


class _Reader:
    """Typed access to one TOML table. A missing or invalid field is recorded in `errors`
    (named by its full path) and a stand-in value returned, so one pass over a description
    finds every problem in it."""

    def __init__(self, data: Mapping[str, Any], source: str, errors: list[str], prefix: str = ""):
        self.data, self.source, self.errors, self.prefix = data, source, errors, prefix

    def _err(self, key: str, what: str) -> None:
        self.errors.append(f"field '{self.prefix}{key}' {what}")

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def _need(self, key: str, default: Any = None) -> Any:
        if key in self.data:
            return self.data[key]
        if default is None:
            self._err(key, "is missing")
            return _ABSENT
        return default

    def table(self, key: str, optional: bool = False) -> "_Reader":
        v = self.data.get(key, {}) if optional else self._need(key)
        if v is not _ABSENT and not isinstance(v, Mapping):
            self._err(key, f"must be a table, got {type(v).__name__}")
        # a missing or wrong table reads as an empty one: its own fields are then reported
        # as missing only where the table itself was present
        sub = v if isinstance(v, Mapping) else {}
        errors = self.errors if isinstance(v, Mapping) else []
        return _Reader(sub, self.source, errors, f"{self.prefix}{key}.")

    def str(self, key: str, default: "str | None" = None) -> str:
        v = self._need(key, default)
        if v is _ABSENT:
            return ""
        if not isinstance(v, str):
            self._err(key, f"must be a string, got {v!r}")
            return ""
        return v

    def choice(self, key: str, allowed: tuple[str, ...], default: "str | None" = None) -> str:
        v = self._need(key, default)
        if v is not _ABSENT and v not in allowed:
            self._err(key, f"must be one of {allowed}, got {v!r}")
        return v if v in allowed else allowed[0]

    def bool(self, key: str, default: "bool | None" = None) -> bool:
        v = self._need(key, default)
        if v is not _ABSENT and not isinstance(v, bool):
            self._err(key, f"must be true or false, got {v!r}")
        return v if isinstance(v, bool) else False

    def int(self, key: str, minimum: int) -> int:
        v = self._need(key)
        if v is _ABSENT:
            return minimum
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            self._err(key, f"must be an integer >= {minimum}, got {v!r}")
            return minimum
        return v

    def _number(self, key: str, test, what: str) -> float:
        v = self._need(key)
        if v is _ABSENT:
            return 1.0
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            self._err(key, f"must be a number, got {v!r}")
            return 1.0
        if not test(v):
            self._err(key, f"must be {what}, got {float(v)!r}")
            return 1.0
        return float(v)

    def positive(self, key: str) -> float:
        return self._number(key, lambda v: v > 0, "positive")

    def non_negative(self, key: str) -> float:
        return self._number(key, lambda v: v >= 0, ">= 0")

    def link(self, key: str, required: bool) -> "LinkSpec | None":
        if key not in self.data and not required:
            return None
        t = self.table(key)
        return LinkSpec(bandwidth=t.positive("bandwidth_gbs") * 1e9, latency_s=t.non_negative("latency_us") * 1e-6)

    def islands(self, key: str, num_devices: int, default=None) -> tuple[tuple[int, ...], ...]:
        v = self._need(key, default)
        if v is _ABSENT:
            return (tuple(range(num_devices)),)
        if isinstance(v, tuple):  # the default
            return v
        ok = isinstance(v, list) and v and all(isinstance(i, list) and i for i in v)
        if not ok:
            self._err(key, f"must be a non-empty list of non-empty device lists, got {v!r}")
            return (tuple(range(num_devices)),)
        flat = [d for isl in v for d in isl]
        if sorted(flat) != list(range(num_devices)):
            self._err(key, f"must cover devices 0..{num_devices - 1} exactly once, got {v!r}")
            return (tuple(range(num_devices)),)
        return tuple(tuple(i) for i in v)
