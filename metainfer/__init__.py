"""metainfer: a compiler-pass framework for LLM inference on long-tail accelerators.

    opt = metainfer.optimize(model, target="pcie8", example_inputs=(input_ids,))
    opt(input_ids); print(opt.report); opt.report.save("dump/")
"""

from __future__ import annotations

import importlib
from pathlib import Path as _Path

# The design card fixes passes/, lowering/, kernels/ and models/ as top-level folders; an
# install maps them to metainfer.* (pyproject.toml). Run from a source tree without an
# install (e.g. PYTHONPATH=.), let this package find them beside itself.
_here = _Path(__file__).resolve().parent
if not (_here / "passes").is_dir() and (_here.parent / "passes" / "__init__.py").is_file():
    __path__.append(str(_here.parent))  # noqa: F821  (the package's own __path__)

__version__ = "0.1.0"


def _choose_triton_mode() -> None:
    """Triton's interpreter (kernels on CPU tensors) must be chosen before anything imports
    triton.language (torch._dynamo does), since Triton's own library functions are decorated
    then: on a machine without CUDA, or with METAINFER_TRITON_INTERPRET=1. A CPU build of
    torch says so in its version, without the second it takes to import it."""
    import os

    if os.environ.get("METAINFER_TRITON_INTERPRET") == "1":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return
    from importlib import metadata

    try:
        cpu_build = metadata.version("torch").endswith("+cpu")
    except metadata.PackageNotFoundError:
        return
    if cpu_build:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return
    if _cuda_devices() == 0:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _cuda_devices() -> int:
    """GPUs visible, counted without initialising CUDA in this process: torch.cuda.is_available()
    initialises the CUDA runtime, after which processes forked from this one (a forkserver that
    preloads metainfer, multirank's ranks) cannot use CUDA. NVML counts without that; where NVML
    cannot answer, the device nodes do."""
    import glob

    import torch

    if not torch.cuda._is_compiled():
        return 0
    count = getattr(torch.cuda, "_device_count_nvml", lambda: -1)()
    if count >= 0:
        return count
    return len(glob.glob("/dev/nvidia[0-9]*"))


_choose_triton_mode()

from .hardware import targets  # noqa: E402  (plain Python: no torch)

# Everything else imports torch (seconds): loaded on first use, so `metainfer --help` and
# `metainfer targets` stay fast.
_LAZY = {
    "optimize": "api", "bisect": "api", "OptimizedModel": "api",
    "analyze": "analyze", "plan": "api", "PlanError": "hardware.planner",
    "EquivalenceError": "verify", "BisectResult": "verify", "CaptureError": "runtime.model_capture",
    "Report": "report", "Target": "hardware.targets", "cache": None, "load": "loading",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'metainfer' has no attribute {name!r}")
    module = _LAZY[name]
    value = importlib.import_module(f".{name if module is None else module}", __name__)
    if module is not None:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def last_report():
    """The report of the latest torch.compile(..., backend="metainfer") compilation."""
    from .dynamo_backend import last_report as _last

    return _last()


__all__ = ["optimize", "load", "analyze", "plan", "PlanError", "bisect", "cache", "EquivalenceError", "CaptureError",
           "BisectResult", "OptimizedModel", "Report", "Target", "targets", "last_report", "__version__"]
