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
        # every step yields its accepted drafts and one token of the model's own; the prefill one
        # token, and a last step for one token drafts nothing and is not reported
        assert NEW - 2 <= sum(a + 1 for _, a in log.steps) <= NEW - 1 and max(d for d, _ in log.steps) == k


def test_the_mtp_does_not_change_the_main_model():
    ids = prompt(build())
    torch.testing.assert_close(build(n_mtp_layers=1)(ids), build(n_mtp_layers=0)(ids), rtol=0, atol=0)


def whole_sequence_mtp(model, seq):
    """Each MTP layer's logits over the whole sequence at once, no cache: layer 0 at position i
    reads (h_i, t_{i+1}); layer j reads layer j-1's output at i - 1 (zeros before 0) and t_{i+1}."""
    with torch.no_grad():
        _, hidden = model(seq[:, :-1], return_hidden=True)
        out = []
        for j in range(len(model.mtp.layers)):
            if j:
                hidden = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
            logits, h = model.mtp(hidden, seq[:, 1:], depth=j)
            out.append(logits)
    return out


@pytest.mark.parametrize("n_mtp", [1, 3])
def test_accepted_drafts_keep_the_sequence(monkeypatch, n_mtp):
    """The MTP runs as usual, but the drafts it hands the verify are read from the plain greedy
    answer, wrong at every position = 3 (mod 4): the loop must keep exactly the leading right
    ones and hand the MTP the kept tokens; and every MTP pass, now over several kept positions,
    computes what the MTP computes over the whole final sequence at once."""
    model = build(n_mtp_layers=n_mtp)
    ids = prompt(model)
    s = ids.shape[1]
    greedy = model.generate(ids, NEW)
    drafted, passes, kept = [], [], set()
    real_draft = model._draft

    def oracle(hidden, next_tokens, start, k, carry):
        last = start + next_tokens.shape[1]  # next_tokens hold positions start+1 .. last
        assert hidden.shape[1] == next_tokens.shape[1]
        assert torch.equal(next_tokens, greedy[:, start + 1:last + 1])  # the kept tokens, as generated
        _, carry = real_draft(hidden, next_tokens, start, k, carry)
        if k:  # positions start..last-1 are final now, in every layer
            kept.update(range(start, last))
        positions = list(range(last + 1, last + 1 + k))
        drafts = greedy[:, last + 1:last + 1 + k].clone()
        for j, p in enumerate(positions):
            if p % 4 == 3:
                drafts[0, j] = (drafts[0, j] + 1) % model.config.vocab_size
        drafted.append(positions)
        return drafts, carry

    monkeypatch.setattr(model, "_draft", oracle)
    hook = model.mtp.register_forward_hook(lambda m, args, kwargs, out: passes.append(
        (kwargs["start_pos"], kwargs["depth"], args[1], out[0])), with_kwargs=True)
    log = Log(3)
    assert torch.equal(model.generate(ids, NEW, speculate=log), greedy)
    hook.remove()
    # a last step for one token drafts nothing and is not reported
    assert len(drafted) - len(log.steps) in (0, 1) and not any(drafted[len(log.steps):])
    for (k, accepted), positions in zip(log.steps, drafted):
        assert k == len(positions)
        right = next((j for j, p in enumerate(positions) if p % 4 == 3), k)  # leading right drafts
        assert accepted == right, (positions, accepted)
    assert sum(a for _, a in log.steps) >= NEW // 2  # most drafts were right: the accepting path ran
    assert drafted[0][0] == s + 1  # the first draft follows the first generated token
    whole = whole_sequence_mtp(model, greedy)
    checked = set()
    for start, depth, tokens, logits in passes:
        # a pass's positions whose tokens are the answer's (not a wrong draft) are final: compare those
        n = next((i for i in range(tokens.shape[1]) if tokens[0, i] != greedy[0, start + i + 1]), tokens.shape[1])
        torch.testing.assert_close(logits[:, :n], whole[depth][:, start:start + n], rtol=1e-4, atol=1e-4)
        checked |= {(depth, start + i) for i in range(n)}
    assert checked >= {(d, i) for d in range(n_mtp) for i in kept}  # every layer, every kept position
    assert max(t.shape[1] for st, d, t, _ in passes if st > 0) > 1 + n_mtp  # passes over several kept positions


def test_chained_drafts_use_the_layers_in_turn():
    model = build(n_mtp_layers=2)
    ids = prompt(model)
    calls = []
    model.mtp.register_forward_hook(
        lambda m, args, kwargs, out: calls.append((kwargs["start_pos"], kwargs["depth"], args[1].shape[1])),
        with_kwargs=True)
    model.generate(ids, 6, speculate=3)
    s = ids.shape[1]
    # over the prompt: layer 0 at positions 0..s-1 (draft 1), layer 1 at 0..s (draft 2), then
    # layer 1, the last, chained one position further (draft 3)
    assert calls[:3] == [(0, 0, s), (0, 1, s + 1), (s + 1, 1, 1)]


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
    assert drafter.lowering == "aot_eager"  # optimized as the target was
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
    with pytest.raises(ValueError, match="draft_length="):
        opt.generate(ids, 4, 2)  # speculate= given by position
    batch = torch.cat([ids, prompt(model, seed=5)])  # the MTP loop takes one sequence: a batch runs the plain one
    assert torch.equal(opt.generate(batch, 1), model.generate(batch, 1))
    assert len(opt.report.speculation) == before and any("without MTP speculation" in n for n in opt.report.notes)
    with pytest.raises(ValueError, match="draft_length=0"):
        opt.generate(batch, 4, draft_length=2)
    plain = metainfer.optimize(build(n_mtp_layers=0), "cpu", lowering="aot_eager")
    with pytest.raises(ValueError, match="MTP layers"):
        plain.generate(ids, 4, draft_length=2)
