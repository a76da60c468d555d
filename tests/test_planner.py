"""The planner: model shapes from configs, plan enumeration, capacity, per-phase choice,
speculative draft length, errors, the CLI; and its modelled layer against the simulator on a
captured real-size graph."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import metainfer
from metainfer.hardware import planner, shapes, targets
from metainfer.hardware.planner import Plan, PlanError, expected_accepted


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
        assert c.tokens_per_second == max(x.tokens_per_second for x in ph.candidates if x.executable)


def test_a_model_that_does_not_fit_is_a_clear_error():
    with pytest.raises(PlanError, match=r"deepseek-v3 does not fit pcie8: 671B parameters .* GiB usable"):
        metainfer.plan("deepseek-v3", "pcie8")


def test_a_batch_the_kv_cache_cannot_hold_is_refused():
    with pytest.raises(PlanError, match="KV cache holds"):
        planner.plan("llama3-70b", targets.get("pcie8"), phases="decode", batch=4096, seq=8192)


def test_million_token_context_where_memory_allows():
    result = planner.plan("deepseek-v4-flash-like", targets.get("nvlink8"), phases="prefill", batch=1, seq=4096)
    million = [c for c in result.phases["prefill"].candidates if c.runs and c.capacity.million_token_context]
    assert million and all(c.capacity.max_context == 1 << 20 for c in million)  # the model's own limit
    small = planner.plan("llama3-70b", targets.get("pcie8"), phases="prefill", batch=1, seq=4096)
    assert not any(c.capacity.million_token_context for c in small.phases["prefill"].candidates)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch=0), "batch must be a positive integer"),
    (dict(seq=-1), "seq must be a positive integer"),
    (dict(phases="train"), "unknown phase"),
    (dict(acceptance=1.5), "acceptance rate"),
])
def test_bad_planner_input(kwargs, match):
    with pytest.raises(PlanError, match=match):
        planner.plan("llama3-8b", targets.get("pcie8"), **kwargs)


# ---- pricing ----------------------------------------------------------------------------

def test_pcie_prefers_less_tensor_parallel_traffic_than_nvlink():
    """On PCIe (10 GB/s across islands) TP 8 prefill is communication-bound; on NVLink far less."""
    m = shapes.resolve("llama3-70b")
    pcie = planner.step_time(m, Plan(8, 1, 1, 1), targets.get("pcie8"), "prefill", 4, 4096)
    nvl = planner.step_time(m, Plan(8, 1, 1, 1), targets.get("nvlink8"), "prefill", 4, 4096)
    assert pcie[2] / pcie[0] > 0.5 > nvl[2] / nvl[0]
    chosen = planner.plan(m, targets.get("pcie8"), phases="prefill").phases["prefill"].chosen.plan
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
    k_lo = planner._best_draft(m, p, t, 32, 2048, lo)[0]
    k_hi = planner._best_draft(m, p, t, 32, 2048, lo + step)[0]
    assert k_hi >= k_lo
    assert planner._best_draft(m, p, t, 32, 2048, 0.0)[0] == 0, "nothing accepted: no draft"


def test_a_decode_layer_by_hand():
    """Llama-3-8B (hidden 4096, 32 heads / 8 KV heads of 128, MLP 14336, bf16), one layer at
    tp 1 decoding one sequence over 1,024 cached tokens on pcie8 (864 GB/s, 4 us a kernel,
    no custom-op costs measured): at one token every kernel is memory-bound, so the layer is
    its bytes over the bandwidth plus nine launches, listed here from the architecture."""
    kernel_bytes = {
        "residual add + rmsnorm": 4 * 4096 * 2,  # read x and the residual, write both
        "qkv": 4096 * (32 + 2 * 8) * 128 * 2 + (4096 + 6144) * 2,  # the weight, the row in and out
        "rope": 2 * (32 + 8) * 128 * 2,
        "attention": 1024 * 2 * 8 * 128 * 2 + 32 * 256 * 2,  # the K and V cache, q in and o out
        "o": 4096 * 4096 * 2 + (4096 + 4096) * 2,
        "residual add + rmsnorm 2": 4 * 4096 * 2,
        "gate_up": 4096 * 2 * 14336 * 2 + (4096 + 2 * 14336) * 2,
        "swiglu": 3 * 14336 * 2,
        "down": 14336 * 4096 * 2 + (14336 + 4096) * 2,
    }
    expected = sum(kernel_bytes.values()) / 864e9 + len(kernel_bytes) * 4e-6
    step, floor, comm = planner._layer_time("dense", shapes.resolve("llama3-8b"), Plan(1, 1, 1, 1),
                                            targets.get("pcie8"), "decode", 1, 1, 1024)
    assert step == pytest.approx(expected, rel=1e-9)
    assert (floor, comm) == (pytest.approx(expected, rel=1e-9), 0.0)


def test_the_chosen_plan_is_one_metainfer_executes():
    """Llama-3-70B prefill on pcie8: the planner prices pipeline stages cheapest (they carry
    little traffic over PCIe), but nothing runs them, so they are a labelled what-if."""
    result = planner.plan("llama3-70b", targets.get("pcie8"), acceptance=0.7)
    for ph in result.phases.values():
        assert ph.chosen.executable and ph.chosen.plan.pp == 1
        faster = [c for c in ph.candidates if c.runs and c.tokens_per_second > ph.chosen.tokens_per_second]
        assert all(not c.executable for c in faster)
        if faster:
            assert ph.what_if is max(faster, key=lambda c: c.tokens_per_second)
            assert f"not executable yet: {ph.what_if.plan.label}" in ph.reason
    assert result.phases["prefill"].what_if.plan.pp > 1
    dec = result.phases["decode"].chosen
    # the draft is a what-if too: the headline is plain decode, one new token for each of the
    # 64 sequences (plan()'s decode default) per plain step, not the accepted tokens of a draft
    assert dec.draft >= 1 and dec.tokens_per_second * dec.step_seconds == pytest.approx(64)
    assert dec.speculative_tokens_per_second != pytest.approx(dec.tokens_per_second)
    assert "what-if, not applied yet: speculative draft length" in result.phases["decode"].reason


# ---- output and CLI ---------------------------------------------------------------------

def test_table_and_json():
    result = metainfer.plan("deepseek-v4-flash-like", "pcie8", acceptance=0.7)
    text = str(result)
    assert "prefill:" in text and "decode:" in text and "chosen:" in text and "not measurements" in text
    d = json.loads(json.dumps(result.to_dict()))
    assert d["predicted"] and set(d["phases"]) == {"prefill", "decode"}
    dec = d["phases"]["decode"]
    # 64 x 4096 tokens of cache fit only plans with pipeline stages or expert dispatch across
    # replicas: none chosen, the fastest of them a labelled what-if with its draft
    assert dec["chosen"] is None and "no plan that fits is one metainfer executes" in dec["reason"]
    what_if = dec["what_if_not_executable"]
    assert not what_if["executable"] and what_if["runs"] and what_if["draft_length"] >= 1
    assert all(c["plan"] for c in dec["candidates"])
    assert "chosen: (none executable)" in text and "not executable (priced only)" in text


def test_cli_plan_from_a_fresh_process():
    out = subprocess.run([sys.executable, "-m", "metainfer", "plan", "--model", "llama3-70b", "--target", "pcie8",
                          "--json", "--acceptance", "0.6"], capture_output=True, text=True, timeout=900)  # a hang guard
    assert out.returncode == 0, out.stderr
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
    assert all(r["executable"] for r in rows if "error" not in r)
    assert any(r["what_if_not_executable"] for r in rows)
