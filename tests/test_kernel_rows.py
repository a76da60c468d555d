"""Each compiled graph launches its kernels with the rows of the target it was compiled for
(kernels/configs.using), not those of whichever target was activated last in the process."""

import dataclasses
from types import SimpleNamespace

import torch

import metainfer
from metainfer.hardware import targets
from metainfer.kernels import configs as KC
from metainfer.testing import tiny_hf_model


def _gpu_target(name, kernels):
    return SimpleNamespace(name=name, device=SimpleNamespace(kind="cuda", arch="sm_90"), kernels=kernels)


def test_rows_in_use_win_over_the_last_activated(monkeypatch):
    monkeypatch.setattr(KC, "_active", {})
    monkeypatch.setattr(KC, "_device_sms", lambda device: 66)
    gpu = torch.device("cuda")
    a = _gpu_target("a", {"attention": {"BLOCK_N": 32}})
    b = _gpu_target("b", {"attention": {"BLOCK_N": 16}})
    KC.activate(b)  # compiled last
    assert KC.config_for("attention", gpu, head_dim=128)["BLOCK_N"] == 16
    with KC.using(KC.rows_of(a)):
        assert KC.config_for("attention", gpu, head_dim=128)["BLOCK_N"] == 32
        with KC.using(KC.rows_of(b)):
            assert KC.config_for("attention", gpu, head_dim=128)["BLOCK_N"] == 16
        assert KC.config_for("attention", gpu, head_dim=128)["BLOCK_N"] == 32
    assert KC.config_for("attention", gpu, head_dim=128)["BLOCK_N"] == 16
    assert KC.rows_of(a) is KC.rows_of(_gpu_target("a again", {"attention": {"BLOCK_N": 32}})), "equal rows: one set"


def test_launch_plans_of_two_row_sets_stay_apart(monkeypatch):
    from metainfer.kernels import _common

    plans, built = _common.LaunchPlans(), []

    def build(tag):
        built.append(tag)
        return tag

    a, b = _gpu_target("a", {"attention": {"BLOCK_N": 32}}), _gpu_target("b", {})
    with KC.using(KC.rows_of(a)):
        assert plans.get(("sig",), None, build, "a") == "a"
    with KC.using(KC.rows_of(b)):
        assert plans.get(("sig",), None, build, "b") == "b"
    with KC.using(KC.rows_of(a)):
        assert plans.get(("sig",), None, build, "again") == "a", "a's plan is kept while b's runs"
    assert built == ["a", "b"]


def test_each_models_graphs_run_under_its_own_targets_rows(monkeypatch):
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    cpu = targets.get("cpu")
    t_a = dataclasses.replace(cpu, name="rows-a", kernels={"rmsnorm": {"max_warps": 2}})
    t_b = dataclasses.replace(cpu, name="rows-b", kernels={"rmsnorm": {"max_warps": 4}})
    opt_a = metainfer.optimize(tiny_hf_model("Llama", "sdpa", layers=1), t_a, lowering="aot_eager",
                               example_inputs=(ids,))
    metainfer.optimize(tiny_hf_model("Llama", "sdpa", layers=1), t_b, lowering="aot_eager", example_inputs=(ids,))
    assert KC._active["cpu"] is KC.rows_of(t_b)[1], "b was compiled last"
    seen, real = [], KC.using

    def spy(rows):
        seen.append(rows)
        return real(rows)

    monkeypatch.setattr(KC, "using", spy)
    opt_a(ids)
    assert seen and all(rows is KC.rows_of(t_a) for rows in seen), seen
