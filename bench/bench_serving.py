"""Serving benchmark (issue 15): many requests through transformers' continuous batching, side by
side in one run: HF generate in static batches, continuous batching plain, with Inductor, with
metainfer. See metainfer/servebench.py for the method and docs/serving.md for the results.

    python bench/bench_serving.py                       # the workloads below, about 6 minutes on 2 cores
    python bench/bench_serving.py --only main --variants cb cb+metainfer
    python bench/bench_serving.py --json out.json

Workloads (HF Llama, hidden 512 x 4 layers, 8 heads / 2 kv heads, vocab 32000, fp32, random weights):
- main: 32 requests, prompts of 64-512 tokens, 32 new tokens each, all arriving at once;
- shared-prefix: 32 requests sharing a 1024-token system prompt (4 groups of 8) plus 32-128
  tokens of their own, 16 new tokens; the engine's prefix blocks on vs off, metainfer serving;
- engine-defaults: the main workload with each engine left to its own sizing (the plain engine's
  defaults vs metainfer's capacity): what a user gets without tuning;
- compiles: 200 requests of 1..2048 prompt tokens on a tiny model: how many graphs metainfer compiles;
- long-context (on request, `--only long-context`): one 128k-token prompt on a tiny model through
  chunked prefill: peak memory, and tokens against unchunked HF generate.
- long-tail: 32 requests with log-normal prompt lengths (median 128 tokens, a few up to 2048;
  about 6,800 tokens in all), 32 new tokens each, in float32 and bfloat16 (`--dtype`): metainfer
  against the plain engine at its best max_batch_tokens (`cb-tuned`), each sizing its pool for
  the workload; tokens scored against the float32 plain engine's (the reference for bf16);
- decode-heavy: 32 requests of 16-128 prompt tokens and 128 new tokens each, the same variants;
- cold-start (`--only cold-start`): the long-tail batch served once by a fresh process: plain;
  metainfer (its default policy: compile only once it pays) on an empty compile cache; metainfer
  compiling at the first step, on an empty cache and on the cache that left; metainfer's default
  again on that warm cache.
The main and shared-prefix runs give every engine the same explicit pool and batch size.
Rows of a workload are served `--rounds` times (default 3), interleaved; the first round includes
compiles (the "first run" column), the table gives the median of the others. Each of those runs
between readings of a yardstick (metainfer.hardware.noise): a round the machine swung through is
served again, and left out where it never held still; the last line states the swing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from metainfer import servebench
from metainfer.hardware import noise

SAME = dict(num_blocks=96, page_size=256, max_batch_tokens=2048)
WORKLOADS = ("main", "shared-prefix", "engine-defaults", "compiles", "long-tail", "decode-heavy")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TUNED = ("cb-tuned", "cb+metainfer", "cb+metainfer-auto")  # the long-tail and decode-heavy comparisons


def long_tail() -> "servebench.Workload":
    return servebench.Workload.long_tail(32, median=128, sigma=1.0, lo=8, hi=2048, output=32, seed=11)


def decode_heavy() -> "servebench.Workload":
    return servebench.Workload.synthetic(32, prompt=(16, 128), output=128, seed=12)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=WORKLOADS + ("long-context", "cold-start"), default=WORKLOADS)
    ap.add_argument("--dtype", nargs="+", choices=DTYPES, default=("float32", "bfloat16"),
                    help="long-tail / decode-heavy: the model's dtypes (default both)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per variant, interleaved; the first compiles")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--long-tokens", type=int, default=131072, help="long-context: prompt tokens (default 128k)")
    ap.add_argument("--variants", nargs="+", choices=servebench.VARIANTS, default=servebench.VARIANTS)
    ap.add_argument("--model", default="hf-llama-512x4")
    ap.add_argument("--json", metavar="FILE", help="write every row here")
    ap.add_argument("--band", type=float, default=noise.BAND,
                    help=f"the noise guard's yardstick band around its run median (default {noise.BAND})")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    guard = noise.Yardstick(band=a.band)  # around every measured round: re-run while the machine swings
    model = servebench.build_model(a.model) if set(a.only) & {"main", "shared-prefix", "engine-defaults"} else None
    results = {}
    if "main" in a.only:
        w = servebench.Workload.synthetic(32, prompt=(64, 512), output=32, seed=1)
        rows = servebench.run(model, w, variants=a.variants, cb_config=SAME, rounds=a.rounds, guard=guard)
        print(f"\n== main: 32 requests, prompts 64-512 tokens ({sum(r.prompt_tokens for r in w.requests)} in all), "
              f"32 new tokens each; engine config {SAME}")
        print(servebench.table(rows))
        results["main"] = [r.to_dict() for r in rows]
    if "shared-prefix" in a.only:
        w = servebench.Workload.synthetic(32, prompt=(32, 128), output=16, prefix_groups=4, prefix_tokens=1024,
                                          seed=2)
        print("\n== shared-prefix: 32 requests in 4 groups sharing a 1024-token prompt, 32-128 tokens each of "
              "their own, 16 new tokens")
        by_sharing = {}
        for share in (False, True):
            cfg = {**SAME, "allow_block_sharing": share}
            rows = servebench.run(model, w, variants=[v for v in ("cb", "cb+metainfer") if v in a.variants],
                                  cb_config=cfg, rounds=a.rounds, guard=guard)
            print(f"-- prefix blocks {'shared' if share else 'not shared'} (allow_block_sharing={share})")
            print(servebench.table(rows))
            by_sharing[share] = {r.variant: r for r in rows}
            results[f"shared-prefix sharing={share}"] = [r.to_dict() for r in rows]
        for v in ("cb", "cb+metainfer"):
            if v in by_sharing[True] and v in by_sharing[False]:
                print(f"{v}: input tok/s with prefix blocks reused / without: "
                      f"{by_sharing[True][v].input_tps / by_sharing[False][v].input_tps:.2f}x")
    if "engine-defaults" in a.only:
        w = servebench.Workload.synthetic(32, prompt=(64, 512), output=32, seed=1)
        rows = servebench.run(model, w, variants=[v for v in ("cb", "cb+metainfer") if v in a.variants],
                              rounds=a.rounds, engine_sizing=True, guard=guard)
        print("\n== engine-defaults: the main workload, each engine sizing its own pool and batch")
        print(servebench.table(rows))
        results["engine-defaults"] = [r.to_dict() for r in rows]
    if "compiles" in a.only:
        results["compiles"] = compiles()
    for name, make in (("long-tail", long_tail), ("decode-heavy", decode_heavy)):
        if name not in a.only:
            continue
        w = make()
        reference = float32_reference(a.model, w)  # what every dtype's tokens are scored against
        for dtype in a.dtype:
            m = servebench.build_model(a.model, dtype=DTYPES[dtype])
            rows = servebench.run(m, w, variants=[v for v in TUNED if v in a.variants], rounds=a.rounds,
                                  reference=reference, guard=guard)
            print(f"\n== {name}, {dtype}: {len(w.requests)} requests, {sum(r.prompt_tokens for r in w.requests)} prompt "
                  f"tokens ({min(r.prompt_tokens for r in w.requests)}..{max(r.prompt_tokens for r in w.requests)}), "
                  f"{w.requests[0].output_tokens} new tokens each; each engine sizes its pool for the workload")
            print(servebench.table(rows))
            results[f"{name} {dtype}"] = [r.to_dict() for r in rows]
    if "cold-start" in a.only:
        results["cold-start"] = cold_start(a.model, a.dtype, a.threads)
    if "long-context" in a.only:
        results["long-context"] = long_context(a.long_tokens)
    print(guard.line())
    results["noise"] = guard.summary()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


def float32_reference(model_name: str, w) -> list[list[int]]:
    """Each request's greedy tokens from the plain engine on the model in float32."""
    from transformers import ContinuousBatchingConfig

    m = servebench.build_model(model_name, dtype=torch.float32)
    out = m.generate_batch(w.prompts(m.config.vocab_size), generation_config=servebench._greedy(
        m, w.requests[0].output_tokens), continuous_batching_config=ContinuousBatchingConfig(
        num_blocks=servebench.workload_blocks(w), max_batch_tokens=2048))
    return [o.generated_tokens for o in out.values()]


def cold_start(model_name: str, dtypes, threads: int | None) -> dict:
    """The long-tail batch served once by a fresh process each: plain (at its tuned
    max_batch_tokens, the pool of the workload); metainfer with its default policy on an empty
    compile cache; metainfer compiling at the first step on an empty cache, then again on the
    cache that left (the cost of compiling, cold and warm); metainfer's default policy once more,
    on that warm cache with its measured compile times. Wall time from the call to the last result."""
    import tempfile

    runs = (("plain", "cb", "auto"), ("metainfer, empty cache", "cb+metainfer", "auto"),
            ("metainfer compiling at once, empty cache", "cb+metainfer", "always"),
            ("metainfer compiling at once, warm cache", "cb+metainfer", "always"),
            ("metainfer, warm cache", "cb+metainfer", "auto"))
    out = {}
    for dtype in dtypes:
        with tempfile.TemporaryDirectory() as cache:
            times = {}
            for label, variant, policy in runs:
                proc = subprocess.run([sys.executable, __file__, "--first-batch", variant, "--model", model_name,
                                       "--dtype", dtype, "--cache", cache, "--serve-compile", policy]
                                      + (["--threads", str(threads)] if threads else []), capture_output=True, text=True)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("first batch", "  serving compile"))]
                if proc.returncode or not lines:
                    raise RuntimeError(f"cold-start run {label} failed:\n{proc.stderr[-3000:]}")
                times[label] = float(lines[0].split()[2])
                print(f"{dtype}, {label}: " + "\n    ".join(lines))
            base = times["plain"]
            print(f"== cold-start {dtype}: " + "; ".join(f"{k} {v:.1f} s ({v / base:.2f}x)" for k, v in times.items()))
            out[dtype] = times
    return out


def first_batch(variant: str, model_name: str, dtype: str, cache: str, threads: int | None,
                serve_compile: str = "auto") -> None:
    """One process, one batch (the long-tail workload): its wall time including everything the
    first call does (compiles, warm-up), and the report's serving notes."""
    from transformers import ContinuousBatchingConfig

    import metainfer

    if threads:
        torch.set_num_threads(threads)
    model = servebench.build_model(model_name, dtype=DTYPES[dtype])
    w = long_tail()
    prompts = w.prompts(model.config.vocab_size)
    gen = servebench._greedy(model, w.requests[0].output_tokens)
    if variant == "cb":
        # the plain engine at the max_batch_tokens its sweep chose on this workload (2048 on the dev VM)
        cfg = ContinuousBatchingConfig(num_blocks=servebench.workload_blocks(w), max_batch_tokens=2048)
        t0 = time.perf_counter()
        model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg)
        print(f"first batch {time.perf_counter() - t0:.2f} s")
        return
    t0 = time.perf_counter()
    opt = metainfer.optimize(model, "cpu", cache_dir=cache, serve_compile=serve_compile)
    opt.generate_batch(prompts, generation_config=gen)
    print(f"first batch {time.perf_counter() - t0:.2f} s ({len(opt.report.sections)} graphs)")
    for n in opt.report.notes:
        if n.startswith("serving compile"):
            print("  " + n)


def compiles() -> dict:
    """Graphs compiled for 200 requests of 1..2048 prompt tokens (tiny HF Llama, 4 new tokens)."""
    import metainfer
    from transformers import ContinuousBatchingConfig

    model = servebench.build_model("hf-llama-tiny")
    w = servebench.Workload.synthetic(200, prompt=(1, 2048), output=4, seed=5)
    opt = metainfer.optimize(model, "cpu")
    out = opt.generate_batch(w.prompts(model.config.vocab_size), generation_config=servebench._greedy(model, 4),
                             continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=2048))
    failed = sum(r.error is not None for r in out.values())
    print(f"\n== compiles: 200 requests, prompts 1..2048 tokens: {len(opt.report.sections)} graphs compiled, "
          f"{failed} failed requests")
    for c in opt.report.compiles():
        print(f"  graph {c['index']} {c['phase']}: {c['why'][:150]}")
    return {"graphs": len(opt.report.sections), "failed": failed, "compiles": opt.report.compiles()}


def long_context(tokens: int) -> dict:
    """One long prompt through chunked prefill (tiny HF Llama with positions for it): peak memory
    against the chunk and the pool, and the generated tokens against the plain engine's."""
    import time

    import torch
    from transformers import ContinuousBatchingConfig

    import metainfer

    fields = dict(servebench.MODELS["hf-llama-tiny"], max_position_embeddings=tokens + 64)
    servebench.MODELS["hf-llama-long"] = fields
    model = servebench.build_model("hf-llama-long")
    prompt = torch.randint(3, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(7)).tolist()
    chunk = 2048
    cfg = ContinuousBatchingConfig(max_batch_tokens=chunk)
    opt = metainfer.optimize(model, "cpu")
    # compile first on a short prompt of several chunks (the graphs have symbolic sizes)
    opt.generate_batch([prompt[:3 * chunk]], generation_config=servebench._greedy(model, 8),
                       continuous_batching_config=cfg)
    with servebench._PeakRSS() as mem:
        t0 = time.perf_counter()
        out = opt.generate_batch([prompt], generation_config=servebench._greedy(model, 8), continuous_batching_config=cfg)
        seconds = time.perf_counter() - t0
    (got,) = out.values()
    kv_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * (
        model.config.hidden_size // model.config.num_attention_heads) * 4
    with servebench._PeakRSS() as ref_mem:
        t0 = time.perf_counter()
        ref = model.generate(torch.tensor([prompt]), generation_config=servebench._greedy(model, 8))[0, tokens:].tolist()
        ref_seconds = time.perf_counter() - t0
    print(f"\n== long-context: one prompt of {tokens} tokens, chunks of {chunk}, 8 new tokens")
    print(f"metainfer serving: {seconds:.1f} s after compiling ({len(opt.report.sections)} graphs), peak {mem.mib:.0f} MiB above the start (KV pool of the whole "
          f"sequence {(tokens + 8) * kv_token / 2**20:.0f} MiB); tokens {'equal' if got.generated_tokens == ref else 'DIFFER'}"
          f" to unchunked HF generate ({ref_seconds:.1f} s, peak {ref_mem.mib:.0f} MiB); error: {got.error}")
    return {"tokens": tokens, "seconds": seconds, "peak_mib": mem.mib, "kv_mib": (tokens + 8) * kv_token / 2**20,
            "equal": got.generated_tokens == ref, "reference_seconds": ref_seconds, "reference_peak_mib": ref_mem.mib}


if __name__ == "__main__":
    if "--first-batch" in sys.argv:
        fb = argparse.ArgumentParser()
        fb.add_argument("--first-batch", choices=("cb", "cb+metainfer"))
        fb.add_argument("--model", default="hf-llama-512x4")
        fb.add_argument("--dtype", choices=DTYPES, default="float32")
        fb.add_argument("--cache", required=True)
        fb.add_argument("--threads", type=int)
        fb.add_argument("--serve-compile", default="auto")
        x = fb.parse_args()
        first_batch(x.first_batch, x.model, x.dtype, x.cache, x.threads, x.serve_compile)
        sys.exit(0)
    sys.exit(main())
