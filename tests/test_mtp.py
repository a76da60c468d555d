"""models/ DeepSeek's multi-token-prediction layers as the drafter of greedy speculative
decoding: the model's own loop (`generate(..., speculate=)`) and metainfer driving it
(`opt.generate`: the MTP layers compiled as the drafter, the draft length metainfer's).
With random weights the MTP's drafts are almost never accepted, so the accepting path is
tested with drafts from a known answer."""

import pytest
import torch

import metainfer
from metainfer import models
from metainfer.models import deepseek as ds

NEW = 20


def build(name="deepseek-tiny", n_mtp_layers=1):
    # DSA: with the tiny config's 2 indexer heads many keys score exactly 0 (relu), and which of
    # the tied keys top-k keeps is arbitrary (a plain cached decode already disagrees with a
    # full forward); with 8 heads no key ties here
    extra = dict(index_n_heads=8) if name == "deepseek-v32-tiny" else {}
    return ds.build(name, n_mtp_layers=n_mtp_layers, **extra)


def prompt(model, seq=12, seed=0):
    return ds.example_inputs(model.config, seq=seq, seed=seed)[0]


class Log:
    """A speculate= policy with a fixed length that records what each verify kept."""

    def __init__(self, k):
        self.k, self.steps = k, []

    def draft_length(self):
        return self.k

    def verified(self, drafted, accepted):
        self.steps.append((drafted, accepted))


@pytest.mark.parametrize("name,n_mtp,k", [("deepseek-tiny", 1, 1), ("deepseek-tiny", 1, 3),
                                          ("deepseek-tiny", 2, 2), ("deepseek-v32-tiny", 1, 2)])
def test_mtp_speculation_never_changes_greedy_tokens(name, n_mtp, k):
    model = build(name, n_mtp)
    for seed in (0, 1):
        ids = prompt(model, seed=seed)
        greedy = model.generate(ids, NEW)
        assert torch.equal(model.generate(ids, NEW, speculate=k), greedy)
        log = Log(k)
        assert torch.equal(model.generate(ids, NEW, speculate=log), greedy)
        # every step yields its accepted drafts and one token of the model's own
        assert sum(a + 1 for _, a in log.steps) == NEW - 1 and max(d for d, _ in log.steps) == k


def test_the_mtp_does_not_change_the_main_model():
    ids = prompt(build())
    torch.testing.assert_close(build(n_mtp_layers=1)(ids), build(n_mtp_layers=0)(ids), rtol=0, atol=0)


def test_accepted_drafts_keep_the_sequence(monkeypatch):
    """Drafts read from the plain greedy answer, wrong at every position = 3 (mod 4): the loop
    must keep exactly the leading right ones, and hand the MTP the kept tokens."""
    model = build()
    ids = prompt(model)
    s = ids.shape[1]
    greedy = model.generate(ids, NEW)
    drafted = []

    def oracle(hidden, next_tokens, start, k):
        last = start + next_tokens.shape[1]  # next_tokens hold positions start+1 .. last
        assert hidden.shape[1] == next_tokens.shape[1]
        assert torch.equal(next_tokens, greedy[:, start + 1:last + 1])  # the kept tokens, as generated
        positions = list(range(last + 1, last + 1 + k))
        drafts = greedy[:, last + 1:last + 1 + k].clone()
        for j, p in enumerate(positions):
            if p % 4 == 3:
                drafts[0, j] = (drafts[0, j] + 1) % model.config.vocab_size
        drafted.append(positions)
        return drafts

    monkeypatch.setattr(model, "_draft", oracle)
    log = Log(3)
    assert torch.equal(model.generate(ids, NEW, speculate=log), greedy)
    assert len(log.steps) == len(drafted)
    for (k, accepted), positions in zip(log.steps, drafted):
        assert k == len(positions)
        right = next((j for j, p in enumerate(positions) if p % 4 == 3), k)  # leading right drafts
        assert accepted == right, (positions, accepted)
    assert sum(a for _, a in log.steps) >= NEW // 2  # most drafts were right: the accepting path ran
    assert drafted[0][0] == s + 1  # the first draft follows the first generated token


def test_mtp_drafts_are_the_mtp_over_the_whole_sequence():
    """Each MTP pass in the loop, reading and writing its cache, computes what the MTP layer
    computes over the whole final sequence at once (no cache)."""
    model = build()
    ids = prompt(model)
    passes = []
    hook = model.mtp.register_forward_hook(
        lambda m, args, kwargs, out: passes.append((kwargs["start_pos"], kwargs["depth"], out[0])), with_kwargs=True)
    seq = model.generate(ids, NEW, speculate=1)
    hook.remove()
    assert passes and all(depth == 0 for _, depth, _ in passes)
    with torch.no_grad():
        _, hidden = model(seq[:, :-1], return_hidden=True)
        whole, _ = model.mtp(hidden, seq[:, 1:])
    for start, _, logits in passes:
        torch.testing.assert_close(logits, whole[:, start:start + logits.shape[1]], rtol=1e-4, atol=1e-4)


def test_chained_drafts_use_the_layers_in_turn():
    model = build(n_mtp_layers=2)
    ids = prompt(model)
    calls = []
    model.mtp.register_forward_hook(
        lambda m, args, kwargs, out: calls.append((kwargs["start_pos"], kwargs["depth"], args[1].shape[1])),
        with_kwargs=True)
    model.generate(ids, 6, speculate=3)
    s = ids.shape[1]
    # the prompt pass (depth 0 over positions 0..s-1), then drafts 2 and 3 one position further each,
    # by layers 1 and 1 (the last, reused)
    assert calls[:3] == [(0, 0, s), (s, 1, 1), (s + 1, 1, 1)]


def test_speculate_errors():
    model, plain = build(), build(n_mtp_layers=0)
    ids = prompt(model)
    with pytest.raises(ValueError, match="no MTP layers|has none"):
        plain.generate(ids, 4, speculate=2)
    with pytest.raises(ValueError, match="batch 1"):
        model.generate(ids.repeat(2, 1), 4, speculate=2)
    with pytest.raises(ValueError, match=">= 0"):
        model.generate(ids, 4, speculate=-1)
    with pytest.raises(TypeError, match="draft_length"):
        model.generate(ids, 4, speculate="auto")
    with pytest.raises(ValueError, match="draft length must be an integer"):
        model.generate(ids, 4, speculate=Log(1.5))
    with pytest.raises(ValueError, match="n_mtp_layers"):
        ds.DeepSeekConfig(n_mtp_layers=-1)


def test_real_size_mtp_layer_is_the_reports_size():
    """DeepSeek-V3's report: 671B main weights and a 14B MTP module (its embedding and head
    shared with the main model, and counted in the 14B)."""
    v3 = models.config("deepseek-v3")
    with torch.device("meta"):
        layer = ds.MTPLayer(v3)
    own = sum(p.numel() for p in layer.parameters())
    shared = 2 * v3.vocab_size * v3.dim
    assert 13.0e9 < own + shared < 14.5e9
    assert own - sum(p.numel() for p in layer.block.parameters()) == 2 * v3.dim * v3.dim + 3 * v3.dim


# ---- metainfer drives the loop --------------------------------------------------------------

@pytest.fixture(scope="module")
def optimized():
    model = build()
    ids = prompt(model)
    return model, ids, model.generate(ids, 32), metainfer.optimize(model, "cpu", lowering="aot_eager")


def test_metainfer_turns_random_mtp_off_early_and_keeps_tokens(optimized):
    model, ids, greedy, opt = optimized
    before = len(opt.report.speculation)
    assert torch.equal(opt.generate(ids, 32), greedy)
    decisions = opt.report.speculation[before:]
    assert all(d["drafter"] == "mtp" for d in decisions)
    assert decisions[0]["when"] == "before the first step" and "probing" in decisions[0]["why"]
    off = [d for d in decisions if d["draft_length"] == 0]
    assert off and "speculation off" in off[0]["why"], decisions
    assert int(off[0]["when"].split()[-1]) <= 16  # a step yields >= 1 token: within the first 32 tokens
    assert decisions[-1]["when"] == "end of call"
    main = [s.phase for s in opt.report.sections]
    assert main[0] == "prefill" and "verify" in main, main
    drafter = model.mtp.__dict__["_metainfer_drafter"]
    assert drafter._backend.lowering == "aot_eager"  # optimized as the target was
    assert {s.phase for s in drafter.report.sections} == {"draft"}
    assert drafter.report.matches("fuse_moe") >= 1 and drafter.report.matches("mla_prefill") >= 1  # its own passes


def test_metainfer_fixed_length_and_bounded_graphs(optimized):
    model, ids, greedy, opt = optimized
    drafter = model.mtp.__dict__.get("_metainfer_drafter")
    graphs = len(opt.report.sections), len(drafter.report.sections) if drafter else 0
    for k in (3, 1, 2):
        before = len(opt.report.speculation)
        assert torch.equal(opt.generate(ids, 32, draft_length=k), greedy)
        decisions = opt.report.speculation[before:]
        assert [d["draft_length"] for d in decisions[:-1]] == [k] and "fixed" in decisions[0]["why"]
        assert max(decisions[-1]["drafted"]) == k
    drafter = model.mtp.__dict__["_metainfer_drafter"]
    # lengths are symbolic: three more lengths compile no graph per k or per step
    assert len(opt.report.sections) - graphs[0] <= 2, [s.phase for s in opt.report.sections]
    assert len(drafter.report.sections) - graphs[1] <= 4, [s.phase for s in drafter.report.sections]


def test_metainfer_mtp_arguments(optimized):
    model, ids, greedy, opt = optimized
    before = len(opt.report.speculation)
    assert torch.equal(opt.generate(ids, 8, draft_length=0), greedy[:, :ids.shape[1] + 8])  # the plain loop
    assert len(opt.report.speculation) == before
    with pytest.raises(ValueError, match="draft_length="):
        opt.generate(ids, 4, speculate=2)
    with pytest.raises(ValueError, match="batch 1"):
        opt.generate(ids.repeat(2, 1), 4)
    plain = metainfer.optimize(build(n_mtp_layers=0), "cpu", lowering="aot_eager")
    with pytest.raises(ValueError, match="MTP layers"):
        plain.generate(ids, 4, draft_length=2)
