"""bench/gpu_check.py, the prepared script for a GPU machine, runs end to end on CPU in its
dry-run mode: every check at a tiny size through Triton's interpreter, against its reference;
every row states its peak GPU memory and estimated H100 time, the whole run fits 8 minutes and
--quick 3 (estimates), and on a GPU a check over its stated peak or a device too small is named."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpu_script_dry_run_checks_every_kernel(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--dry-run", "--json", str(out)],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)  # a hang guard
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    kernels = {line.split()[0] for line in lines if " ok " in line}
    assert kernels == {"attention", "paged_attention", "rmsnorm", "glu", "rope", "fp8_gemm", "int4_gemm", "moe",
                       "sparse_attention", "mla_decode", "token_ids", "dispatch", "autotune", "collectives", "end_to_end"}
    assert "32 checks, 0 failed" in proc.stdout
    data = json.loads(out.read_text())
    rows = data["checks"]
    assert data["calibration"] is None and data["device"] == "cpu (dry run)"  # measured on a GPU only
    assert len(rows) == 32 and all(r["stated_peak_gib"] > 0 and r["est_s"] > 0 for r in rows)
    assert data["estimated_s"] == sum(r["est_s"] for r in rows) and data["estimated_s"] + 30 < 8 * 60  # + calibration
    # the end-to-end row's budget counts the graphs it compiles, measured here
    import re

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    (compiled,) = re.findall(r"; (\d+) graphs compiled", proc.stdout)
    assert int(compiled) == gpu_check.E2E_COMPILES, "update E2E_COMPILES (and see that the budget still fits)"
    # the 80 GB H100 holds every check with room; the MoE rows (DeepSeek-V3's 256 experts) name their need
    assert max(r["stated_peak_gib"] for r in rows) <= 0.92 * 79


def test_quick_is_one_check_a_family_within_three_minutes():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    quick = [c for c in gpu_check.CHECKS if c.quick]
    assert sum(c.est_s for c in quick) < 180
    assert {c.kernel for c in quick} >= {"attention", "paged_attention", "fp8_gemm", "int4_gemm", "moe",
                                        "mla_decode", "sparse_attention", "dispatch", "collectives"}


def test_a_check_over_its_stated_peak_or_larger_than_the_gpu_is_named(monkeypatch):
    """run() on a pretend GPU: a check that allocates past its statement fails naming both figures;
    one that states more than the device has is skipped by name, not run."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)

    class Props:
        total_memory = 24 * 2**30  # an L4-class card

    peaks = iter([3 * 2**30])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: Props())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *_: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *_: next(peaks))
    small = lambda dev, f: {"ours": lambda: torch.ones(2), "reference": lambda: torch.ones(2),  # noqa: E731
                            "torch": lambda: torch.ones(2), "dtype": torch.float32, "once": True}
    rows = gpu_check.run([gpu_check.Check("k", "over", small, 2, 1), gpu_check.Check("k", "huge", small, 40, 1)],
                         "cuda", 1.0)
    assert rows[0]["ok"] is False and rows[0]["error"] == "peak 3.0 GiB over the stated 2 GiB"
    assert rows[1]["ok"] is True and rows[1]["skipped"] == "needs 40 GiB, this GPU has 24 GiB"
