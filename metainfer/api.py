"""metainfer.optimize() and metainfer.bisect(): the public entry points."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from metainfer import targets as _targets
from metainfer.lowering.backend import LOWERINGS, MetainferBackend
from metainfer.passes import resolve
from metainfer.report import Report
from metainfer.verify import BisectResult, EquivalenceError, bisect_captured, mismatch


class OptimizedModel:
    """The optimized callable: same call signature and outputs as the model; `.report`
    says what metainfer did. Attributes it does not have are read from the model."""

    def __init__(self, model: torch.nn.Module, compiled, backend: MetainferBackend, dump_dir: str | None):
        self.model = model
        self._compiled = compiled
        self._backend = backend
        self._dump_dir = dump_dir
        self._dumped_sections = 0

    @property
    def report(self) -> Report:
        return self._backend.report

    @property
    def target(self) -> _targets.Target:
        return self._backend.target

    def __call__(self, *args, **kwargs):
        _check_devices(self.target, args, kwargs, what="input")
        # model constants (eps, attention scales) stay Python numbers in the graph rather than
        # becoming graph inputs, which Dynamo does by default once it compiles dynamic shapes
        with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True):
            out = self._compiled(*args, **kwargs)
        if self._dump_dir and len(self.report.sections) != self._dumped_sections:
            self.report.save(self._dump_dir)
            self._dumped_sections = len(self.report.sections)
        return out

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("model",):
            raise AttributeError(name)
        return getattr(self.model, name)

    def __repr__(self) -> str:
        return f"<metainfer.OptimizedModel of {type(self.model).__name__} for {self.target.name}>"


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


def _tensors(obj, path: str):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]")


def _check_devices(target, args, kwargs, what: str) -> None:
    kind = target.device.kind
    for path, t in _tensors((args, kwargs), what):
        if t.device.type != kind:
            raise ValueError(f"{what} {path} is on {t.device}, but target {target.name!r} drives {kind} "
                             f"devices; move it with .to({kind!r}) or pick a {t.device.type} target")


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


def _build(model, target, passes, disable, lowering, pass_options, capture) -> tuple[MetainferBackend, Any]:
    target = _targets.get(target)
    _validate_model(model, target)
    chosen, disabled, explicit = resolve(target, passes, disable)
    lowering = lowering or "inductor"
    if lowering not in LOWERINGS:
        raise ValueError(f"unknown lowering {lowering!r}; known: {', '.join(LOWERINGS)}")
    backend = MetainferBackend(target, chosen, disabled, explicit=explicit, lowering=lowering,
                               options=pass_options, capture=capture)
    # Each optimize() is a new backend, hence a new Dynamo cache entry for the model class's
    # forward; allow more than the default 8 so a process can optimize many models.
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 64)
    return backend, torch.compile(model, backend=backend, dynamic=os.environ.get("METAINFER_DYNAMIC") == "1" or None)


def optimize(model: torch.nn.Module, target="cpu", *, example_inputs=None, passes: Iterable | None = None,
             disable: Iterable[str] = (), verify: bool = False, dump_dir: str | os.PathLike | None = None,
             lowering: str | None = None, pass_options: dict | None = None) -> OptimizedModel:
    """Optimize `model` for `target`; returns a callable with the model's signature and outputs.

    target: a name from metainfer.targets.names(), a TOML path, or a Target.
    example_inputs: positional inputs (tensor, tuple or list) or keyword inputs (dict); if
        given, the model is compiled now and the report is complete on return.
    passes: explicit pipeline (names or Pass objects); default: the target's pipeline.
    disable: pass names to skip.
    verify: run eager and optimized on example_inputs; on a mismatch raise EquivalenceError
        naming the first pass whose inclusion breaks equivalence.
    dump_dir: write the report and graph dumps there (METAINFER_DUMP does the same).
    lowering: "inductor" (default) or "aot_eager" (same passes, no Inductor codegen).
    """
    args, kwargs = _as_args(example_inputs)
    if verify and example_inputs is None:
        raise ValueError("verify=True needs example_inputs to compare eager and optimized outputs on")
    t = _targets.get(target)
    if example_inputs is not None:
        _check_devices(t, args, kwargs, what="example_inputs")
    backend, compiled = _build(model, t, passes, disable, lowering, pass_options, capture=verify)
    dump = os.fspath(dump_dir) if dump_dir is not None else os.environ.get("METAINFER_DUMP") or None
    opt = OptimizedModel(model, compiled, backend, dump)
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
    t = _targets.get(target)
    _check_devices(t, args, kwargs, what="example_inputs")
    backend, compiled = _build(model, t, passes, disable, lowering, pass_options, capture=True)
    with torch.no_grad():
        ref = model(*args, **kwargs)
        out = compiled(*args, **kwargs)
    found = bisect_captured(backend)
    if found.equivalent and (why := mismatch(ref, out)) is not None:
        return BisectResult(False, None, None, f"the whole model differs ({why}) but no single graph does: "
                                               "errors accumulate across graphs")
    return found
