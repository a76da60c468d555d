import importlib.metadata
import os
import sys
from pathlib import Path

# `python -m pytest` puts the checkout's root on sys.path, where the kernels/ folder (installed
# as metainfer.kernels) would shadow PyPI's `kernels`, which transformers >= 5.25 imports.
# With metainfer installed the root is not needed (spawned ranks inherit this sys.path); a
# source-tree run (PYTHONPATH=., no install) keeps it.
_ROOT = Path(__file__).resolve().parents[1]
try:
    importlib.metadata.distribution("metainfer")
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _ROOT]
except importlib.metadata.PackageNotFoundError:
    pass

import pytest  # noqa: E402
import torch  # noqa: E402

# Keep metainfer's record cache inside the test run (Inductor's own cache is left alone:
# reusing it between runs only makes them faster, and cache hits are a case under test).
os.environ.setdefault("METAINFER_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "metainfer"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def interpret():
    """Run metainfer's ops through the Triton kernels under Triton's interpreter."""
    from metainfer import kernels

    if not kernels.INTERPRETED:
        pytest.skip("kernels were built for a GPU (set METAINFER_TRITON_INTERPRET=1 to interpret)")
    with kernels.interpret(True):
        yield


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    """Dynamo keeps per-code-object state (cache entries, automatic-dynamic decisions, graph
    breaks seen) across models of one class; start each test module from a clean slate."""
    torch._dynamo.reset()
    yield


@pytest.fixture
def python_c():
    """Run `python -c code` in a fresh interpreter (what a process that never imported this test
    run's modules sees): returns its stdout; a non-zero exit fails with its stderr."""
    import subprocess
    import tempfile

    def run(code: str, timeout: float = 120) -> str:
        # not from the checkout: `-c` puts the working directory first on sys.path, where kernels/
        # would shadow the `kernels` package transformers imports
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                           cwd=tempfile.gettempdir())
        assert r.returncode == 0, r.stderr
        return r.stdout

    return run
