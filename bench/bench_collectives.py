"""Collective selection: the library's flat ring vs metainfer's choice, predicted on the real
boxes and measured on CPU gloo ranks, in one run.

    python bench/bench_collectives.py [--ranks 4] [--skip-measured]

Predicted (metainfer's cost model, not measured): per transformer layer under tensor
parallelism over 8 devices, the two all-reduces of tokens x hidden (bf16), for Llama-3-70B
(hidden 8192) and DeepSeek-V3 (hidden 7168) shapes, prefill (4 x 4096 tokens) and decode
(64 tokens), on pcie8 and nvlink8: time with the ring vs with the algorithm
select_collectives picks (ring or hierarchical over islands), and bytes across the island
boundary.

Measured: a tiny Hugging Face Llama (hidden 256, 8 heads) sharded over `--ranks` gloo ranks
on 127.0.0.1 with pcie8's topology scaled onto them (2 islands), one forward of 4 x 128
tokens with select_collectives on and off: the bytes each rank actually sent to its own
island and across (kernel socket counters, `ss`), and the outputs' agreement with the
unsharded model.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from metainfer.hardware import cost, targets  # noqa: E402

SHAPES = {"llama3-70b": 8192, "deepseek-v3": 7168}
PHASES = {"prefill": 4 * 4096, "decode": 64}


def predicted() -> None:
    print("predicted per layer (2 all-reduces), tensor parallel over 8 devices; a model, not a measurement")
    print("| model | phase | target | message | ring | metainfer | speed-up | across islands: ring -> metainfer |")
    print("|---|---|---|---|---|---|---|---|")
    for model, hidden in SHAPES.items():
        for phase, tokens in PHASES.items():
            nbytes = tokens * hidden * 2
            for name in ("pcie8", "nvlink8"):
                t = targets.get(name)
                ring = cost.collective_cost("all_reduce", nbytes, t, "ring")
                options = [c for c in cost.candidates("all_reduce", nbytes, t) if c.algorithm in ("ring", "hierarchical")]
                chosen = min(options, key=lambda c: c.seconds)
                print(f"| {model} | {phase} | {name} | {nbytes / 2**20:.2f} MiB | {2 * ring.seconds * 1e6:,.0f} us | "
                      f"{2 * chosen.seconds * 1e6:,.0f} us ({chosen.algorithm}) | {ring.seconds / chosen.seconds:.2f}x | "
                      f"{2 * ring.bytes_inter / 2**20:.1f} -> {2 * chosen.bytes_inter / 2**20:.1f} MiB |")


def measured_rank(rank, world, select):
    import torch

    import metainfer
    from metainfer.parallel import multirank
    from metainfer.testing import tiny_hf_model

    model = tiny_hf_model("Llama", attn="eager", layers=2, hidden_size=256, intermediate_size=512,
                          num_attention_heads=8, num_key_value_heads=8)
    ids = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    passes = None if select else ["fuse_moe", "mla_prefill", "fuse_attention", "sparse_mla", "mla_decode", "fp8_gemm"]
    opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, lowering="aot_eager", passes=passes)
    with torch.no_grad():
        opt(ids)  # warm: connections of every group set up
        with multirank.SentBytes() as sent:
            out = opt(ids).logits
    return sent.by_link(opt.report.target.topology.islands), (out - ref).abs().max().item()


def measured(ranks: int) -> None:
    from metainfer.parallel import multirank

    print(f"\nmeasured on {ranks} gloo ranks (pcie8 scaled to 2 islands), one forward of 4 x 128 tokens, "
          "tiny HF Llama (hidden 256, 2 layers): bytes sent per rank")
    print("| collectives | intra-island KiB/rank | inter-island KiB/rank | max |out - unsharded| |")
    print("|---|---|---|---|")
    rows = {}
    for select in (False, True):
        res = multirank.run(measured_rank, ranks, args=(select,), timeout_s=600)
        intra = sum(b["intra"] for b, _ in res) / ranks
        inter = sum(b["inter"] for b, _ in res) / ranks
        rows[select] = inter
        label = "select_collectives (hierarchical)" if select else "library default (ring)"
        print(f"| {label} | {intra / 1024:,.1f} | {inter / 1024:,.1f} | {max(d for _, d in res):.2e} |")
    from metainfer.parallel import distributed

    t = distributed.emulated(targets.get("pcie8"), ranks)
    nbytes = 4 * 128 * 256 * 4
    formula = (cost.collective_cost("all_reduce", nbytes, t, "hierarchical").bytes_inter
               / cost.collective_cost("all_reduce", nbytes, t, "ring").bytes_inter)
    print(f"\nacross islands, selected / ring: measured {rows[True] / rows[False]:.3f}, formula {formula:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--skip-measured", action="store_true")
    a = ap.parse_args()
    predicted()
    if not a.skip_measured:
        measured(a.ranks)


if __name__ == "__main__":
    main()
