"""The server soak (slow tier): 500 requests from 64 concurrent clients against one `metainfer
serve` process, mixed lengths and shared prefixes, streamed and not, 10% of the clients going
away after their first chunk, 5% malformed. Checked: every request answered once and in the way
its kind asks for, every good request's tokens equal to `opt.generate_batch` greedy in this
process, the server's counts adding up, every KV block free at the end, the server's resident
memory flat after warm-up.

    python -m pytest -m slow tests/test_server_soak.py -s   # prints one JSON line of figures
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from metainfer.testing import ServerProcess, tiny_model_folder  # noqa: E402

pytestmark = pytest.mark.slow

REQUESTS, CLIENTS, SEED = 500, 64, 7
DISCONNECT, MALFORMED = 0.10, 0.05
MAX_NEW, VOCAB, BLOCKS = 64, 128, 256
WARM_UP = 100  # requests answered before the first memory reading


def malformed(rng: random.Random, model: str) -> tuple[bytes | dict, int]:
    """A bad request and the status it must get."""
    return rng.choice([
        (b'{"model": "x", "prompt": [1', 400),  # not JSON
        ({"model": model, "prompt": []}, 400),
        ({"model": model, "prompt": [VOCAB + 5]}, 400),  # outside the vocabulary
        ({"model": model, "prompt": [5], "max_tokens": -3}, 400),
        ({"model": model, "prompt": [5], "temperature": 9}, 400),
        ({"model": model, "prompt": [5] * 500, "max_tokens": 100}, 400),  # past the 512 positions
        ({"model": "no-such-model", "prompt": [5]}, 404),
    ])


def plan(model: str) -> list[dict]:
    rng = random.Random(SEED)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(24)] for _ in range(4)]
    out = []
    for i in range(REQUESTS):
        r = rng.random()
        if r < MALFORMED:
            body, status = malformed(rng, model)
            out.append({"i": i, "kind": "malformed", "body": body, "status": status})
            continue
        prompt = (rng.choice(prefixes) if rng.random() < 0.5 else []) + [rng.randrange(3, VOCAB)
                                                                       for _ in range(rng.randint(1, 200))]
        if r < MALFORMED + DISCONNECT:  # long enough to still be running when the client goes away
            body = {"model": model, "prompt": prompt, "max_tokens": 300, "temperature": 0, "stream": True}
            out.append({"i": i, "kind": "disconnect", "body": body, "prompt": prompt})
            continue
        body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(1, MAX_NEW), "temperature": 0,
                "stream": rng.random() < 0.7}
        out.append({"i": i, "kind": "good", "body": body, "prompt": prompt})
    return out


def reference(folder, prompts: list[list[int]]) -> dict[tuple, list[int]]:
    """Greedy tokens, MAX_NEW of them (fewer at EOS), of `opt.generate_batch` in this process."""
    import transformers

    import metainfer

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa").eval()
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW,
                                        eos_token_id=model.generation_config.eos_token_id, pad_token_id=0)
    distinct = sorted({tuple(p) for p in prompts})
    out = opt.generate_batch([list(p) for p in distinct], generation_config=gen,
                             continuous_batching_config=transformers.ContinuousBatchingConfig(num_blocks=BLOCKS))
    return {p: list(o.generated_tokens) for p, o in zip(distinct, out.values())}


async def one(client: httpx.AsyncClient, server: ServerProcess, item: dict) -> dict:
    body = item["body"]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if item["kind"] == "malformed" or not body.get("stream"):
        r = await client.post(f"{server.url}/v1/completions", content=content, headers=headers)
        data = r.json()
        if r.status_code != 200:
            return {"status": r.status_code, "error": data.get("error")}
        choice = data["choices"][0]
        return {"status": 200, "id": data["id"], "tokens": choice["token_ids"], "finish": choice["finish_reason"]}
    async with client.stream("POST", f"{server.url}/v1/completions", content=content, headers=headers) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": json.loads(await r.aread()).get("error")}
        tokens, finish, ids, done = [], None, set(), 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done += 1
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            ids.add(chunk["id"])
            for c in chunk["choices"]:
                tokens += c["token_ids"]
                finish = c["finish_reason"] or finish
            if item["kind"] == "disconnect":
                return {"status": "gone", "tokens": tokens}  # closing the stream closes the connection
        assert len(ids) == 1 and done == 1, (ids, done)
        return {"status": 200, "id": ids.pop(), "tokens": tokens, "finish": finish}


async def soak(server: ServerProcess, items: list[dict]) -> tuple[list[dict], list[int]]:
    results: list[dict | None] = [None] * len(items)
    rss: list[int] = []
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    answered = 0

    async def client_loop(client):
        nonlocal answered
        while not queue.empty():
            item = queue.get_nowait()
            results[item["i"]] = await one(client, server, item)
            answered += 1
            if answered == WARM_UP:
                rss.append(server.rss_bytes())

    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await asyncio.wait_for(asyncio.gather(*(client_loop(client) for _ in range(CLIENTS))), timeout=1500)
    rss.append(server.rss_bytes())
    return results, rss


def test_soak(tmp_path):
    folder = tiny_model_folder(tmp_path / "model")
    server = ServerProcess(folder, tmp_path, "--max-running", str(CLIENTS), "--max-queue", str(2 * CLIENTS),
                           "--num-blocks", str(BLOCKS), "--request-timeout", "600")
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        items = plan(model)
        want = reference(folder, [it["prompt"] for it in items if it["kind"] == "good"])
        before = server.metrics()
        started = time.perf_counter()
        results, rss = asyncio.run(soak(server, items))
        seconds = time.perf_counter() - started
        deadline = time.monotonic() + 10  # cancellations land within a second; leave slack for a loaded machine
        while time.monotonic() < deadline:
            after = server.metrics()
            if after["metainfer_requests_running"] == 0 and after['metainfer_kv_blocks{state="used"}'] == 0:
                break
            time.sleep(0.2)

        kinds = collections.Counter(it["kind"] for it in items)
        lost = [it["i"] for it, r in zip(items, results) if r is None]
        wrong_status = [(it["i"], r["status"]) for it, r in zip(items, results) if r is not None and r["status"] != {
            "good": 200, "disconnect": "gone", "malformed": it.get("status")}[it["kind"]]]
        mismatched = [it["i"] for it, r in zip(items, results)
                      if it["kind"] == "good" and r is not None and r["status"] == 200
                      and r["tokens"] != want[tuple(it["prompt"])][:it["body"]["max_tokens"]]]
        response_ids = [r["id"] for r in results if r is not None and "id" in r]
        counted = {k.split('status="')[1].rstrip('"}'): v - before.get(k, 0) for k, v in after.items()
                   if k.startswith("metainfer_requests_total{")}
        figures = {
            "requests": len(items), "by_kind": dict(kinds), "seconds": round(seconds, 1), "lost": len(lost),
            "wrong_status": wrong_status, "tokens_mismatched": len(mismatched),
            "duplicate_ids": len(response_ids) - len(set(response_ids)),
            "server_counts": {k: int(v) for k, v in counted.items() if v},
            "kv_blocks_used_at_end": after['metainfer_kv_blocks{state="used"}'],
            "kv_blocks_cached_at_end": after['metainfer_kv_blocks{state="cached"}'],
            "running_at_end": after["metainfer_requests_running"], "queued_at_end": after["metainfer_requests_queued"],
            "rss_mb_after_warm_up": round(rss[0] / 2**20, 1), "rss_mb_at_end": round(rss[-1] / 2**20, 1),
        }
        print("\nsoak: " + json.dumps(figures))
        assert not lost and not wrong_status and not mismatched, figures
        assert figures["duplicate_ids"] == 0
        # a client that goes away is cancelled, unless its request ended (at EOS) first
        assert counted.get("ok", 0) + counted.get("cancelled", 0) == kinds["good"] + kinds["disconnect"]
        assert counted.get("cancelled", 0) <= kinds["disconnect"]
        assert sum(v for k, v in counted.items() if k not in ("ok", "cancelled")) == kinds["malformed"]
        assert figures["kv_blocks_used_at_end"] == 0 and figures["running_at_end"] == 0 and figures["queued_at_end"] == 0
        # flat: after warm-up the server grows by less than a tenth (allocator slack, graph caches)
        assert rss[-1] <= rss[0] * 1.10 + 16 * 2**20, figures
    finally:
        assert server.stop() == 0, server.tail()
