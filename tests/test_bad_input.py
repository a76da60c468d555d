"""Bad input to an optimized model is a ValueError naming what is wrong, raised before any
compiled graph runs; a failed capture says what metainfer knows first."""

import pytest
import torch

import metainfer
from metainfer.runtime import inputs
from metainfer import models
from metainfer.testing import tiny_hf_model


@pytest.fixture(scope="module")
def llama():
    """models/ Llama through the default Inductor lowering: the generated code is what an
    out-of-range id would have reached (its bounds check aborts, or asserts on a GPU)."""
    model = models.build("llama-tiny", n_layers=1)
    ids = models.example_inputs("llama-tiny", seq=8)[0]
    return metainfer.optimize(model, "cpu", example_inputs=(ids,)), ids


@pytest.mark.parametrize("value, where", [(256, (0, 5)), (300, (0, 7)), (-1, (0, 2))])
def test_token_ids_out_of_range_name_position_and_value(llama, value, where):
    opt, ids = llama
    bad = ids.clone()
    bad[where] = value
    compiles = len(opt.report.sections)
    with pytest.raises(ValueError, match=rf"tokens\[{where[0]}, {where[1]}\] = {value} is not a token id: "
                                         r"the model's vocabulary is 256 ids \(0..255\)"):
        opt(bad)
    assert len(opt.report.sections) == compiles
    torch.testing.assert_close(opt(ids), opt.model(ids))  # the process and the graph are fine


def test_every_bad_id_is_counted(llama):
    opt, ids = llama
    bad = ids.clone()
    bad[0, 1], bad[0, 4] = 999, -5
    with pytest.raises(ValueError, match=r"tokens\[0, 1\] = 999 .*; 2 ids in all are out of range"):
        opt(bad)


def test_token_ids_must_be_integers(llama):
    opt, ids = llama
    with pytest.raises(ValueError, match=r"tokens must hold integer token ids \(torch.int64 or torch.int32\), "
                                         r"got a torch.float32 tensor of shape \(1, 8\)"):
        opt(ids.float())
    torch.testing.assert_close(opt(ids.int()), opt.model(ids))  # int32 ids are ids


def test_float_example_inputs_are_refused_before_capture():
    with pytest.raises(ValueError, match="tokens must hold integer token ids"):
        metainfer.optimize(models.build("llama-tiny", n_layers=1), "cpu",
                           example_inputs=(torch.zeros(1, 8),), lowering="aot_eager")


def test_deferred_check_runs_the_graph_on_a_safe_copy_then_raises(interpret):
    """The GPU path, run on CPU tensors through the interpreted kernel: the ids handed to the
    graph have the bad ones replaced by 0, and finish() raises the same ValueError."""
    ids = torch.tensor([[5, 7, 300, 2]])
    safe, finish = inputs.TokenGuard().check(ids, 256, "input_ids", deferred=True)
    assert safe.tolist() == [[5, 7, 0, 2]]
    with pytest.raises(ValueError, match=r"input_ids\[0, 2\] = 300 is not a token id"):
        finish()
    good, finish = inputs.TokenGuard().check(torch.tensor([[5, 7]]), 256, "input_ids", deferred=True)
    finish()  # nothing to raise
    assert good.tolist() == [[5, 7]]


def test_generate_refuses_a_bad_prompt_before_generating():
    model = tiny_hf_model("Llama", layers=1)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    prompt = torch.tensor([[1, 5, 128, 9]])
    with pytest.raises(ValueError, match=r"input_ids\[0, 2\] = 128 is not a token id: the model's vocabulary is "
                                         r"128 ids"):
        opt.generate(prompt, max_new_tokens=2, do_sample=False)
    assert not opt.report.sections, "nothing was compiled for the bad prompt"


def test_a_request_is_judged_on_its_own():
    """For serving: one request's problem, without failing the others."""
    assert inputs.request_error([1, 2, 3], 128) is None
    assert "prompt[1] = 200 is not a token id" in inputs.request_error([1, 200, 3], 128)
    assert inputs.request_error([1, 2.0], 128) == "prompt[1] is 2.0 (float), not an integer token id"
    assert "list of integer token ids, got a str" in inputs.request_error("hello", 128)
    assert "is empty" in inputs.request_error([], 128)


def test_a_model_without_token_inputs_is_not_checked():
    """Any module may be optimized: a float input to a model with no token ids is data."""
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    opt = metainfer.optimize(mlp, "cpu", example_inputs=(x,), lowering="aot_eager")
    torch.testing.assert_close(opt(x), mlp(x))


def test_training_mode_after_optimize_is_refused(llama):
    opt, ids = llama
    opt.model.train()
    try:
        with pytest.raises(ValueError, match=r"training mode \(.*\.train\(\) after metainfer.optimize\).*model.eval"):
            opt(ids)
        opt.model.layers[0].attention.train()  # one submodule is enough
        opt.model.eval()
        opt.model.layers[0].train()
        with pytest.raises(ValueError, match=r"training mode \(layers.0 "):
            opt(ids)
    finally:
        opt.model.eval()
    torch.testing.assert_close(opt(ids), opt.model(ids))


def test_a_model_that_fails_capture_says_where_and_on_what():
    """A config that breaks the model itself (3 kv heads do not divide 4 query heads): the
    message leads with the inputs, the module and line, and the cause; Dynamo's text follows."""
    model = tiny_hf_model("Llama", layers=1, num_key_value_heads=3)
    ids = torch.randint(0, 128, (1, 8))
    with pytest.raises(RuntimeError, match="must match the size"):
        model(ids)  # eager fails too: the model's own error
    with pytest.raises(metainfer.CaptureError) as e:
        metainfer.optimize(model, "cpu", example_inputs=(ids,), lowering="aot_eager")
    text = str(e.value)
    first, *rest = text.splitlines()
    assert first.startswith("metainfer could not capture LlamaForCausalLM.forward for target cpu: ")
    assert "RuntimeError: Attempting to broadcast a dimension of length 3" in first, "the cause, from line 2 of Dynamo's"
    assert rest[0] == "  inputs: input_ids: int64[1, 8]"
    assert rest[1].startswith("  where: model.layers.0.self_attn in LlamaAttention.forward (transformers/models/"
                              "llama/modeling_llama.py:")
    assert "Dynamo's message:" in text and text.index("Dynamo's message:") > text.index("where:")
    assert isinstance(e.value.__cause__, torch._dynamo.exc.TorchDynamoException)


def test_the_failing_layer_is_named_not_its_first_sibling():
    """Layer 1 of 2 broken (its key projection gives 1.5 heads): the message names layers.1."""
    model = models.build("llama-tiny")
    model.layers[1].attention.wk = torch.nn.Linear(64, 24, bias=False).eval()
    ids = models.example_inputs("llama-tiny", seq=8)[0]
    with pytest.raises(metainfer.CaptureError) as e:
        metainfer.optimize(model, "cpu", example_inputs=(ids,), lowering="aot_eager")
    where = str(e.value).splitlines()[2]
    assert where.startswith("  where: layers.1.attention in Attention.forward (models/llama.py:"), where
