"""verify=True and metainfer.bisect name the first pass that breaks equivalence."""

import pytest
import torch

import metainfer
from metainfer import models
from metainfer.passes import FunctionPass, PassResult
from metainfer.passes.matching import aten, is_op, location


def _flip_first_residual_add(graph, ctx):
    """add -> sub on the first residual add (deliberately wrong)"""
    for n in graph.nodes:
        if is_op(n, aten.add) and all(isinstance(a, torch.fx.Node) for a in n.args[:2]):
            if n.args[0].meta["val"].shape == n.args[1].meta["val"].shape and n.meta["val"].dim() == 3:
                n.target = aten.sub.Tensor
                return PassResult(True, 1, [f"{location(n)}: add -> sub"])
    return PassResult(False)


def _noop(graph, ctx):
    """nothing -> nothing"""
    return PassResult(False)


BAD = FunctionPass("flip_residual_add", _flip_first_residual_add)
NOOP = FunctionPass("noop", _noop)


@pytest.fixture(scope="module")
def setup():
    model = models.build("llama-tiny")
    return model, models.example_inputs("llama-tiny", batch=1, seq=8)


@pytest.mark.parametrize("lowering", ["aot_eager", "inductor"])
def test_verify_names_the_injected_wrong_pass(setup, lowering):
    model, inputs = setup
    with pytest.raises(metainfer.EquivalenceError) as e:
        metainfer.optimize(model, "cpu", example_inputs=inputs, passes=["fuse_attention", NOOP, BAD, "fuse_rmsnorm"],
                           verify=True, lowering=lowering)
    assert e.value.pass_name == "flip_residual_add" and e.value.graph_index == 0
    assert "flip_residual_add" in str(e.value)


def test_bisect_function(setup):
    model, inputs = setup
    found = metainfer.bisect(model, inputs, "cpu", passes=["fuse_attention", BAD], lowering="aot_eager")
    assert not found.equivalent and found.pass_name == "flip_residual_add"
    ok = metainfer.bisect(model, inputs, "cpu", passes=["fuse_attention", "fuse_rmsnorm"], lowering="aot_eager")
    assert ok.equivalent and ok.pass_name is None


def test_verify_passes_on_a_correct_pipeline(setup):
    model, inputs = setup
    opt = metainfer.optimize(model, "cpu", example_inputs=inputs, verify=True, lowering="aot_eager")
    assert any("verify: outputs equal" in n for n in opt.report.notes)
