"""Load for any OpenAI-compatible server: a servebench Workload sent over HTTP (`metainfer
bench-serving --url`), each request a streamed /v1/completions call, measured from the client.

    result = asyncio.run(loadgen.run(url, workload, vocab=32000, concurrency=32))
    print(loadgen.table([result]))

Prompts are the workload's token ids (shared-prefix groups included); servers that take text
only (transformers serve) get them as text through `tokenizer` (a tokenizer whose decode and
encode round-trip, e.g. servebench.word_tokenizer). Requests arrive at their workload times
(all at once if none), at most `concurrency` in flight. Greedy (temperature 0), max_tokens the
workload's output length, usage asked for in the stream.

Figures are the field's: input tok/s and output tok/s are the prompt and generated tokens of
the requests that succeeded over the run's duration (first request sent to last token
received); TTFT is a request's time from sending to its first token, TPOT the mean gap between
its later tokens; p50/p99 over requests. Errors are counted by kind (HTTP status, or the
exception's name), never dropped.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sent:
    """One request as the client saw it."""

    prompt_tokens: int
    start: float
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


@dataclass
class LoadResult:
    name: str
    seconds: float
    requests: int
    ok: int
    input_tokens: int
    output_tokens: int
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    errors: dict[str, int]
    concurrency: int | None

    @property
    def input_tps(self) -> float:
        return self.input_tokens / self.seconds if self.seconds else 0.0

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        return {**dataclasses.asdict(self), "input_tok_s": self.input_tps, "output_tok_s": self.output_tps}


async def served_model(client, url: str) -> str:
    r = await client.get(f"{url}/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run(url: str, workload, *, name: str | None = None, model: str | None = None, vocab: int | None = None,
              tokenizer=None, api_key: str | None = None, concurrency: int | None = None, timeout_s: float = 600.0,
              progress: bool = False) -> LoadResult:
    import httpx
    from tqdm.auto import tqdm

    if tokenizer is None and vocab is None:
        raise ValueError("token-id prompts need the model's vocabulary size (vocab=), or pass a tokenizer")
    prompts = workload.prompts(vocab if vocab is not None else len(tokenizer))
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(100, concurrency or len(prompts)), max_keepalive_connections=None)
    gate = asyncio.Semaphore(concurrency or len(prompts))
    bar = tqdm(total=len(prompts), desc=name or url, unit="request", disable=not progress)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout_s) as client:
        model = model or await served_model(client, url)
        t0 = time.perf_counter()

        async def one(i: int) -> Sent:
            await asyncio.sleep(max(0.0, t0 + workload.requests[i].arrival_s - time.perf_counter()))
            async with gate:
                body = {"model": model, "max_tokens": workload.requests[i].output_tokens, "temperature": 0,
                        "stream": True, "stream_options": {"include_usage": True},
                        "prompt": tokenizer.decode(prompts[i]) if tokenizer is not None else prompts[i]}
                sent = Sent(prompt_tokens=len(prompts[i]), start=time.perf_counter())
                try:
                    await _stream(client, f"{url}/v1/completions", body, sent)
                except (httpx.HTTPError, ValueError) as e:
                    sent.error = sent.error or type(e).__name__
                bar.update(1)
                return sent

        sent = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    bar.close()
    return summarise(name or url, sent, t0, concurrency)


async def _stream(client, url: str, body: dict, sent: Sent) -> None:
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            sent.error = f"HTTP {r.status_code}"
            return
        ids: list[int] = []
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                sent.error = f"stream error: {chunk['error'].get('code') or chunk['error'].get('type')}"
                return
            if chunk.get("usage"):
                sent.output_tokens = chunk["usage"]["completion_tokens"]
                sent.prompt_tokens = chunk["usage"]["prompt_tokens"] or sent.prompt_tokens
            for choice in chunk.get("choices", []):
                new = choice.get("token_ids")
                if choice.get("text") or new:
                    sent.token_times.append(time.perf_counter())
                    ids += new or []
        if not sent.output_tokens:
            sent.output_tokens = len(ids) or len(sent.token_times)


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summarise(name: str, sent: list[Sent], t0: float, concurrency: int | None = None) -> LoadResult:
    good = [s for s in sent if s.error is None]
    end = max((s.token_times[-1] for s in good if s.token_times), default=t0)
    ttft = [s.token_times[0] - s.start for s in good if s.token_times]
    tpot = [(s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1) for s in good if len(s.token_times) > 1]
    errors: dict[str, int] = {}
    for s in sent:
        if s.error is not None:
            errors[s.error] = errors.get(s.error, 0) + 1
    return LoadResult(name=name, seconds=end - t0, requests=len(sent), ok=len(good),
                      input_tokens=sum(s.prompt_tokens for s in good), output_tokens=sum(s.output_tokens for s in good),
                      ttft_p50=_quantile(ttft, 0.5), ttft_p99=_quantile(ttft, 0.99),
                      tpot_p50=_quantile(tpot, 0.5), tpot_p99=_quantile(tpot, 0.99), errors=errors,
                      concurrency=concurrency)


def table(results: list[LoadResult]) -> str:
    """Side by side, ratios against the first."""
    base = results[0] if results else None
    head = ("server", "input tok/s", "output tok/s", f"vs {base.name if base else '-'}", "TTFT p50 ms", "TTFT p99 ms",
            "TPOT p50 ms", "TPOT p99 ms", "ok", "errors")

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.0f}"

    lines = [head] + [(r.name, f"{r.input_tps:.0f}", f"{r.output_tps:.0f}",
                       f"{r.input_tps / base.input_tps:.2f}x" if base and base.input_tps else "-",
                       ms(r.ttft_p50), ms(r.ttft_p99), ms(r.tpot_p50), ms(r.tpot_p99), f"{r.ok}/{r.requests}",
                       ", ".join(f"{k}: {v}" for k, v in sorted(r.errors.items())) or "0") for r in results]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)

