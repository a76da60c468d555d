"""Multi-rank faults end cleanly (bench/faults.py, run as a developer runs it): a rank killed
mid-forward (collectives on gloo, and on the shared-memory path), a rank that never joins the job's collectives, a rank raising in a pass and a
mismatched collective each end the job with an error naming the rank at fault (a mismatch:
the rank gloo aborted) and what every rank reported, with no rank process, zombie, listening
port or /dev/shm file left behind."""

import json
import os
import subprocess
import sys

import pytest

# each fault starts a job and optimizes a model on every rank; one fault waits out a collective
# timeout of 30 s (shorter ones fire on a loaded machine before the slower rank's compile ends)
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_injected_faults_end_the_job_naming_the_rank(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "faults.py"), "--json", "--timeout", "60"],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    rows = {r["fault"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])["faults"]}
    assert len(rows) == 5, out.stdout[-2000:]
    for name, r in rows.items():
        assert r["raised"] == "RankFailure" and not r["left_behind"], r
        assert set(r["reports"]) == {"0", "1"} and all(r["reports"].values()), r
    assert rows["rank 1 killed mid-forward"]["named_rank"] == 1
    assert "was killed (signal 9)" in rows["rank 1 killed mid-forward"]["first_line"]
    shm = rows["rank 1 killed mid-forward, collectives through shared memory"]
    assert shm["named_rank"] == 1 and "ShmCollectiveError" in shm["reports"]["0"], shm
    assert "rank 1 (pid" in shm["reports"]["0"] and "exited before reaching it" in shm["reports"]["0"], shm
    joins = rows["rank 1 never joins the job's collectives"]
    assert joins["named_rank"] == 1 and "never_joins" in joins["first_line"], joins
    raises = rows["rank 1 raises in a pass"]
    assert raises["named_rank"] == 1 and "deliberate failure in a pass" in raises["reports"]["1"]
    mismatch = rows["mismatched collective (all_reduce of 4 vs 8 elements)"]
    assert "collective mismatch" in mismatch["first_line"] or "mismatch" in json.dumps(mismatch["reports"]), mismatch
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
