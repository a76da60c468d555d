"""Speculative decoding (metainfer.runtime.speculative): Hugging Face's assisted generation with the
verify and draft steps on metainfer's graphs and the draft length metainfer's. Greedy tokens
equal plain greedy generate() in every case (speculation never changes outputs); the report
labels verify and draft graphs and records every change of the draft length."""

import gc

import pytest
import torch

import metainfer
from metainfer.hardware import planner
from metainfer.runtime import speculative
from metainfer.runtime.speculative import Acceptance, Measured, _Mean
from metainfer.testing import tiny_hf_model

NEW = 24


@pytest.fixture(scope="module")
def target():
    model = tiny_hf_model("Qwen2", "sdpa", layers=2)
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([ids, ids, ids], 1)  # repetitive: prompt lookup finds continuations
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    return model, ids, greedy, metainfer.optimize(model, "cpu", example_inputs=(ids,))


@pytest.mark.parametrize("how", [dict(prompt_lookup_num_tokens=4), dict(prompt_lookup_num_tokens=4, draft_length=2),
                                 dict(assistant="self", draft_length=2), dict(assistant="other")])
def test_speculation_never_changes_greedy_tokens(target, how):
    model, ids, greedy, opt = target
    kw = dict(how)
    who = kw.pop("assistant", None)
    if who == "self":
        kw["assistant_model"] = opt
    elif who == "other":  # a plain model: metainfer optimizes it for the same target
        kw["assistant_model"] = tiny_hf_model("Qwen2", "sdpa", layers=1, seed=1)
    before = len(opt.report.speculation)
    out = opt.generate(ids, max_new_tokens=NEW, do_sample=False, **kw)
    assert torch.equal(out, greedy)
    decisions = opt.report.speculation[before:]
    assert decisions and all(d["why"] for d in decisions)
    assert decisions[-1]["when"] == "end of call"
    if "draft_length" in kw:
        assert [d["draft_length"] for d in decisions[:-1]] == [kw["draft_length"]]
        drafted = decisions[-1]["drafted"]
        assert max(drafted) <= kw["draft_length"] and drafted.get(kw["draft_length"]), drafted


def test_a_fixed_length_holds_over_the_engines_own_schedule(target):
    """Hugging Face's "heuristic" schedule would lengthen the draft by 2 after each fully
    accepted one (the target drafting for itself accepts everything)."""
    model, ids, greedy, opt = target
    model.generation_config.num_assistant_tokens_schedule = "heuristic"
    try:
        out = opt.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=opt, draft_length=2)
    finally:
        model.generation_config.num_assistant_tokens_schedule = "constant"
    assert torch.equal(out, greedy)
    end = opt.report.speculation[-1]
    assert end["when"] == "end of call" and set(end["drafted"]) <= {0, 1, 2} and end["drafted"].get(2), end


def test_verify_and_draft_graphs_are_labelled_and_bounded(target):
    model, ids, greedy, _ = target
    opt = metainfer.optimize(model, "cpu")
    out = opt.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=opt, draft_length=2)
    assert torch.equal(out, greedy)
    phases = [s.phase for s in opt.report.sections]
    assert {"prefill", "verify", "draft"} <= set(phases), phases
    # symbolic lengths: not a graph per step or per k; the KV cache's two layouts (whole, and
    # cropped after a rejection) may each take one
    assert phases.count("verify") <= 2, phases
    assert "speculation: " in str(opt.report)


def test_an_unrelated_drafter_is_switched_off_early(target):
    model, ids, greedy, _ = target
    opt = metainfer.optimize(model, "cpu")
    drafter = tiny_hf_model("Llama", "sdpa", layers=1, seed=7)  # another family, random: nothing agrees
    out = opt.generate(ids, max_new_tokens=32, do_sample=False, assistant_model=drafter)
    off = [d for d in opt.report.speculation if d["draft_length"] == 0]
    assert off, opt.report.speculation
    assert int(off[0]["when"].split()[-1]) <= 16  # a step yields >= 1 token: within the first 32 tokens
    assert off[0]["acceptance"] < 0.5 and "speculation off" in off[0]["why"]
    assert torch.equal(out[:, :greedy.shape[1]], greedy)


def test_a_step_cut_at_eos_is_not_a_rejection(target):
    """Hugging Face cuts a verified step after an EOS among the accepted drafts and reports
    fewer matches; the drafts were not rejected (the target drafting for itself agrees with
    every one)."""
    model, ids, greedy, opt = target
    new = greedy[0, ids.shape[1]:].tolist()
    eos = next(t for i, t in enumerate(new) if i >= 6 and t not in new[:i])  # first seen mid-way
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    speculative.forget(opt)
    out = opt.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, assistant_model=opt,
                       draft_length=4)
    assert torch.equal(out, plain) and out[0, -1] == eos
    (acceptance, _), = speculative.statistics(opt)
    assert acceptance.rejected == 0 and acceptance.accepted >= 4, acceptance


def test_statistics_keep_draft_models_and_named_drafters_apart(target):
    """A draft model's statistics are held weakly (dropped with it), prompt lookup's by name."""
    model, ids, greedy, _ = target
    opt = metainfer.optimize(model, "cpu")
    drafter = tiny_hf_model("Qwen2", "sdpa", layers=1, seed=3)
    opt.generate(ids, max_new_tokens=3, do_sample=False, assistant_model=drafter, draft_length=1)
    opt.generate(ids, max_new_tokens=3, do_sample=False, prompt_lookup_num_tokens=2, draft_length=1)
    assert len(speculative.statistics(opt)) == 2
    del drafter
    gc.collect()
    assert len(speculative.statistics(opt)) == 1


def test_bad_speculation_arguments(target):
    _, ids, _, opt = target
    for kw, msg in ((dict(prompt_lookup_num_tokens=4, draft_length=-1), "non-negative integer"),
                    (dict(draft_length=2), "applies to speculative decoding"),
                    (dict(prompt_lookup_num_tokens=4, assistant_model=opt), "not both"),
                    (dict(prompt_lookup_num_tokens=4, do_sample=True), "greedy"),
                    (dict(prompt_lookup_num_tokens=0), "positive integer")):
        with pytest.raises(ValueError, match=msg):
            opt.generate(ids, max_new_tokens=2, **kw)


# ---- the decision, by hand ------------------------------------------------------------------

def test_draft_length_by_hand():
    flat = lambda n: 1.0  # noqa: E731  a verify costs the same whatever its length
    assert planner.best_draft_length(0.0, flat, lambda k: 0.0, 8)[0] == 0  # nothing is ever accepted
    assert planner.best_draft_length(1.0, flat, lambda k: 0.0, 8)[0] == 8  # free drafts, all accepted
    # a = 0.5, verify 1 + 0.1 n, drafting 0.3 per token: k=1 gives 1.5 / 1.5 = 1.0 tok/s,
    # k=0 gives 1 / 1.1 = 0.909, k=2 gives 1.75 / 1.9 = 0.921: k = 1
    k, acc, step = planner.best_draft_length(0.5, lambda n: 1 + 0.1 * n, lambda k: 0.3 * k, 8)
    assert (k, acc) == (1, 1.5) and step == pytest.approx(1.5)


def test_acceptance_and_verify_time_estimates_by_hand():
    a = Acceptance()
    assert a.rate == 0.5  # the Beta(1, 1) prior
    a.observe(drafted=3, matched=3)  # all accepted: no rejection seen
    a.observe(drafted=3, matched=1)  # one accepted, the second rejected
    assert (a.accepted, a.rejected) == (4, 1) and a.rate == pytest.approx(5 / 7)
    m = Measured()
    assert m.verify_seconds(3) is None
    m.verify.setdefault(2, _Mean()).add(0.010)
    assert m.verify_seconds(5) == 0.010  # one length: flat
    m.verify.setdefault(4, _Mean()).add(0.014)
    m.verify[4].add(0.014)
    # least squares through (2, 0.010) x1 and (4, 0.014) x2: 0.002 s per token
    assert m.verify_seconds(6) == pytest.approx(0.018)
