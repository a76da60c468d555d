"""Speculative decoding inside the serving engine (metainfer.runtime.serve_speculation): greedy
tokens equal the same requests' without it, in the engine (prompt lookup and a draft model,
with prefix sharing over small pages, EOS and max_tokens inside the drafts) and through
`metainfer serve --speculative`, with drafted and accepted tokens in /metrics. The reference
is the engine without speculation on the same requests."""

from __future__ import annotations

import copy
import signal

import pytest
import torch

import metainfer
from metainfer import servebench
from metainfer.runtime import serve_speculation
from metainfer.server.engine import engine_manager

# repetitive prompts: prompt lookup finds its n-grams; the last has no repeat at all
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10], [40], list(range(3, 40)), [20, 21, 22, 20, 21, 22]]


@pytest.fixture(scope="module")
def opt():
    model = servebench.build_model("hf-llama-tiny")
    return metainfer.optimize(model, "cpu", lowering="aot_eager")


def _run(opt, prompts, speculation=None, max_new_tokens=40, page_size=256, stop=None, rounds=1, watch=False,
         **kwargs):
    """Each prompt's tokens from the server's engine (greedy unless kwargs say), its speculation
    stats and the KV blocks still used at the end. `rounds`: the prompts go in that many
    times, one round after the other, into one engine (the later ones reuse the earlier ones'
    pages); the last round's tokens are returned."""
    from transformers import ContinuousBatchingConfig

    cfg = ContinuousBatchingConfig(num_blocks=max(96, 2 * 4096 // page_size), max_batch_tokens=512,
                                   page_size=page_size)
    manager = engine_manager(opt, cfg, max_running=8, speculation=speculation, get_results=True)
    manager.start()
    try:
        for r in range(rounds):
            if watch:  # the server watches a request's log-probabilities (rank 0)
                manager.sampler.watch_logprobs([f"r{r}-{i}" for i in range(len(prompts))], 1)
            ids = [manager.add_request(p, request_id=f"r{r}-{i}", max_new_tokens=max_new_tokens,
                                       eos_token_id=stop if stop is not None else [2], **{"temperature": 0.0, **kwargs})
                   for i, p in enumerate(prompts)]
            done = servebench.collect(manager, ids)
            assert all(done[i].error is None for i in ids), [done[i].error for i in ids]
        used = manager.kv_blocks()[0]
    finally:
        manager.stop(block=True, timeout=30)
    stats = manager.speculation.stats if manager.speculation is not None else None
    return [list(done[i].generated_tokens) for i in ids], stats, used


def test_prompt_lookup_keeps_the_greedy_tokens(opt):
    want, _, _ = _run(opt, PROMPTS)
    got, stats, used = _run(opt, PROMPTS, (serve_speculation.drafter("prompt-lookup"), 4))
    assert got == want
    assert stats.drafted > 0 and 0 < stats.accepted <= stats.drafted  # it drafted, and some drafts held
    assert used == 0


def test_a_draft_model_keeps_the_greedy_tokens_whatever_it_drafts(opt):
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(opt.model.config)
    config._attn_implementation = "sdpa"  # the engine switches the served model's
    torch.manual_seed(123)  # other weights than the model's: most drafts are wrong
    other = LlamaForCausalLM(config).eval()
    want, _, _ = _run(opt, PROMPTS[:3])
    got, stats, _ = _run(opt, PROMPTS[:3], (serve_speculation.drafter("draft", other), 3))
    assert got == want and stats.drafted > 0 and stats.accepted < stats.drafted
    same = servebench.build_model("hf-llama-tiny")  # the model's own weights: nearly every draft holds
    got, stats, _ = _run(opt, PROMPTS[:3], (serve_speculation.drafter("draft", same), 3))
    assert got == want and stats.accepted >= 0.9 * stats.drafted


def test_max_tokens_inside_the_drafts(opt):
    spec = (serve_speculation.drafter("prompt-lookup"), 4)
    want, _, _ = _run(opt, PROMPTS, max_new_tokens=7)
    got, stats, used = _run(opt, PROMPTS, spec, max_new_tokens=7)
    assert got == want and all(len(g) <= 7 for g in got) and used == 0 and stats.drafted > 0


def test_an_eos_the_drafts_reach_ends_the_request_where_it_would(opt):
    """The prompt holds the model's own continuation, so prompt lookup drafts it; the stop token
    is one of the drafted tokens: accepted drafts stop before it and the engine's token is it."""
    base = PROMPTS[3]
    (cont,), _, _ = _run(opt, [base], max_new_tokens=12)
    prompt = base + cont + base[-6:]  # the continuation drafted again after this n-gram
    (again,), _, _ = _run(opt, [prompt], max_new_tokens=12)
    stop = again[3]
    assert stop not in again[:3] and stop != 2
    want, _, _ = _run(opt, [prompt], max_new_tokens=12, stop=[2, stop])
    got, stats, used = _run(opt, [prompt], (serve_speculation.drafter("prompt-lookup"), 6), max_new_tokens=12,
                            stop=[2, stop])
    assert got == want and got[0][-1] == stop and used == 0 and stats.drafted > 0


def test_pages_completed_in_speculative_steps_are_shared_only_as_verified(opt):
    """Small pages filled in speculative steps (rejected drafts' rows written, then overwritten)
    are reused by requests whose prompts are the first ones' prompt + output (prefix sharing):
    their tokens equal the same two rounds without speculation. (A page is hashed for sharing
    only once the target verified every row of it: a rejected row's page hashed a step early
    would be wrong only until the next step wrote the row, a window this test cannot hit.)"""
    spec = (serve_speculation.drafter("prompt-lookup"), 4)

    def two_rounds(speculation):
        from transformers import ContinuousBatchingConfig

        cfg = ContinuousBatchingConfig(num_blocks=1024, max_batch_tokens=512, page_size=8)
        manager = engine_manager(opt, cfg, max_running=8, speculation=speculation, get_results=True)
        manager.start()
        try:
            def round_(name, prompts, new):
                ids = [manager.add_request(p, request_id=f"{name}{i}", max_new_tokens=new, eos_token_id=[2],
                                           temperature=0.0) for i, p in enumerate(prompts)]
                done = servebench.collect(manager, ids)
                return [list(done[i].generated_tokens) for i in ids]

            first = round_("a", PROMPTS, 40)
            computed = manager.steps.tokens
            again = round_("b", [p + out for p, out in zip(PROMPTS, first)], 8)
            # the second round's prompts came mostly from the first round's pages
            assert manager.steps.tokens - computed < sum(len(p) + len(o) for p, o in zip(PROMPTS, first)) // 2
        finally:
            manager.stop(block=True, timeout=30)
        return first, again

    assert two_rounds(spec) == two_rounds(None)


def test_sampled_and_penalised_requests_do_not_speculate(opt):
    spec = (serve_speculation.drafter("prompt-lookup"), 4)
    _, stats, _ = _run(opt, PROMPTS, spec, temperature=1.0)
    assert stats.drafted == 0
    _, stats, _ = _run(opt, PROMPTS, spec, repetition_penalty=1.2)
    assert stats.drafted == 0
    _, stats, _ = _run(opt, PROMPTS, spec, watch=True)  # log-probabilities are recorded a token a step
    assert stats.drafted == 0
    _, stats, _ = _run(opt, PROMPTS, spec)  # the same requests otherwise: they draft
    assert stats.drafted > 0


def test_speculation_is_refused_where_ranks_would_draft_apart(monkeypatch):
    from metainfer import cli

    monkeypatch.setattr(cli, "_serve_world", lambda a: 2)
    assert cli.main(["serve", "--model", "hf-llama-tiny", "--speculative", "prompt-lookup"]) == 2


def test_sliding_window_models_are_refused():
    import transformers

    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, sliding_window=16)
    model = transformers.MistralForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match="ring buffer"):
        serve_speculation.EngineSpeculation(None, model, serve_speculation.PromptLookup())


def test_metainfer_serve_speculative_over_http(tmp_path):
    import httpx

    from metainfer.testing import ServerProcess, tiny_model_folder

    folder = tiny_model_folder(tmp_path / "m")
    server = ServerProcess(folder, tmp_path, "--max-running", "4", "--num-blocks", "64", "--speculative",
                           "prompt-lookup", "--draft-tokens", "3")
    try:
        name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0}
        whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
        streamed = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed += __import__("json").loads(line[6:])["choices"][0]["token_ids"]
        m = server.metrics()
        assert streamed == whole
        assert m["metainfer_spec_drafted_tokens"] > 0 and 0 < m["metainfer_spec_acceptance"] <= 1
    finally:
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
    # the same request, served without speculation (the engine in this process): the same tokens
    opt_ = metainfer.optimize(__import__("transformers").AutoModelForCausalLM.from_pretrained(str(folder)).eval(),
                              "cpu", lowering="aot_eager")
    want, _, _ = _run(opt_, [PROMPTS[0]], max_new_tokens=30)
    assert whole == want[0]


def test_the_draft_length_follows_measured_step_times_and_acceptance():
    """Hand-worked cases: with a step as long whatever its tokens (a memory-bound GPU decode)
    every accepted draft is free, so the maximum; with a step proportional to its tokens (a
    compute-bound CPU batch) a request yields expected_accepted(a, k) < k + 1 tokens for k + 1
    tokens' time, so none; and while none pays, a probe every PROBE_EVERY steps."""
    import types

    model = torch.nn.Linear(1, 1)
    model.config = types.SimpleNamespace(vocab_size=8)
    spec = serve_speculation.EngineSpeculation(None, model, serve_speculation.PromptLookup(), max_draft=4)
    assert spec.draft_length(8, 8) == 4  # nothing measured yet: probe at the maximum
    spec.acceptance.observe(4, 3)
    for tokens in (8, 16, 24, 40, 8, 16, 24, 40):
        spec.step_times.add(tokens, 0.02)  # flat
    assert spec.draft_length(8, 8) == 4
    spec.step_times = serve_speculation.StepTimes()
    for tokens in (8, 16, 24, 40, 8, 16, 24, 40):
        spec.step_times.add(tokens, 0.001 * tokens)  # proportional
    lengths = [spec.draft_length(8, 8) for _ in range(2 * serve_speculation.PROBE_EVERY)]
    assert lengths.count(0) == len(lengths) - 2 and lengths.count(4) == 2
    spec.close()
