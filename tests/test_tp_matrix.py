"""Hugging Face architectures across ranks: each at the largest tensor-parallel degree its tiny
config allows (4 heads: tp 4, above its 2 KV heads, so K/V heads are replicated) and at tp 2
(the heads split), MoE models with their experts spread too; every rank's output against the
unsharded eager model computed in the same process before sharding. Gloo ranks on 127.0.0.1.

    python tests/test_tp_matrix.py      # prints the matrix: max abs difference, passes per rank
"""

import os

import pytest
import torch
from torch.distributed.tensor import DTensor

import metainfer
from metainfer.parallel import multirank, sharding
from metainfer.hardware import planner, shapes
from metainfer.testing import tiny_hf_model

TIMEOUT_S = int(os.environ.get("METAINFER_TEST_RANK_TIMEOUT", 240))

DEEPSEEK = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                n_shared_experts=1, first_k_dense_replace=1)
ARCHS = {
    "Llama": {}, "Qwen2": {}, "Qwen3": {}, "Mistral": {}, "Gemma": dict(hidden_activation="gelu_pytorch_tanh"),
    "Gemma2": dict(sliding_window=4), "Phi3": {}, "Mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "Qwen3Moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "DeepseekV3": DEEPSEEK,
}
COMPUTE = ("fuse_attention", "mla_prefill", "fuse_moe", "fuse_rmsnorm", "fuse_swiglu", "fuse_geglu", "fuse_rope")


def matrix_run(rank, world, arch, tp, ep, dtype=torch.float32, lowering="aot_eager"):
    """One arch on this job: (max abs difference to the unsharded model, relative in bf16; matches per compute
    pass, K/V heads this rank holds, experts per rank, notes)."""
    model = tiny_hf_model(arch, "eager", layers=2, **ARCHS[arch]).to(dtype)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits.float()
    opt = metainfer.optimize(model, "pcie8", example_inputs=(ids,), emulate=True, lowering=lowering,
                             tensor_parallel=tp, expert_parallel=ep)
    with torch.no_grad():
        out = opt(ids).logits.float()
    fired = {p: opt.report.matches(p) for p in COMPUTE if opt.report.record(p) and opt.report.matches(p)}
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = sorted({m.weight.shape[0] / head_dim for n, m in model.named_modules()  # local tensors: replicated
                       if n.endswith((".k_proj", ".v_proj")) and not isinstance(m.weight, DTensor)})
    experts = sorted({m.num_experts for _, m in sharding.hf_expert_modules(model)})
    # K/V bytes one token adds to this rank's cache, from the sharded projections' local widths,
    # and what the planner counts for the same plan
    kv_bytes = sum(m.weight.shape[0] * m.weight.element_size() for n, m in model.named_modules()
                   if n.endswith((".k_proj", ".v_proj")) and not isinstance(m.weight, DTensor))
    shape = shapes.resolve(cfg)  # its activations' bytes are the config's dtype (bf16 unless given)
    planned = planner.kv_per_token(shape, planner.Plan(tp, 1, 1, 1)) / shape.act_bytes * model.dtype.itemsize
    kv_heads = (kv_heads, kv_bytes, planned)
    scale = 1.0 if dtype == torch.float32 else ref.abs().max().item()  # bf16: relative to the logits' range
    return (out - ref).abs().max().item() / scale, fired, kv_heads, experts, opt.report.notes


MOE = ("Mixtral", "Qwen3Moe", "DeepseekV3")
# the default tier: one row per mechanism (a gradients-only style in the plan; gathered /
# split-input styles; K/V heads replicated with Hugging Face experts spread; MLA with experts spread);
# the rest of the matrix is the slow tier (pytest -m slow tests/test_tp_matrix.py)
DEFAULT = {("Qwen3", 2), ("Phi3", 2), ("Mixtral", 4), ("DeepseekV3", 2)}  # 12-20 s each on 2 cores
ROWS = [(arch, world, torch.float32, "aot_eager") for arch in ARCHS for world in (2, 4)]
ROWS += [("Llama", 4, torch.float32, "inductor"), ("Llama", 4, torch.bfloat16, "aot_eager"),
         ("Mixtral", 2, torch.bfloat16, "aot_eager")]


def _param(arch, world, dtype, lowering):
    slow = (arch, world) not in DEFAULT or dtype != torch.float32 or lowering != "aot_eager"
    name = f"{arch}-{world}ranks" + ("-bf16" if dtype == torch.bfloat16 else "") + ("-inductor" if lowering == "inductor" else "")
    return pytest.param(arch, world, dtype, lowering, id=name, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("arch,world,dtype,lowering", [_param(*r) for r in ROWS])
def test_sharded_equals_unsharded(arch, world, dtype, lowering):
    """tp = world (the largest the tiny config allows at 4: above its 2 KV heads), experts
    spread for MoE models; bf16 against the bf16 eager model (differently rounded sums)."""
    ep = arch in MOE
    results = multirank.run(matrix_run, world, args=(arch, world, ep, dtype, lowering), timeout_s=TIMEOUT_S)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for diff, fired, kv_heads, experts, notes in results:
        assert diff < tol, (arch, world, diff)
        assert any("tensor parallel over ranks" in n for n in notes), notes
        assert fired.get("fuse_attention", 0) + fired.get("mla_prefill", 0) >= 2, fired
        if ep:
            assert any("expert parallel" in n for n in notes), notes
            assert fired.get("fuse_moe", 0) >= 1, fired
            if arch != "DeepseekV3":  # HF experts: E / world per rank
                assert experts == [ARCHS[arch].get("num_local_experts", ARCHS[arch].get("num_experts")) // world]
        heads, kv_bytes, planned = kv_heads
        if arch not in ("DeepseekV3", "Phi3") and world == 4:  # MLA has no K/V heads, Phi3's sit in one gathered qkv_proj
            assert heads == [1.0], heads  # 2 KV heads over 4 ranks: one whole head each
            assert kv_bytes == planned, (kv_bytes, planned)  # what the planner counts per rank is what is held


if __name__ == "__main__":
    import sys

    import test_tp_matrix as me  # the ranks find matrix_run by its module's name, not __main__

    for arch, world, dtype, lowering in ROWS:
        res = multirank.run(me.matrix_run, world, args=(arch, world, arch in MOE, dtype, lowering), timeout_s=TIMEOUT_S)
        print(f"{arch:10s} {world} ranks tp{world}{' ep' if arch in MOE else ''} {str(dtype)[6:]:8s} {lowering:9s} "
              f"max|diff| {max(r[0] for r in res):.2e}  kv heads/rank, KV B/token/rank local vs planner {res[0][2]}  experts/rank {res[0][3]}  "
              f"fired per rank {[r[1] for r in res]}", flush=True)
    sys.exit(0)
