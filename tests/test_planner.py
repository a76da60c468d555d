"""The planner: model shapes from configs, plan enumeration, capacity, per-phase choice,
speculative draft length, errors, the CLI; and its modelled layer against the simulator on a
captured real-size graph."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import metainfer
from metainfer import planner, shapes, targets
from metainfer.planner import Plan, PlanError, expected_accepted


# ---- shapes ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("deepseek-v3", 671.0)])
def test_parameter_counts_match_the_published_sizes(name, billions):
    assert shapes.resolve(name).params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_hugging_face_configs(tmp_path):
    transformers = pytest.importorskip("transformers")
    ds = shapes.from_hf(transformers.DeepseekV3Config())
    assert ds.mla and ds.moe and ds.dense_layers == 3 and ds.params() / 1e9 == pytest.approx(671, rel=0.01)
    mixtral = shapes.from_hf(transformers.MixtralConfig())
    assert mixtral.experts == 8 and mixtral.params() / 1e9 == pytest.approx(46.7, rel=0.01)
    cfg = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                   num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    cfg.save_pretrained(tmp_path)
    from_file = shapes.resolve(tmp_path / "config.json")
    assert from_file.params() == pytest.approx(shapes.resolve("llama3-70b").params(), rel=1e-6)
    assert shapes.resolve(tmp_path).hidden == 8192
    with pytest.raises(ValueError, match="hidden_size"):
        shapes.from_hf({"num_hidden_layers": 2})


def test_kv_cache_per_token_by_hand():
    # Llama-3-70B: 80 layers x (K and V) x 8 kv heads x 128 x 2 bytes
    assert shapes.resolve("llama3-70b").kv_bytes_per_token() == 80 * 2 * 8 * 128 * 2
    # DeepSeek-V3 MLA: 61 layers x (512 latent + 64 rope) x 2 bytes
    assert shapes.resolve("deepseek-v3").kv_bytes_per_token() == 61 * 576 * 2


# ---- enumeration and capacity ----------------------------------------------------------

def test_every_split_of_the_devices_is_a_candidate():
    m = shapes.resolve("llama3-70b")
    plans = planner.candidate_plans(m, 8)
    assert {p.devices for p, _ in plans} == {8}
    assert len({(p.tp, p.dp, p.pp) for p, _ in plans}) == 10  # ordered factorisations of 8 into 3
    moe = planner.candidate_plans(shapes.resolve("deepseek-v4-flash-like"), 8)
    assert any(p.ep == 8 and p.dp == 8 for p, _ in moe), "DP attention + expert parallelism"


def test_capacity_shrinks_with_sharding_and_the_chosen_plan_fits():
    m, t = shapes.resolve("llama3-70b"), targets.get("pcie8")
    caps = {tp: planner.capacity(m, Plan(tp, 8 // tp, 1, 1), t, 4096, 1) for tp in (1, 2, 4, 8)}
    weights = [caps[tp].weights_bytes for tp in (1, 2, 4, 8)]
    assert weights == sorted(weights, reverse=True)
    assert caps[8].weights_bytes == pytest.approx(m.params() * 2 / 8, rel=0.01)
    assert not caps[1].fits and caps[8].fits
    # TP 8 over 8 kv heads: one kv head per device
    assert caps[8].kv_tokens_per_replica == pytest.approx(caps[8].kv_budget_bytes / (80 * 2 * 128 * 2), abs=1)
    result = planner.plan(m, t)
    for ph in result.phases.values():
        c = ph.chosen
        assert c.capacity.fits and c.capacity.weights_bytes + c.capacity.activation_bytes < t.device.memory_bytes
        assert c.tokens_per_second == max(x.tokens_per_second for x in ph.candidates)


def test_a_model_that_does_not_fit_is_a_clear_error():
    with pytest.raises(PlanError, match=r"deepseek-v3 does not fit pcie8: 671B parameters .* GiB usable"):
        metainfer.plan("deepseek-v3", "pcie8")


def test_a_batch_the_kv_cache_cannot_hold_is_refused():
    with pytest.raises(PlanError, match="KV cache holds"):
        planner.plan("llama3-70b", "pcie8", phases="decode", batch=4096, seq=8192)


def test_million_token_context_where_memory_allows():
    result = planner.plan("deepseek-v4-flash-like", "nvlink8", phases="prefill", batch=1, seq=4096)
    assert result.phases["prefill"].chosen.capacity.million_token_context
    assert result.phases["prefill"].chosen.capacity.max_context == 1 << 20  # the model's own limit
    small = planner.plan("llama3-70b", "pcie8", phases="prefill", batch=1, seq=4096)
    assert not small.phases["prefill"].chosen.capacity.million_token_context


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch=0), "batch must be a positive integer"),
    (dict(seq=-1), "seq must be a positive integer"),
    (dict(phases="train"), "unknown phase"),
    (dict(acceptance=1.5), "acceptance rate"),
])
def test_bad_planner_input(kwargs, match):
    with pytest.raises(PlanError, match=match):
        planner.plan("llama3-8b", "pcie8", **kwargs)


# ---- pricing ----------------------------------------------------------------------------

def test_pcie_prefers_less_tensor_parallel_traffic_than_nvlink():
    """On PCIe (10 GB/s across islands) TP 8 prefill is communication-bound; on NVLink far less."""
    m = shapes.resolve("llama3-70b")
    pcie = planner.step_time(m, Plan(8, 1, 1, 1), targets.get("pcie8"), "prefill", 4, 4096)
    nvl = planner.step_time(m, Plan(8, 1, 1, 1), targets.get("nvlink8"), "prefill", 4, 4096)
    assert pcie[2] / pcie[0] > 0.5 > nvl[2] / nvl[0]
    chosen = planner.plan(m, "pcie8", phases="prefill").phases["prefill"].chosen.plan
    assert chosen.tp < 8


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), batch=st.integers(1, 64), extra=st.integers(1, 64),
       phase=st.sampled_from(["prefill", "decode"]))
def test_more_work_is_never_faster(tp, batch, extra, phase):
    m, t = shapes.resolve("llama3-8b"), targets.get("pcie8")
    p = Plan(tp, 8 // tp, 1, 1)
    a = planner.step_time(m, p, t, phase, batch, 1024)
    b = planner.step_time(m, p, t, phase, batch + extra, 1024)
    assert b[0] >= a[0] * (1 - 1e-12) and a[1] <= a[0] * (1 + 1e-12)


def test_expected_accepted_tokens_by_hand():
    assert expected_accepted(0.0, 5) == 1.0
    assert expected_accepted(0.5, 1) == pytest.approx(1.5)
    assert expected_accepted(0.5, 2) == pytest.approx(1.75)
    assert expected_accepted(1.0, 4) == 5.0


@settings(max_examples=10, deadline=None)
@given(lo=st.floats(0.0, 0.95), step=st.floats(0.0, 0.05))
def test_draft_length_grows_with_the_acceptance_rate(lo, step):
    m, t, p = shapes.resolve("llama3-8b"), targets.get("pcie8"), Plan(4, 2, 1, 1)
    k_lo = planner._decode_with_draft(m, p, t, 32, 2048, lo)[3]
    k_hi = planner._decode_with_draft(m, p, t, 32, 2048, lo + step)[3]
    assert k_hi >= k_lo
    assert planner._decode_with_draft(m, p, t, 32, 2048, 0.0)[3] == 0, "nothing accepted: no draft"


def test_the_modelled_layer_agrees_with_the_simulated_captured_graph():
    """The planner's dense layer (tp 1, prefill) against the simulator on the real graph of a
    Llama-3-70B-shaped layer built on `meta`: the difference of a 2-layer and a 1-layer model."""
    from metainfer import models

    t = targets.get("pcie8")
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    after = []
    for n in (1, 2):
        model = models.build("llama3-70b", device="meta", dtype=torch.bfloat16, n_layers=n)
        after.append(metainfer.analyze(model, t, example_inputs=(ids,)).sections[0].prediction["after_s"])
    modelled = planner._layer_time("dense", shapes.resolve("llama3-70b"), Plan(1, 1, 1, 1), t, "prefill",
                                   4096, 1, 4096)[0]
    assert modelled == pytest.approx(after[1] - after[0], rel=0.1)


# ---- output and CLI ---------------------------------------------------------------------

def test_table_and_json():
    result = metainfer.plan("deepseek-v4-flash-like", "pcie8", acceptance=0.7)
    text = str(result)
    assert "prefill:" in text and "decode:" in text and "chosen:" in text and "not measurements" in text
    d = json.loads(json.dumps(result.to_dict()))
    assert d["predicted"] and set(d["phases"]) == {"prefill", "decode"}
    dec = d["phases"]["decode"]
    assert dec["chosen"]["draft_length"] >= 1 and dec["chosen"]["runs"]
    assert all(c["plan"] for c in dec["candidates"])


def test_cli_plan_from_a_fresh_process_in_seconds():
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "metainfer", "plan", "--model", "llama3-70b", "--target", "pcie8",
                          "--json", "--acceptance", "0.6"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert time.perf_counter() - t0 < 60
    d = json.loads(out.stdout)
    assert d["phases"]["prefill"]["chosen"]["plan"] and d["phases"]["decode"]["chosen"]["plan"]
    bad = subprocess.run([sys.executable, "-m", "metainfer", "plan", "--model", "deepseek-v3", "--target", "pcie8"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "does not fit" in bad.stderr


def test_bench_plan_runs():
    out = subprocess.run([sys.executable, "bench/bench_plan.py", "--json"], capture_output=True, text=True,
                         timeout=120, cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert {r["target"] for r in rows} >= {"pcie8", "nvlink8"}
    assert any("error" in r and "does not fit" in r["error"] for r in rows)  # DeepSeek-V3 on 8 x 48 GB
    assert all(r["tokens_per_second"] <= r["floor_tokens_per_second"] * (1 + 1e-9) for r in rows if "error" not in r)
