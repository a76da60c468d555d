"""models/deepseek.py: the reference DeepSeek-class model itself (MLA with a latent cache, DSA,
MoE routing, FP8 blocks): runs, its cache is consistent with a full forward, configs validate."""

import pytest
import torch

from metainfer import models
from metainfer.kernels import fp8_gemm
from metainfer.models import deepseek as ds


@pytest.mark.parametrize("name", ["deepseek-tiny", "deepseek-v32-tiny", "deepseek-v32-tiny-fp8"])
def test_cached_decode_matches_full_forward(name):
    # one token at a time through the latent cache = one forward over the whole sequence
    m = models.build(name)
    (ids,) = models.example_inputs(name, batch=2, seq=7)
    full = m(ids)
    m.setup_cache(2, 7)
    m(ids[:, :4], start_pos=0)
    steps = [m(ids[:, i:i + 1], start_pos=i) for i in range(4, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 4:], atol=1e-4, rtol=1e-4)


def test_generate_and_cache_errors():
    m = models.build("deepseek-tiny")
    (ids,) = models.example_inputs("deepseek-tiny", batch=1, seq=5)
    out = m.generate(ids, 3)
    assert out.shape == (1, 8) and torch.equal(out[:, :5], ids)
    with pytest.raises(ValueError, match="do not fit"):
        m(torch.zeros(1, 9, dtype=torch.long), start_pos=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        m.generate(ids, 0)


def test_routing_is_group_limited_top_k():
    cfg = ds.CONFIGS["deepseek-tiny"]
    gate = ds.Gate(cfg)
    x = torch.randn(50, cfg.dim)
    weights, idx = gate(x)
    per_group = cfg.n_routed_experts // cfg.n_expert_groups
    groups = idx // per_group
    assert idx.shape == (50, cfg.n_activated_experts)
    assert all(len(set(g.tolist())) <= cfg.n_limited_groups for g in groups)
    assert all(len(set(r.tolist())) == cfg.n_activated_experts for r in idx)  # distinct experts
    torch.testing.assert_close(weights.sum(-1), torch.full((50,), cfg.route_scale))


def test_fp8_weights_are_block_quantised():
    m = models.build("deepseek-v32-tiny-fp8")
    lin = m.layers[0].attn.wq_b
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight_scale_inv.dtype == torch.float32
    n, k = lin.weight.shape
    assert lin.weight_scale_inv.shape == (-(-n // 32), -(-k // 32))
    moe = m.layers[1].ffn
    assert moe.w1.dtype == torch.float8_e4m3fn and moe.w1_scale_inv.shape[0] == moe.w1.shape[0]
    # the model's dequantisation is the kernel module's
    torch.testing.assert_close(ds.weight_dequant(lin.weight, lin.weight_scale_inv, 32, torch.float32),
                               fp8_gemm.dequantize(lin.weight, lin.weight_scale_inv, 32, 32, torch.float32))


def test_real_size_configs_are_data():
    v3 = models.config("deepseek-v3")
    assert (v3.dim, v3.n_layers, v3.n_heads, v3.n_routed_experts, v3.n_activated_experts) == (7168, 61, 128, 256, 8)
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_head_dim, v3.v_head_dim, v3.quant_block) == (1536, 512, 192, 128, 128)
    assert models.config("deepseek-v32").index_topk == 2048
    assert models.config("deepseek-v4-flash-like").max_seq_len == 1 << 20
    with torch.device("meta"):  # the real shape builds without memory
        layer = ds.Block(v3, layer=5)
    assert sum(p.numel() for p in layer.parameters()) > 11e9


def test_bad_configs():
    with pytest.raises(ValueError, match="divisible"):
        ds.DeepSeekConfig(n_routed_experts=10, n_expert_groups=4)
    with pytest.raises(ValueError, match="n_activated_experts"):
        ds.DeepSeekConfig(n_routed_experts=8, n_expert_groups=4, n_limited_groups=1, n_activated_experts=3)
    with pytest.raises(ValueError, match="attention"):
        ds.DeepSeekConfig(attention="flash")
