"""The cost model against measurements: predicted vs measured wall time of compiled graphs on a
calibrated CPU target, in one run.

    python bench/validate_cost_model.py [--target cpu-calibrated.toml] [--json]

Each row is one graph metainfer compiled (Inductor lowering, a fresh compile cache): Hugging
Face Llama, Qwen2 and DeepSeek-V3 built from configs with random weights (fp32), prefill
forwards of 1 x 512 and 4 x 128 tokens and the prefill and decode graphs of `generate`, with
metainfer's passes on and with none (the same lowering, no rewrites). Predicted: the
simulator's step time for the graph after the passes, on the target. Measured: the median
wall time of the compiled graph's own calls (the backend times them; Dynamo's guards and the
model wrapper are outside), after warm-up calls. Error = predicted / measured - 1.

Without --target, the machine is calibrated first (`metainfer calibrate`, gloo over the
--ranks job sizes) and its TOML used. Then the pass decisions that can be measured on one
CPU device (fuse_rmsnorm, fuse_swiglu, fuse_rope, fuse_attention in Llama's prefill and
decode graphs; mla_decode's absorbed form in DeepSeek-V3's; mla_prefill and fuse_moe in DeepSeek-V3's prefill): what the
cost model predicts for the pass (its record's predicted step before and after, with the cost
gates off so every pass runs; mla_decode: whether it absorbed, which it decides by the
simulator) against the measured graph time with the pass (forced where it declined) and with
it disabled (with fuse_attention for mla_prefill, which would fuse the same attention), each
twice: with it (the case's first run, or a forced run), without it twice, then with it again;
the means of each pair are compared (a drift of the machine between the pairs cancels, fully
for a case's first decision); a measured difference under 5% agrees with either choice.

Then the same on gloo ranks of this machine (bench/validate_ranks.py): tensor-parallel prefill
steps of Llama over 2 and 4 ranks with the communication passes on and off, and the
communication decisions (sequence_parallel, two_batch_overlap, pipeline_collectives' k, the
overlap order) against their measured alternatives. The last line is JSON: {"graphs": n,
"median_abs_error": x, "decisions": n, "decisions_agree": m}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch  # noqa: E402

import metainfer  # noqa: E402
from metainfer.hardware import noise, targets  # noqa: E402
from metainfer.passes.pipeline import DEFAULT_ORDER  # noqa: E402
from metainfer.testing import tiny_hf_model  # noqa: E402

DEEPSEEK = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=8,
                num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                n_shared_experts=1, first_k_dense_replace=1)
MODELS = {  # name -> (arch, config fields)
    "llama": ("Llama", dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=2,
                            vocab_size=4096, max_position_embeddings=1024)),
    "qwen2": ("Qwen2", dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=2,
                            vocab_size=4096, max_position_embeddings=1024)),
    "deepseek-v3": ("DeepseekV3", dict(DEEPSEEK, vocab_size=4096, max_position_embeddings=1024)),
}
FORWARDS = {"prefill 1x512": (1, 512), "prefill 4x128": (4, 128)}
CALLS = 7  # timed calls per graph after warm-up (the median is reported)


def _model(name: str, layers: int = 4):
    arch, fields = MODELS[name]
    return tiny_hf_model(arch, attn="eager", layers=layers, **fields)


def _optimized(model, target, passes_on: bool, cache_dir: str):
    opt = metainfer.optimize(model, target, passes=None if passes_on else [], cache_dir=cache_dir)
    opt.record_call_times()
    return opt


def _run_forward(opt, ids) -> None:
    with torch.no_grad():
        for _ in range(2 + CALLS):
            opt(ids)


def _run_generate(opt, ids, new: int = 16) -> None:
    for _ in range(3):
        opt.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)


def _warm(call_seconds: list[float]) -> list[float]:
    """The warm calls of a graph: the later two thirds, never its first; none for a graph
    called fewer than three times (generate's first decode step runs once: never warm)."""
    calls = call_seconds[max(1, len(call_seconds) // 3):]
    return calls if len(calls) >= 2 else []


def _paired_rows(on, off) -> list[dict]:
    """Rows for the graphs of a run with the passes and of the same run without: the second's
    graphs are the first's before any pass, so their prediction is the first's `before_s`."""
    rows = []
    for label, report, key in (("passes", on, "after_s"), ("no passes", off, "before_s")):
        for s, twin in zip(report.sections, on.sections):
            p = twin.prediction
            calls = _warm(s.call_seconds)
            if p is None or not calls or s.phase != twin.phase:
                continue
            measured = statistics.median(calls)
            rows.append({"phase": s.phase, "passes": label, "inputs": " ".join(s.inputs[:1]),
                         "predicted_s": p[key], "measured_s": measured, "error": p[key] / measured - 1,
                         "calls": len(calls)})
    return rows


def graphs(target, cache_dir: str, models=tuple(MODELS), progress=print, guard=None) -> list[dict]:
    """Rows of predicted vs measured graph time; each run (passes on, passes off) between
    yardstick readings of `guard`, re-run while the machine swings: a row whose run never held
    still has "stable": False and is left out of the error summary."""
    guard = guard or noise.Yardstick()
    rows = []
    for name in models:
        model = _model(name)
        vocab = model.config.vocab_size
        cases = [(shape, _run_forward, torch.randint(3, vocab, (b, s), generator=torch.Generator().manual_seed(0)))
                 for shape, (b, s) in FORWARDS.items()]
        cases.append(("generate 2x64 +16", _run_generate,
                      torch.randint(3, vocab, (2, 64), generator=torch.Generator().manual_seed(1))))
        for case, run, ids in cases:
            t0 = time.perf_counter()
            runs = []
            for passes_on in (True, False):
                def one(passes_on=passes_on, run=run, ids=ids):
                    torch._dynamo.reset()
                    opt = _optimized(model, target, passes_on, cache_dir)
                    run(opt, ids)
                    return opt.report

                runs.append(guard.measure(one, f"{name} {case}, passes {'on' if passes_on else 'off'}"))
            for r in _paired_rows(runs[0].value, runs[1].value):
                graph = f"{case}, {r['phase']}" if case.startswith("generate") else case
                kept = runs[0] if r["passes"] == "passes" else runs[1]
                rows.append({"model": name, "case": f"{graph}, {r['passes']}", **r, "stable": kept.stable,
                             "yardstick_ms": [[x * 1e3 for x in r] for r in kept.yardstick_s]})
            progress(f"{name} {case}: {time.perf_counter() - t0:.0f} s")
    return rows


# pass decisions measured on one CPU device: (model, case, pass, graph phase)
DECISIONS = [("llama", "prefill 1x512", p, "forward") for p in ("fuse_rmsnorm", "fuse_swiglu", "fuse_rope", "fuse_attention")]
DECISIONS += [("llama", "generate 2x64 +16", p, "decode") for p in ("fuse_rmsnorm", "fuse_swiglu", "fuse_rope",
                                                                     "fuse_attention")]
DECISIONS += [("deepseek-v3", "generate 2x64 +16", "mla_decode", "decode"),
              ("deepseek-v3", "prefill 1x512", "mla_decode", "forward"),
              ("deepseek-v3", "prefill 1x512", "mla_prefill", "forward"),
              ("deepseek-v3", "prefill 1x512", "fuse_moe", "forward")]
# the alternative to a pass is the graph without it and without a later pass that would do the
# same rewrite in its place (fuse_attention fuses MLA's attention where mla_prefill does not)
ALTERNATIVE = {"mla_prefill": ("mla_prefill", "fuse_attention")}


def _phase_time(report, phase: str) -> float:
    return sum(statistics.median(_warm(s.call_seconds)) for s in report.sections
               if s.phase == phase and _warm(s.call_seconds))


def decisions(target, cache_dir: str, models=tuple(MODELS), progress=print, guard=None) -> list[dict]:
    """For each pass decision: what the cost model predicts (the pass's record in a run with the
    cost gates off: predicted step before vs after it; mla_decode decides by the simulator itself)
    and what the measurement favours (the run with the pass vs the same run with it disabled).
    Every run sits between yardstick readings of `guard`; the measured difference is judged
    against the noise those runs show (noise.decision_noise): inside it, "either"."""
    guard = guard or noise.Yardstick()
    rows = []
    for name in models:
        wanted = [d for d in DECISIONS if d[0] == name]
        if not wanted:
            continue
        model = _model(name)
        vocab = model.config.vocab_size
        inputs = {"prefill 1x512": (_run_forward, torch.randint(3, vocab, (1, 512), generator=torch.Generator().manual_seed(0))),
                  "generate 2x64 +16": (_run_generate, torch.randint(3, vocab, (2, 64),
                                                                     generator=torch.Generator().manual_seed(1)))}
        for case in dict.fromkeys(d[1] for d in wanted):
            run, ids = inputs[case]
            t0 = time.perf_counter()

            def measured(disable=(), force=None, label=""):
                def one():
                    torch._dynamo.reset()
                    # every pass named (the pointwise fusions are off by default on CPU), gates off
                    opt = metainfer.optimize(model, target, passes=list(DEFAULT_ORDER), disable=disable,
                                             pass_options={"cost_gates": False, **({force: True} if force else {})},
                                             cache_dir=cache_dir)
                    opt.record_call_times()
                    run(opt, ids)  # noqa: B023
                    return opt.report

                return guard.measure(one, f"{name} {case} {label}")  # noqa: B023

            base = measured(label="all passes")
            for _, _, pass_name, phase in [d for d in wanted if d[1] == case]:
                recs = [r for s in base.value.sections if s.phase == phase for r in s.records if r.name == pass_name]
                fired = [r for r in recs if r.matches]
                if pass_name == "mla_decode":  # it decides per site by the simulator: absorbed or kept
                    if not recs or not (fired or any("kept decompressed" in n for r in recs for n in r.near_misses)):
                        continue  # nothing to decide in this graph
                    pays = bool(fired)
                    force = None if pays else "mla_decode"
                else:
                    if not fired:
                        continue  # nothing to decide in this graph
                    pays = all(r.predicted_after_s <= r.predicted_before_s for r in fired)
                    force = None
                disable = ALTERNATIVE.get(pass_name, (pass_name,))
                # with, without, without, with: the mean of each pair cancels a drift of the machine (the
                # first 'with' is the case's base run, so it sits next to the rest only for its first decision)
                with_runs = [base if force is None else measured(force=force, label=f"{pass_name} forced")]
                without = [measured(disable=disable, label=f"without {pass_name}") for _ in range(2)]
                with_runs.append(measured(force=force, label=f"with {pass_name}"))
                ons = [_phase_time(r.value, phase) for r in with_runs]
                offs = [_phase_time(r.value, phase) for r in without]
                on, off = statistics.mean(ons), statistics.mean(offs)
                readings = [x for r in with_runs + without for x in r.yardstick_s]
                band = noise.decision_noise(ons, offs, readings)
                stable = all(r.stable for r in with_runs + without)
                favours = noise.verdict(on, off, band) if stable else "unstable"
                says = "apply" if pays else "decline"
                rows.append({"model": name, "case": case, "pass": pass_name, "phase": phase, "model_says": says,
                             "measured_on_s": on, "measured_off_s": off, "noise": band,
                             "measurement_favours": favours, "agree": favours in ("either", says)})
            progress(f"decisions {name} {case}: {time.perf_counter() - t0:.0f} s")
    return rows


def decision_table(rows: list[dict]) -> str:
    out = ["| model | graph | pass | model says | measured with / without | noise | favours | agree |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = abs(r["measured_on_s"] - r["measured_off_s"]) / min(r["measured_on_s"], r["measured_off_s"])
        out.append(f"| {r['model']} | {r['case']}, {r['phase']} | {r['pass']} | {r['model_says']} | "
                   f"{r['measured_on_s'] * 1e3:.3f} / {r['measured_off_s'] * 1e3:.3f} ms ({diff:.1%} apart) | "
                   f"{r['noise']:.1%} | {r['measurement_favours']} | "
                   f"{'yes' if r['agree'] else 'NO'} |")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    out = ["| model | graph | predicted ms | measured ms | error |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['case']} | {r['predicted_s'] * 1e3:.3f} | {r['measured_s'] * 1e3:.3f} | "
                   f"{r['error']:+.0%}{'' if r.get('stable', True) else ' (unstable: left out)'} |")
    return "\n".join(out)


def summarise(rows: list[dict], chosen: list[dict], guard) -> dict:
    """The run's last line: the error over rows measured while the machine held still, the
    agreement over decisions whose measured difference is outside the noise, and the swing."""
    kept = [r for r in rows if r.get("stable", True)]
    judged = [r for r in chosen if r["measurement_favours"] in ("apply", "decline")]
    return {"graphs": len(rows), "median_abs_error": statistics.median(abs(r["error"]) for r in kept) if kept else None,
            "rows_dropped": len(rows) - len(kept) + sum(r["measurement_favours"] == "unstable" for r in chosen),
            "decisions": len(chosen), "decisions_agree": sum(r["agree"] for r in chosen),
            "decisions_outside_noise": len(judged), "decisions_outside_noise_agree": sum(r["agree"] for r in judged),
            "swing": {k: v for k, v in guard.summary().items() if k != "unstable"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="a calibrated target TOML (default: calibrate this machine first)")
    ap.add_argument("--json", action="store_true", help="print every row as JSON before the summary line")
    ap.add_argument("--models", nargs="+", choices=tuple(MODELS), default=tuple(MODELS))
    ap.add_argument("--decisions-only", action="store_true", help="skip the per-graph rows")
    ap.add_argument("--overlap", nargs="*", default=[], metavar="RANKS=SHARE",
                    help="with --target: calibrate's measured overlap per job size (else measured again)")
    ap.add_argument("--ranks", type=int, nargs="*", default=[2, 4],
                    help="gloo job sizes for the multi-rank steps (none: skip them; decisions at the first)")
    ap.add_argument("--band", type=float, default=noise.BAND,
                    help=f"the yardstick's band around its run median (default {noise.BAND})")
    ap.add_argument("--tries", type=int, default=2, help="runs of a case while the machine swings outside the band "
                    "before it is reported unstable (default 2: a case compiles and runs for 10-60 s)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    import validate_ranks

    guard = noise.Yardstick(band=a.band, tries=a.tries)
    validate_ranks.GUARD[:] = [guard]  # one guard over the whole run: one swing figure
    if a.target:
        target, source = targets.get(a.target), a.target
        validate_ranks.OVERLAP.update({int(k): float(v) for k, v in (x.split("=") for x in a.overlap)})
    else:
        from metainfer import calibrate

        path = os.path.join(tempfile.mkdtemp(), "cpu-calibrated.toml")
        m = calibrate.measure(targets.get("cpu"), sorted(set(a.ranks)), progress=lambda s: print(s, file=sys.stderr),
                              guard=guard)
        validate_ranks.OVERLAP.update({int(k): v for k, v in m.comm_overlap.items()})
        with open(path, "w") as f:
            f.write(calibrate.to_toml(m, targets.get("cpu")))
        print(calibrate.table(m))
        target, source = targets.load(path), path
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as cache:
        rows = [] if a.decisions_only else graphs(target, cache, a.models, progress=say, guard=guard)
        chosen = decisions(target, cache, a.models, progress=say, guard=guard)
        print(table(rows), decision_table(chosen), sep="\n\n", flush=True)  # before the multi-rank part
        if a.ranks:
            rank_rows, default = validate_ranks.steps(source, cache, a.ranks, progress=say)
            rows += rank_rows
            chosen += validate_ranks.decisions(source, cache, default, a.ranks[:1], progress=say)
    print(f"\ntarget {target.name}: peak fp32 {target.device.peak_flops['fp32'] / 1e9:.0f} GFLOP/s, "
          f"{target.device.memory_bandwidth / 1e9:.1f} GB/s, {target.device.launch_overhead_s * 1e6:.2f} us per kernel")
    if target.machine is not None:
        print(f"machine: {target.machine.cpu}, flags {', '.join(target.machine.flags) or 'none'}, "
              f"{target.machine.cores} cores")
    print(table(rows))
    print()
    print(decision_table(chosen))
    print(guard.line())
    if a.json:
        print(json.dumps({"graphs": rows, "decisions": chosen, "unstable": guard.unstable,
                          "yardstick_timeline": guard.timeline()}, indent=1))
    print(json.dumps(summarise(rows, chosen, guard)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
