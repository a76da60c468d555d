"""Match counts of every compute pass on every model the tests cover, under both lowerings,
each run checked for equivalence against eager (optimize(..., verify=True)).

    python bench/match_counts.py [--lowerings inductor aot_eager] [--json out.json]

Prints a table: model, lowering, then each pass's match count. Run it before and after a
change to the passes or to the capture: the counts and equivalence must not move (the JSON
also keeps each pass's decision and near-miss lines, to diff). Cost gates
are off (pass_options) so a count is what the pass matched, not what the CPU's cost model kept.
"""

from __future__ import annotations

import argparse
import json

import torch

import metainfer
from metainfer import models
from metainfer.testing import tiny_hf_model

PASSES = [p for p in ("fuse_moe", "mla_prefill", "fuse_attention", "sparse_mla", "mla_decode", "fp8_gemm",
                      "fuse_rope", "fuse_rmsnorm", "fuse_swiglu", "fuse_geglu") if p in metainfer.passes.pass_names()]

DEEPSEEK = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                n_shared_experts=1, first_k_dense_replace=1)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
HF = [("Llama", "eager", {}), ("Llama", "sdpa", {}), ("Qwen2", "eager", {}), ("Qwen3", "eager", {}),
      ("Mistral", "eager", {}), ("Phi3", "eager", {}), ("Gemma", "eager", dict(hidden_activation="gelu_pytorch_tanh")), ("Gemma2", "eager", {}),
      ("Mixtral", "eager", MOE), ("Qwen3Moe", "eager", dict(num_experts=4, num_experts_per_tok=2,
                                                            moe_intermediate_size=32)),
      ("DeepseekV3", "eager", DEEPSEEK)]
OURS = ["llama-tiny", "deepseek-tiny", "deepseek-v32-tiny", "deepseek-v32-tiny-fp8"]


def cases():
    for name in OURS:
        yield name, lambda name=name: (models.build(name).eval(), torch.randint(3, 100, (2, 16)))
    for arch, attn, extra in HF:
        yield f"hf-{arch}-{attn}", lambda a=arch, t=attn, e=extra: (tiny_hf_model(a, t, layers=2, **e),
                                                                     torch.randint(3, 100, (2, 16)))
    yield "hf-Llama-eager-bf16", lambda: (tiny_hf_model("Llama", "eager", layers=2).to(torch.bfloat16),
                                          torch.randint(3, 100, (2, 16)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lowerings", nargs="+", default=["inductor", "aot_eager"])
    ap.add_argument("--only", nargs="*", help="case names to run")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    print("case".ljust(28), "lowering".ljust(10), " ".join(p[:12].rjust(12) for p in PASSES))
    for name, build in cases():
        if args.only and name not in args.only:
            continue
        torch.manual_seed(0)
        model, ids = build()
        for lowering in args.lowerings:
            torch._dynamo.reset()
            try:
                opt = metainfer.optimize(model, "cpu", example_inputs=(ids,), passes=PASSES, verify=True,
                                         lowering=lowering, pass_options={"cost_gates": False})
                counts = [opt.report.matches(p) for p in PASSES]
                said = {p: sorted(line for r in opt.report.passes if r.name == p for line in r.decisions + r.near_misses)
                        for p in PASSES}
                status = "equivalent"
            except Exception as e:  # a broken case is a row, not the end of the table
                counts, said, status = [None] * len(PASSES), {}, f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(dict(case=name, lowering=lowering, counts=dict(zip(PASSES, counts)), status=status,
                             decisions_and_near_misses=said))
            print(name.ljust(28), lowering.ljust(10), " ".join(str(c).rjust(12) for c in counts),
                  "" if status == "equivalent" else status, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
