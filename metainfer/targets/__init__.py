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

__all__ = ["Target", "DeviceSpec", "LinkSpec", "Topology", "TargetError", "names", "get", "load"]

_BUILTIN_DIR = Path(__file__).resolve().parent
DEVICE_KINDS = ("cpu", "cuda")
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


class TargetError(ValueError):
    """A target description is missing a field or has an invalid value."""


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # "cpu" | "cuda": the torch device type this target drives
    name: str
    peak_flops: Mapping[str, float]  # FLOP/s per dtype name in DTYPES
    memory_bytes: float
    memory_bandwidth: float  # bytes/s
    launch_overhead_s: float
    arch: str = ""  # e.g. "sm_89"; selects kernel block sizes in lowering/


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


def names() -> list[str]:
    """Names of the built-in targets."""
    return sorted(p.stem for p in _BUILTIN_DIR.glob("*.toml"))


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
    r = _Reader(data, source)
    name = r.str("name")
    num_devices = r.int("num_devices", minimum=1)
    dev = r.table("device")
    kind = dev.str("kind")
    if kind not in DEVICE_KINDS:
        raise TargetError(f"{source}: device.kind must be one of {DEVICE_KINDS}, got {kind!r}")
    tflops = dev.table("peak_tflops")
    peak = {dt: tflops.positive(dt) * 1e12 for dt in DTYPES}
    device = DeviceSpec(
        kind=kind,
        name=dev.str("name"),
        peak_flops=peak,
        memory_bytes=dev.positive("memory_gib") * 2**30,
        memory_bandwidth=dev.positive("memory_bandwidth_gbs") * 1e9,
        launch_overhead_s=dev.non_negative("launch_overhead_us") * 1e-6,
        arch=dev.str("arch", default=""),
    )
    topo = r.table("topology")
    islands = topo.islands("islands", num_devices)
    inter = topo.link("inter_island", required=len(islands) > 1)
    ring = topo.get("flat_ring_bus_bandwidth_gbs")
    topology = Topology(
        islands=islands,
        p2p=topo.bool("p2p"),
        intra_island=topo.link("intra_island", required=True),
        inter_island=inter,
        flat_ring_bus_bandwidth=None if ring is None else topo.positive("flat_ring_bus_bandwidth_gbs") * 1e9,
        interconnect=topo.choice("interconnect", ("pcie", "nvlink", "host"), default="pcie"),
    )
    coll = r.table("collectives")
    backend = coll.str("backend")
    if backend not in ("nccl", "gloo"):
        raise TargetError(f"{source}: collectives.backend must be 'nccl' or 'gloo', got {backend!r}")
    overrides = coll.get("settings") or {}
    if not isinstance(overrides, Mapping) or not all(isinstance(v, (str, int)) for v in overrides.values()):
        raise TargetError(f"{source}: field 'collectives.settings' must be a table of NAME = value, got {overrides!r}")
    kernels = dict(data.get("kernels", {}))
    pass_options = data.get("passes", {})
    if not isinstance(pass_options, Mapping):
        raise TargetError(f"{source}: field 'passes' must be a table of pass options, got {pass_options!r}")
    return Target(name=name, description=r.str("description", default=name), num_devices=num_devices,
                  device=device, topology=topology, collective_backend=backend, kernels=kernels,
                  pass_options=dict(pass_options), source=source,
                  collective_overrides={k: str(v) for k, v in overrides.items()})


class _Reader:
    """Typed access to one TOML table; every error names the full field path."""

    def __init__(self, data: Mapping[str, Any], source: str, prefix: str = ""):
        self.data, self.source, self.prefix = data, source, prefix

    def _err(self, key: str, what: str) -> TargetError:
        return TargetError(f"{self.source}: field '{self.prefix}{key}' {what}")

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def _need(self, key: str) -> Any:
        if key not in self.data:
            raise self._err(key, "is missing")
        return self.data[key]

    def table(self, key: str) -> "_Reader":
        v = self._need(key)
        if not isinstance(v, Mapping):
            raise self._err(key, f"must be a table, got {type(v).__name__}")
        return _Reader(v, self.source, f"{self.prefix}{key}.")

    def str(self, key: str, default: "str | None" = None) -> str:
        if default is not None and key not in self.data:
            return default
        v = self._need(key)
        if not isinstance(v, str):
            raise self._err(key, f"must be a string, got {v!r}")
        return v

    def choice(self, key: str, allowed: tuple[str, ...], default: str) -> str:
        v = self.data.get(key, default)
        if v not in allowed:
            raise self._err(key, f"must be one of {allowed}, got {v!r}")
        return v

    def bool(self, key: str) -> bool:
        v = self._need(key)
        if not isinstance(v, bool):
            raise self._err(key, f"must be true or false, got {v!r}")
        return v

    def int(self, key: str, minimum: int) -> int:
        v = self._need(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise self._err(key, f"must be an integer >= {minimum}, got {v!r}")
        return v

    def _number(self, key: str) -> float:
        v = self._need(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise self._err(key, f"must be a number, got {v!r}")
        return float(v)

    def positive(self, key: str) -> float:
        v = self._number(key)
        if not v > 0:
            raise self._err(key, f"must be positive, got {v!r}")
        return v

    def non_negative(self, key: str) -> float:
        v = self._number(key)
        if not v >= 0:
            raise self._err(key, f"must be >= 0, got {v!r}")
        return v

    def link(self, key: str, required: bool) -> "LinkSpec | None":
        if key not in self.data and not required:
            return None
        t = self.table(key)
        return LinkSpec(bandwidth=t.positive("bandwidth_gbs") * 1e9, latency_s=t.non_negative("latency_us") * 1e-6)

    def islands(self, key: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
        v = self._need(key)
        ok = isinstance(v, list) and v and all(isinstance(i, list) and i for i in v)
        if not ok:
            raise self._err(key, f"must be a non-empty list of non-empty device lists, got {v!r}")
        flat = [d for isl in v for d in isl]
        if sorted(flat) != list(range(num_devices)):
            raise self._err(key, f"must cover devices 0..{num_devices - 1} exactly once, got {v!r}")
        return tuple(tuple(i) for i in v)
