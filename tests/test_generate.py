"""Inference as users run it: greedy generate() through the optimized graphs gives the eager
model's tokens, for models/ Llama (its own KV cache and loop) and Hugging Face models
(dynamic and static caches, left-padded batches); the report has prefill and decode graphs."""

import pytest
import torch

import metainfer
from metainfer import models
from metainfer.testing import tiny_hf_model

PROMPTS = [(1, 5, 9), (2, 9, 12), (3, 4, 6)]  # (batch, prompt length, new tokens)


def _phases(report):
    return {s.phase for s in report.sections}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_models_llama_generate_matches_eager(attention):
    model = models.build("llama-tiny", attention=attention)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    g = torch.Generator().manual_seed(1)
    for b, s, n in PROMPTS:
        prompt = torch.randint(0, 256, (b, s), generator=g)
        ref = model.generate(prompt, n)
        out = opt.generate(prompt, n)
        assert out.shape == (b, s + n) and torch.equal(ref, out), (b, s, n)
    r = opt.report
    assert _phases(r) == {"prefill", "decode"}
    for sec in r.sections:
        rec = next(x for x in sec.records if x.name == "fuse_attention")
        assert rec.matches == model.config.n_layers, (sec.phase, rec.near_misses)
        if sec.phase == "decode":
            assert all(" 1 x " in d for d in rec.decisions), rec.decisions
    assert len(r.sections) <= 8  # batch 1 vs symbolic, static vs symbolic lengths, per phase


def test_models_llama_decode_step_and_cache_errors():
    model = models.build("llama-tiny", n_layers=1)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    prompt = torch.randint(0, 256, (2, 6))
    model.setup_cache(2, 10)
    with torch.no_grad():
        ref_prefill = model(prompt, start_pos=0)
        ref_step = model(prompt[:, :1], start_pos=6)
    model.setup_cache(2, 10)
    assert torch.allclose(opt(prompt, start_pos=0), ref_prefill, atol=1e-5)
    assert torch.allclose(opt(prompt[:, :1], start_pos=6), ref_step, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit the KV cache"):
        opt(prompt, start_pos=6)
    model.layers[0].attention.cache = None
    with pytest.raises(ValueError, match="setup_cache"):
        opt(prompt, start_pos=0)


def test_models_llama_generate_through_inductor():
    model = models.build("llama-tiny", n_layers=1)
    opt = metainfer.optimize(model, "cpu")
    prompt = torch.randint(0, 256, (2, 7))
    assert torch.equal(model.generate(prompt, 5), opt.generate(prompt, 5))
    assert _phases(opt.report) == {"prefill", "decode"}


def _hf(arch, impl, layers=2):
    pytest.importorskip("transformers")
    return tiny_hf_model(arch, impl, layers)


def _left_padded(b, s, pad, g):
    ids = torch.randint(3, 128, (b, s), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        ids[1:, :pad] = 0
        mask[1:, :pad] = 0
    return ids, mask


# each attention form and each cache once in the default tier; the rest of the square in the slow one
@pytest.mark.parametrize("arch,impl,cache", [
    ("Llama", "sdpa", "dynamic"), ("Llama", "eager", "static"),
    pytest.param("Llama", "eager", "dynamic", marks=pytest.mark.slow),
    pytest.param("Llama", "sdpa", "static", marks=pytest.mark.slow),
    pytest.param("Qwen2", "eager", "dynamic", marks=pytest.mark.slow),
    pytest.param("Qwen2", "eager", "static", marks=pytest.mark.slow)])
def test_hugging_face_generate_matches_eager(arch, impl, cache):
    model = _hf(arch, impl)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    g = torch.Generator().manual_seed(2)
    kw = dict(max_new_tokens=8, do_sample=False)
    if cache == "static":
        kw["cache_implementation"] = "static"
    for b, s, pad in [(1, 6, 0), (2, 7, 3), (3, 5, 1)]:
        ids, mask = _left_padded(b, s, pad, g)
        ref = model.generate(ids, attention_mask=mask, **kw)
        out = opt.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(ref, out), (b, s, pad)
    r = opt.report
    assert _phases(r) == {"prefill", "decode"}
    for sec in r.sections:
        rec = next(x for x in sec.records if x.name == "fuse_attention")
        assert rec.matches == 2, (sec.index, sec.phase, rec.near_misses)


def test_hugging_face_generate_with_every_pass():
    model = _hf("Llama", "eager")
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager",
                             passes=["fuse_attention", "fuse_rope", "fuse_rmsnorm", "fuse_swiglu"])
    ids = torch.randint(3, 128, (2, 6))
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(ref, opt.generate(ids, max_new_tokens=6, do_sample=False))
    decode = [s for s in opt.report.sections if s.phase == "decode"]
    assert decode and all(r.matches > 0 for s in decode for r in s.records)


def test_generate_leaves_the_model_as_it_was():
    model = _hf("Llama", "eager", layers=1)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    opt.generate(torch.randint(3, 128, (1, 4)), max_new_tokens=2, do_sample=False)
    assert "forward" not in model.__dict__, "the compiled forward is only installed during a call"
    with pytest.raises(ValueError, match="empty input"):
        opt.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    assert "forward" not in model.__dict__, "... also when the call raises"


def test_an_instance_forward_is_what_gets_compiled_and_is_put_back():
    """A forward set on the instance (as accelerate's hooks do) is the one optimized, and is
    the model's forward again after each call."""
    model = models.build("llama-tiny", n_layers=1)
    original = model.forward
    calls = []

    def hooked(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.forward = hooked
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        assert torch.allclose(opt(ids), original(ids), atol=1e-5)
    assert calls, "the instance forward was traced"
    assert model.__dict__["forward"] is hooked
    with pytest.raises(AttributeError, match="no generate"):
        metainfer.optimize(torch.nn.Linear(2, 2).eval(), "cpu").generate(torch.zeros(1, 2))


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_hugging_face_generate_through_inductor(cache):
    model = _hf("Llama", "eager")
    opt = metainfer.optimize(model, "cpu")
    ids, mask = _left_padded(2, 7, 2, torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False, attention_mask=mask)
    if cache == "static":
        kw["cache_implementation"] = "static"
    assert torch.equal(model.generate(ids, **kw), opt.generate(ids, **kw))
    assert _phases(opt.report) == {"prefill", "decode"}
