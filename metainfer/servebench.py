"""Serving benchmark: one workload, several ways of serving it, side by side in one run.

    from metainfer import servebench
    workload = servebench.Workload.synthetic(32, prompt=(64, 512), output=32, vocab=32000)
    rows = servebench.run(model, workload, target="cpu", variants=servebench.VARIANTS)
    print(servebench.table(rows))

A workload is data (`Workload.to_dict()` / `Workload.load(path)`): per request its prompt
length, output length, shared-prefix group and arrival time. Prompts are random token ids
(no data set can be downloaded); requests of one prefix group share their group's first
`prefix_tokens` tokens. Arrival times > 0 are honoured by submitting through the engine's
streaming manager; otherwise all requests arrive at once (generate_batch).

Variants:
- `hf-generate`: the model's own `generate`, in static batches of `static_batch` prompts,
  left-padded (what one does without a serving engine);
- `cb`: transformers' continuous batching, plain;
- `cb+inductor`: the same with the engine's compile configs set to Inductor;
- `cb+metainfer`: OptimizedModel.generate_batch (metainfer's graphs, paged attention kernel,
  KV pool sized by metainfer).

Each variant serves the workload twice; the first run (compiles, warm-up) and the second are
both timed, and the table reports the second. Input tok/s and output tok/s are the field's:
all prompt tokens (resp. generated tokens) over the run's duration, from the first arrival to
the last token. TTFT is from a request's arrival to its first token, TPOT the mean gap
between its later tokens (medians over requests). Peak memory is the process's resident set
sampled every 10 ms during the run, above its level before. Greedy tokens are compared with
the plain engine's request by request.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

VARIANTS = ("hf-generate", "cb", "cb+inductor", "cb+metainfer")


@dataclass
class Request:
    prompt_tokens: int
    output_tokens: int
    prefix_group: int | None = None
    arrival_s: float = 0.0


@dataclass
class Workload:
    requests: list[Request]
    prefix_tokens: int = 0  # tokens shared by the requests of one prefix group
    seed: int = 0

    @classmethod
    def synthetic(cls, n: int, prompt: tuple[int, int] = (64, 512), output: int = 32, prefix_groups: int = 0,
                  prefix_tokens: int = 0, arrival_rate: float | None = None, seed: int = 0) -> "Workload":
        """n requests with prompt lengths uniform in `prompt` (unique part; a group's shared
        prefix comes on top), `output` new tokens each; arrivals Poisson at `arrival_rate`
        requests/s, or all at once."""
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=g).tolist()
        gaps = (torch.empty(n).exponential_(generator=g) / arrival_rate).tolist() if arrival_rate else [0.0] * n
        t, reqs = 0.0, []
        for i, (length, gap) in enumerate(zip(lengths, gaps)):
            t += gap if i else 0.0
            reqs.append(Request(length, output, i % prefix_groups if prefix_groups else None, round(t, 4)))
        return cls(reqs, prefix_tokens if prefix_groups else 0, seed)

    @classmethod
    def load(cls, path) -> "Workload":
        data = json.loads(Path(path).read_text())
        try:
            return cls([Request(**r) for r in data["requests"]], data.get("prefix_tokens", 0), data.get("seed", 0))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a workload ({{'requests': [{{'prompt_tokens', 'output_tokens', "
                             f"'prefix_group'?, 'arrival_s'?}}], 'prefix_tokens'?}}): {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"requests": [dataclasses.asdict(r) for r in self.requests], "prefix_tokens": self.prefix_tokens,
                "seed": self.seed}

    def prompts(self, vocab: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed + 1)
        groups = {grp: torch.randint(3, vocab, (self.prefix_tokens,), generator=g).tolist()
                  for grp in sorted({r.prefix_group for r in self.requests if r.prefix_group is not None})}
        return [groups.get(r.prefix_group, []) + torch.randint(3, vocab, (r.prompt_tokens,), generator=g).tolist()
                for r in self.requests]

    @property
    def staggered(self) -> bool:
        return any(r.arrival_s > 0 for r in self.requests)


@dataclass
class Row:
    variant: str
    seconds: float
    first_run_seconds: float
    input_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    peak_mib: float
    graphs: int | None
    same_tokens: int | None = None  # requests whose greedy tokens equal the plain engine's
    requests: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def input_tps(self) -> float:
        return self.input_tokens / self.seconds

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "input_tok_s": self.input_tps, "output_tok_s": self.output_tps}


class _PeakRSS:
    """Peak resident memory of this process while the block runs, above its level before."""

    def __enter__(self):
        import psutil

        self._proc = psutil.Process()
        self.base = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def mib(self) -> float:
        return (self.peak - self.base) / 2**20


def _greedy(model, max_new: int):
    from transformers import GenerationConfig

    eos = -1  # every request generates its full output (a random model would stop anywhere)
    return GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=eos,
                            pad_token_id=model.config.pad_token_id or 0)


def _engine_run(serve, prompts, workload: Workload, outputs: list[int]):
    """(seconds, [(arrival, [token times]) per request], [tokens per request]) of one engine run;
    `serve` is generate_batch-like (all at once) or a manager factory (staggered arrivals)."""
    t0 = time.perf_counter()
    if not workload.staggered:
        results = list(serve["batch"](prompts, max(outputs)).values())
        times = [(o.created_time, o.timestamps or []) for o in results]
        return _duration(t0, times), times, [o.generated_tokens for o in results]
    manager = serve["manager"](max(outputs))
    got: dict[str, Any] = {}
    arrivals = {}
    manager.start()
    try:
        ids = []
        for r, p in zip(workload.requests, prompts):
            wait = t0 + r.arrival_s - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            rid = manager.add_request(p, max_new_tokens=r.output_tokens, record_timestamps=True)
            arrivals[rid] = time.perf_counter()
            ids.append(rid)
        while len(got) < len(ids):
            out = manager.get_result(timeout=60)
            if out is None:
                raise RuntimeError("the engine stopped before serving every request")
            if out.is_finished():
                got[out.request_id] = out
    finally:
        manager.stop(block=True, timeout=60)
    times = [(arrivals[i], got[i].timestamps or []) for i in ids]
    return _duration(t0, times), times, [got[i].generated_tokens for i in ids]


def _duration(t0: float, times) -> float:
    """From the first arrival to the last token: the engine's teardown after it (its stop()
    runs gc.collect() twice, ~0.4 s here) is not serving time."""
    last = [ts[-1] for _, ts in times if ts]
    return (max(last) if last else time.perf_counter()) - t0


def _latencies(times) -> tuple[float | None, float | None]:
    ttft = [ts[0] - start for start, ts in times if ts]
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for _, ts in times if len(ts) > 1]
    return (statistics.median(ttft) if ttft else None), (statistics.median(tpot) if tpot else None)


def run(model, workload: Workload, target="cpu", variants=VARIANTS, cb_config: dict | None = None,
        static_batch: int = 8, progress: bool = True, lowering: str | None = None) -> list[Row]:
    """Serve `workload` with each variant (model: a transformers causal LM in eval mode)."""
    from tqdm.auto import tqdm
    from transformers import CompileConfig, ContinuousBatchingConfig

    import metainfer

    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    prompts = workload.prompts(model.config.vocab_size)
    outputs = [r.output_tokens for r in workload.requests]
    input_tokens = sum(len(p) for p in prompts)
    rows: list[Row] = []
    reference: list[list[int]] | None = None
    bar = tqdm(total=2 * len(variants), desc="serving benchmark", unit="run", disable=not progress)

    def engine_cfg(**extra):
        return None if cb_config is None and not extra else ContinuousBatchingConfig(**{**(cb_config or {}), **extra})

    for variant in variants:
        # every variant from no compiled code: Dynamo's caches and recompile budgets are per code
        # object, and the model's forward is the same code in every variant
        torch._dynamo.reset()
        graphs = None
        notes: list[str] = []
        if variant == "hf-generate":
            serve = None
        elif variant == "cb+metainfer":
            opt = metainfer.optimize(model, target, lowering=lowering)
            serve = {"batch": lambda ps, n: opt.generate_batch(ps, generation_config=_greedy(model, n),
                                                                continuous_batching_config=engine_cfg(),
                                                                record_timestamps=True),
                     "manager": lambda n: opt.init_continuous_batching(generation_config=_greedy(model, n),
                                                                      continuous_batching_config=engine_cfg())}
        else:
            extra = {}
            if variant == "cb+inductor":
                compiled = CompileConfig(backend="inductor", mode=None, dynamic=True)
                extra = dict(varlen_compile_config=compiled, decode_compile_config=compiled)
            serve = {"batch": lambda ps, n, extra=extra: model.generate_batch(
                        ps, generation_config=_greedy(model, n), continuous_batching_config=engine_cfg(**extra),
                        record_timestamps=True),
                     "manager": lambda n, extra=extra: model.init_continuous_batching(
                        generation_config=_greedy(model, n), continuous_batching_config=engine_cfg(**extra))}
        timings = []
        for _ in range(2):
            counter = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            with _PeakRSS() as mem:
                if serve is None:
                    seconds, times, tokens = _static_batches(model, prompts, outputs, static_batch)
                else:
                    seconds, times, tokens = _engine_run(serve, prompts, workload, outputs)
            timings.append(seconds)
            if variant == "cb+metainfer":
                graphs = len(opt.report.sections)
            elif variant == "cb+inductor":
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - counter + (graphs or 0)
            bar.update(1)
        ttft, tpot = _latencies(times)
        row = Row(variant, timings[1], timings[0], input_tokens, sum(len(t) for t in tokens), ttft, tpot, mem.mib,
                  graphs, requests=len(prompts), notes=notes)
        if variant == "cb":
            reference = tokens
        row._tokens = tokens  # type: ignore[attr-defined]
        if variant == "cb+metainfer":
            row.notes += list(dict.fromkeys(n for n in opt.report.notes if n.startswith("serving")))
        rows.append(row)
    bar.close()
    if reference is not None:
        for row in rows:
            row.same_tokens = sum(a == b for a, b in zip(row._tokens, reference))  # type: ignore[attr-defined]
    return rows


def _static_batches(model, prompts, outputs, batch: int):
    """HF generate in static batches, left-padded: (seconds, token times, tokens per request)."""
    times, tokens = [], []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        n = max(outputs[i:i + batch])
        width = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, p in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        stamps = []

        class _Stamp:  # a streamer: one call per generated step (the prompt first)
            def put(self, value):
                stamps.append(time.perf_counter())

            def end(self):
                pass

        out = model.generate(ids, attention_mask=mask, generation_config=_greedy(model, n), streamer=_Stamp())
        tokens += [row[width:].tolist() for row in out]
        times += [(t0, stamps[1:])] * len(chunk)
    return _duration(t0, times), times, tokens


def table(rows: list[Row]) -> str:
    base = {r.variant: r for r in rows}.get("cb")
    head = ("variant", "input tok/s", "output tok/s", "vs cb", "TTFT ms", "TPOT ms", "peak MiB", "graphs",
            "first run s", "same tokens")
    lines = [head]
    for r in rows:
        ratio = f"{r.input_tps / base.input_tps:.2f}x" if base else "-"
        lines.append((r.variant, f"{r.input_tps:.0f}", f"{r.output_tps:.0f}", ratio,
                      "-" if r.ttft_s is None else f"{r.ttft_s * 1e3:.0f}",
                      "-" if r.tpot_s is None else f"{r.tpot_s * 1e3:.1f}", f"{r.peak_mib:.0f}",
                      "-" if r.graphs is None else str(r.graphs), f"{r.first_run_seconds:.1f}",
                      "-" if r.same_tokens is None else f"{r.same_tokens}/{r.requests}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in lines]
    for r in rows:
        out += [f"{r.variant}: {n}" for n in r.notes]
    return "\n".join(out)


# Hugging Face model shapes for the benchmark (random weights): the issue-15 workload's model
# and a tiny one for quick runs.
MODELS = {
    "hf-llama-512x4": dict(arch="Llama", vocab_size=32000, hidden_size=512, intermediate_size=1376,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=4096),
    "hf-llama-tiny": dict(arch="Llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
}


def build_model(spec: str, attn: str = "sdpa", dtype=torch.float32):
    """A transformers causal LM with random weights: a name from MODELS or a config.json path."""
    import transformers

    if spec in MODELS:
        fields = dict(MODELS[spec])
        cfg = getattr(transformers, f"{fields.pop('arch')}Config")(pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                                   **fields)
    else:
        from metainfer.shapes import read_config_json

        path, _ = read_config_json(spec)
        cfg = transformers.AutoConfig.from_pretrained(str(path))
    cfg._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
