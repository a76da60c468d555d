"""Tensor parallelism on CPU ranks of one host: gloo vs metainfer's shared-memory path, in one run.

    python bench/bench_tp_paths.py [--target cpu-calibrated.toml] [--ranks 2] [--rounds 2] [--json]

Hugging Face Llama (hidden 512, 4 layers, 8 heads / 2 kv heads, vocab 32,000, fp32, random
weights) sharded over `--ranks` gloo processes on 127.0.0.1 (metainfer.parallel.multirank),
Inductor lowering, the default pipeline, on the calibrated target scaled onto the ranks
(bench/validate_ranks.rank_target: each rank its share of the cores). Two jobs that differ only
in the target: with its [collectives.shm] fits (select_collectives may take the shared-memory
path; the report says where) and with them removed (every collective through gloo). The jobs
alternate for `--rounds` rounds; each figure is the median over rounds of the slowest rank's.

- forward: a 4 x 128-token prefill, the median of 7 calls after 2 warm-up calls;
- serving: `generate_batch` of 16 prompts (64-256 tokens) x 32 new tokens each, greedy, after
  a warm-up call of the same workload (its packed sizes compile there): input and output
  tokens per second of the faster of two measured calls. The engine's own
  per-step exchanges (rank 0 schedules) stay on gloo in both jobs.

For scale, the same model in one process with all the cores (tp1, no collective) is timed once.

Tokens must be identical between the jobs (greedy on the same weights). Without --target the
machine is calibrated first (`metainfer calibrate --quick`, gloo and the shm path over 2 ranks).
With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time


CONFIG = dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=2,
              vocab_size=32000, max_position_embeddings=2048)
PROMPTS, NEW_TOKENS, BATCH, SEQ = 16, 32, 4, 128


def job(rank: int, world: int, path: str, overlap: float, shm_on: bool) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from validate_ranks import rank_target

    import metainfer
    from metainfer.testing import tiny_hf_model

    target, threads = rank_target(path, world, overlap)
    torch.set_num_threads(threads)
    if not shm_on:
        target = dataclasses.replace(target, shm_links={}, name=target.name + ", gloo only")
    model = tiny_hf_model("Llama", attn="sdpa", layers=4, **CONFIG)
    ids = torch.randint(3, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    opt = metainfer.optimize(model, target, example_inputs=(ids,), tensor_parallel=world)
    with torch.no_grad():
        for _ in range(2):
            opt(ids)
        times = []
        for _ in range(7):
            dist.barrier()
            t0 = time.perf_counter()
            opt(ids)
            times.append(time.perf_counter() - t0)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(64, 257, (PROMPTS,), generator=g).tolist()
    prompts = [torch.randint(3, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    gen = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=-1, pad_token_id=0)
    cfg = ContinuousBatchingConfig(num_blocks=160, page_size=256, max_batch_tokens=2048)
    # warm-up: the same workload (its packed sizes compile here, not in the measured calls)
    opt.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg)
    serve = []
    for _ in range(2):
        dist.barrier()
        t0 = time.perf_counter()
        out = opt.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg)
        serve.append(time.perf_counter() - t0)
    serve_s = min(serve)
    sel = next((r for r in opt.report.passes if r.name == "select_collectives"), None)  # the forward's graph
    return {"forward_s": statistics.median(times), "serve_s": serve_s, "prompt_tokens": sum(lengths),
            "tokens": [o.generated_tokens for o in out.values()],
            "decisions": sel.decisions if sel else [], "shm_graphs": sum(
                (r.graph_after or "").count("metainfer.shm_") for r in opt.report.passes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="a calibrated target TOML (default: calibrate this machine first, quick)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    from metainfer import calibrate
    from metainfer.hardware import targets
    from metainfer.parallel import multirank

    if a.target:
        path = a.target
    else:
        print("calibrating this machine (quick) ...", file=sys.stderr)
        m = calibrate.measure(targets.get("cpu"), [a.ranks], quick=True, progress=lambda s: print(s, file=sys.stderr))
        path = os.path.join(tempfile.mkdtemp(), "cpu-calibrated.toml")
        with open(path, "w") as f:
            f.write(calibrate.to_toml(m, targets.get("cpu")))
    t = targets.load(path)
    if not t.shm_links:
        sys.exit(f"{path} has no [collectives.shm]: recalibrate (`metainfer calibrate`) where the shm path runs")
    overlap = t.comm_overlap
    runs: dict = {True: [], False: [], "tp1": []}
    for _ in range(a.rounds):
        for shm_on in (True, False):
            res = multirank.run(job, a.ranks, args=(path, overlap, shm_on), timeout_s=1800)
            runs[shm_on].append(res)
    # for scale: the same model on one process with every core (no collective at all)
    runs["tp1"].append(multirank.run(job, 1, args=(path, overlap, False), timeout_s=1800))

    def slowest(shm_on: bool, key: str) -> float:
        return statistics.median(max(r[key] for r in res) for res in runs[shm_on])

    first = {s: runs[s][0][0] for s in runs}
    same_tokens = all(r["tokens"] == first[False]["tokens"] for s in (True, False) for res in runs[s] for r in res)
    out_tokens = PROMPTS * NEW_TOKENS
    rows = {}
    for s, label in (("tp1", "one process, no collectives"), (False, "gloo"), (True, "shm")):
        rows[label] = {"forward_s": slowest(s, "forward_s"), "serve_s": slowest(s, "serve_s")}
        rows[label]["input_tok_s"] = first[s]["prompt_tokens"] / rows[label]["serve_s"]
        rows[label]["output_tok_s"] = out_tokens / rows[label]["serve_s"]
    print(f"\nHF Llama 512 x 4 (fp32, vocab 32,000) at tp{a.ranks} on {a.ranks} processes of this machine, target "
          f"{t.name} ({path}); median over {a.rounds} round(s) of the slowest rank")
    print("| collectives | forward 4 x 128 | serving: 16 prompts x 32 new | input tok/s | output tok/s |")
    print("|---|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['forward_s'] * 1e3:,.1f} ms | {r['serve_s']:.2f} s | {r['input_tok_s']:,.0f} | "
              f"{r['output_tok_s']:,.0f} |")
    fwd = rows["gloo"]["forward_s"] / rows["shm"]["forward_s"]
    srv = rows["gloo"]["serve_s"] / rows["shm"]["serve_s"]
    print(f"\nshm path vs gloo: forward {fwd:.2f}x, serving {srv:.2f}x; tokens identical between the tp{a.ranks} "
          f"jobs: {same_tokens} (one process: {first['tp1']['tokens'] == first[False]['tokens']})")
    print(f"collectives the shm job's forward graph runs through shared memory: {first[True]['shm_graphs']} "
          f"(gloo job: {first[False]['shm_graphs']})")
    for d in first[True]["decisions"][:4]:
        print("  " + d)
    if a.json:
        print(json.dumps({"forward_ratio": fwd, "serving_ratio": srv, "tokens_identical": same_tokens,
                          "rows": rows}))


if __name__ == "__main__":
    main()
