"""metainfer inside a torch.distributed job: the process group, the target's topology over
the job's ranks, and the degrees the model is sharded with (metainfer.parallel.sharding applies them).

    torchrun --nproc-per-node 8 my_script.py      # my_script calls metainfer.optimize(...)

- `start(target)` starts the process group (if the job has not) with the collective
  library's settings that the target recommends (`Target.collective_settings()`) set first;
  backend from the target (nccl) or gloo for CPU runs.
- `emulated(target, world_size)`: the target's topology scaled onto `world_size` CPU ranks
  (2 islands x 4 -> 2 x 2 on 4 ranks), device rates and links unchanged, device kind "cpu":
  how the pcie8 pipeline runs under gloo in tests, every decision from pcie8's numbers.
- `choose_degrees(...)`: tp (and dp = world / tp) and whether experts are spread, from the
  planner's fastest plan that metainfer executes (no pipeline stages yet), or as the caller
  fixed them (`optimize(..., tensor_parallel=, expert_parallel=)`).
- `prepare(...)`: the model sharded with its own plan (metainfer.parallel.sharding) inside each group
  of tp consecutive ranks, experts spread over that group where chosen; clear errors before
  any collective when the plan is missing or cannot be honoured.

What the passes need from the job they compile in (this rank's place, the islands' sub-groups,
agreement across ranks) is in metainfer.passes.ranks, below this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from metainfer.hardware import targets as _targets
from metainfer.parallel import sharding
from metainfer.passes import ranks
from metainfer.passes.ranks import island_groups, rank, world_size

DEFAULT_TIMEOUT_S = 300.0


def start(target: _targets.Target, *, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Start the default process group from torchrun's environment unless the job already
    has; set the target's collective-library settings first (ones the user set win).
    Returns the settings applied, "NAME=value" each."""
    t = _targets.required(target, "distributed.start")
    applied = apply_collective_settings(t)
    if not dist.is_initialized():
        backend = backend or ("nccl" if t.device.kind == "cuda" and torch.cuda.is_available() else "gloo")
        if backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return applied


def apply_collective_settings(target: _targets.Target) -> list[str]:
    """The target's collective-library settings into the environment, before a process group
    starts (ones the user set win); returns those applied, "NAME=value" each."""
    applied = []
    for name, (value, _) in target.collective_settings().items():
        if name not in os.environ:
            os.environ[name] = value
            applied.append(f"{name}={value}")
    return applied


def emulated(target: _targets.Target, world: int, device_kind: str = "cpu") -> _targets.Target:
    """`target` scaled onto `world` ranks (CPU ranks under gloo by default): the same number
    of islands where `world` divides evenly over them (else one island), rates and links
    unchanged."""
    t = _targets.required(target, "distributed.emulated")
    if world > t.num_devices:
        raise ValueError(f"{world} ranks but target {t.name!r} has {t.num_devices} devices")
    m = len(t.topology.islands)
    if world % m or world < m:
        m = 1
    k = world // m
    islands = tuple(tuple(range(i * k, (i + 1) * k)) for i in range(m))
    topo = dataclasses.replace(t.topology, islands=islands,
                               inter_island=t.topology.inter_island if m > 1 else None)
    dev = dataclasses.replace(t.device, kind=device_kind)
    where = f"{world} CPU ranks" if device_kind == "cpu" else f"{world} {device_kind} ranks"
    return dataclasses.replace(t, name=f"{t.name}@{m}x{k}", num_devices=world, device=dev, topology=topo,
                               description=f"{t.description}, emulated on {where} ({m} island(s) of {k})"
                                           + (" with gloo" if device_kind == "cpu" else ""))


def host_ranks(target: _targets.Target, world: int) -> _targets.Target:
    """A one-device CPU target (a host) run as `world` ranks of that host: each rank has a
    1/world share of its FLOP/s, memory bandwidth and memory (the ranks split its cores, one
    island), and they talk over the links the target declares for processes of the host (gloo's
    loopback; metainfer's shared-memory path where a calibration measured it)."""
    t = _targets.required(target, "distributed.host_ranks")
    if t.device.kind != "cpu" or t.num_devices != 1:
        raise ValueError(f"host_ranks splits a one-device CPU target, not {t.name!r} ({t.num_devices} x {t.device.kind})")
    d = t.device
    dev = dataclasses.replace(d, peak_flops={k: v / world for k, v in d.peak_flops.items()},
                              memory_bytes=d.memory_bytes / world, memory_bandwidth=d.memory_bandwidth / world,
                              cache_bytes=d.cache_bytes / world, cache_bandwidth=d.cache_bandwidth / world,
                              stream_bandwidth=d.stream_bandwidth / world)
    topo = dataclasses.replace(t.topology, islands=(tuple(range(world)),), inter_island=None)
    return dataclasses.replace(t, name=f"{t.name}@{world}", num_devices=world, device=dev, topology=topo,
                               description=f"{t.description}, as {world} ranks of one host (each 1/{world} of it)")


_TP_MESHES: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def tp_mesh(model: torch.nn.Module):
    """The tensor-parallel mesh prepare() sharded `model` over (None if it did not)."""
    return _TP_MESHES.get(model)


def prepare(model: torch.nn.Module, target: _targets.Target, *, emulate: bool, expert_parallel_on: bool | None = None,
            tensor_parallel: int | None = None) -> tuple[_targets.Target, list[str]]:
    """Inside a job of several ranks: the target over the job's ranks (emulated on CPU ranks
    if asked), the degrees chosen (`choose_degrees`), the model sharded for tensor
    parallelism inside each group of `tp` consecutive ranks (dp = world / tp replicas), the
    island sub-groups created. Returns (target, notes for the report). Outside a job:
    unchanged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    t = _targets.required(target, "distributed.prepare")
    w = world_size()
    if w <= 1:
        if emulate:
            raise ValueError("emulate=True runs a multi-device target on CPU ranks: start a process group of "
                             "several ranks first (torchrun, or metainfer.parallel.multirank.run in tests)")
        if tensor_parallel not in (None, 1):
            raise ValueError(f"tensor_parallel={tensor_parallel} needs a job of that many ranks (torchrun)")
        return t, []
    if t.device.kind == "cpu" and t.num_devices == 1 and not emulate:
        t = host_ranks(t, w)
    if w > t.num_devices:
        raise ValueError(f"the job has {w} ranks but target {t.name!r} has {t.num_devices} devices")
    if emulate:
        t = emulated(t, w, "cuda" if dist.get_backend() == "nccl" else "cpu")
    elif w < t.num_devices:
        raise ValueError(f"the job has {w} ranks but target {t.name!r} has {t.num_devices} devices; run one rank "
                         "per device, or emulate=True to scale the target's topology onto the job's ranks")
    notes = []
    if emulate:
        notes.append(f"emulated: {t.description}; every decision takes the target's numbers, times are predictions")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        notes.append("model already sharded (DTensor parameters): used as it is")
        island_groups(t)
        return t, notes
    moe = sharding.has_experts(model)
    if expert_parallel_on and not moe:
        raise ValueError(f"expert_parallel=True but {type(model).__name__} has no MoE layer that can spread its "
                         "experts (a models/ layer's shard_experts, or a Hugging Face base_model_ep_plan)")
    degrees = choose_degrees(model, t, w, tensor_parallel=tensor_parallel,
                             expert_parallel=expert_parallel_on if moe else False)
    tp, ep_on = degrees.tp, degrees.expert_parallel
    notes.append(degrees.why)
    if ep_on and tp == 1:
        raise ValueError("expert_parallel=True spreads experts over a tensor-parallel group, and tensor_parallel=1 "
                         "has none (all-to-all dispatch across data-parallel replicas is not implemented)")
    if ep_on:  # checked before any weight moves
        sharding.check_expert_parallel(model, tp)
    if tp > 1:
        sharding.check_shardable(model, tp)  # before the mesh's groups are made
        mesh = (init_device_mesh(t.device.kind, (w,)) if tp == w else
                init_device_mesh(t.device.kind, (w // tp, tp), mesh_dim_names=("dp", "tp"))["tp"])
        plan = sharding.shard(model, mesh)
        _TP_MESHES[model] = mesh
        members = dist.get_process_group_ranks(mesh.get_group())
        notes.append(f"tensor parallel over ranks {members} (rank {rank()}): {len(plan)} plan entries of "
                     f"{type(model).__name__} applied with DTensor parallelize_module"
                     + (f"; {w // tp} data-parallel replicas, each rank serving its own inputs" if tp < w else ""))
        if ep_on:
            n = sharding.expert_parallel(model, mesh.get_group())
            notes.append(f"expert parallel over those {tp} ranks: routed experts of {n} MoE layer(s) spread, "
                         "their outputs summed by an all-reduce")
    else:
        notes.append(f"data parallel: {w} replicas of the whole model, each rank serving its own inputs; no "
                     "collective in the forward")
    island_groups(t)
    return t, notes


@dataclass(frozen=True)
class Degrees:
    tp: int
    expert_parallel: bool
    why: str  # for the report


def choose_degrees(model: torch.nn.Module, target: _targets.Target, world: int, *,
                   tensor_parallel: int | None = None, expert_parallel: bool | None = None,
                   phase: str = "decode") -> Degrees:
    """The tensor-parallel degree and whether experts are spread: the planner's fastest
    executable plan for `phase` (decode by default: a job serves both phases with one plan)
    for the model on `target` over `world` ranks, within what the caller fixed. Without a
    planner result (a model whose shape it cannot read, or that fits no plan), tensor
    parallel over every rank."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
    if tensor_parallel is not None:
        if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be a positive integer, got {tensor_parallel!r}")
        if world % tensor_parallel:
            raise ValueError(f"tensor_parallel={tensor_parallel} does not match the job's {world} ranks: tp x dp "
                             f"must equal the world size (tp one of {[d for d in range(1, world + 1) if world % d == 0]})")
    result = _planner_result(model, target)
    if result is None or phase not in result.phases:
        tp = tensor_parallel or world
        return Degrees(tp, bool(expert_parallel),
                       f"degrees: tp{tp} (the planner cannot read {type(model).__name__}'s shape; "
                       + ("as asked)" if tensor_parallel else "tensor parallel over every rank)"))
    ph = result.phases[phase]
    # MoE layers (models/ and Hugging Face's) keep their routed experts whole under the TP plan
    # (they are spread by expert parallelism instead), while the planner prices ep = 1 as experts split like the
    # MLP: with tp > 1 only its expert-parallel plans are what would run
    whole_experts = isinstance(model, torch.nn.Module) and sharding.has_experts(model)
    fits = [c for c in ph.candidates if c.runs and c.executable
            and not (whole_experts and c.plan.tp > 1 and c.plan.ep == 1)
            and (tensor_parallel is None or c.plan.tp == tensor_parallel)
            and (expert_parallel is None or (c.plan.ep > 1) == expert_parallel)]
    fits.sort(key=lambda c: -c.tokens_per_second)
    top = ph.chosen.plan.label if ph.chosen else "(none)"
    if not fits:
        tp = tensor_parallel or world
        return Degrees(tp, bool(expert_parallel),
                       f"degrees: tp{tp}{' with experts spread' if expert_parallel else ''} as asked; the planner "
                       f"on {target.name} ({phase}, {ph.batch} x {ph.seq}) prices no executable plan like it; its "
                       f"choice: {top}")
    best = fits[0].plan
    asked = "within what was asked, " if tensor_parallel is not None or expert_parallel is not None else ""
    why = (f"degrees: {best.label}: the planner's fastest plan that metainfer executes, {asked}for {phase} "
           f"({ph.batch} x {ph.seq}) on {target.name}, predicted {fits[0].tokens_per_second:,.0f} tok/s")
    if ph.what_if is not None:
        why += (f"; {ph.what_if.plan.label} is predicted faster but needs pipeline stages or all-to-all expert "
                "dispatch, not executed yet")
    other = result.phases.get("prefill" if phase == "decode" else "decode")
    if other is not None and other.chosen is not None:
        why += f"; for {other.phase} it would pick {other.chosen.plan.label} (one plan serves both phases here)"
    return Degrees(best.tp, best.ep > 1, why)


def _planner_result(model, target):
    """The planner's plans for this model on the job's target (its default workloads), or
    None where it cannot read the model's shape or nothing fits."""
    from metainfer.hardware import planner, shapes

    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    try:
        return planner.plan(shapes.resolve(cfg), target)
    except Exception:
        return None


# ---- one process standing for a whole job ------------------------------------------------

@contextlib.contextmanager
def fake_job(world: int):
    """Rank 0 of a `world`-rank job in this one process, on torch's "fake" process group:
    sharding and capture see the real per-rank shapes and collectives, and nothing is sent.
    How a multi-device target is analysed on a laptop (metainfer.analyze(..., ranks=N))."""
    if dist.is_initialized():
        raise RuntimeError("already inside a torch.distributed job: analyse there without ranks=")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        ranks.forget_job()
