"""bench/gpu_check.py, the prepared script for a GPU machine, runs end to end on CPU in its
dry-run mode: every check at a tiny size through Triton's interpreter, against its reference."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpu_script_dry_run_checks_every_kernel():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)  # a hang guard
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    kernels = {line.split()[0] for line in lines if " ok " in line}
    assert kernels == {"attention", "paged_attention", "rmsnorm", "glu", "rope", "fp8_gemm", "int4_gemm", "moe",
                       "sparse_attention", "mla_decode", "token_ids", "dispatch", "autotune", "collectives", "end_to_end"}
    assert "32 checks, 0 failed" in proc.stdout
