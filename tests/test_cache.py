"""Compile-artifact reuse: a second optimize() in a fresh process reuses what the first
compiled; a change to a pass's source, the pipeline or its options does not; the cache can be
listed and cleared."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import metainfer

# A child process: optimize models/llama-tiny (one layer) and say what the report says. The
# pipeline is fuse_attention plus a pass defined in a file the test writes (so the test can
# change a pass's source between runs).
CHILD = textwrap.dedent('''
    import json, sys, time
    import torch, metainfer
    from metainfer import models
    sys.path.insert(0, sys.argv[2])
    import extra_pass
    model = models.build("llama-tiny", n_layers=1)
    (ids,) = models.example_inputs("llama-tiny", seq=8)
    t0 = time.perf_counter()
    opt = metainfer.optimize(model, "cpu", example_inputs=(ids,), cache_dir=sys.argv[1],
                             passes=["fuse_attention", extra_pass.PASS], pass_options=json.loads(sys.argv[3]))
    (longer,) = models.example_inputs("llama-tiny", seq=13)  # a second graph, of symbolic length
    with torch.no_grad():
        ok = all(torch.allclose(opt(x), model(x), atol=1e-5) for x in (ids, longer))
    print(json.dumps({"seconds": time.perf_counter() - t0, "ok": ok,
                      "from_cache": [s.from_cache for s in opt.report.sections],
                      "matches": opt.report.matches("fuse_attention"),
                      "extra_ran": [r.ran for r in opt.report.passes if r.name == "count_nodes"]}))
''')

EXTRA_PASS = textwrap.dedent('''
    from metainfer.passes import FunctionPass, PassResult

    def count_nodes(graph, ctx):
        """graph -> graph (counts nodes: {version})"""
        return PassResult(modified=False, decisions=[f"{{len(graph.nodes)}} nodes"])

    PASS = FunctionPass("count_nodes", count_nodes)
''')


@pytest.fixture
def child(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    pass_dir = tmp_path / "passes_src"
    pass_dir.mkdir()
    cache = tmp_path / "cache"

    def run(version="v1", options=None):
        (pass_dir / "extra_pass.py").write_text(EXTRA_PASS.format(version=version))
        env = {k: v for k, v in os.environ.items() if k not in ("METAINFER_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
        r = subprocess.run([sys.executable, str(script), str(cache), str(pass_dir), json.dumps(options or {})],
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    run.cache = cache
    return run


def test_fresh_process_reuses_and_changes_invalidate(child):
    cold = child()
    assert cold["ok"] and cold["from_cache"] == [False, False] and cold["matches"] == 2
    warm = child()
    assert warm["ok"] and warm["from_cache"] == [True, True], "both graphs, the symbolic one too"
    assert warm["matches"] == 2 and warm["extra_ran"] == [True, True], "the report is whole from the record cache"
    # a pass whose source changed is a new pipeline (options, target and the pass list are
    # in the same key: tests/test_backend.py::test_uuid_is_stable_and_tracks_the_pipeline)
    assert child(version="v2")["from_cache"] == [False, False]

    info = metainfer.cache.info(child.cache)
    assert info["records"]["files"] == 4 and info["inductor"]["files"] > 0
    assert metainfer.cache.clear(child.cache) > 0
    info = metainfer.cache.info(child.cache)
    assert info["records"]["files"] == info["inductor"]["files"] == 0


def test_cache_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("METAINFER_CACHE_DIR", str(tmp_path / "env"))
    assert metainfer.cache.directory() == (tmp_path / "env").resolve()
    assert metainfer.cache.directory(tmp_path / "explicit") == (tmp_path / "explicit").resolve()
    monkeypatch.delenv("METAINFER_CACHE_DIR")
    assert metainfer.cache.directory().name == "metainfer"


def test_cli_cache_info_and_clear(tmp_path):
    from metainfer.cli import main

    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "x.json").write_text("[]")
    assert main(["cache", "info", "--dir", str(tmp_path)]) == 0
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert not (tmp_path / "records").exists()
