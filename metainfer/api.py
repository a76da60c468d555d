"""metainfer.optimize() and metainfer.bisect(): the public entry points."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping

import torch

from metainfer.hardware import targets as _targets
from metainfer.runtime.inputs import check_devices
from metainfer.lowering.backend import LOWERINGS, MetainferBackend
from metainfer.passes import resolve
from metainfer.report import Report
from metainfer.runtime.optimized import ACCUMULATED_LIMIT, RECOMPILE_LIMIT, OptimizedModel
from metainfer.runtime.serve_compile import MODES as SERVE_COMPILE_MODES
from metainfer.verify import BisectResult, EquivalenceError, bisect_captured, mismatch


def resolve_target(target: "str | os.PathLike | _targets.Target") -> _targets.Target:
    """The one place a target name or TOML path becomes a Target: every entry point (optimize,
    bisect, analyze, plan, the torch.compile backend, the CLI) calls this once and passes the
    object down."""
    return _targets.get(target)


def _machine_changed(t: _targets.Target) -> str | None:
    """A target whose figures were measured on another machine ([machine] differs from this
    one): words naming what changed, for the report's notes. A calibrated target (the user's
    file) also warns; a built-in one, or one derived from it, only notes it (its figures
    describe the machine they came from, which few users have)."""
    if t.machine is None:
        return None
    import warnings

    from metainfer.hardware import machine

    changed = machine.differences(t.machine, machine.current(gpu=t.device.kind == "cuda"))
    if not changed:
        return None
    if _targets.is_builtin(t):
        return (f"target {t.name!r}'s figures were measured on another machine ({'; '.join(changed)}); "
                "`metainfer calibrate` measures this one")
    message = (f"target {t.name!r} was calibrated on another machine ({'; '.join(changed)}): its figures describe "
               "that machine, not this one; run `metainfer calibrate` here for this machine's")
    warnings.warn(message, machine.MachineChanged, stacklevel=3)
    return message


def plan(model, target="pcie8", **options):
    """metainfer.plan: metainfer.hardware.planner.plan with `target` a name, a TOML path or a
    Target."""
    from metainfer.hardware import planner

    return planner.plan(model, resolve_target(target), **options)


def target_for_device(target, device_capability: tuple[int, int] | None):
    """(target, note or None) as the GPU that runs it allows: one rule for optimize() and for
    torch.compile(backend="metainfer") (targets.for_device with the kernel tables' architectures)."""
    from metainfer.kernels import configs

    return _targets.for_device(target, device_capability, configs.arches())


def inputs_capability(tensors) -> tuple[int, int] | None:
    """The compute capability of the GPU of the first CUDA tensor among `tensors` (None if none)."""
    for t in tensors:
        device = getattr(t, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            return torch.cuda.get_device_capability(device)
    return None


def _gpu_capability(model: torch.nn.Module) -> tuple[int, int] | None:
    """The compute capability of the GPU holding the model's parameters (None off a GPU)."""
    param = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    if param is None or param.device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(param.device)


def _as_args(example_inputs) -> tuple[tuple, dict]:
    if example_inputs is None:
        return (), {}
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (list, tuple)):
        return tuple(example_inputs), {}
    raise TypeError("example_inputs must be a tensor, a tuple/list of positional inputs or a dict of "
                    f"keyword inputs, not {type(example_inputs).__name__}")


def _validate_model(model, target) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    training = [n or type(model).__name__ for n, m in model.named_modules() if m.training]
    if training:
        raise ValueError(f"model is in training mode ({training[0]}{' and others' if len(training) > 1 else ''}); "
                         "call model.eval() before metainfer.optimize (dropout would make outputs random)")
    kind = target.device.kind
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type != kind:
            raise ValueError(f"model {name} is on {t.device}, but target {target.name!r} drives {kind} "
                             f"devices; move the model with .to({kind!r}) or pick a {t.device.type} target")


def _build(model, target, passes, disable, lowering, pass_options, capture, cache_dir, dynamic,
           dump_dir=None, serve_compile: str = "auto", cuda_graphs: bool = True
           ) -> tuple[OptimizedModel, MetainferBackend]:
    target = _targets.required(target, "_build")
    _validate_model(model, target)
    from metainfer.models.quantized import adopt_transformers_fp8

    adopted = adopt_transformers_fp8(model)
    chosen, disabled, explicit = resolve(target, passes, disable)
    lowering = lowering or "inductor"
    if lowering not in LOWERINGS:
        raise ValueError(f"unknown lowering {lowering!r}; known: {', '.join(LOWERINGS)}")
    if dynamic not in (None, True, False):
        raise ValueError(f"dynamic must be None (automatic), True or False, not {dynamic!r}")
    if dynamic is None and os.environ.get("METAINFER_DYNAMIC") == "1":
        dynamic = True
    backend = MetainferBackend(target, chosen, disabled, explicit=explicit, lowering=lowering,
                               options=pass_options, capture=capture, cache_dir=cache_dir,
                               report=Report(target, [p.name for p in chosen]), cuda_graphs=cuda_graphs)
    # recompiles of one optimized model (its own cache: _own_entry): generate() and serving
    # meet several shapes and masks
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, ACCUMULATED_LIMIT)
    remake = functools.partial(optimize, target=target)  # a drafter, optimized as how_optimized() says
    opt = OptimizedModel(model, backend, dynamic=dynamic, dump_dir=dump_dir, serve_compile=serve_compile,
                         remake=remake)
    if adopted:
        opt.report.notes.append(f"model: {adopted} transformers FP8Linear layer(s) replaced in place by metainfer's "
                                "FP8Linear holding the same tensors (transformers' forward needs a kernel from the hub)")
    return opt, backend


def optimize(model: torch.nn.Module, target="cpu", *, example_inputs=None, passes: Iterable | None = None,
             disable: Iterable[str] = (), verify: bool = False, dump_dir: str | os.PathLike | None = None,
             lowering: str | None = None, pass_options: dict | None = None,
             cache_dir: str | os.PathLike | None = None, dynamic: bool | None = None,
             emulate: bool = False, tensor_parallel: int | None = None,
             expert_parallel: bool | None = None, serve_compile: str | None = None,
             cuda_graphs: bool = True) -> OptimizedModel:
    """Optimize `model` for `target`; returns a callable with the model's signature and outputs.

    target: a name from metainfer.hardware.targets.names(), a TOML path, or a Target.
    example_inputs: positional inputs (tensor, tuple or list) or keyword inputs (dict); if
        given, the model is compiled now and the report is complete on return.
    passes: explicit pipeline (names or Pass objects); default: the target's pipeline.
    disable: pass names to skip.
    verify: run eager and optimized on example_inputs; on a mismatch raise EquivalenceError
        naming the first pass whose inclusion breaks equivalence.
    dump_dir: write the report and graph dumps there (METAINFER_DUMP does the same).
    lowering: "inductor" (default) or "aot_eager" (same passes, no Inductor codegen).
    cache_dir: where compiled artifacts are kept and reused across processes (default
        $METAINFER_CACHE_DIR, else ~/.cache/metainfer); see metainfer.cache.
    dynamic: Dynamo's choice for shapes: None (default) compiles the first shapes statically
        and recompiles once with symbolic sizes when they change; True starts symbolic;
        False specialises every shape (one graph per shape).
    emulate: inside a job of several CPU ranks (gloo), run a multi-GPU target's pipeline
        with its topology scaled onto the ranks (docs/distributed.md).
    tensor_parallel: inside a job, the tensor-parallel degree tp (it must divide the world
        size; the other factor is data-parallel replicas); None (default) takes the
        planner's fastest decode plan that metainfer executes.
    expert_parallel: inside a job, spread MoE models' routed experts over each tensor-parallel
        group; None (default) follows the same planner choice.
    serve_compile: when a serving engine's steps (generate_batch, init_continuous_batching)
        switch from eager to the compiled graph: "auto" (default; once the compile's measured or
        predicted cost is at most 20% of the eager serving time, metainfer.runtime.serve_compile),
        "always" (at the first step), "never"; $METAINFER_SERVE_COMPILE sets the default.
    cuda_graphs: on a CUDA target (Inductor lowering), generate()'s decode steps over a static
        KV cache (cache_implementation="static") replay CUDA graphs, one per batch size, instead
        of launching every kernel from Python; False launches them. A serving engine captures
        its own steps (transformers' continuous batching CUDA-graph mode).

    Inside a torch.distributed job of several ranks the model is sharded in place for tensor
    parallelism over each group of tp consecutive ranks (its plan: Hugging Face's
    base_model_tp_plan or a models/ TP_PLAN) and every rank gets a callable whose outputs
    equal the unsharded model's on that rank's inputs.
    """
    args, kwargs = _as_args(example_inputs)
    if serve_compile is not None and serve_compile not in SERVE_COMPILE_MODES:
        raise ValueError(f"serve_compile must be one of {', '.join(SERVE_COMPILE_MODES)}, not {serve_compile!r}")
    if verify and example_inputs is None:
        raise ValueError("verify=True needs example_inputs to compare eager and optimized outputs on")
    from metainfer.parallel import distributed

    t, dist_notes = distributed.prepare(model, resolve_target(target), emulate=emulate, expert_parallel_on=expert_parallel,
                                         tensor_parallel=tensor_parallel)
    t, arch_note = target_for_device(t, _gpu_capability(model))
    machine_note = _machine_changed(t)
    if t.device.kind == "cuda":
        from metainfer.lowering import compile_cache

        compile_cache.point_triton_at(compile_cache.cache_dir(cache_dir))
    dist_notes = dist_notes + [n for n in (arch_note, machine_note) if n]
    if example_inputs is not None:
        check_devices(t, args, kwargs, what="example_inputs")
    dump = os.fspath(dump_dir) if dump_dir is not None else os.environ.get("METAINFER_DUMP") or None
    opt, backend = _build(model, t, passes, disable, lowering, pass_options, capture=verify, cache_dir=cache_dir,
                          dynamic=dynamic, dump_dir=dump, cuda_graphs=bool(cuda_graphs),
                          serve_compile=serve_compile or os.environ.get("METAINFER_SERVE_COMPILE") or "auto")
    opt.report.notes.extend(dist_notes)
    if example_inputs is None:
        return opt
    out = opt(*args, **kwargs)
    if not opt.report.sections:
        raise RuntimeError("torch.compile did not hand any graph to metainfer (is the model's forward "
                           "excluded from Dynamo, or was its recompile limit reached?)")
    if verify:
        with torch.no_grad():
            ref = model(*args, **kwargs)
        why = mismatch(ref, out)
        if why is not None:
            found = bisect_captured(backend)
            opt.report.notes.append(f"verify: outputs differ from eager: {why}")
            culprit = f"; first failing pass: {found.pass_name!r}" if found.pass_name else ""
            raise EquivalenceError(f"optimized outputs differ from eager on the example inputs: {why}{culprit}. "
                                   f"{found.detail}", pass_name=found.pass_name, graph_index=found.graph_index)
        opt.report.notes.append("verify: outputs equal eager's on the example inputs (within dtype tolerance)")
        if dump:
            opt.report.save(dump)
    return opt


def bisect(model: torch.nn.Module, example_inputs, target="cpu", *, passes: Iterable | None = None,
           disable: Iterable[str] = (), lowering: str | None = None,
           pass_options: dict | None = None) -> BisectResult:
    """Find the first pass of the pipeline whose inclusion makes outputs differ from eager.

    Compiles once with the full pipeline (capturing each graph and its inputs), then for each
    graph re-compiles growing prefixes of the passes that ran on it and compares that graph's
    outputs with running it eagerly."""
    args, kwargs = _as_args(example_inputs)
    t = resolve_target(target)
    check_devices(t, args, kwargs, what="example_inputs")
    opt, backend = _build(model, t, passes, disable, lowering, pass_options, capture=True, cache_dir=None,
                          dynamic=None)
    with torch.no_grad():
        ref = model(*args, **kwargs)
    out = opt(*args, **kwargs)
    found = bisect_captured(backend)
    if found.equivalent and (why := mismatch(ref, out)) is not None:
        return BisectResult(False, None, None, f"the whole model differs ({why}) but no single graph does: "
                                               "errors accumulate across graphs")
    return found
