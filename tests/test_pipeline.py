"""Whole pipeline: optimize() against eager on models/ Llama and on Hugging Face Llama, Qwen2
and Mistral (tiny random-init configs), eager and sdpa attention."""

import pytest
import torch

import metainfer
from metainfer import kernels, models
from metainfer.testing import tiny_hf_model
from metainfer.verify import mismatch

ALL = ["fuse_attention", "fuse_rope", "fuse_rmsnorm", "fuse_swiglu"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_models_llama_default_cpu_pipeline(dtype):
    model = models.build("llama-tiny", dtype=dtype)
    (ids,) = models.example_inputs("llama-tiny", batch=2, seq=24)
    opt = metainfer.optimize(model, "cpu", example_inputs=(ids,), verify=True)
    assert opt.report.matches("fuse_attention") == model.config.n_layers
    rec = opt.report.record("fuse_attention")
    assert all("causal" in d and "GQA" in d for d in rec.decisions)
    with torch.no_grad():
        other = torch.randint(0, 256, (2, 24))
        assert mismatch(model(other), opt(other)) is None


def test_models_llama_all_passes_match_once_per_site():
    model = models.build("llama-tiny")
    (ids,) = models.example_inputs("llama-tiny", batch=1, seq=16)
    opt = metainfer.optimize(model, "cpu", example_inputs=(ids,), passes=ALL, verify=True)
    n = model.config.n_layers
    r = opt.report
    assert (r.matches("fuse_attention"), r.matches("fuse_rope"), r.matches("fuse_rmsnorm"),
            r.matches("fuse_swiglu")) == (n, 2 * n, 2 * n + 1, n)


def test_models_llama_through_the_triton_kernels(interpret):
    """Every fused op runs its Triton kernel (interpreted) inside the compiled graph."""
    model = models.build("llama-tiny")
    (ids,) = models.example_inputs("llama-tiny", batch=2, seq=20)
    opt = metainfer.optimize(model, "cpu", example_inputs=(ids,), passes=ALL, lowering="aot_eager")
    calls = []
    real = kernels.attention.launch
    try:
        kernels.attention.launch = lambda *a, **k: calls.append(1) or real(*a, **k)
        out = opt(ids)
    finally:
        kernels.attention.launch = real
    assert calls, "the attention op went through the Triton launcher"
    with torch.no_grad():
        assert mismatch(model(ids), out) is None


def _hf(arch, impl, layers=2):
    pytest.importorskip("transformers")
    return tiny_hf_model(arch, impl, layers)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["Llama", "Qwen2", "Mistral"])
def test_hugging_face_models(arch, impl):
    model = _hf(arch, impl)
    ids = torch.randint(3, 128, (2, 16))
    opt = metainfer.optimize(model, "cpu", example_inputs=(ids,), verify=True)
    rec = opt.report.record("fuse_attention")
    assert rec.matches == model.config.num_hidden_layers, rec.near_misses
    assert all("causal" in d for d in rec.decisions), rec.decisions


def test_hugging_face_llama_all_passes():
    model = _hf("Llama", "eager")
    ids = torch.randint(3, 128, (1, 12))
    opt = metainfer.optimize(model, "cpu", example_inputs=(ids,), passes=ALL, verify=True, lowering="aot_eager")
    r = opt.report
    assert (r.matches("fuse_attention"), r.matches("fuse_rope"), r.matches("fuse_rmsnorm"),
            r.matches("fuse_swiglu")) == (2, 4, 5, 2)


def test_hugging_face_padding_mask_stays_a_mask():
    """A padding attention_mask is data: not provably causal, passed to the op as a tensor."""
    model = _hf("Llama", "eager")
    ids = torch.randint(3, 128, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    opt = metainfer.optimize(model, "cpu", example_inputs={"input_ids": ids, "attention_mask": mask},
                             verify=True, lowering="aot_eager")
    assert opt.report.matches("fuse_attention") == 2
