"""metainfer.analyze(): real-size models on the `meta` device (models/ and Hugging Face
configs) captured, passed and simulated without allocating their weights."""

import pytest
import torch

import metainfer
from metainfer import models


def _on_meta(model):
    return all(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))


def test_llama_70b_shape_on_meta():
    model = models.build("llama3-70b", device="meta", dtype=torch.bfloat16, n_layers=2)
    assert _on_meta(model), "built without allocating a weight"
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    report = metainfer.analyze(model, "pcie8", example_inputs=(ids,))
    assert report.matches("fuse_attention") == 2 and report.matches("fuse_rmsnorm") == 5
    p = report.sections[0].prediction
    assert p["predicted"] and p["after_s"] < p["before_s"]
    # 2 layers of 70B at 4096 tokens: the QKV/O/MLP GEMMs alone are 2 * 4096 * 2 * 0.86e9 FLOP
    # (~14 TFLOP): at the L40S's 362 TFLOP/s bf16 that is ~39 ms, which bounds the prediction below
    assert p["after_s"] > 0.035
    assert "analysis only" in str(report)


def test_hugging_face_config_on_meta():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=1,
                                   num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    assert _on_meta(model)
    ids = torch.zeros(2, 512, dtype=torch.long, device="meta")
    report = metainfer.analyze(model, "nvlink8", example_inputs=(ids,))
    assert report.matches("fuse_attention") == 1
    assert any("use_cache=False" in n for n in report.notes)


def test_deepseek_v3_layer_on_meta_fires_the_mla_and_fp8_passes():
    model = models.build("deepseek-v3", device="meta", dtype=torch.bfloat16, n_layers=1)
    assert _on_meta(model)
    ids = torch.zeros(1, 256, dtype=torch.long, device="meta")
    report = metainfer.analyze(model, "pcie8", example_inputs=(ids,))
    assert report.matches("mla_prefill") == 1
    assert report.matches("fp8_gemm") >= 7  # wq_a, wq_b, wkv_a, wkv_b, wo, w1, w2, w3 (minus any kept)
    assert report.sections[0].prediction["after_s"] < report.sections[0].prediction["before_s"]


def test_training_mode_is_refused():
    model = models.build("llama-tiny", device="meta").train()
    with pytest.raises(ValueError, match="training mode"):
        metainfer.analyze(model, "pcie8", example_inputs=(torch.zeros(1, 4, dtype=torch.long, device="meta"),))
