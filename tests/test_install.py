"""A non-editable install maps passes/, lowering/, kernels/, models/ to metainfer.* and
works from any directory (the test suite itself runs on the editable install)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_install_imports_everything(tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (site / "metainfer" / "passes" / "fuse_attention.py").is_file()
    assert (site / "metainfer" / "hardware" / "targets" / "pcie8.toml").is_file()
    code = ("import metainfer, metainfer.passes, metainfer.kernels, metainfer.lowering, metainfer.models;"
            "print(metainfer.__file__); print(metainfer.hardware.targets.names())")
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert str(site) in r.stdout and "pcie8" in r.stdout
