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
The main and shared-prefix runs give every engine the same explicit pool and batch size.
"""

from __future__ import annotations

import argparse
import json
import sys

from metainfer import servebench

SAME = dict(num_blocks=96, page_size=256, max_batch_tokens=2048)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=("main", "shared-prefix", "engine-defaults", "compiles", "long-context"),
                    default=("main", "shared-prefix", "engine-defaults", "compiles"))
    ap.add_argument("--long-tokens", type=int, default=131072, help="long-context: prompt tokens (default 128k)")
    ap.add_argument("--variants", nargs="+", choices=servebench.VARIANTS, default=servebench.VARIANTS)
    ap.add_argument("--model", default="hf-llama-512x4")
    ap.add_argument("--json", metavar="FILE", help="write every row here")
    a = ap.parse_args(argv)
    model = servebench.build_model(a.model)
    results = {}
    if "main" in a.only:
        w = servebench.Workload.synthetic(32, prompt=(64, 512), output=32, seed=1)
        rows = servebench.run(model, w, variants=a.variants, cb_config=SAME)
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
                                  cb_config=cfg)
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
        rows = servebench.run(model, w, variants=[v for v in ("cb", "cb+metainfer") if v in a.variants])
        print("\n== engine-defaults: the main workload, each engine sizing its own pool and batch")
        print(servebench.table(rows))
        results["engine-defaults"] = [r.to_dict() for r in rows]
    if "compiles" in a.only:
        results["compiles"] = compiles()
    if "long-context" in a.only:
        results["long-context"] = long_context(a.long_tokens)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


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
    sys.exit(main())
