"""metainfer.parallel.sharding: every tensor-parallel style name Hugging Face's plans use, applied on 2
gloo ranks to a small model that uses them all and compared with the unsharded model; styles
that cannot be honoured, and K/V heads that can neither split nor replicate, refused by name
before any collective."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metainfer.parallel import multirank, sharding
from metainfer.testing import tiny_hf_model

TIMEOUT_S = int(os.environ.get("METAINFER_TEST_RANK_TIMEOUT", 240))


class _Mix(nn.Module):
    """A module whose output is a partial sum on each rank: its own weight `w` is split along
    its input dim (a plan entry naming a bare parameter) and `inner` colwise."""

    def __init__(self, d):
        super().__init__()
        self.inner = nn.Linear(d, 2 * d)
        self.w = nn.Parameter(torch.randn(d, 2 * d) / d)
        self.gain = nn.Parameter(torch.randn(2 * d))  # per-unit, like attention sinks: split with inner's outputs

    def forward(self, x):
        return (self.inner(x) * self.gain) @ self.w.t()


class StyleZoo(nn.Module):
    TP_PLAN = {"embed": "embedding_rowwise", "embed2": "embedding_colwise", "up": "colwise_gather_output",
               "down": "rowwise_split_input", "gate_up": "packed_colwise", "down2": "rowwise",
               "norm": "sequence_parallel", "mix": "all_reduce", "mix.inner": "colwise", "mix.w": "rowwise",
               "mix.gain": "colwise", "head_norm": "replicated_with_grad_allreduce", "gate_up2": "colwise_rep",
               "down3": "rowwise_rep", "up4": "unit_colwise", "down4": "unit_rowwise"}

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.embed, self.embed2 = nn.Embedding(vocab, d), nn.Embedding(vocab, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gate_up, self.down2 = nn.Linear(d, 8 * d), nn.Linear(4 * d, d)  # packed, with a bias
        self.gate_up2, self.down3 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.up4, self.down4 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.norm, self.head_norm = nn.LayerNorm(d), nn.RMSNorm(d)
        self.mix = _Mix(d)
        self.lm = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.embed2(ids)
        x = x + self.down(F.gelu(self.up(x)))
        g, u = self.gate_up(x).chunk(2, -1)
        x = x + self.down2(F.silu(g) * u)
        x = x + self.down3(torch.tanh(self.gate_up2(x)))
        x = x + self.down4(F.relu(self.up4(x)))
        x = self.norm(x)
        x = x + self.mix(x)
        return self.lm(self.head_norm(x))


def zoo_run(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = StyleZoo().eval()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids)
        sharding.shard(model, init_device_mesh("cpu", (world,)))
        out = model(ids)
    local = {n: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape) for n, p in model.named_parameters()}
    return (out - ref).abs().max().item(), local


def test_every_style_name_on_two_ranks():
    results = multirank.run(zoo_run, 2, timeout_s=TIMEOUT_S)
    for diff, local in results:
        assert diff < 1e-5, diff
        assert local["embed.weight"] == (16, 16)  # vocabulary split
        assert local["embed2.weight"] == (32, 8)  # hidden split
        assert local["gate_up.weight"] == (64, 16)  # this rank's gate and up rows
        assert local["mix.w"] == (16, 16)  # a bare parameter: its chunk
        assert local["mix.gain"] == (16,)
        assert local["gate_up.bias"] == (64,)
        assert local["head_norm.weight"] == (16,)  # gradients-only style: whole


def test_styles_that_cannot_be_honoured_are_named():
    class Deprecated(StyleZoo):
        TP_PLAN = {"up": "colwise", "down": "moe_tp_experts"}

    with pytest.raises(ValueError, match=r"moe_tp_experts.*expert_parallel=True"):
        sharding.check_shardable(Deprecated(), 2)

    class Unknown(StyleZoo):
        TP_PLAN = {"up": "diagonal"}

    with pytest.raises(ValueError, match=r"\['diagonal'\]"):
        sharding.check_shardable(Unknown(), 2)

    class PackedRows(StyleZoo):
        TP_PLAN = {"down2": "packed_rowwise"}

    with pytest.raises(ValueError, match="packed_rowwise.*expert_parallel=True"):
        sharding.check_shardable(PackedRows(), 2)

    class BiasSplit(StyleZoo):
        TP_PLAN = {"up": "colwise", "down.bias": "rowwise"}

    with pytest.raises(ValueError, match="names the parameter down.bias"):
        sharding.check_shardable(BiasSplit(), 2)


def test_kv_heads_that_neither_split_nor_replicate_are_refused():
    model = tiny_hf_model("Llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    with pytest.raises(ValueError, match="2 key-value heads neither split over nor replicate onto.*3"):
        sharding.check_shardable(model, 3)
    assert sharding.check_shardable(model, 2)  # 3 query heads over 1 KV head per rank
    with pytest.raises(ValueError, match="6 attention heads .* do not split over tensor-parallel degree 4"):
        sharding.check_shardable(model, 4)
    more_kv = tiny_hf_model("Llama", num_attention_heads=12, num_key_value_heads=6, hidden_size=96)
    with pytest.raises(ValueError, match="6 key-value heads neither split over nor replicate onto.*4"):
        sharding.check_shardable(more_kv, 4)  # 12 query heads split, but 6 KV heads neither split nor replicate
    fused = tiny_hf_model("Llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    attn = fused.model.layers[0].self_attn
    attn.k_proj = torch.nn.Linear(64, 3 * 16, bias=False)  # not 2 heads of 16: which rows are a head?
    with pytest.raises(ValueError, match="48 output features, not 2 key-value heads of 16"):
        sharding.check_shardable(fused, 4)


def test_the_planner_spreads_hugging_face_experts():
    """Qwen3-30B-A3B's shape on meta, pcie8: its experts stay whole under the tensor-parallel
    plan (they are in its expert-parallel plan), so with tp 8 only the plan that spreads them
    runs, as for models/ DeepSeek."""
    import transformers

    from metainfer.parallel import distributed
    from metainfer.hardware import targets

    cfg = transformers.Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                      num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                                      moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert sharding.has_experts(model)
    sharding.check_expert_parallel(model, 8)  # 128 experts, every per-expert weight in the plan
    with pytest.raises(ValueError, match="128 experts do not split over 3 ranks"):
        sharding.check_expert_parallel(model, 3)
    d = distributed.choose_degrees(model, targets.get("pcie8"), 8)
    assert (d.tp, d.expert_parallel) == (8, True), d.why
    assert d.why.startswith("degrees: tp8 ep8")
    experts = next(m for _, m in sharding.hf_expert_modules(model))
    experts.register_parameter("scale", torch.nn.Parameter(torch.ones(128, 4, device="meta")))
    with pytest.raises(ValueError, match=r"but not \['scale'\]: cannot spread its experts"):
        sharding.check_expert_parallel(model, 8)  # read with local ids, it would be wrong: refused
