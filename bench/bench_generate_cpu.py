"""Inference as users run it, on CPU, side by side in one run:

1. optimize() cold (empty compile cache, fresh process) vs warm (the same cache, a new process),
   and the first generate() after it (which compiles the decode graphs);
2. greedy generate() tokens/s, eager vs metainfer, at batch 1 and 8 (after a first generate of
   the same shape, so compilation is not in the timing), and whether the tokens are equal;
3. how many graphs one optimized callable compiles for full-sequence forwards at lengths
   1..4096 (a stride through them plus every power of two).

    python bench/bench_generate_cpu.py                     # about 25 minutes on 2 cores
    python bench/bench_generate_cpu.py --models llama-tiny --new-tokens 16 --batches 1 --max-len 256

Models: models/ Llama (its own KV cache and loop) and a Hugging Face Llama built from a config
of llama-small's shape (hidden 256, 8 heads / 2 kv heads, 2 layers), eager attention, dynamic
cache. Each measurement runs in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROMPT = 32


def build(name: str):
    import torch

    from metainfer import models

    if name.startswith("hf-"):
        import transformers

        small = models.config(name[3:])
        cfg = transformers.LlamaConfig(vocab_size=small.vocab_size, hidden_size=small.dim,
                                       intermediate_size=small.ffn_dim, num_hidden_layers=small.n_layers,
                                       num_attention_heads=small.n_heads, num_key_value_heads=small.n_kv_heads,
                                       max_position_embeddings=small.max_seq_len, pad_token_id=0, bos_token_id=1,
                                       eos_token_id=2)
        cfg._attn_implementation = "eager"
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg).eval(), small.vocab_size
    return models.build(name), models.config(name).vocab_size


def generate(fn, model_name: str, prompt, n: int):
    if model_name.startswith("hf-"):
        return fn.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return fn.generate(prompt, n)


def child_generate(a) -> dict:
    import torch

    import metainfer

    model, vocab = build(a.model)
    prompt = torch.randint(3, vocab, (a.batch, PROMPT), generator=torch.Generator().manual_seed(0))
    out = {"model": a.model, "mode": a.mode, "batch": a.batch}
    if a.mode == "eager":
        fn = model
    else:
        t0 = time.perf_counter()
        fn = metainfer.optimize(model, "cpu", example_inputs=(prompt,), cache_dir=a.cache_dir)
        out["optimize_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = generate(fn, a.model, prompt, a.new_tokens)
    out["first_generate_s"] = time.perf_counter() - t0
    times = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        tokens = generate(fn, a.model, prompt, a.new_tokens)
        times.append(time.perf_counter() - t0)
    times.sort()
    out["tokens_per_s"] = a.batch * a.new_tokens / times[len(times) // 2]
    out["tokens"] = tokens[:, PROMPT:].tolist()
    assert torch.equal(first, tokens)
    if a.mode != "eager":
        r = fn.report
        out["graphs"] = len(r.sections)
        out["from_cache"] = sum(s.from_cache for s in r.sections)
        out["phases"] = [s.phase for s in r.sections]
    return out


def child_lengths(a) -> dict:
    import torch

    import metainfer

    model, vocab = build(a.model)
    cfg = model.config
    max_len = min(a.max_len, getattr(cfg, "max_seq_len", None) or cfg.max_position_embeddings)
    opt = metainfer.optimize(model, "cpu", cache_dir=a.cache_dir)
    lengths = sorted(set(range(1, max_len + 1, 97)) | {2 ** k for k in range(13) if 2 ** k <= max_len} | {max_len})
    t0 = time.perf_counter()
    for s in lengths:
        ids = torch.randint(3, vocab, (1, s))
        opt(ids)
    r = opt.report
    return {"model": a.model, "lengths": len(lengths), "max_len": max_len, "graphs": len(r.sections),
            "recompilations": r.recompilations, "seconds": time.perf_counter() - t0,
            "why": [s.why[:160] for s in r.sections]}


def run_child(args: list[str]) -> dict:
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1], "args": args}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama-tiny", "llama-small", "hf-llama-small"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--out", help="also write the tables to this file")
    ap.add_argument("--child", choices=("generate", "lengths"))
    ap.add_argument("--model")
    ap.add_argument("--mode")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--cache-dir")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child_generate(a) if a.child == "generate" else child_lengths(a)))
        return

    gen_rows, len_rows = [], []
    for model in a.models:
        with tempfile.TemporaryDirectory() as cache:
            for batch in a.batches:
                common = ["--model", model, "--batch", str(batch), "--new-tokens", str(a.new_tokens),
                          "--reps", str(a.reps), "--cache-dir", cache]
                for mode in ("eager", "metainfer-cold", "metainfer-warm"):
                    if mode == "metainfer-cold" and batch != a.batches[0]:
                        continue  # the cache is warm after the first batch size
                    row = run_child(["--child", "generate", "--mode", mode, *common])
                    row.setdefault("mode", mode)
                    print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), file=sys.stderr, flush=True)
                    gen_rows.append(row)
        with tempfile.TemporaryDirectory() as cache:
            row = run_child(["--child", "lengths", "--model", model, "--max-len", str(a.max_len), "--cache-dir", cache])
            print(json.dumps(row), file=sys.stderr, flush=True)
            len_rows.append(row)
    text = tables(gen_rows, len_rows, a)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


def tables(gen_rows, len_rows, a) -> str:
    lines = [f"CPU ({os.cpu_count()} cores), fp32, prompt {PROMPT} tokens, greedy, {a.new_tokens} new tokens.", "",
             "| model | batch | mode | optimize (s) | first generate (s) | tokens/s | vs eager | tokens equal eager | graphs (from cache) |",
             "|---|---:|---|---:|---:|---:|---:|---|---|"]
    for r in gen_rows:
        if "error" in r:
            lines.append(f"| {' '.join(r['args'][4:6])} | | error: {r['error']} | | | | | | |")
            continue
        eager = next((e for e in gen_rows if e.get("model") == r["model"] and e.get("batch") == r["batch"]
                      and e.get("mode") == "eager"), None)
        ratio = f"{r['tokens_per_s'] / eager['tokens_per_s']:.2f}x" if eager else "-"
        same = "-" if r["mode"] == "eager" or not eager else ("yes" if r["tokens"] == eager["tokens"] else "NO")
        opt_s = f"{r['optimize_s']:.1f}" if "optimize_s" in r else "-"
        graphs = f"{r['graphs']} ({r['from_cache']})" if "graphs" in r else "-"
        lines.append(f"| {r['model']} | {r['batch']} | {r['mode']} | {opt_s} | {r['first_generate_s']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {ratio} | {same} | {graphs} |")
    lines += ["", "Warm vs cold (same model, first batch size): time of optimize(example_inputs=prompt) and of "
                  "optimize + the first generate (which compiles the decode graphs).", "",
              "| model | optimize warm/cold | optimize + first generate warm/cold |", "|---|---:|---:|"]
    for model in a.models:
        rows = {r.get("mode"): r for r in gen_rows if r.get("model") == model and r.get("batch") == a.batches[0]}
        c, w = rows.get("metainfer-cold"), rows.get("metainfer-warm")
        if c and w and "error" not in c and "error" not in w:
            lines.append(f"| {model} | {w['optimize_s']:.1f} / {c['optimize_s']:.1f} s = {w['optimize_s'] / c['optimize_s']:.2f} | "
                         f"{w['optimize_s'] + w['first_generate_s']:.1f} / {c['optimize_s'] + c['first_generate_s']:.1f} s = "
                         f"{(w['optimize_s'] + w['first_generate_s']) / (c['optimize_s'] + c['first_generate_s']):.2f} |")
    lines += ["", f"Graphs compiled by one optimized callable over full-sequence forwards at lengths 1..{a.max_len} "
                  "or the model's maximum (batch 1; a stride of 97 plus every power of two):", "",
              "| model | lengths run | graphs | recompilations | why each graph |", "|---|---:|---:|---:|---|"]
    for r in len_rows:
        if "error" in r:
            lines.append(f"| {r['args'][3]} | error: {r['error']} | | | |")
            continue
        lines.append(f"| {r['model']} (1..{r['max_len']}) | {r['lengths']} | {r['graphs']} | {r['recompilations']} | "
                     + "; ".join(f"{i}: {w}" for i, w in enumerate(r["why"])) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
