"""Speculative decoding on this machine: tokens/s and acceptance against the draft length.

    python bench/bench_speculative.py [--new 64] [--repeats 3] [--hidden 256] [--layers 4]
                                      [--only NAME ...] [--ds-layers 4] [--distil-steps 600]

Three drafters for one greedy target (a random-weight Qwen2-style model built from a config):
- "same model": the target drafts for itself (acceptance 1: every drafted token is accepted);
- "unrelated": a one-layer model of another family with its own random weights (acceptance
  near 0);
- "prompt lookup": n-gram continuations from a repetitive prompt (no draft model).
And models/ DeepSeek (tiny shape, --ds-layers layers) drafting with its MTP layer in its own loop:
- "mtp random": the MTP layer's random weights (acceptance near 0);
- "mtp distilled": the MTP layer trained here for --distil-steps Adam steps to predict the
  model's own greedy token two ahead (self-distillation on its greedy continuations of 1024
  random prompts; the main model untouched), so that some of its drafts are right (a random
  model's greedy choice is hard to predict: about one in four on a new prompt).
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
import torch.nn.functional as F

import metainfer
from metainfer.runtime import speculative
from metainfer.models import deepseek
from metainfer.testing import tiny_hf_model

LENGTHS = (0, 1, 2, 3, 5, 7)


def run(opt, generate, length, repeats, greedy, new, reports):
    """(median tokens/s, acceptance observed, graphs compiled by the warm-up, same tokens).
    generate(length) -> tokens; reports() -> the reports whose graphs count (target, drafter)."""
    def once():
        speculative.forget(opt)  # each run decides from scratch
        start = time.perf_counter()
        out = generate(length)
        return out, new / (time.perf_counter() - start)

    def graphs():
        return sum(len(r.sections) for r in reports())

    before = graphs()
    out, _ = once()
    compiled = graphs() - before
    same = torch.equal(out, greedy)
    rates = []
    for _ in range(repeats):
        out, rate = once()
        same &= torch.equal(out, greedy)
        rates.append(rate)
    stats = speculative.statistics(opt)
    acc = stats[0][0] if stats else None
    accepted = f"{acc.accepted}/{acc.accepted + acc.rejected}" if acc else "-"
    return statistics.median(rates), accepted, compiled, same


def distil_mtp(model, steps: int, seed: int = 0, sequences: int = 1024, batch: int = 64, prompt: int = 8,
               length: int = 64) -> float:
    """Train model.mtp's own weights (not the shared embedding and head, not the main model) to
    predict the model's greedy choice two tokens ahead, on its greedy continuations of random
    prompts (Adam, minibatches of `batch` sequences). Returns the accuracy on the training
    sequences (argmax equal to the target)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.config.vocab_size, (sequences, prompt), generator=g)
    seqs = model.generate(prompts, length - prompt)
    with torch.no_grad():
        logits, hidden = model(seqs, return_hidden=True)
    # the MTP at position i reads (h_i, t_{i+1}); the model's own choice for t_{i+2} is the
    # argmax of its logits at i + 1
    target = logits[:, 1:].argmax(-1)
    own = [p for n, p in model.mtp.named_parameters() if not n.startswith(("embed.", "head."))]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in own:
        p.requires_grad_(True)
    adam = torch.optim.Adam(own, lr=3e-3)
    for _ in range(steps):
        idx = torch.randint(0, sequences, (batch,), generator=g)
        out, _ = model.mtp(hidden[idx, :-1], seqs[idx, 1:])
        loss = F.cross_entropy(out.flatten(0, 1), target[idx].flatten())
        adam.zero_grad()
        loss.backward()
        adam.step()
    for p in own:
        p.requires_grad_(False)
    with torch.no_grad():
        out, _ = model.mtp(hidden[:, :-1], seqs[:, 1:])
    return float((out.argmax(-1) == target).float().mean())


def table(name, results):
    base = results[0][0]
    for length, (rate, acc, graphs, same) in results.items():
        label = "auto" if length is None else str(length)
        print(f"{name:14s} {label:>6s} {rate:8.1f} {rate / base:7.2f} {acc:>9s} {graphs:6d} {same}")
    best = max(LENGTHS, key=lambda k: results[k][0])
    ratio = results[None][0] / results[best][0]
    print(f"{name:14s} metainfer's choice at {ratio:.2f} of the best fixed length ({best}): "
          f"{'within' if ratio >= 0.9 else 'NOT within'} 10%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ds-layers", type=int, default=4)
    ap.add_argument("--distil-steps", type=int, default=600)
    ap.add_argument("--only", nargs="*", choices=["same model", "unrelated", "prompt lookup", "mtp random",
                                                  "mtp distilled"])
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
    print(f"target: Qwen2-style, hidden {args.hidden}, {args.layers} layers, random weights; models/ DeepSeek "
          f"tiny with {args.ds_layers} layers + 1 MTP layer; {args.new} new tokens, greedy, batch 1; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'drafter':14s} {'draft':>6s} {'tok/s':>8s} {'vs k=0':>7s} {'accepted':>9s} {'graphs':>6s} same")
    for name, kw in drafters.items():
        if args.only and name not in args.only:
            continue
        ids = prompts[name]
        with torch.no_grad():
            greedy = target.generate(ids, max_new_tokens=args.new, do_sample=False)

        def generate(length, ids=ids, kw=kw):
            return opt.generate(ids, max_new_tokens=args.new, do_sample=False, draft_length=length, **kw)

        results = {length: run(opt, generate, length, args.repeats, greedy, args.new, lambda: [opt.report])
                   for length in (*LENGTHS, None)}
        table(name, results)
    decisions = list(opt.report.speculation)
    for name in ("mtp random", "mtp distilled"):
        if args.only and name not in args.only:
            continue
        model = deepseek.build("deepseek-tiny", n_mtp_layers=1, n_layers=args.ds_layers)
        if name == "mtp distilled":
            start = time.perf_counter()
            accuracy = distil_mtp(model, args.distil_steps)
            print(f"{name:14s} MTP trained {args.distil_steps} steps in {time.perf_counter() - start:.0f} s: "
                  f"training accuracy {accuracy:.2f}")
        ds_opt = metainfer.optimize(model, "cpu")
        ids = deepseek.example_inputs(model.config, seq=32, seed=2)[0]
        greedy = model.generate(ids, args.new)

        def generate(length, ids=ids, ds_opt=ds_opt):
            return ds_opt.generate(ids, args.new, draft_length=length)

        def reports(model=model, ds_opt=ds_opt):
            drafter = model.mtp.__dict__.get(speculative._DRAFTER_ATTR)
            return [ds_opt.report] + ([drafter.report] if drafter is not None else [])

        results = {length: run(ds_opt, generate, length, args.repeats, greedy, args.new, reports)
                   for length in (*LENGTHS, None)}
        table(name, results)
        decisions += [{**d, "drafter": name} for d in ds_opt.report.speculation]
    last = {}
    for d in decisions:
        last[d["drafter"]] = d
    print("last decisions:")
    for d in last.values():
        print(f"  {d['drafter']}: draft length {d['draft_length']} ({d['when']}): {d['why']}")


if __name__ == "__main__":
    main()
