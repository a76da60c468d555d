"""`metainfer serve` as a client sees it: a real server process on 127.0.0.1, the real `openai`
client and plain HTTP. One server for the module (a tiny Llama saved with a tokenizer built
offline, the aot_eager lowering so it starts in seconds); the last test stops it with SIGTERM.

Expected tokens come from `opt.generate_batch` in this process (greedy), not from the server."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from metainfer.testing import ServerProcess, tiny_model_folder

KEY = "test-key"
MAX_RUNNING, MAX_QUEUE = 2, 2
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [40]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    s = ServerProcess(folder, tmp_path_factory.mktemp("server"), "--api-key", KEY, "--max-running", str(MAX_RUNNING),
                      "--max-queue", str(MAX_QUEUE), "--num-blocks", "64", "--grace", "20", key=KEY)
    yield s
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(folder):
    """Greedy tokens of `opt.generate_batch` for PROMPTS, 12 new tokens each."""
    import transformers

    import metainfer

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa").eval()
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=2, pad_token_id=0)
    from transformers import ContinuousBatchingConfig

    out = opt.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(
        num_blocks=64, max_batch_tokens=256))
    return [list(o.generated_tokens) for o in out.values()]


def test_completions_streamed_and_not_equal_generate_batch(server, client, expected):
    for prompt, want in zip(PROMPTS, expected):
        whole = client.completions.create(model=server_model(server), prompt=prompt, max_tokens=12, temperature=0)
        choice = whole.choices[0]
        assert choice.model_extra["token_ids"] == want
        assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == len(want)
        assert choice.finish_reason == ("stop" if want[-1] == 2 else "length")
        streamed, text, usage = [], "", None
        for c in client.completions.create(model=server_model(server), prompt=prompt, max_tokens=12, temperature=0,
                                           stream=True):
            streamed += c.choices[0].model_extra["token_ids"]
            text += c.choices[0].text
            usage = c.usage or usage
        assert streamed == want
        assert text == choice.text  # the deltas add up to the whole text
        assert usage.completion_tokens == len(want)


def server_model(server) -> str:
    return httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]


def test_chat_completion_uses_the_chat_template(server, client, folder):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "w1 w2 w3"}]
    whole = client.chat.completions.create(model=server_model(server), messages=messages, max_tokens=6, temperature=0)
    ids = whole.choices[0].model_extra["token_ids"]
    assert whole.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert whole.usage.prompt_tokens == len(prompt)
    # the same tokens through /v1/completions with the rendered prompt's ids
    plain = client.completions.create(model=server_model(server), prompt=prompt, max_tokens=6, temperature=0)
    assert plain.choices[0].model_extra["token_ids"] == ids
    chunks = list(client.chat.completions.create(model=server_model(server), messages=messages, max_tokens=6,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks), []) == ids
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_sampling_with_a_seed_and_text_prompts(server, client):
    out = client.completions.create(model=server_model(server), prompt="w3 w4 w5", max_tokens=8, temperature=1.0,
                                    top_p=0.9, seed=7)
    ids = out.choices[0].model_extra["token_ids"]
    assert 1 <= len(ids) <= 8 and all(0 <= t < 128 for t in ids)
    assert out.usage.prompt_tokens == 3


@pytest.mark.parametrize("body, status, param", [
    ('{"model": "tiny", "prompt": [1, 2', 400, None),  # malformed JSON
    ({"model": "other", "prompt": [1]}, 404, "model"),
    ({"model": None, "prompt": [1]}, 400, "model"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 2, 128]}, 400, "prompt"),  # outside the vocabulary
    ({"prompt": [1, -1]}, 400, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 600}, 400, "max_tokens"),  # past the model's 512 positions
    ({"prompt": [1] * 513}, 400, "prompt"),
    ({"prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [1], "temperature": -0.5}, 400, "temperature"),
    ({"prompt": [1], "temperature": 1e9}, 400, "temperature"),
    ({"prompt": [1], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1], "n": 3}, 400, "n"),
    ({"prompt": [1], "logprobs": 99}, 400, "logprobs"),
    ({"prompt": [1], "stop": ["a"] * 5}, 400, "stop"),
    ({"prompt": [1], "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"prompt": [1], "stop_token_ids": [999]}, 400, "stop_token_ids"),
    ({"prompt": [[1], [2]]}, 400, "prompt"),
])
def test_bad_requests_are_4xx_naming_the_field(server, body, status, param):
    if isinstance(body, dict):
        body = {"model": server_model(server), **body} if "model" not in body else body
    r = server.post("/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    # the server goes on serving
    assert server.post("/v1/completions", {"model": server_model(server), "prompt": [5], "max_tokens": 1}).status_code == 200


def test_a_body_past_the_limit_is_413_and_health_keeps_answering(server):
    """Issue 50: the body limit (default 1 MiB for a 512-position model) answers 413 in OpenAI's
    shape from the Content-Length, or as a chunked body passes it, holding no more than the limit;
    /health answers meanwhile."""
    url = f"{server.url}/v1/completions"
    big = b'{"model": "x", "prompt": "' + b"w1 " * (2 * 2**20 // 3) + b'"}'
    r = httpx.post(url, content=big, headers=server.headers(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "1048576 bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit applies as the body arrives
        yield b'{"model": "x", "prompt": "'
        for _ in range(40):
            yield b"w2 " * 10000
        yield b'"}'

    r = httpx.post(url, content=chunks(), headers=server.headers(), timeout=60)
    assert r.status_code == 413
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_a_prompt_past_the_character_bound_is_refused_before_tokenising(server):
    text = "w5 " * 12000  # 36,000 characters > 64 x 512 positions
    r = httpx.post(f"{server.url}/v1/completions", json={"model": server_model(server), "prompt": text},
                   headers=server.headers(), timeout=60)
    body = r.json()["error"]
    assert r.status_code == 400 and body["param"] == "prompt" and "at most 32768 are tokenised" in body["message"]


def test_chat_without_messages_and_a_wrong_api_key(server):
    r = server.post("/v1/chat/completions", {"model": server_model(server), "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    for key in (None, "wrong"):
        r = server.post("/v1/completions", {"model": server_model(server), "prompt": [1]}, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/health").status_code == 200  # open without the key


def test_a_client_that_disconnects_has_its_request_cancelled(server):
    before = server.metrics()
    body = {"model": server_model(server), "prompt": [5, 6, 7], "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk: the request runs
    # closed after one chunk: within a second the request is out of the engine, its blocks free
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["metainfer_requests_running"] == 0 and m['metainfer_kv_blocks{state="used"}'] == 0:
            break
        time.sleep(0.1)
    assert m["metainfer_requests_running"] == 0 and m['metainfer_kv_blocks{state="used"}'] == 0, m
    cancelled = 'metainfer_requests_total{endpoint="/v1/completions",status="cancelled"}'
    assert m.get(cancelled, 0) == before.get(cancelled, 0) + 1
    generated = m["metainfer_generation_tokens_total"] - before["metainfer_generation_tokens_total"]
    assert generated < 400, "the request ran to its end"


def test_past_the_queue_requests_get_429(server):
    """MAX_RUNNING in the engine, MAX_QUEUE waiting: of more concurrent long requests, the rest
    get 429 with Retry-After, the others finish."""
    n = MAX_RUNNING + MAX_QUEUE + 4
    codes, retry = [], []
    body = {"model": server_model(server), "prompt": [5, 6, 7], "max_tokens": 60}
    start = threading.Barrier(n)

    def one():
        start.wait()
        r = server.post("/v1/completions", body)
        codes.append(r.status_code)
        if r.status_code == 429:
            retry.append(r.headers.get("retry-after"))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(set(codes)) == [200, 429], codes
    assert codes.count(200) <= MAX_RUNNING + MAX_QUEUE and codes.count(429) >= n - MAX_RUNNING - MAX_QUEUE
    assert all(r is not None and int(r) >= 1 for r in retry)


def test_bench_serving_url_drives_the_server(server):
    """The HTTP load generator (metainfer bench-serving --url): every request answered, the
    figures add up, a wrong key is counted as errors, not dropped."""
    import asyncio

    from metainfer import loadgen, servebench

    w = servebench.Workload.synthetic(6, prompt=(4, 20), output=5, prefix_groups=2, prefix_tokens=8, seed=3)
    res = asyncio.run(loadgen.run(server.url, w, vocab=128, api_key=KEY, concurrency=3))
    assert res.ok == 6 and res.errors == {}
    assert res.input_tokens == sum(len(p) for p in w.prompts(128))
    assert 6 <= res.output_tokens <= 30 and res.seconds > 0 and res.ttft_p50 <= res.seconds
    text = asyncio.run(loadgen.run(server.url, w, tokenizer=servebench.word_tokenizer(128), api_key=KEY, concurrency=4))
    assert text.ok == 6 and text.input_tokens == res.input_tokens  # the word tokenizer round-trips
    bad = asyncio.run(loadgen.run(server.url, w, vocab=128, api_key="wrong", model="hf-llama-tiny"))
    assert bad.ok == 0 and bad.errors == {"HTTP 401": 6}
    assert "TTFT p50 ms" in loadgen.table([res, text, bad])


def test_the_cli_drives_a_server_by_url(server, capsys):
    from metainfer import cli

    rc = cli.main(["bench-serving", "--url", server.url, "--api-key", KEY, "--requests", "3", "--prompt", "4", "8",
                   "--output", "2", "--concurrency", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "3 requests" in out and "3/3" in out, out
    assert cli.main(["bench-serving", "--url", server.url, "--model", "cfg.json"]) == 2  # no vocabulary to draw from


def test_metrics_count_what_happened(server):
    m = server.metrics()
    assert m['metainfer_requests_total{endpoint="/v1/completions",status="ok"}'] >= 6
    assert m["metainfer_time_to_first_token_seconds_count"] >= 6
    assert m["metainfer_prompt_tokens_total"] > 0 and m["metainfer_generation_tokens_total"] > 0
    assert m['metainfer_kv_blocks{state="free"}'] + m['metainfer_kv_blocks{state="cached"}'] == 64 and m["metainfer_graphs_compiled"] >= 1


@pytest.fixture(scope="module")
def reference(folder):
    """The served model and tokenizer loaded in this process: the references of issue 50's fields."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa").eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(folder))


def _idle(server):
    """Waits until no request runs and no KV block is held; the metrics then."""
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        if m["metainfer_requests_running"] == 0 and m['metainfer_kv_blocks{state="used"}'] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def test_stop_strings_end_the_text_before_them(server, client, expected, reference):
    _, tok = reference
    at = max(range(len(PROMPTS)), key=lambda i: len(expected[i]))
    prompt, want = PROMPTS[at], expected[at]
    words = tok.decode(want, skip_special_tokens=True).split()
    stop = " " + words[len(words) // 2]  # a word in the middle, found where it first appears
    kept = next(end for end in range(1, len(want) + 1) if stop in tok.decode(want[:end], skip_special_tokens=True))
    text = tok.decode(want[:kept], skip_special_tokens=True)
    text = text[:text.find(stop)]
    name = server_model(server)
    out = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "zz"])
    choice = out.choices[0]
    assert (choice.text, choice.model_extra["token_ids"], choice.finish_reason) == (text, want[:kept], "stop")
    assert out.usage.completion_tokens == kept
    chunks = [c for c in client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                                    stop=stop, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == text and chunks[-1].choices[0].finish_reason == "stop"
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks), []) == want[:kept]
    _idle(server)  # the engine's request was stopped with the text


def test_n_choices_share_one_prompt(server, client, expected):
    name = server_model(server)
    out = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=12, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.model_extra["token_ids"] == expected[0] for c in out.choices)  # greedy: both the same
    assert out.usage.completion_tokens == 2 * len(expected[0])
    chunks = [c for c in client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=5, temperature=1.0,
                                                    n=2, seed=4, stream=True) if c.choices]
    per = {i: [t for c in chunks if c.choices[0].index == i for t in c.choices[0].model_extra["token_ids"]]
           for i in (0, 1)}
    assert all(1 <= len(v) <= 5 for v in per.values())
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]  # each choice finishes once
    assert chunks[-1].usage.completion_tokens == len(per[0]) + len(per[1])
    r = server.post("/v1/completions", {"model": name, "prompt": [5], "n": MAX_RUNNING + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    _idle(server)


def test_logprobs_are_the_models_log_softmax(server, client, expected, reference):
    import torch

    model, _ = reference
    name = server_model(server)
    want = expected[0]
    out = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    with torch.no_grad():  # teacher-forced: the distribution before each generated token
        logits = model(torch.tensor([PROMPTS[0] + want])).logits[0, len(PROMPTS[0]) - 1:-1].float()
    ref = torch.log_softmax(logits, -1)
    picked = ref.gather(-1, torch.tensor(want)[:, None]).squeeze(-1)
    assert lp.token_logprobs == pytest.approx(picked.tolist(), abs=1e-4)
    top = ref.topk(3)
    for i, alternatives in enumerate(lp.top_logprobs):
        assert list(alternatives.values()) == pytest.approx(top.values[i].tolist(), abs=1e-4)
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "w1 w2"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(chat.choices[0].model_extra["token_ids"]) and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)
    _idle(server)


def test_penalties_equal_transformers_generate_with_its_processors(server, client, reference):
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    model, _ = reference
    prompt = PROMPTS[1]
    ids = torch.tensor([prompt])

    class OpenAIPenalties(LogitsProcessor):  # OpenAI's definition, over the generated tokens
        def __call__(self, input_ids, scores):
            for t in input_ids[0, len(prompt):].tolist():
                scores[0, t] -= 0.7 + 0.0  # frequency 0.7 per occurrence
            for t in set(input_ids[0, len(prompt):].tolist()):
                scores[0, t] -= 0.4  # presence 0.4 once
            return scores

    def generated(**kw):
        with torch.no_grad():
            return model.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=2, pad_token_id=0,
                                  **kw)[0, len(prompt):].tolist()

    name = server_model(server)
    r = server.post("/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                        "repetition_penalty": 1.3})
    assert r.json()["choices"][0]["token_ids"] == generated(repetition_penalty=1.3)
    out = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0, frequency_penalty=0.7,
                                    presence_penalty=0.4)
    assert out.choices[0].model_extra["token_ids"] == generated(logits_processor=LogitsProcessorList([OpenAIPenalties()]))


def test_echo_puts_the_prompt_before_the_completion(server, client):
    name = server_model(server)
    plain = client.completions.create(model=name, prompt="w3 w4 w5", max_tokens=4, temperature=0)
    echoed = client.completions.create(model=name, prompt="w3 w4 w5", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "w3 w4 w5" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=name, prompt="w3 w4 w5", max_tokens=4, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == echoed.choices[0].text


def test_sigterm_finishes_in_flight_requests_and_exits_0(server):
    """The last test: SIGTERM while a stream runs; the stream completes, new connections are
    refused, the process exits 0."""
    body = {"model": server_model(server), "prompt": [5, 6, 7], "max_tokens": 40, "stream": True}
    lines = []

    def read():
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines.extend(line for line in r.iter_lines() if line)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.3)
    server.proc.send_signal(signal.SIGTERM)
    reader.join(timeout=120)
    assert server.proc.wait(timeout=60) == 0, server.tail()
    assert lines[-1] == "data: [DONE]", lines[-3:]
    tokens = sum(len(json.loads(x[6:])["choices"][0]["token_ids"]) for x in lines[:-1] if json.loads(x[6:])["choices"])
    last = json.loads(lines[-2][6:])
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and tokens == last["usage"]["completion_tokens"]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=5)


# ---- the application around a stand-in engine (no model): failures a real engine rarely shows

class _StandInEngine:
    """Yields `tokens` one at a time, or raises what `fail` holds at the first step; its loop
    never dies (what the app watches for)."""

    failed = None

    def __init__(self, fail=None, tokens=(7, 8, 9)):
        self.fail, self.tokens, self.ready = fail, list(tokens), False

    def fatal_error(self):
        return None

    def stopped_by_itself(self):
        return None

    def start(self):
        pass

    async def warm_up(self):
        self.ready = True

    def stop(self):
        pass

    async def generate(self, req, count=True):
        from metainfer.server.engine import Update

        if self.fail is not None:
            raise self.fail
        for i in range(1, len(self.tokens) + 1):
            yield Update(0, self.tokens[:i], "length" if i == len(self.tokens) else None)

    def end_choice(self, req, index):
        pass


def _app(engine):
    from fastapi.testclient import TestClient

    from metainfer.server.app import build_app
    from metainfer.server.metrics import Metrics
    from metainfer.server.protocol import ModelInfo

    info = ModelInfo(name="m", vocab_size=16, max_positions=64)
    return TestClient(build_app(engine, info, Metrics()), raise_server_exceptions=False)


def test_an_internal_error_fails_that_request_with_an_id_in_the_log(caplog):
    with _app(_StandInEngine(fail=RuntimeError("boom"))) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": [1, 2]})
        assert r.status_code == 500
        err = r.json()["error"]
        ref = err["message"].split("id ")[1].split(" ")[0]
        assert err["code"] == "internal_error" and any(ref in rec.getMessage() for rec in caplog.records)
        assert c.get("/health").status_code == 200  # still serving


def test_timeouts_and_overload_keep_the_openai_shape():
    from metainfer.server.engine import Overloaded, RequestTimeout

    with _app(_StandInEngine(fail=RequestTimeout(3.0))) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": [1]})
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    with _app(_StandInEngine(fail=Overloaded(2, 2))) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": [1], "stream": True})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
    with _app(_StandInEngine()) as c:  # no tokenizer: ids out, empty text
        assert c.get("/ready").status_code == 200
        r = c.post("/v1/completions", json={"model": "m", "prompt": [1], "max_tokens": 3})
        assert r.json()["choices"][0]["token_ids"] == [7, 8, 9] and r.json()["choices"][0]["text"] == ""
        r = c.post("/v1/completions", json={"model": "m", "prompt": "text"})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]


def test_admission_hands_slots_in_order_and_refuses_past_the_queue():
    import asyncio

    from metainfer.server.engine import Admission, Overloaded

    async def scenario():
        adm = Admission(max_running=1, max_queue=2)
        await adm.acquire()  # runs
        order = []

        async def wait(name):
            await adm.acquire()
            order.append(name)

        a, b = asyncio.create_task(wait("a")), asyncio.create_task(wait("b"))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await adm.acquire()  # one running, two waiting: full
        b.cancel()  # a waiter that goes away leaves the queue
        await asyncio.sleep(0)
        assert len(adm.waiting) == 1
        adm.release()  # the running one ends: a takes its slot
        await a
        assert order == ["a"] and adm.running == 1 and not adm.waiting
        adm.release()
        assert adm.running == 0

    asyncio.run(scenario())


def test_streamed_text_deltas_add_up_to_the_whole_text():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from metainfer import servebench
    from metainfer.server import protocol

    info = protocol.ModelInfo("m", 64, None, tokenizer=servebench.word_tokenizer(64))

    @settings(max_examples=40, deadline=None)
    @given(ids=st.lists(st.integers(0, 63), min_size=1, max_size=30), cuts=st.lists(st.integers(1, 30), max_size=8))
    def check(ids, cuts):
        detok = protocol.Detokenizer(info)
        ends = sorted({min(c, len(ids)) for c in cuts} | {len(ids)})
        text = "".join(detok.delta(ids[:end], final=end == len(ids)) for end in ends)
        assert text == protocol.text_of(info, ids)

    check()

