"""The OpenAI fields the server computes, each against a reference outside the code under test:
stop strings against transformers' StopStringCriteria (on a byte-level BPE tokenizer, so stops
fall inside tokens and characters span tokens), penalties against transformers' processors,
log-probabilities against log_softmax of the same logits, choices' admission by hand-worked
cases, and the request fields' checks. The server end to end: tests/test_server.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metainfer.runtime import sampling
from metainfer.server import protocol

CORPUS = ["the cat sat on the mat, naïve café 日本語 — done.", "stop here STOP there; end of line\nnew line"] * 20


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE tokenizer trained offline on CORPUS (multi-byte characters span tokens)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def _request(**fields) -> protocol.GenerationRequest:
    return protocol.GenerationRequest(kind=fields.pop("kind", "completion"), prompt_ids=[1, 2], max_tokens=16, **fields)


# ---- stop strings

def _stop_reference(tokenizer, ids: list[int], stops: list[str]) -> tuple[int, str]:
    """(tokens kept, text): transformers' StopStringCriteria names the first token that completes
    a stop string; the text is the decoded tokens up to it, cut before the stop string."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    criteria = StopStringCriteria(tokenizer, stops)
    for end in range(1, len(ids) + 1):
        if bool(criteria(torch.tensor([ids[:end]]), None)[0]):
            text = tokenizer.decode(ids[:end])
            return end, text[:min(at for at in (text.find(s) for s in stops) if at >= 0)]
    return len(ids), tokenizer.decode(ids)


def test_stop_strings_end_the_text_where_transformers_stops(bpe):
    info = protocol.ModelInfo("m", len(bpe), None, tokenizer=bpe)
    texts = [t for line in CORPUS[:2] for t in (line, line.upper(), line[::-1])]

    @settings(max_examples=80, deadline=None)
    @given(text=st.sampled_from(texts), data=st.data())
    def check(text, data):
        ids = bpe(text)["input_ids"]
        whole = bpe.decode(ids)
        # stops: pieces of the text (inside tokens, across them, within multi-byte characters'
        # tokens) and strings that never occur
        pieces = []
        for _ in range(data.draw(st.integers(1, 3))):
            a = data.draw(st.integers(0, len(whole) - 1))
            pieces.append(whole[a:a + data.draw(st.integers(1, 6))])
        stops = list(dict.fromkeys(pieces + data.draw(st.lists(st.sampled_from(["zzz", "QQ", "日本語!"]), max_size=1))))
        cuts = sorted(set(data.draw(st.lists(st.integers(1, len(ids)), max_size=6))) | {len(ids)})
        choice = protocol.Choice(0, _request(stop=stops), info)
        streamed = ""
        for end in cuts:  # the engine hands tokens out a few at a time
            text_delta, _new, _ = choice.add(ids[:end], "length" if end == len(ids) else None)
            streamed += text_delta
            if choice.finish is not None:
                break
        kept, want = _stop_reference(bpe, ids, stops)
        assert choice.ids == ids[:kept]
        assert streamed == choice.text == want
        assert choice.finish == ("stop" if kept < len(ids) or any(s in whole for s in stops) else "length")

    check()


def test_text_that_may_begin_a_stop_string_is_held_until_the_next_token(bpe):
    info = protocol.ModelInfo("m", len(bpe), None, tokenizer=bpe)
    ids = bpe("the cat sat on the mat")["input_ids"]
    choice = protocol.Choice(0, _request(stop=["cat sat!"]), info)
    shown = [choice.add(ids[:end], None)[0] for end in range(1, len(ids))]
    at = [bpe.decode(ids[:end]) for end in range(1, len(ids))].index("the cat sat")
    assert "".join(shown[:at + 1]) == "the "  # "cat sat" might still become the stop string
    assert "".join(shown[:at + 2]).startswith("the cat sat ")  # and then did not
    final, _, _ = choice.add(ids, "length")
    assert "".join(shown) + final == "the cat sat on the mat" and choice.finish == "length"


def test_deltas_add_up_to_the_whole_text_with_characters_split_over_tokens(bpe):
    info = protocol.ModelInfo("m", len(bpe), None, tokenizer=bpe)

    @settings(max_examples=60, deadline=None)
    @given(text=st.sampled_from(CORPUS[:2]), data=st.data())
    def check(text, data):
        ids = bpe(text[data.draw(st.integers(0, 10)):])["input_ids"]
        cuts = sorted(set(data.draw(st.lists(st.integers(1, len(ids)), max_size=10))) | {len(ids)})
        detok = protocol.Detokenizer(info)
        parts = [detok.delta(ids[:end], final=end == len(ids)) for end in cuts]
        assert "".join(parts) == bpe.decode(ids)
        assert all("\ufffd" not in p for p in parts)  # a split character goes out whole

    check()


# ---- penalties and log-probabilities in the sampler

def _states(histories, kwargs):
    from transformers.generation.continuous_batching.requests import RequestState

    states = []
    for i, ((prompt, generated), kw) in enumerate(zip(histories, kwargs)):
        state = RequestState(request_id=f"r{i}", initial_tokens=list(prompt), logit_processor_kwargs=dict(kw))
        state.generated_tokens = list(generated)
        states.append(state)
    return states


class _Row:
    def __init__(self, state):
        self.state, self.has_new_token = state, True


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(8, 64), seed=st.integers(0, 2**16), rows=st.integers(1, 4), data=st.data())
def test_penalties_equal_transformers_processors_on_the_same_logits(vocab, seed, rows, data):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    ids = st.lists(st.integers(0, vocab - 1), max_size=12)
    histories = [(data.draw(ids), data.draw(ids)) for _ in range(rows)]
    penalties = [{"repetition_penalty": data.draw(st.sampled_from([1.0, 0.7, 1.3, 2.0])),
                  "presence_penalty": data.draw(st.sampled_from([0.0, -0.5, 1.25])),
                  "frequency_penalty": data.draw(st.sampled_from([0.0, 0.4, -2.0]))} for _ in range(rows)]
    got = sampling.penalise(logits, list(range(rows)), penalties, *map(list, zip(*histories)))
    for r, ((prompt, generated), p) in enumerate(zip(histories, penalties)):
        want = logits[r:r + 1].clone()
        if prompt + generated:  # transformers: repetition over every token the sequence holds
            want = RepetitionPenaltyLogitsProcessor(p["repetition_penalty"])(torch.tensor([prompt + generated]), want)
        # OpenAI's presence and frequency penalties over the generated tokens: a bias per token
        bias = [[[t], -(generated.count(t) * p["frequency_penalty"] + p["presence_penalty"])] for t in set(generated)]
        if bias:
            want = SequenceBiasLogitsProcessor(bias)(torch.tensor([prompt + generated]), want)
        torch.testing.assert_close(got[r], want[0], rtol=1e-6, atol=1e-6)


def test_the_sampler_penalises_watched_rows_and_records_their_logprobs():
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)) * 4
    histories = [([3, 4], [5, 5, 6]), ([7], []), ([1], [int(logits[2].argmax())])]
    kwargs = [{"temperature": 0.0, "frequency_penalty": 1.0, "repetition_penalty": 1.5}, {"temperature": 0.0},
              {"temperature": 0.7, "top_k": 4, "presence_penalty": 2.0}]
    states = _states(histories, kwargs)
    sampler = sampling.Sampler()
    sampler.watch_logprobs(["r0", "r2"], top=3)
    storage = torch.zeros(3, 8, dtype=torch.int32)
    sampler.prepare_tensor_args([_Row(s) for s in states], storage)
    out = sampler(None, logits.clone(), storage)
    penalised = sampling.penalise(logits, [0], [{"repetition_penalty": 1.5, "presence_penalty": 0.0,
                                                 "frequency_penalty": 1.0}], [[3, 4]], [[5, 5, 6]])
    assert out.argmax(-1)[0] == penalised[0].argmax()  # the greedy row: the penalised argmax
    assert torch.equal(out[1], logits[1])  # a row without penalties is untouched
    want = torch.log_softmax(logits, -1)  # the model's raw distribution
    for row, rid in ((0, "r0"), (2, "r2")):
        (record,) = sampler.take_logprobs(rid, 3 if row == 0 else 1, 4 if row == 0 else 2)
        assert record.token == int(out[row].argmax())
        assert record.logprob == pytest.approx(float(want[row, record.token]), abs=1e-5)
        top = want[row].topk(3)
        assert [t for t, _ in record.top] == top.indices.tolist()
        assert [lp for _, lp in record.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    with pytest.raises(RuntimeError, match="no log-probabilities"):
        sampler.take_logprobs("r1", 0, 1)  # not watched
    sampler.unwatch(["r0", "r2"])
    assert not sampler._logprobs and not sampler._watched


def test_a_preempted_request_keeps_its_generated_tokens_apart_from_its_prompt():
    from transformers.generation.continuous_batching.requests import RequestState

    state = RequestState(request_id="r", initial_tokens=[1, 2, 3])
    state.generated_tokens = [7, 8]
    again = state.create_equivalent_initial_request()  # what the engine re-queues after a preemption
    again.generated_tokens = [9]
    assert sampling.history(state) == ([1, 2, 3], [7, 8])
    assert sampling.history(again) == ([1, 2, 3], [7, 8, 9])


def test_logprobs_blocks_in_openais_shapes():
    record = sampling.TokenLogprob(5, -0.25, [(5, -0.25), (6, -1.5)])
    info = protocol.ModelInfo("m", 16, None)  # no tokenizer: tokens named by id
    completion = protocol.Choice(0, _request(logprobs=2), info)
    block = completion.logprobs_block([record, record])
    assert block == {"tokens": ["token_id:5"] * 2, "token_logprobs": [-0.25, -0.25],
                     "top_logprobs": [{"token_id:5": -0.25, "token_id:6": -1.5}] * 2, "text_offset": [0, 10]}
    chat = protocol.Choice(0, _request(kind="chat", logprobs=1), info).logprobs_block([record])
    entry = chat["content"][0]
    assert entry["token"] == "token_id:5" and entry["bytes"] == list(b"token_id:5")
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.25, -1.5]
    assert protocol.Choice(0, _request(), info).logprobs_block([record]) is None


# ---- choices hold running slots

def test_admission_counts_a_requests_choices_and_serves_waiters_in_order():
    from metainfer.server.engine import Admission, Overloaded

    async def scenario():
        adm = Admission(max_running=4, max_queue=2)
        await adm.acquire(3)
        order = []

        async def wait(name, slots):
            await adm.acquire(slots)
            order.append(name)

        big, small = asyncio.create_task(wait("big", 2)), asyncio.create_task(wait("small", 1))
        await asyncio.sleep(0)
        assert adm.running == 3 and len(adm.waiting) == 2  # "small" would fit, but "big" came first
        with pytest.raises(Overloaded):
            await adm.acquire(1)
        adm.release(3)
        await asyncio.gather(big, small)
        assert order == ["big", "small"] and adm.running == 3
        big_again = asyncio.create_task(wait("big again", 4))
        await asyncio.sleep(0)
        big_again.cancel()  # going away: the queue moves on
        await asyncio.sleep(0)
        assert not adm.waiting
        adm.release(2)
        adm.release(1)
        assert adm.running == 0
        with pytest.raises(ValueError):
            await adm.acquire(5)
        # a waiter the engine failed (its future holds the error), then cancelled: no slot to give back
        await adm.acquire(4)
        waiter = asyncio.create_task(adm.acquire(1))
        await asyncio.sleep(0)
        adm.waiting[0][0].set_exception(RuntimeError("failed"))
        waiter.cancel()
        with pytest.raises((asyncio.CancelledError, RuntimeError)):
            await waiter
        assert adm.running == 4

    asyncio.run(scenario())


# ---- the fields' checks

INFO = protocol.ModelInfo("m", 16, 64)


def _parse(kind="completion", **body):
    body = {"model": "m", **({"prompt": [1, 2]} if kind == "completion" else
                             {"messages": [{"role": "user", "content": "hi"}]}), **body}
    if kind == "chat":  # a chat needs a tokenizer with a chat template
        from metainfer import servebench

        return protocol.parse(body, kind, protocol.ModelInfo("m", 16, 64, tokenizer=servebench.word_tokenizer(16)))
    return protocol.parse(body, kind, INFO)


@pytest.mark.parametrize("body, param, words", [
    ({"n": 0}, "n", ">= 1"),
    ({"n": protocol.MAX_N + 1}, "n", "<="),
    ({"stop": ["a"] * 5}, "stop", "at most 4"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop": "x" * 600}, "stop", "longer than"),
    ({"stop": "end"}, "stop", "no tokenizer"),
    ({"logprobs": 21}, "logprobs", "<= 20"),
    ({"logprobs": True}, "logprobs", "integer"),
    ({"top_logprobs": 2}, "top_logprobs", "chat completions field"),
    ({"echo": True, "logprobs": 1}, "echo", "prompt's log-probabilities"),
    ({"echo": "yes"}, "echo", "true or false"),
    ({"presence_penalty": 2.5}, "presence_penalty", "<= 2.0"),
    ({"frequency_penalty": "1"}, "frequency_penalty", "number"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0.0"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "'json_schema' is not supported"),
    ({"response_format": "json"}, "response_format", "object"),
    ({"logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    # found by fuzzing: falsy values of the wrong type were taken as "not set"
    ({"stream": 0}, "stream", "true or false"),
    ({"stream_options": ""}, "stream_options", "object"),
    ({"stop_token_ids": 0}, "stop_token_ids", "list"),
])
def test_a_bad_field_is_a_400_naming_it(body, param, words):
    with pytest.raises(protocol.APIError) as e:
        _parse(**body)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


@pytest.mark.parametrize("body, param", [({"logprobs": 2}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
                                         ({"echo": True}, "echo"),
                                         ({"max_completion_tokens": 4, "max_tokens": "x"}, "max_tokens")])
def test_chat_takes_its_own_logprob_fields(body, param):
    with pytest.raises(protocol.APIError) as e:
        _parse("chat", **body)
    assert e.value.param == param


def test_the_fields_parse_to_what_the_engine_takes():
    req = _parse(n=3, logprobs=0, presence_penalty=0.5, repetition_penalty=1.0, response_format={"type": "text"},
                 echo=False, stop=None)
    assert (req.n, req.logprobs, req.penalties, req.echo, req.stop) == (3, 0, {"presence_penalty": 0.5}, False, [])
    info = protocol.ModelInfo("m", 16, 64, tokenizer=object())
    req = protocol.parse({"model": "m", "prompt": [1], "stop": ["a", "a", "b"], "echo": True}, "completion", info)
    assert req.stop == ["a", "b"] and req.echo
    # chat: logprobs a boolean, top_logprobs the number of alternatives
    assert _parse("chat", logprobs=True).logprobs == 0 and _parse("chat", logprobs=True, top_logprobs=5).logprobs == 5
    assert _parse("chat", logprobs=False).logprobs is None and _parse().logprobs is None


# ---- n choices in the engine

def test_n_choices_after_the_prompt_is_cached_but_its_last_token():
    """The engine forks n choices after prefilling all but the last prompt token; with the rest
    in cached prefix pages (a prompt of k pages + 1 token, sent before) its fork step would be
    empty and fail the engine: metainfer sends n requests there instead."""
    from transformers import ContinuousBatchingConfig

    import metainfer
    from metainfer import servebench
    from metainfer.server.engine import engine_manager

    opt = metainfer.optimize(servebench.build_model("hf-llama-tiny"), "cpu", lowering="aot_eager")
    manager = engine_manager(opt, ContinuousBatchingConfig(num_blocks=64, page_size=8), max_running=4,
                             get_results=True)
    prompt = list(range(5, 22))  # 2 pages + 1 token
    manager.start()
    try:
        first = servebench.collect(manager, [manager.add_request(prompt, request_id="a", max_new_tokens=4,
                                                                 temperature=0.0)])
        manager.add_request(prompt, request_id="b", max_new_tokens=4, temperature=0.0, n=2)
        both = servebench.collect(manager, manager.request_ids("b", 2))
    finally:
        manager.stop(block=True, timeout=30)
    assert all(o.error is None for o in both.values())
    assert [list(o.generated_tokens) for o in both.values()] == [list(first["a"].generated_tokens)] * 2


def test_the_servers_engine_drops_outputs_no_handler_claims():
    """An output delivered after its request was cancelled (a stop string, a disconnect) has no
    handler; the engine would keep it on a queue only get_result reads, forever. The server's
    managers (rank 0 and the ranks that follow it) drop them."""
    import metainfer
    from metainfer import servebench
    from metainfer.server.engine import engine_manager

    opt = metainfer.optimize(servebench.build_model("hf-llama-tiny"), "cpu", lowering="aot_eager")
    router = engine_manager(opt, None, max_running=2).output_router
    router.deliver(type("Output", (), {"request_id": "gone"})())
    assert router.output_queue.empty() and router.output_queue.qsize() == 0
    kept = engine_manager(opt, None, max_running=2, get_results=True).output_router
    kept.deliver(type("Output", (), {"request_id": "gone"})())
    assert kept.output_queue.qsize() == 1
