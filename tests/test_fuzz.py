"""Differential fuzzing (bench/fuzz.py and bench/fuzz_serving.py, run as a developer runs them):
random Hugging Face models and inputs through metainfer against eager (float64-anchored
tolerances), and a random request stream through the serving engine against its invariants.
The default tier runs a short fixed-seed run; `pytest -m fuzz` the long one.

Bugs the fuzzer found have their own regression tests (tests/test_many_models.py)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fuzz(tmp_path, *args):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "fuzz.py"), "--json", *args],
                         capture_output=True, text=True, timeout=7200, cwd=tmp_path)
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr[-3000:]
    return out.returncode, json.loads(lines[-1]), out.stdout


def test_a_short_fuzz_run_finds_nothing(tmp_path):
    rc, res, log = _fuzz(tmp_path, "--cases", "6", "--streams", "1", "--seed", "0")
    assert res["cases"] + res["invalid"] == 6 and res["cases"] >= 5, log[-3000:]
    assert res["mismatches"] == 0 and res["crashes"] == 0 and not res["stream_failures"], res["failures"]
    assert res["streams"] == 1 and rc == 0


@pytest.mark.fuzz
def test_the_long_fuzz_run_finds_nothing(tmp_path):
    rc, res, log = _fuzz(tmp_path, "--cases", "200", "--streams", "20", "--seed", "1")
    assert len(res["architectures"]) >= 15, res["by_architecture"]
    assert res["mismatches"] == 0 and res["crashes"] == 0 and not res["stream_failures"], res["failures"]
    assert rc == 0
