"""metainfer: a compiler-pass framework for LLM inference on long-tail accelerators.

    opt = metainfer.optimize(model, target="pcie8", example_inputs=(ids,))
    opt(ids); print(opt.report); opt.report.save("dump/")
"""

from __future__ import annotations

from pathlib import Path as _Path

# The design card fixes passes/, lowering/, kernels/ and models/ as top-level folders; an
# install maps them to metainfer.* (pyproject.toml). Run from a source tree without an
# install (e.g. PYTHONPATH=.), let this package find them beside itself.
_here = _Path(__file__).resolve().parent
if not (_here / "passes").is_dir() and (_here.parent / "passes" / "__init__.py").is_file():
    __path__.append(str(_here.parent))  # noqa: F821  (the package's own __path__)

__version__ = "0.1.0"

from . import targets  # noqa: E402
from . import cache  # noqa: E402
from .verify import BisectResult, EquivalenceError  # noqa: E402
from .api import OptimizedModel, bisect, optimize  # noqa: E402
from .analyze import analyze  # noqa: E402
from .planner import PlanError, plan  # noqa: E402
from .report import Report  # noqa: E402
from .targets import Target  # noqa: E402


def last_report():
    """The report of the latest torch.compile(..., backend="metainfer") compilation."""
    from .lowering.backend import last_report as _last

    return _last()


__all__ = ["optimize", "analyze", "plan", "PlanError", "bisect", "cache", "EquivalenceError", "BisectResult", "OptimizedModel", "Report", "Target",
           "targets", "last_report", "__version__"]
