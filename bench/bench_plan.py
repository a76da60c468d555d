"""Predicted throughput of the planner's chosen plans, PCIe box vs NVLink box, in one run.

The chosen plan is the fastest one metainfer executes; faster plans it only prices (pipeline
stages, all-to-all expert dispatch) and speculative draft lengths are labelled what-ifs.

    python bench/bench_plan.py [--acceptance 0.7] [--json]

For a Llama-3-70B-shaped and a DeepSeek-V3-shaped model on `pcie8` (8 x L40S-class, PCIe
Gen4, 2 islands x 4) and `nvlink8` (8 x H100 SXM): the plan the planner picks for prefill
(4 x 4096-token prompts) and for decode (64 sequences at 4096 tokens of context), its
predicted tokens/s and the floor (communication fully hidden). DeepSeek-V3 in FP8 (625 GiB
of weights) fits neither box; the rows say so, and a what-if block gives both boxes 141 GiB
per device (H200-class memory; not a product on PCIe) to compare the links at that shape.

Every figure is a prediction of metainfer's cost model (docs/cost-model.md), not a
measurement; bench/calibrate_gpu.py measures the constants it rests on where a GPU is lent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from metainfer.hardware import planner, targets

MODELS = ("llama3-70b", "deepseek-v3")
TARGETS = ("pcie8", "nvlink8")
WHAT_IF_GIB = 141


def with_memory(target, gib: float):
    dev = dataclasses.replace(target.device, memory_bytes=gib * 2**30)
    return dataclasses.replace(target, name=f"{target.name}@{gib:g}GiB", device=dev)


def rows(model, target, acceptance):
    try:
        result = planner.plan(model, target, acceptance=acceptance)
    except planner.PlanError as e:
        return [{"model": model, "target": target.name, "phase": ph, "error": str(e), "what_if_not_executable": None}
                for ph in planner.PHASES]
    out = []
    for ph in planner.PHASES:
        phase = result.phases[ph]
        c, w = phase.chosen, phase.what_if
        row = {"model": model, "target": target.name, "phase": ph,
               "what_if_not_executable": None if w is None else {
                   "plan": w.plan.label, "tokens_per_second": w.tokens_per_second}}
        if c is None:
            out.append({**row, "error": "no plan metainfer executes fits: " + phase.reason})
            continue
        out.append({**row, "plan": c.plan.label, "executable": c.executable,
                    "tokens_per_second": c.tokens_per_second, "floor_tokens_per_second": c.floor_tokens_per_second,
                    "comm_share": c.comm_seconds / c.step_seconds, "draft_what_if": c.draft,
                    "speculative_tokens_per_second_what_if": c.speculative_tokens_per_second,
                    "kv_tokens": c.capacity.kv_tokens_total, "max_context": c.capacity.max_context})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--acceptance", type=float, default=0.7, help="speculative acceptance rate for decode")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    table = []
    for model in MODELS:
        for name in TARGETS:
            table += rows(model, targets.get(name), a.acceptance)
    for name in TARGETS:
        table += rows("deepseek-v3", with_memory(targets.get(name), WHAT_IF_GIB), a.acceptance)
    if a.json:
        print(json.dumps(table, indent=2))
        return
    print("predicted by metainfer's cost model (not measured); prefill 4 x 4096 tokens, decode 64 x 4096 context; "
          "the chosen plan is the fastest one metainfer executes (tp x dp, experts inside a tp group); plans with "
          "pipeline stages or all-to-all expert dispatch and speculative drafts are priced only, shown as what-ifs")
    print("| model | target | phase | chosen plan | tok/s | floor tok/s | pred/floor | comm share | KV tokens |"
          f" what-if, not executable | what-if draft (acceptance {a.acceptance}) |")
    print("|---" * 11 + "|")
    for r in table:
        w = r["what_if_not_executable"]
        what_if = f"{w['plan']}: {w['tokens_per_second']:,.0f} tok/s" if w else "-"
        if "error" in r:
            print(f"| {r['model']} | {r['target']} | {r['phase']} | {r['error'].split(': ', 1)[1]} "
                  f"| | | | | | {what_if} | |")
            continue
        draft = (f"k={r['draft_what_if']}: {r['speculative_tokens_per_second_what_if']:,.0f} tok/s"
                 if r["phase"] == "decode" and r["draft_what_if"] else "-")
        print(f"| {r['model']} | {r['target']} | {r['phase']} | {r['plan']} | {r['tokens_per_second']:,.0f} | "
              f"{r['floor_tokens_per_second']:,.0f} | {r['tokens_per_second'] / r['floor_tokens_per_second']:.2f} | "
              f"{r['comm_share']:.0%} | {r['kv_tokens']:,} | {what_if} | {draft} |")
    by = {(r["model"], r["target"], r["phase"]): r for r in table if "error" not in r}
    print()
    for model, (p, n) in (("llama3-70b", TARGETS), ("deepseek-v3", (f"pcie8@{WHAT_IF_GIB}GiB", f"nvlink8@{WHAT_IF_GIB}GiB"))):
        for ph in planner.PHASES:
            if (model, p, ph) in by and (model, n, ph) in by:
                ratio = by[(model, p, ph)]["tokens_per_second"] / by[(model, n, ph)]["tokens_per_second"]
                print(f"{model} {ph}: {p} / {n} = {ratio:.2f}x")


if __name__ == "__main__":
    main()
