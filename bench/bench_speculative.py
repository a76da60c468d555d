"""Speculative decoding on this machine: tokens/s and acceptance against the draft length.

    python bench/bench_speculative.py [--new 64] [--repeats 3] [--hidden 256] [--layers 4]

Three drafters for one greedy target (a random-weight Qwen2-style model built from a config):
- "same model": the target drafts for itself (acceptance 1: every drafted token is accepted);
- "unrelated": a one-layer model of another family with its own random weights (acceptance
  near 0);
- "prompt lookup": n-gram continuations from a repetitive prompt (no draft model).
Each row runs draft lengths 0, 1, 2, 3, 5, 7 fixed (`draft_length=`) and metainfer's choice
(`draft_length=None`, its acceptance statistics reset before every run so each run decides
from scratch), side by side in one process; tokens/s is the median over the repeats after a
warm-up run that compiles. Every run's tokens are compared with plain greedy generate().
Prints the table and, per row, the planner's choice against the best fixed length.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import metainfer
from metainfer import speculative
from metainfer.testing import tiny_hf_model

LENGTHS = (0, 1, 2, 3, 5, 7)


def run(opt, ids, new, kw, length, repeats, greedy):
    """(median tokens/s, acceptance observed, graphs compiled by the warm-up, same tokens)."""
    def once():
        speculative.forget(opt)  # each run decides from scratch
        start = time.perf_counter()
        out = opt.generate(ids, max_new_tokens=new, do_sample=False, draft_length=length, **kw)
        return out, (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)

    graphs = len(opt.report.sections)
    out, _ = once()
    graphs = len(opt.report.sections) - graphs
    same = torch.equal(out, greedy)
    rates = []
    for _ in range(repeats):
        out, rate = once()
        same &= torch.equal(out, greedy)
        rates.append(rate)
    stats = speculative.statistics(opt)
    acc = stats[0][0] if stats else None
    accepted = f"{acc.accepted}/{acc.accepted + acc.rejected}" if acc else "-"
    return statistics.median(rates), accepted, graphs, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--only", nargs="*", choices=["same model", "unrelated", "prompt lookup"])
    args = ap.parse_args()
    torch.manual_seed(0)
    target = tiny_hf_model("Qwen2", "sdpa", layers=args.layers, hidden_size=args.hidden,
                           intermediate_size=4 * args.hidden, num_attention_heads=8, num_key_value_heads=2)
    unrelated = tiny_hf_model("Llama", "sdpa", layers=1, seed=7)
    phrase = torch.randint(3, 100, (1, 16), generator=torch.Generator().manual_seed(1))
    prompts = {"same model": torch.randint(3, 100, (1, 32), generator=torch.Generator().manual_seed(2)),
               "unrelated": torch.randint(3, 100, (1, 32), generator=torch.Generator().manual_seed(2)),
               "prompt lookup": torch.cat([phrase] * 4, 1)}
    opt = metainfer.optimize(target, "cpu")
    drafters = {"same model": dict(assistant_model=opt), "unrelated": dict(assistant_model=unrelated),
                "prompt lookup": dict(prompt_lookup_num_tokens=max(LENGTHS))}
    print(f"target: Qwen2-style, hidden {args.hidden}, {args.layers} layers, random weights; {args.new} new "
          f"tokens, greedy, batch 1; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'drafter':14s} {'draft':>6s} {'tok/s':>8s} {'vs k=0':>7s} {'accepted':>9s} {'graphs':>6s} same")
    for name, kw in drafters.items():
        if args.only and name not in args.only:
            continue
        ids = prompts[name]
        with torch.no_grad():
            greedy = target.generate(ids, max_new_tokens=args.new, do_sample=False)
        results = {}
        for length in (*LENGTHS, None):
            results[length] = run(opt, ids, args.new, kw, length, args.repeats, greedy)
        base = results[0][0]
        for length, (rate, acc, graphs, same) in results.items():
            label = "auto" if length is None else str(length)
            print(f"{name:14s} {label:>6s} {rate:8.1f} {rate / base:7.2f} {acc:>9s} {graphs:6d} {same}")
        best = max(LENGTHS, key=lambda k: results[k][0])
        ratio = results[None][0] / results[best][0]
        print(f"{name:14s} metainfer's choice at {ratio:.2f} of the best fixed length ({best}): "
              f"{'within' if ratio >= 0.9 else 'NOT within'} 10%")
    last = {}
    for d in opt.report.speculation:
        last[d["drafter"]] = d
    print("last decisions:")
    for d in last.values():
        print(f"  {d['drafter']}: draft length {d['draft_length']} ({d['when']}): {d['why']}")


if __name__ == "__main__":
    main()
