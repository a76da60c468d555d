"""optimize(): bad input is a clear error; the optimized object behaves like the model."""

import pytest
import torch

import metainfer
from metainfer import models
from metainfer.hardware import targets


@pytest.fixture
def tiny():
    return models.build("llama-tiny", n_layers=1)


def test_unknown_target_lists_known(tiny):
    with pytest.raises(ValueError, match="unknown target 'tpu9'.*pcie8"):
        metainfer.optimize(tiny, "tpu9")


def test_model_in_train_mode(tiny):
    with pytest.raises(ValueError, match="training mode.*eval"):
        metainfer.optimize(tiny.train(), "cpu")


def test_inputs_on_a_device_the_target_does_not_drive(tiny):
    with pytest.raises(ValueError, match="target 'cuda' drives cuda devices"):
        metainfer.optimize(tiny, "cuda", example_inputs=(torch.zeros(1, 4, dtype=torch.long),))


def test_model_on_a_device_the_target_does_not_drive(tiny):
    with pytest.raises(ValueError, match="model .* is on cpu.*'pcie8'"):
        metainfer.optimize(tiny, "pcie8")


def test_unknown_pass_names(tiny):
    with pytest.raises(ValueError, match="disable='fuse_everything': no such pass; known passes: .*fuse_attention"):
        metainfer.optimize(tiny, "cpu", disable=("fuse_everything",))
    with pytest.raises(ValueError, match="unknown pass 'nope'"):
        metainfer.optimize(tiny, "cpu", passes=["nope"])


def test_verify_needs_inputs(tiny):
    with pytest.raises(ValueError, match="verify=True needs example_inputs"):
        metainfer.optimize(tiny, "cpu", verify=True)


def test_unknown_lowering(tiny):
    with pytest.raises(ValueError, match="unknown lowering"):
        metainfer.optimize(tiny, "cpu", lowering="tvm")


def test_not_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        metainfer.optimize(lambda x: x, "cpu")


def test_disable_skips_and_says_so(tiny):
    ids = torch.randint(0, 256, (1, 8))
    opt = metainfer.optimize(tiny, "cpu", example_inputs=(ids,), disable=("fuse_attention",), lowering="aot_eager")
    rec = opt.report.record("fuse_attention")
    assert not rec.ran and rec.skipped_reason == "disabled"


def test_target_objects_and_toml_paths_are_accepted(tiny, tmp_path):
    t = targets.get("cpu")
    ids = torch.randint(0, 256, (1, 8))
    assert metainfer.optimize(tiny, t, example_inputs=(ids,), lowering="aot_eager").target is t
    src = open(t.source).read().replace('name = "cpu"', 'name = "my-cpu"')
    (tmp_path / "mine.toml").write_text(src)
    opt = metainfer.optimize(tiny, str(tmp_path / "mine.toml"), example_inputs=(ids,), lowering="aot_eager")
    assert opt.report.to_dict()["target"] == "my-cpu"


def test_optimized_model_keeps_the_models_attributes(tiny):
    opt = metainfer.optimize(tiny, "cpu", lowering="aot_eager")
    assert opt.config is tiny.config and opt.model is tiny
    with pytest.raises(ValueError, match="input .* is on meta"):
        opt(torch.zeros(1, 4, dtype=torch.long, device="meta"))


def test_too_long_input_gets_the_models_own_error(tiny):
    opt = metainfer.optimize(tiny, "cpu", lowering="aot_eager")
    with pytest.raises(Exception, match="exceeds max_seq_len"):
        opt(torch.zeros(1, tiny.config.max_seq_len + 1, dtype=torch.long))
