"""Every bench script runs against the installed package from any working directory (issue 52,
item 7): none puts the repository root on sys.path, where its kernels/ folder would shadow the
`kernels` package transformers imports (`python bench/bench_collectives.py` failed so: "cannot
import name 'CUDAProperties' from 'kernels'"). Each script's --help (its argument parser, after
all of its imports) runs in a subprocess whose working directory holds nothing of the
repository, with its folder on sys.path as Python puts a script's; afterwards the repository
root must not be on sys.path. The helper modules without a command line are imported the same way."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if "ArgumentParser" in p.read_text())
HELPERS = sorted(p for p in BENCH.glob("*.py") if p not in SCRIPTS)


ROOT = BENCH.parent


def _clean_env():
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}


def _run(body: str, cwd) -> subprocess.CompletedProcess:
    """body, then a check that the repository root is not on sys.path, in a fresh interpreter
    whose sys.path holds bench/ (as for a script there) and not the working directory."""
    code = (f"import os, sys\nsys.path[0] = {str(BENCH)!r}\n{body}\n"
            f"assert {str(ROOT)!r} not in [os.path.abspath(p) for p in sys.path], 'the repository root is on sys.path'\n")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=240)


def test_every_bench_file_is_a_script_or_a_helper():
    assert len(SCRIPTS) >= 20 and {p.name for p in HELPERS} == {"_cuda_timing.py", "_memory.py", "deepseek_forms.py"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_bench_script_runs_from_a_clean_directory(script, tmp_path):
    r = _run(f"import runpy\nsys.argv = [{str(script)!r}, '--help']\ntry:\n"
             f"    runpy.run_path({str(script)!r}, run_name='__main__')\nexcept SystemExit as e:\n"
             "    assert e.code in (0, None), e.code", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout


@pytest.mark.parametrize("helper", HELPERS, ids=lambda p: p.name)
def test_a_bench_helper_imports_from_a_clean_directory(helper, tmp_path):
    r = _run(f"import {helper.stem}", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
