"""`torch.compile(model, backend="metainfer", options={"target": "pcie8", ...})`: the entry
point registered under `torch_dynamo_backends`, and the report of its last compilation."""

from __future__ import annotations

from typing import Any

from metainfer import api
from metainfer.api import resolve_target
from metainfer.lowering.backend import MetainferBackend
from metainfer.passes import resolve
from metainfer.report import Report

_OPTION_KEYS = ("target", "passes", "disable", "lowering", "dump_dir", "pass_options", "cache_dir")
_last: dict[str, Any] = {"key": None, "backend": None}


def metainfer_backend(gm, example_inputs, options: dict | None = None, **unused):
    """Entry point registered under `torch_dynamo_backends` as "metainfer"."""
    opts = dict(options or {})
    unknown = set(opts) - set(_OPTION_KEYS)
    if unknown:
        raise ValueError(f"unknown metainfer backend options {sorted(unknown)}; known: {list(_OPTION_KEYS)}")
    key = id(options)
    if _last["key"] != key or _last["backend"] is None:
        # the GPU the graph runs on decides as it does for optimize() (an A100 under an sm_89
        # target: no FP8 dot; an H100: sm_90's rows)
        target, arch_note = api.target_for_device(resolve_target(opts.get("target", "cpu")),
                                                  api.inputs_capability(example_inputs))
        passes, disabled, explicit = resolve(target, opts.get("passes"), opts.get("disable", ()))
        report = Report(target, [p.name for p in passes])
        if arch_note:
            report.notes.append(arch_note)
        _last["backend"] = MetainferBackend(target, passes, disabled, explicit=explicit, report=report,
                                            lowering=opts.get("lowering", "inductor"),
                                            options=opts.get("pass_options"), cache_dir=opts.get("cache_dir"))
        _last["key"] = key
    backend: MetainferBackend = _last["backend"]
    compiled = backend(gm, example_inputs)
    dump = opts.get("dump_dir") or _env_dump()
    if dump:
        backend.report.save(dump)
    return compiled


def last_report() -> Report | None:
    """The report of the most recent torch.compile(..., backend="metainfer") compilation."""
    b = _last["backend"]
    return b.report if b is not None else None


def _env_dump():
    import os

    return os.environ.get("METAINFER_DUMP") or None
