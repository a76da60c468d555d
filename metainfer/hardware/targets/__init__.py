"""Hardware targets: what metainfer compiles for, loaded from TOML.

A target describes one box: the device kind and its peak rates, memory, and how the
devices are wired (islands of devices behind one PCIe switch / NUMA node, links inside
and across islands, whether P2P works). Built-ins live beside this file as `<name>.toml`,
each number with its source in a comment; users pass their own TOML path.

Units in TOML are the ones datasheets use (TFLOP/s, GiB, GB/s, us); the `Target` object
holds SI units (FLOP/s, bytes, bytes/s, s). Every key is declared once, in schema.py, which
reads (`from_dict`), writes (`to_toml`) and describes (`describe`) the TOML.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["Target", "DeviceSpec", "LinkSpec", "Topology", "TargetError", "names", "get", "load", "builtins", "required",
           "from_dict", "to_toml", "describe"]

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
    """A Target from a parsed TOML table, read through the schema (schema.KEYS: every key's unit,
    check and default). Every missing or invalid field is reported at once, in one TargetError.
    Fields that cannot apply to the device are optional: a CPU has no TF32 mode and no FP8 units
    (both run as fp32 there), and a one-device box has no topology to describe (its [topology]
    may be left out) and a default collective backend."""
    return schema.read(data, source)


# the schema reads into and writes from the classes above
from metainfer.hardware.targets import schema  # noqa: E402
from metainfer.hardware.targets.schema import describe, to_toml  # noqa: E402
