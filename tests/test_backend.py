"""torch.compile(backend="metainfer"), the entry point, and the compile caches."""

from importlib.metadata import entry_points

import pytest
import torch

import metainfer
from metainfer import models
from metainfer.lowering import backend as be


def test_entry_point_is_registered():
    eps = entry_points(group="torch_dynamo_backends")
    assert "metainfer" in {e.name for e in eps}
    assert "metainfer" in torch._dynamo.list_backends()


def test_torch_compile_with_options():
    model = models.build("llama-tiny", n_layers=1)
    (ids,) = models.example_inputs("llama-tiny", seq=8)
    f = torch.compile(model, backend="metainfer", options={"target": "cpu", "lowering": "aot_eager"})
    with torch.no_grad():
        torch.testing.assert_close(f(ids), model(ids), atol=1e-5, rtol=1e-5)
    assert metainfer.last_report().matches("fuse_attention") == 1


def test_unknown_backend_option():
    f = torch.compile(models.build("llama-tiny", n_layers=1), backend="metainfer", options={"tgt": "cpu"})
    with pytest.raises(Exception, match="unknown metainfer backend options"):
        f(torch.zeros(1, 4, dtype=torch.long))


def test_uuid_is_stable_and_tracks_the_pipeline():
    from metainfer.hardware import targets
    from metainfer.passes import PassManager, get_pass

    t = targets.get("cpu")
    a = PassManager([get_pass("fuse_attention")], t).uuid()
    assert a == PassManager([get_pass("fuse_attention")], t).uuid()
    assert a != PassManager([get_pass("fuse_attention"), get_pass("fuse_rope")], t).uuid()
    assert a != PassManager([get_pass("fuse_attention")], t, disabled={"fuse_attention"}).uuid()
    assert a != PassManager([get_pass("fuse_attention")], targets.get("cuda")).uuid()
    assert a != PassManager([get_pass("fuse_attention")], t, options={"cost_gates": False}).uuid()
    # an option given at its default is the same pipeline as one left out
    assert a == PassManager([get_pass("fuse_attention")], t, options={"cost_gates": True}).uuid()


def test_inductor_cache_hit_still_reports(tmp_path, monkeypatch):
    """A second compile of the same graph is served by Inductor's FX graph cache (the passes
    do not run); the report still says what they did."""
    monkeypatch.setenv("METAINFER_CACHE_DIR", str(tmp_path))
    model = models.build("llama-tiny", n_layers=1)
    (ids,) = models.example_inputs("llama-tiny", seq=8)
    first = metainfer.optimize(model, "cpu", example_inputs=(ids,))
    second = metainfer.optimize(model, "cpu", example_inputs=(ids,))
    assert second.report.matches("fuse_attention") == first.report.matches("fuse_attention") == 1
    assert second.report.sections[0].from_cache
    # an Inductor hit without metainfer's record: the graph is compiled again, caches off
    assert metainfer.cache.clear(parts=("records",)) >= 1  # Inductor's cache stays: it still hits
    third = metainfer.optimize(model, "cpu", example_inputs=(ids,))
    assert third.report.matches("fuse_attention") == 1 and not third.report.sections[0].from_cache
