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
- `cb-tuned`: the plain engine at its best max_batch_tokens for the workload (swept over
  TUNED_BATCH_TOKENS in the first round), pool sized for the workload unless given;
- `cb+inductor`: the same with the engine's compile configs set to Inductor;
- `cb+metainfer`: OptimizedModel.generate_batch (metainfer's graphs, paged attention kernel,
  KV pool sized by metainfer), the graphs compiled at the first step (serve_compile="always":
  the steady state of a server);
- `cb+metainfer-auto`: the same with metainfer's default policy (eager steps until compiling
  pays, metainfer.runtime.serve_compile): what a one-off batch gets.

Each variant serves the workload `rounds` times (at least twice), the variants interleaved
round by round; the first run (compiles, warm-up) and the later ones are timed, and the table
reports the median of the later ones. Input tok/s and output tok/s are the field's:
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

VARIANTS = ("hf-generate", "cb", "cb-tuned", "cb+inductor", "cb+metainfer", "cb+metainfer-auto")


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
    def long_tail(cls, n: int, median: int = 128, sigma: float = 1.0, lo: int = 8, hi: int = 2048, output: int = 32,
                  seed: int = 0) -> "Workload":
        """n requests whose prompt lengths are log-normal (median `median` tokens, log-space spread
        `sigma`, clipped to lo..hi): most prompts short, a few long, as chat traffic is."""
        g = torch.Generator().manual_seed(seed)
        lengths = torch.empty(n).log_normal_(mean=float(torch.tensor(float(median)).log()), std=sigma, generator=g)
        return cls([Request(int(x), output) for x in lengths.clamp(lo, hi).tolist()], 0, seed)

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
    first_peak_mib: float | None = None  # the first run's peak (compiles included)
    rounds: list[float] = field(default_factory=list)  # seconds of each measured round
    reference_equal: int | None = None  # requests whose tokens equal the reference's (run(reference=))
    reference_prefix: float | None = None  # mean share of the reference's tokens matched before the first difference
    unstable_rounds: int = 0  # measured rounds the noise guard found the machine swinging through (left out)

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
        got = collect(manager, ids)
    finally:
        manager.stop(block=True, timeout=60)
    times = [(arrivals[i], got[i].timestamps or []) for i in ids]
    return _duration(t0, times), times, [got[i].generated_tokens for i in ids]


def collect(manager, ids: list[str], timeout_s: float = 60) -> dict[str, Any]:
    """The final output of every request in `ids` from a running engine manager, by request id."""
    got: dict[str, Any] = {}
    while len(got) < len(ids):
        out = manager.get_result(timeout=timeout_s)
        if out is None:
            raise RuntimeError("the engine stopped before serving every request")
        if out.is_finished():
            got[out.request_id] = out
    return got


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
        static_batch: int = 8, progress: bool = True, lowering: str | None = None, rounds: int = 2,
        reference: list[list[int]] | None = None, cache_dir=None, engine_sizing: bool = False,
        guard=None) -> list[Row]:
    """Serve `workload` with each variant (model: a transformers causal LM in eval mode).

    Every variant serves the workload `rounds` times, interleaved (round r of every variant
    before round r + 1 of any), so drift of the machine falls on all of them alike. Round 0
    includes compiles and warm-ups: its time is the row's first-run time; the row's time is the
    median of the later rounds. `cb-tuned` spends round 0 on its sweep (each max_batch_tokens in
    TUNED_BATCH_TOKENS once) and serves the later rounds with the fastest. `reference`: each
    request's greedy tokens from a reference (e.g. the model in float32), against which every
    variant's tokens are scored; `cache_dir`: metainfer's compile cache (a fresh one measures a
    cold start). Unless `cb_config` gives a pool, the plain engines get one that holds the
    workload (metainfer sizes its own for it); `engine_sizing=True` leaves each engine to its own
    defaults instead (the plain engine's can take most of the machine's memory). `guard`: a
    metainfer.hardware.noise.Yardstick timed around every measured round, which runs again while
    the machine swings outside its band; a round that never held still is left out of the
    row's median where a stable one remains (`unstable_rounds` counts them)."""
    from tqdm.auto import tqdm

    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if rounds < 2:
        raise ValueError(f"rounds must be at least 2 (the first includes compiles), got {rounds}")
    prompts = workload.prompts(model.config.vocab_size)
    outputs = [r.output_tokens for r in workload.requests]
    # every variant from no compiled code: Dynamo's caches and recompile budgets are per code object
    torch._dynamo.reset()
    plain_cfg = cb_config
    if not engine_sizing and not (cb_config or {}).get("num_blocks"):
        page = (cb_config or {}).get("page_size", 256)
        plain_cfg = {**(cb_config or {}), "num_blocks": workload_blocks(workload, page), "page_size": page}
    servers = {v: _server(v, model, workload, target, cb_config if v.startswith("cb+metainfer") else plain_cfg,
                          lowering, cache_dir) for v in variants}
    bar = tqdm(total=rounds * len(variants), desc="serving benchmark", unit="run", disable=not progress)
    runs: dict[str, list] = {v: [] for v in variants}  # (result, peak MiB, stable) per round
    for round_ in range(rounds):
        for v in variants:
            def serve_once(v=v, serve=servers[v], round_=round_):
                if v == "hf-generate":
                    with _PeakRSS() as mem:
                        return _static_batches(model, prompts, outputs, static_batch), mem.mib
                if v == "cb-tuned" and round_ == 0:
                    result, mem = serve.sweep(prompts, workload, outputs)
                    return result, mem.mib
                with _PeakRSS() as mem:
                    result = _engine_run(serve.modes(), prompts, workload, outputs)
                return result, mem.mib

            if guard is None or round_ == 0:  # round 0 compiles: its time is the first-run figure, not a rate
                runs[v].append((*serve_once(), True))
            else:
                kept = guard.measure(serve_once, f"{v} round {round_}")
                runs[v].append((*kept.value, kept.stable))
            bar.update(1)
    bar.close()
    rows = []
    plain = runs.get("cb")
    for v in variants:
        (first, first_peak, _), measured = runs[v][0], runs[v][1:]
        unstable = sum(not ok for *_, ok in measured)
        steady = [(r, peak) for r, peak, ok in measured if ok]
        noted = ([f"{unstable} measured round(s) left out: the machine swung outside the noise band"] if steady and unstable
                 else ["every measured round ran while the machine swung outside the noise band: unstable"] if unstable
                 else [])
        measured = steady or [(r, peak) for r, peak, _ in measured]
        seconds = statistics.median(r[0] for r, _ in measured)
        last = measured[-1][0]
        ttft, tpot = _latencies(last[1])
        row = Row(v, seconds, first[0], sum(len(p) for p in prompts), sum(len(t) for t in last[2]), ttft, tpot,
                  max(peak for _, peak in measured), servers[v].graphs(), requests=len(prompts),
                  first_peak_mib=first_peak, rounds=[r[0] for r, _ in measured], notes=servers[v].notes() + noted,
                  unstable_rounds=unstable)
        if plain is not None:
            row.same_tokens = sum(a == b for a, b in zip(last[2], plain[-1][0][2]))
        if reference is not None:
            row.reference_equal = sum(a == b for a, b in zip(last[2], reference))
            row.reference_prefix = statistics.mean(_common_prefix(a, b) / max(1, len(b))
                                                    for a, b in zip(last[2], reference))
        rows.append(row)
    return rows


TUNED_BATCH_TOKENS = (256, 512, 1024, 2048, 4096, 8192)


def workload_blocks(workload: Workload, page_size: int = 256) -> int:
    """KV blocks that hold every request of the workload whole at once, plus a spare."""
    from metainfer.runtime.capacity import blocks_to_hold

    return blocks_to_hold([r.prompt_tokens + workload.prefix_tokens * (r.prefix_group is not None) + r.output_tokens
                           for r in workload.requests], page_size)


class _Server:
    """One way of serving: `modes()` gives the batch and streaming entry points."""

    def __init__(self, batch, manager, graphs=lambda: None, notes=lambda: []):
        self._batch, self._manager = batch, manager
        self.graphs, self.notes = graphs, notes

    def modes(self, cfg: dict | None = None) -> dict:
        return {"batch": lambda ps, n: self._batch(ps, n, cfg), "manager": lambda n: self._manager(n, cfg)}


class _TunedServer(_Server):
    """The plain engine at the max_batch_tokens that served the workload fastest in round 0."""

    def __init__(self, cb_config: dict, batch, manager):
        super().__init__(batch, manager, notes=lambda: [self.sweep_note] if self.sweep_note else [])
        self.base, self.best, self.sweep_note = cb_config, None, ""

    def sweep(self, prompts, workload, outputs):
        timings = {}
        peak = None
        for mbt in TUNED_BATCH_TOKENS:
            with _PeakRSS() as mem:
                timings[mbt] = _engine_run(super().modes({**self.base, "max_batch_tokens": mbt}), prompts, workload,
                                           outputs)
            peak = mem if peak is None or mem.mib > peak.mib else peak
        self.best = min(timings, key=lambda m: timings[m][0])
        self.sweep_note = ("max_batch_tokens swept in round 0: " + ", ".join(
            f"{m}: {timings[m][0]:.2f} s" for m in TUNED_BATCH_TOKENS) + f"; serving with {self.best}")
        return timings[self.best], peak

    def modes(self, cfg=None):
        return super().modes({**self.base, "max_batch_tokens": self.best})


def _server(variant, model, workload, target, cb_config, lowering, cache_dir) -> _Server:
    from transformers import CompileConfig, ContinuousBatchingConfig

    import metainfer

    def engine_cfg(cfg, **extra):
        return None if cfg is None and not extra else ContinuousBatchingConfig(**{**(cfg or {}), **extra})

    if variant == "hf-generate":
        return _Server(None, None)
    if variant in ("cb+metainfer", "cb+metainfer-auto"):
        opt = metainfer.optimize(model, target, lowering=lowering, cache_dir=cache_dir,
                                 serve_compile="always" if variant == "cb+metainfer" else "auto")
        return _Server(lambda ps, n, cfg: opt.generate_batch(
                           ps, generation_config=_greedy(model, n), continuous_batching_config=engine_cfg(cfg or cb_config),
                           record_timestamps=True),
                       lambda n, cfg: opt.init_continuous_batching(
                           generation_config=_greedy(model, n), continuous_batching_config=engine_cfg(cfg or cb_config)),
                       graphs=lambda: len(opt.report.sections),
                       notes=lambda: _latest_by_kind(n for n in opt.report.notes if n.startswith("serving")))
    extra = {}
    counted = [0]
    if variant == "cb+inductor":
        compiled = CompileConfig(backend="inductor", mode=None, dynamic=True)
        extra = dict(varlen_compile_config=compiled, decode_compile_config=compiled)

    def batch(ps, n, cfg):
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        out = model.generate_batch(ps, generation_config=_greedy(model, n), continuous_batching_config=engine_cfg(
            cfg, **extra), record_timestamps=True)
        counted[0] += torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        return out

    def manager(n, cfg):
        return model.init_continuous_batching(generation_config=_greedy(model, n),
                                              continuous_batching_config=engine_cfg(cfg, **extra))

    if variant == "cb-tuned":
        base = dict(cb_config or {})
        base.setdefault("num_blocks", workload_blocks(workload, base.get("page_size", 256)))
        return _TunedServer(base, batch, manager)
    return _Server(lambda ps, n, _cfg: batch(ps, n, cb_config), lambda n, _cfg: manager(n, cb_config),
                   graphs=(lambda: counted[0]) if variant == "cb+inductor" else (lambda: None))


def _latest_by_kind(notes) -> list[str]:
    """The last note of each kind ("serving capacity: ...", "serving run: ..."), in first-seen order."""
    kinds: dict[str, str] = {}
    for n in notes:
        kinds[n.split(":")[0]] = n
    return list(kinds.values())


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
    """The rows side by side; ratios against the tuned plain engine where it ran, else the plain one."""
    by = {r.variant: r for r in rows}
    base = by.get("cb-tuned") or by.get("cb")
    name = base.variant if base else "-"
    refs = any(r.reference_equal is not None for r in rows)
    head = ("variant", "input tok/s", "output tok/s", f"vs {name}", "TTFT ms", "TPOT ms", "peak MiB", "graphs",
            "first run s", f"first vs {name}", "same tokens as cb") + (("= reference", "ref. prefix") if refs else ())
    lines = [head]
    for r in rows:
        ratio = f"{r.input_tps / base.input_tps:.2f}x" if base else "-"
        first = f"{r.first_run_seconds / base.first_run_seconds:.2f}x" if base else "-"
        cells = (r.variant, f"{r.input_tps:.0f}", f"{r.output_tps:.0f}", ratio,
                 "-" if r.ttft_s is None else f"{r.ttft_s * 1e3:.0f}",
                 "-" if r.tpot_s is None else f"{r.tpot_s * 1e3:.1f}", f"{r.peak_mib:.0f}",
                 "-" if r.graphs is None else str(r.graphs), f"{r.first_run_seconds:.1f}", first,
                 "-" if r.same_tokens is None else f"{r.same_tokens}/{r.requests}")
        if refs:
            cells += ("-" if r.reference_equal is None else f"{r.reference_equal}/{r.requests}",
                      "-" if r.reference_prefix is None else f"{r.reference_prefix:.0%}")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in lines]
    for r in rows:
        out += [f"{r.variant}: {n}" for n in r.notes]
        if len(r.rounds) > 1:
            out.append(f"{r.variant}: measured rounds " + ", ".join(f"{x:.2f} s" for x in r.rounds))
    return "\n".join(out)


# Hugging Face model shapes for the benchmark (random weights): the issue-15 workload's model
# and a tiny one for quick runs.
MODELS = {
    "hf-llama-512x4": dict(arch="Llama", vocab_size=32000, hidden_size=512, intermediate_size=1376,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=4096),
    "hf-llama-tiny": dict(arch="Llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
    # one key-value head: at tp 2 and more, each rank keeps it whole (more ranks than KV heads)
    "hf-llama-tiny-kv1": dict(arch="Llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                              max_position_embeddings=2048),
    # MoE: MLA attention, a dense first layer, 8 routed experts (top 2 of 2 groups) and a shared one
    "hf-deepseek-v3-tiny": dict(arch="DeepseekV3", vocab_size=128, hidden_size=64, intermediate_size=128,
                                moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                                max_position_embeddings=2048),
    "hf-qwen3-moe-tiny": dict(arch="Qwen3Moe", vocab_size=128, hidden_size=64, intermediate_size=128,
                              moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=2048),
}


def build_model(spec: str, attn: str = "sdpa", dtype=torch.float32):
    """A transformers causal LM with random weights: a name from MODELS or a config.json path."""
    import transformers

    from metainfer.models import transformers_adapter as hf

    if spec in MODELS:
        fields = dict(MODELS[spec])
        cfg = getattr(transformers, f"{fields.pop('arch')}Config")(pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                                   **fields)
    else:
        from metainfer.hardware.shapes import read_config_json

        path, _ = read_config_json(spec)
        cfg = transformers.AutoConfig.from_pretrained(str(path))
    hf.set_attention_implementation(cfg, attn)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def word_tokenizer(vocab_size: int):
    """A tokenizer for the random-weight benchmark models, built offline: one token per
    whitespace-separated word ("w0", "w1", ...; the specials <pad> <s> </s> <unk> and the chat
    roles first, at the ids the MODELS configs give pad, bos and eos), with a plain chat template
    ("user <text> assistant")."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<pad>", "<s>", "</s>", "<unk>", "system", "user", "assistant"]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant{% endif %}")
    return fast


def _quantized(folder: Path) -> bool:
    from metainfer.models.checkpoint import read_config

    return bool(read_config(folder).get("quantization_config"))


def checkpoint_dtype(spec: str) -> torch.dtype:
    """The dtype a model `load_model` names was saved in: its config's `dtype` (or the older
    `torch_dtype`) for a config.json or folder; float32 for a benchmark name or a config without
    one. ValueError for a dtype that is not a floating torch dtype."""
    if spec in MODELS:
        return torch.float32
    from metainfer.hardware.shapes import read_config_json

    _path, cfg = read_config_json(spec)
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{spec}: the config's dtype {name!r} is not a floating-point torch dtype")
    return dtype


def load_model(spec: str, dtype: torch.dtype = torch.float32, attn: str = "sdpa"):
    """What `metainfer serve --model` names: a name from MODELS (random weights, a word
    tokenizer), a Hugging Face config.json (random weights, no tokenizer), or a local model
    folder (its weights, quantized checkpoints kept quantized by metainfer.load, and its tokenizer
    where it has one); nothing is downloaded. Returns (model in eval mode, tokenizer or None, served name);
    ValueError says what is wrong."""
    import transformers

    if spec in MODELS:
        return build_model(spec, attn=attn, dtype=dtype), word_tokenizer(MODELS[spec]["vocab_size"]), spec
    path = Path(spec)
    folder = path if path.is_dir() else path.parent
    if not (folder / "config.json").is_file() and not (path.is_file() and path.suffix == ".json"):
        raise ValueError(f"--model {spec}: neither a benchmark model ({', '.join(MODELS)}) nor a Hugging Face "
                         "config.json or model folder")
    if path.is_dir() and _quantized(folder):  # kept quantized, on metainfer's layers
        from metainfer.models.checkpoint import load

        model = load(folder, dtype=dtype, attn=attn)
    elif path.is_dir() and any((folder / w).is_file() for w in _WEIGHTS):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation=attn)
    else:
        model = build_model(str(path), attn=attn, dtype=dtype)  # random weights from the config
    tokenizer = None
    if path.is_dir() and any((folder / t).is_file() for t in _TOKENIZER):
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    return model.eval(), tokenizer, folder.name if path.is_dir() else path.stem
