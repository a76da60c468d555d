"""Whole pipeline on DeepSeek-class models: optimize(..., verify=True) against eager on
models/deepseek.py (fp32, bf16, FP8 weights, with and without DSA) and on Hugging Face
DeepSeek-V3 / V3.2 tiny configs; generate() through the optimized graphs gives eager's tokens;
the report shows each pass's matches once per layer where it applies.

bf16 runs pin the MoE routing (the router's correction bias decides the experts) and keep
prompts within DSA's top-k: a discrete choice on a near tie flips under any change of bf16
rounding, in the eager model as much as in the optimized one; what is compared is the
continuous computation."""

import pytest
import torch

import metainfer
from metainfer import models
from metainfer.models import deepseek as ds
from metainfer.testing import tiny_hf_model
from metainfer.verify import mismatch

HF_TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
               num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
               n_shared_experts=1, first_k_dense_replace=1)


def pin_routing(model):
    """Correction biases far apart: expert choice no longer depends on the tokens."""
    for m in model.modules():
        bias = getattr(m, "bias", None) if isinstance(m, ds.Gate) else getattr(m, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor) and bias.dim() == 1:
            with torch.no_grad():
                bias.copy_(torch.arange(bias.numel(), 0, -1, dtype=bias.dtype) * 4.0)
    return model


def matches(section, name):
    return next(r for r in section.records if r.name == name).matches


@pytest.mark.parametrize("name,dtype,lowering", [
    ("deepseek-tiny", torch.float32, "inductor"),
    ("deepseek-v32-tiny", torch.float32, "aot_eager"),
    pytest.param("deepseek-tiny", torch.bfloat16, "aot_eager", marks=pytest.mark.slow),  # bf16 also runs in the fp8 row
    ("deepseek-v32-tiny-fp8", torch.bfloat16, "aot_eager"),
    pytest.param("deepseek-v32-tiny-fp8", torch.bfloat16, "inductor", marks=pytest.mark.slow),
])
def test_models_deepseek_optimize_verify_and_generate(name, dtype, lowering):
    m = models.build(name, dtype=dtype)
    if dtype == torch.bfloat16:
        pin_routing(m)
    cfg = m.config
    (ids,) = models.example_inputs(name, batch=2, seq=8)
    # decode here is over a few cached tokens, where the cost model keeps MLA decompressed
    # (test_pass_deepseek covers that decision): absorbed by force, to run it end to end
    opt = metainfer.optimize(m, "cpu", example_inputs=(ids,), verify=True, lowering=lowering,
                             pass_options={"mla_decode": True})
    sec = opt.report.sections[0]
    assert matches(sec, "mla_prefill") == cfg.n_layers
    assert matches(sec, "fuse_moe") == cfg.n_layers - cfg.n_dense_layers
    assert matches(sec, "sparse_mla") == (cfg.n_layers if cfg.index_n_heads else 0)
    fp8_linears = cfg.n_layers * (5 + 2 * bool(cfg.index_n_heads)) + 3 * cfg.n_dense_layers + 3 * (
        cfg.n_layers - cfg.n_dense_layers) - cfg.n_layers  # wkv_b: read by the (forced) absorbed form
    assert matches(sec, "fp8_gemm") == (fp8_linears if cfg.fp8 else 0)
    if cfg.fp8:
        assert "W8A16" in str(opt.report)
    if dtype == torch.float32:
        prompt = ids[:, :4]
        assert torch.equal(opt.generate(prompt, 4), m.generate(prompt, 4))
    else:  # greedy argmax over a random model's bf16 logits ties too easily: compare the logits
        ref, out = _teacher_forced(m, ids), _teacher_forced(opt, ids)
        assert mismatch(ref, out) is None, mismatch(ref, out)
    decode = [s for s in opt.report.sections if "int64[2, 1]" in s.inputs]  # one new token per sequence
    assert decode and all(matches(s, "mla_decode") == cfg.n_layers for s in decode)


def _teacher_forced(call, ids):
    """Prefill 4 tokens, then decode the rest one at a time through the latent cache."""
    model = getattr(call, "model", call)
    model.setup_cache(ids.shape[0], ids.shape[1])
    with torch.no_grad():
        return [call(ids[:, :4], start_pos=0)] + [call(ids[:, i:i + 1], start_pos=i) for i in range(4, ids.shape[1])]


@pytest.mark.parametrize("arch,attn", [("DeepseekV3", "sdpa"), ("DeepseekV32", "eager")])
def test_transformers_deepseek_optimize_verify(arch, attn):
    extra = dict(index_n_heads=2, index_head_dim=16, index_topk=4) if arch == "DeepseekV32" else {}
    m = tiny_hf_model(arch, attn, layers=2, **HF_TINY, **extra)
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 10, dtype=torch.long)
    am[1, :3] = 0
    opt = metainfer.optimize(m, "cpu", example_inputs={"input_ids": ids, "attention_mask": am}, verify=True,
                             lowering="aot_eager")
    sec = opt.report.sections[0]
    assert matches(sec, "mla_prefill") == 2 and matches(sec, "fuse_moe") == 1
    assert matches(sec, "sparse_mla") == (2 if extra else 0)


def test_transformers_eager_experts_are_captured_through_grouped_mm():
    m = tiny_hf_model("DeepseekV3", "eager", layers=2, **HF_TINY)
    m.set_experts_implementation("eager")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    opt = metainfer.optimize(m, "cpu", example_inputs=(ids,), verify=True, lowering="aot_eager")
    assert len(opt.report.sections) == 1  # one graph: no break per expert
    assert matches(opt.report.sections[0], "fuse_moe") == 1
    assert any("grouped_mm" in n for n in opt.report.notes)
    assert m.config._experts_implementation == "eager"  # switched back after the call
    out = opt.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, m.generate(ids, max_new_tokens=3, do_sample=False))


def test_models_deepseek_through_the_triton_kernels(interpret, monkeypatch):
    """Every DeepSeek op runs its Triton kernel (interpreted) inside the compiled graphs."""
    from metainfer import kernels

    calls = {}
    for mod in (kernels.fp8_gemm, kernels.moe, kernels.sparse_attention, kernels.mla_decode, kernels.attention):
        real = mod.launch
        monkeypatch.setattr(mod, "launch", lambda *a, _real=real, _name=mod.NAME, **k:
                            calls.__setitem__(_name, calls.get(_name, 0) + 1) or _real(*a, **k))
    m = models.build("deepseek-v32-tiny-fp8")
    (ids,) = models.example_inputs("deepseek-v32-tiny-fp8", batch=2, seq=8)
    prefill = metainfer.optimize(m, "cpu", lowering="aot_eager")
    # decode steps over a few cached tokens, where the cost model keeps MLA decompressed:
    # absorbed by force, so its kernel runs too
    decode = metainfer.optimize(m, "cpu", lowering="aot_eager", pass_options={"mla_decode": True})

    class Both:
        model = m

        def __call__(self, x, start_pos):
            return (prefill if start_pos == 0 else decode)(x, start_pos=start_pos)

    ref, out = _teacher_forced(m, ids), _teacher_forced(Both(), ids)
    assert mismatch(ref, out) is None, mismatch(ref, out)
    # prefill: sparse attention over the decompressed cache; decode steps: absorbed MLA
    assert set(calls) == {"fp8_gemm", "moe", "sparse_attention", "mla_decode"}, calls
