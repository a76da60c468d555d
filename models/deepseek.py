"""A DeepSeek-V3 / V3.2-style decoder in plain PyTorch, written the way day-0 community ports
(and DeepSeek's own reference inference code) write it: nothing fused, every fallback form in
the open. This is the code metainfer's DeepSeek passes are meant to find:

- MLA (multi-head latent attention): queries through a low-rank `q_lora_rank` bottleneck; keys
  and values compressed to a `kv_lora_rank` latent plus one shared rope key. The cache keeps
  only the latent and the rope key (B, T, kv_lora_rank) + (B, T, qk_rope_head_dim); every step,
  prefill or decode, decompresses the whole cache with `wkv_b` and attends over full keys and
  values ("decompress then attend"). Value heads (`v_head_dim`) are narrower than query/key
  heads (`qk_nope_head_dim + qk_rope_head_dim`).
- DSA (DeepSeek Sparse Attention, V3.2): a lightning indexer scores every key for every query,
  keeps the top `index_topk`, and the selection is folded into a dense attention mask
  (-inf everywhere but the selected keys), then ordinary dense attention runs. Attention is
  eager matmul/softmax/matmul, or (`attention="sdpa"`) torch's SDPA with V zero-padded to
  the query head dim and the padding sliced off after, as ports to one-head-dim kernels do.
- MoE: sigmoid router scores plus a bias correction, group-limited top-k routing, routed
  experts computed by a loop over the experts (each one gathers its tokens with
  `torch.where`), plus shared experts; the first `n_dense_layers` layers are dense MLPs.
- FP8: with `fp8=True` every projection and expert weight is float8_e4m3fn with a
  `weight_scale_inv` per block of `quant_block` x `quant_block`, used through the fallback
  "dequantise the weight to the activation dtype, then F.linear".
- MTP (multi-token prediction, `n_mtp_layers`, HF's `num_nextn_predict_layers`): layers that
  predict one token further from the main model's hidden state and the next token, used by
  `generate(..., speculate=)` as the drafter of greedy speculative decoding.

Configs are data: tiny ones for tests, real-size shapes (DeepSeek-V3 671B, a V3.2 / V4-Flash
-like shape) for planning; the real ones are far too large to build here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .llama import RMSNorm


@dataclass(frozen=True)
class DeepSeekConfig:
    vocab_size: int = 129280
    dim: int = 7168
    inter_dim: int = 18432  # dense MLP layers
    moe_inter_dim: int = 2048  # each expert
    n_layers: int = 61
    n_dense_layers: int = 3
    n_heads: int = 128
    # MoE
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 8
    n_expert_groups: int = 8
    n_limited_groups: int = 4
    route_scale: float = 2.5
    # MLA
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    max_seq_len: int = 163840
    norm_eps: float = 1e-6
    # DSA (V3.2): 0 indexer heads = dense attention (V3)
    index_n_heads: int = 0
    index_head_dim: int = 128
    index_topk: int = 2048
    # FP8 block-quantised weights
    fp8: bool = False
    quant_block: int = 128
    # "eager" (matmul/softmax/matmul) or "sdpa" (V zero-padded to the query head dim, as ports
    # to kernels that need one head dim write it)
    attention: str = "eager"
    # multi-token-prediction layers (num_nextn_predict_layers): drafters for speculative decoding
    n_mtp_layers: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def __post_init__(self):
        if self.n_routed_experts % self.n_expert_groups:
            raise ValueError(f"n_routed_experts {self.n_routed_experts} is not divisible by "
                             f"n_expert_groups {self.n_expert_groups}")
        if not 1 <= self.n_limited_groups <= self.n_expert_groups:
            raise ValueError(f"n_limited_groups must be in 1..n_expert_groups, got {self.n_limited_groups}")
        per_group = self.n_routed_experts // self.n_expert_groups
        if not 1 <= self.n_activated_experts <= self.n_limited_groups * per_group:
            raise ValueError(f"n_activated_experts {self.n_activated_experts} must be in 1.."
                             f"{self.n_limited_groups * per_group} (the experts of the limited groups)")
        if self.qk_rope_head_dim % 2 or (self.index_n_heads and self.index_head_dim < self.qk_rope_head_dim):
            raise ValueError("qk_rope_head_dim must be even and at most index_head_dim")
        if self.attention not in ("eager", "sdpa"):
            raise ValueError(f"attention must be 'eager' or 'sdpa', got {self.attention!r}")
        if self.quant_block < 16 or self.quant_block & (self.quant_block - 1):
            raise ValueError(f"quant_block must be a power of two >= 16, got {self.quant_block}")
        if self.n_mtp_layers < 0:
            raise ValueError(f"n_mtp_layers must be >= 0, got {self.n_mtp_layers}")


_TINY = dict(vocab_size=256, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2, n_dense_layers=1, n_heads=4,
             n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, n_expert_groups=4,
             n_limited_groups=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=12, max_seq_len=512)

CONFIGS = {
    # tests: 2 layers (one dense, one MoE), 4 heads, q/k head 24, v head 12, 8 experts top-2
    "deepseek-tiny": DeepSeekConfig(**_TINY),
    # the same with DSA: 2 indexer heads, top-8 keys per query
    "deepseek-v32-tiny": DeepSeekConfig(**_TINY, index_n_heads=2, index_head_dim=16, index_topk=8),
    # FP8 weights in 32x32 blocks (hidden 64: two blocks per row), with DSA
    "deepseek-v32-tiny-fp8": DeepSeekConfig(**_TINY, index_n_heads=2, index_head_dim=16, index_topk=8,
                                            fp8=True, quant_block=32),
    # real shapes, for planning; too big to build here.
    # DeepSeek-V3 671B (config.json of deepseek-ai/DeepSeek-V3), FP8 128x128 blocks, one MTP layer
    "deepseek-v3": DeepSeekConfig(fp8=True, n_mtp_layers=1),
    # V3.2-Exp: V3's shape plus the DSA indexer (64 heads of 128, top-2048)
    "deepseek-v32": DeepSeekConfig(fp8=True, index_n_heads=64, index_head_dim=128, index_topk=2048, n_mtp_layers=1),
    # V4-Flash-like: transformers' DeepseekV4Config defaults (hidden 4096, 43 layers, 64 heads,
    # q_lora 1024, 256 experts top-6 of 2048, indexer 64x128 top-512, 1M context) expressed in
    # this V3.2 architecture (V4's compressed attention and hyper-connections are not modelled)
    "deepseek-v4-flash-like": DeepSeekConfig(dim=4096, inter_dim=2048 * 6, moe_inter_dim=2048, n_layers=43,
                                             n_dense_layers=0, n_heads=64, n_activated_experts=6,
                                             route_scale=1.5, q_lora_rank=1024, max_seq_len=1 << 20,
                                             index_n_heads=64, index_head_dim=128, index_topk=512, fp8=True),
}


# ---- FP8 block-quantised linear layers: the fallback form ---------------------------------

def weight_dequant(w: torch.Tensor, scale_inv: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """(N, K) float8 weight -> `dtype`: each block x block tile times its scale."""
    n, k = w.shape
    s = scale_inv.repeat_interleave(block, dim=0)[:n].repeat_interleave(block, dim=1)[:, :k]
    return (w.to(torch.float32) * s).to(dtype)


class Linear(nn.Linear):
    """nn.Linear without bias whose weight may be FP8 with per-block scales (an nn.Linear,
    so torch's tensor-parallel styles shard it)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        nn.init.normal_(self.weight, std=in_features ** -0.5)
        self.block = 0  # > 0 once quantised

    def reset_parameters(self) -> None:
        pass  # initialised above (normal, std in^-1/2); nn.Linear's own init would draw extra numbers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block:
            return F.linear(x, weight_dequant(self.weight, self.weight_scale_inv, self.block, x.dtype))
        return F.linear(x, self.weight)


# ---- rope (interleaved pairs, as DeepSeek's complex-number form) ---------------------------

def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (B, S, H, P); cos/sin (S, P/2): pairs (x0, x1), (x2, x3), ... each rotated by one angle
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


# ---- attention: MLA with an optional DSA indexer -------------------------------------------

class Indexer(nn.Module):
    """DSA's lightning indexer: index_score[b, s, t] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, t]);
    returns the top-k key positions per query."""

    def __init__(self, cfg: DeepSeekConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = Linear(cfg.dim, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim)
        self.weights_proj = nn.Linear(cfg.dim, self.n_heads, bias=False)
        self.k_cache: torch.Tensor | None = None

    def forward(self, x, qr, cos, sin, start_pos, mask):
        b, s, _ = x.shape
        end = (start_pos or 0) + s
        q = self.wq_b(qr).view(b, s, self.n_heads, self.head_dim)
        q_pe, q_nope = torch.split(q, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q = torch.cat([apply_rope(q_pe, cos, sin), q_nope], dim=-1)
        k = self.k_norm(self.wk(x))
        k_pe, k_nope = torch.split(k, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k = torch.cat([apply_rope(k_pe.unsqueeze(2), cos, sin).squeeze(2), k_nope], dim=-1)
        if start_pos is not None:
            self.k_cache[:b, start_pos:end] = k
            k = self.k_cache[:b, :end]
        weights = self.weights_proj(x) * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        score = torch.einsum("bshd,btd->bsht", q.float(), k.float()).relu()
        index_score = (score * weights.float().unsqueeze(-1)).sum(dim=2)  # (B, S, T)
        if mask is not None:
            index_score = index_score + mask
        return index_score.topk(min(self.topk, end), dim=-1)[1]  # (B, S, topk)


class MLA(nn.Module):
    def __init__(self, cfg: DeepSeekConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.n_heads * cfg.qk_head_dim)
        self.wkv_a = Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = Linear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.wo = Linear(cfg.n_heads * cfg.v_head_dim, cfg.dim)
        self.softmax_scale = cfg.qk_head_dim ** -0.5
        self.sdpa = cfg.attention == "sdpa"
        self.indexer = Indexer(cfg) if cfg.index_n_heads else None
        self.kv_cache: torch.Tensor | None = None  # (B, max_len, kv_lora_rank): the latent
        self.pe_cache: torch.Tensor | None = None  # (B, max_len, qk_rope_head_dim)

    def forward(self, x, cos, sin, start_pos: int | None, mask):
        # start_pos None: a standalone sequence, the cache is neither read nor written
        b, s, _ = x.shape
        past = 0 if start_pos is None else start_pos
        end = past + s
        qr = self.q_norm(self.wq_a(x))
        # heads from the projection's width: under tensor parallelism each rank has its share
        q = self.wq_b(qr).view(b, s, -1, self.nope + self.rope_dim)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin)
        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_norm(kv)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin).squeeze(2)
        if start_pos is not None:  # the cache keeps the compressed latent and the rope key
            self.kv_cache[:b, start_pos:end] = kv
            self.pe_cache[:b, start_pos:end] = k_pe
            kv, k_pe = self.kv_cache[:b, :end], self.pe_cache[:b, :end]
        # decompress every cached token, then attend over full keys and values
        kv = self.wkv_b(kv).view(b, end, -1, self.nope + self.v_dim)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S|T, D)
        if self.indexer is not None:  # DSA: the top-k selection folded into the mask
            topk = self.indexer(x, qr, cos, sin, start_pos, mask)
            index_mask = torch.full((b, s, end), float("-inf"), device=x.device).scatter_(-1, topk, 0)
            mask = index_mask if mask is None else index_mask + mask
            mask = mask.unsqueeze(1)  # (B, 1, S, T)
        if self.sdpa:  # SDPA wants one head dim: pad V to the query's, drop the padding after
            v = F.pad(v, [0, q.shape[-1] - self.v_dim])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
            out = out[..., :self.v_dim]
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) * self.softmax_scale  # (B, H, S, T)
            if mask is not None:
                scores = scores + mask
            scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
            out = torch.matmul(scores, v)  # (B, H, S, v_head_dim)
        return self.wo(out.transpose(1, 2).flatten(2))


# ---- feed-forward: dense MLP and MoE -------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, inter_dim), Linear(inter_dim, dim), Linear(dim, inter_dim)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Gate(nn.Module):
    """Sigmoid scores, bias-corrected for the choice only, top groups by their best two
    experts, then the top-k experts of those groups; weights renormalised and scaled."""

    def __init__(self, cfg: DeepSeekConfig):
        super().__init__()
        self.topk, self.n_groups, self.topk_groups = cfg.n_activated_experts, cfg.n_expert_groups, cfg.n_limited_groups
        self.route_scale = cfg.route_scale
        self.weight = nn.Parameter(torch.randn(cfg.n_routed_experts, cfg.dim) * cfg.dim ** -0.5)
        self.register_buffer("bias", torch.randn(cfg.n_routed_experts) * 0.1, persistent=True)

    def forward(self, x):
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # (T, E)
        original = scores
        scores = scores + self.bias
        groups = scores.view(x.size(0), self.n_groups, -1)
        group_scores = groups.topk(min(2, groups.size(-1)), dim=-1)[0].sum(dim=-1)  # (T, G)
        keep = group_scores.topk(self.topk_groups, dim=-1)[1]
        group_mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        scores = groups.masked_fill(group_mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = scores.topk(self.topk, dim=-1)[1]  # (T, k)
        weights = original.gather(1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.route_scale
        return weights.type_as(x), indices


class MoE(nn.Module):
    def __init__(self, cfg: DeepSeekConfig):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.gate = Gate(cfg)
        # routed experts' weights stacked per projection: w1 gate, w3 up (E, I, dim), w2 down (E, dim, I)
        E, D, I = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim
        self.w1 = nn.Parameter(torch.randn(E, I, D) * D ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, I, D) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, I) * I ** -0.5)
        self.block = 0  # > 0 once quantised: w*_scale_inv (E, ceil(N/block), ceil(K/block))
        self.shared_experts = MLP(cfg.dim, cfg.n_shared_experts * cfg.moe_inter_dim)
        self.expert_offset, self.combine = 0, None  # set by shard_experts (expert parallelism)

    def expert_weight(self, name: str, i: int, dtype) -> torch.Tensor:
        w = getattr(self, name)[i]
        if self.block:
            return weight_dequant(w, getattr(self, f"{name}_scale_inv")[i], self.block, dtype)
        return w

    def forward(self, x):
        shape = x.shape
        x = x.view(-1, shape[-1])
        weights, indices = self.gate(x)
        if self.expert_offset:  # expert parallelism: ids of this rank's experts count from 0
            indices = indices - self.expert_offset
        y = torch.zeros_like(x)
        for i in range(self.w1.shape[0]):  # the fallback: one (local) expert at a time
            idx, top = torch.where(indices == i)
            h = x[idx]
            h = F.silu(F.linear(h, self.expert_weight("w1", i, x.dtype))) * F.linear(h, self.expert_weight("w3", i, x.dtype))
            y.index_add_(0, idx, F.linear(h, self.expert_weight("w2", i, x.dtype)) * weights[idx, top, None])
        if self.combine is not None:  # expert parallelism: every rank's experts' share summed
            y = self.combine(y)
        return (y + self.shared_experts(x)).view(shape)

    def shard_experts(self, rank: int, world: int, group) -> None:
        """Expert parallelism: keep experts [rank E/world, (rank+1) E/world) here (weights and
        FP8 scales); the routed outputs of all ranks are summed by an all-reduce."""
        from torch.distributed import _functional_collectives as funcol

        if self.n_experts % world:
            raise ValueError(f"{self.n_experts} experts do not split over {world} ranks")
        per = self.n_experts // world
        lo = rank * per
        for name in ("w1", "w2", "w3", "w1_scale_inv", "w2_scale_inv", "w3_scale_inv"):
            t = getattr(self, name, None)
            if t is not None:
                setattr(self, name, nn.Parameter(t.detach()[lo:lo + per].clone(), requires_grad=False))
        self.expert_offset = lo
        self.combine = lambda y: funcol.all_reduce(y, "sum", group)


class Block(nn.Module):
    def __init__(self, cfg: DeepSeekConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = MLA(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = MLP(cfg.dim, cfg.inter_dim) if layer < cfg.n_dense_layers else MoE(cfg)

    def forward(self, x, cos, sin, start_pos, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, start_pos, mask)
        return x + self.ffn(self.ffn_norm(x))


def rope(cfg: DeepSeekConfig, start: int, end: int, device):
    """cos, sin (S, P/2), float32, of positions start..end-1."""
    d, theta = cfg.qk_rope_head_dim, cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(start, end, device=device, dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()


def causal_mask(s: int, past: int, device) -> torch.Tensor | None:
    """(S, past + S) additive mask, None for one query: query i (position past + i) keeps key j
    iff j <= past + i."""
    if s == 1:
        return None
    return torch.full((s, past + s), float("-inf"), device=device).triu_(past + 1)


def check_cache(cfg: DeepSeekConfig, attn: MLA, b: int, s: int, start_pos: int | None) -> None:
    past = 0 if start_pos is None else start_pos
    if past + s > cfg.max_seq_len:
        raise ValueError(f"sequence length {past + s} exceeds max_seq_len {cfg.max_seq_len}")
    if start_pos is not None:
        cache = attn.kv_cache
        if cache is None:
            raise ValueError("start_pos given but no cache: call setup_cache(batch, max_len) first")
        if b > cache.shape[0] or past + s > cache.shape[1]:
            raise ValueError(f"{b} x {past + s} tokens do not fit the cache of {cache.shape[0]} x "
                             f"{cache.shape[1]}; call setup_cache again")


class MTPLayer(nn.Module):
    """One multi-token-prediction depth (DeepSeek-V3 report, section 2.2): at position i it
    reads the previous depth's hidden state h_i and the token t_{i+1}, and predicts t_{i+2}:
    x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]), then one decoder block with its own cache;
    logits through the shared head after this layer's norm."""

    def __init__(self, cfg: DeepSeekConfig):
        super().__init__()
        self.enorm, self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps), RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = Linear(2 * cfg.dim, cfg.dim)
        self.block = Block(cfg, cfg.n_layers)  # numbered after the main layers: an MoE block, as DeepSeek-V3's
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class MTP(nn.Module):
    """The MTP layers, sharing the main model's embedding and head; a module of its own so
    that a draft step is one call (metainfer compiles and times it as the drafter)."""

    def __init__(self, cfg: DeepSeekConfig, embed: nn.Embedding, head: nn.Linear):
        super().__init__()
        self.config = cfg
        self.embed, self.head = embed, head  # the main model's: DeepSeek-V3 shares them with the MTP
        self.layers = nn.ModuleList(MTPLayer(cfg) for _ in range(cfg.n_mtp_layers))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, start_pos: int | None = None,
                depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (B, S, dim) at positions start_pos.., tokens (B, S) the token after each ->
        (logits (B, S, vocab) for the token after those, the layer's hidden (B, S, dim))."""
        if not 0 <= depth < len(self.layers):
            raise ValueError(f"MTP depth {depth} not in 0..{len(self.layers) - 1}")
        layer = self.layers[depth]
        b, s = tokens.shape
        check_cache(self.config, layer.block.attn, b, s, start_pos)
        past = 0 if start_pos is None else start_pos
        x = layer.eh_proj(torch.cat([layer.enorm(self.embed(tokens)), layer.hnorm(hidden)], dim=-1))
        cos, sin = rope(self.config, past, past + s, tokens.device)
        x = layer.block(x, cos, sin, start_pos, causal_mask(s, past, tokens.device))
        return self.head(layer.norm(x)), x


class DeepSeek(nn.Module):
    # tensor parallelism (metainfer.parallel.sharding): MLA heads (q_b, kv_b, o) and the dense and
    # shared-expert MLPs split; the latent projections and router stay whole on every rank;
    # routed experts stay whole too, or are spread over the ranks (MoE.shard_experts) when
    # expert parallelism is on. MTP layers are not in the plan: whole on every rank.
    TP_PLAN = {"layers.*.attn.wq_b": "colwise", "layers.*.attn.wkv_b": "colwise", "layers.*.attn.wo": "rowwise",
               "layers.*.ffn.w1": "colwise", "layers.*.ffn.w3": "colwise", "layers.*.ffn.w2": "rowwise",
               "layers.*.ffn.shared_experts.w1": "colwise", "layers.*.ffn.shared_experts.w3": "colwise",
               "layers.*.ffn.shared_experts.w2": "rowwise"}

    def __init__(self, cfg: DeepSeekConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # built last: the main model's weights are the same for a seed with or without MTP
        self.mtp = MTP(cfg, self.embed, self.head) if cfg.n_mtp_layers else None

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (Hugging Face's name for it): callers read the vocabulary here."""
        return self.embed

    def setup_cache(self, batch: int, max_len: int) -> None:
        """Allocate each layer's latent cache (and indexer key cache) for `batch` x `max_len`,
        the MTP layers' too."""
        cfg = self.config
        if not 0 < max_len <= cfg.max_seq_len:
            raise ValueError(f"cache length {max_len} must be in 1..max_seq_len ({cfg.max_seq_len})")
        dtype, device = self.embed.weight.dtype, self.embed.weight.device
        blocks = list(self.layers) + ([m.block for m in self.mtp.layers] if self.mtp is not None else [])
        for layer in blocks:
            a = layer.attn
            a.kv_cache = torch.zeros(batch, max_len, cfg.kv_lora_rank, dtype=dtype, device=device)
            a.pe_cache = torch.zeros(batch, max_len, cfg.qk_rope_head_dim, dtype=dtype, device=device)
            if a.indexer is not None:
                a.indexer.k_cache = torch.zeros(batch, max_len, cfg.index_head_dim, dtype=dtype, device=device)

    def forward(self, tokens: torch.Tensor, start_pos: int | None = None, return_hidden: bool = False):
        """Logits (B, S, vocab). With `start_pos` the tokens continue the cached sequence.
        `return_hidden`: (logits, the final-normed hidden state the head reads, (B, S, dim)),
        what the MTP layers read."""
        b, s = tokens.shape
        check_cache(self.config, self.layers[0].attn, b, s, start_pos)
        past = 0 if start_pos is None else start_pos
        x = self.embed(tokens)
        cos, sin = rope(self.config, past, past + s, tokens.device)
        mask = causal_mask(s, past, tokens.device)
        for layer in self.layers:
            x = layer(x, cos, sin, start_pos, mask)
        x = self.norm(x)
        return (self.head(x), x) if return_hidden else self.head(x)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, speculate=None) -> torch.Tensor:
        """Greedy decoding with the latent cache: (B, S) prompt -> (B, S + max_new_tokens).

        `speculate`: speculative decoding with the MTP layers as the drafter (batch 1): an int,
        the tokens drafted per step, or a policy, an object with `draft_length() -> int`
        (asked before each draft) and `verified(drafted, accepted)` (told after each verify).
        The tokens are the same as without: a draft is kept only where the main model's own
        greedy choice agrees."""
        b, s = prompt.shape
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        policy = self._policy(speculate, b)
        if policy is not None:
            return self._generate_speculative(prompt, max_new_tokens, policy)
        self.setup_cache(b, s + max_new_tokens)
        logits = self(prompt, start_pos=0)
        out = [prompt]
        for i in range(max_new_tokens):
            tok = logits[:, -1].argmax(-1, keepdim=True)
            out.append(tok)
            if i + 1 < max_new_tokens:
                logits = self(tok, start_pos=s + i)
        return torch.cat(out, dim=1)

    def _policy(self, speculate, batch: int):
        if speculate is None or (isinstance(speculate, int) and not isinstance(speculate, bool) and speculate == 0):
            return None
        if isinstance(speculate, int) and not isinstance(speculate, bool):
            if speculate < 0:
                raise ValueError(f"speculate must be a draft length >= 0 or a policy, got {speculate}")
            policy = _FixedDraft(speculate)
        elif callable(getattr(speculate, "draft_length", None)) and callable(getattr(speculate, "verified", None)):
            policy = speculate
        else:
            raise TypeError("speculate must be an int (tokens drafted per step) or an object with draft_length() "
                            f"and verified(drafted, accepted), not {type(speculate).__name__}")
        if self.mtp is None:
            raise ValueError("speculative decoding drafts with the MTP layers, and this config has none "
                             "(n_mtp_layers=0)")
        if batch != 1:
            raise ValueError(f"speculative decoding runs one sequence at a time: batch 1, got {batch}")
        return policy

    def _generate_speculative(self, prompt: torch.Tensor, max_new_tokens: int, policy) -> torch.Tensor:
        """Each step verifies [last token, drafts] in one forward at positions pos..pos+k and
        keeps the drafts up to the first the model disagrees with, then the model's own next
        token: the tokens of plain greedy decoding (up to rounding: a forward over k + 1 tokens
        and one over 1 may round differently). Cache entries past the kept tokens are
        overwritten by the next step before they are read (every forward writes its positions
        before attending), so nothing rolls back. The last token needs no draft: that step
        does not ask the policy."""
        s = prompt.shape[1]
        self.setup_cache(1, s + max_new_tokens)
        logits, hidden = self(prompt, start_pos=0, return_hidden=True)
        tok = logits[:, -1:].argmax(-1)
        out, new, pos = [prompt, tok], 1, 0
        kept, carry = torch.cat([prompt[:, 1:], tok], 1), None  # the prompt's next tokens
        while new < max_new_tokens:
            # the MTP continues over the positions just kept (pos.., each with the token after it)
            k = _draft_length(policy, max_new_tokens - new) if max_new_tokens - new > 1 else 0
            drafts, carry = self._draft(hidden, kept, pos, k, carry)
            tok, pos = kept[:, -1:], pos + kept.shape[1]  # tok's position: not in the cache yet
            logits, hidden = self(torch.cat([tok, drafts], 1), start_pos=pos, return_hidden=True)
            best = logits.argmax(-1)  # (1, k + 1): the model's own choice after each token
            m = int((drafts == best[:, :k]).cumprod(1).sum())  # leading drafts it agrees with
            if max_new_tokens - new > 1:
                policy.verified(k, m)
            kept, hidden = best[:, :m + 1], hidden[:, :m + 1]  # drafts 1..m (= best there), its next token
            out.append(kept)
            new += m + 1
        return torch.cat(out, 1)

    def _draft(self, hidden: torch.Tensor, next_tokens: torch.Tensor, start: int, k: int, carry):
        """(k draft tokens (1, k) after next_tokens[:, -1], the carry for the next call).

        hidden: the main model's at positions start..start+L-1, next_tokens the token after
        each. MTP layer 0 at position i reads (h_i, t_{i+1}); layer j > 0 reads layer j-1's
        output at i - 1 and t_{i+1} (DeepSeek-V3's chaining, each layer's positions shifted by
        its depth: attention is relative, so the same). Every layer runs over the new
        positions, and layer j j positions further on its way from drafts 1..j, whose entries
        the next call overwrites; so each layer's cache is whole. Layer j gives draft j + 1;
        further drafts chain the last layer one position at a time. `carry`: each layer's
        output at position start - 1 (zeros before position 0). A step drafting 0 tokens
        skips the MTP: its caches keep holes there (later drafts may be worse; outputs never
        change)."""
        if k == 0:
            return next_tokens[:, :0], None
        layers = len(self.mtp.layers)
        last = next_tokens.shape[1] - 1
        drafts, outs, tokens = [], [], next_tokens
        for j in range(layers):
            if j:
                before = carry[j - 1] if carry is not None else torch.zeros_like(h[:, :1])
                hidden, tokens = torch.cat([before, h], 1), torch.cat([tokens, drafts[-1]], 1)
            logits, h = self.mtp(hidden, tokens, start_pos=start, depth=j)
            outs.append(h[:, last:last + 1])  # at start + L - 1: final, the next call's carry
            drafts.append(logits[:, -1:].argmax(-1))
        pos = start + tokens.shape[1] - 1
        while len(drafts) < k:
            pos += 1
            logits, h = self.mtp(h[:, -1:], drafts[-1], start_pos=pos, depth=layers - 1)
            drafts.append(logits.argmax(-1))
        return torch.cat(drafts[:k], 1), outs


class _FixedDraft:
    """A fixed draft length, as a speculate= policy."""

    def __init__(self, k: int):
        self.k = k

    def draft_length(self) -> int:
        return self.k

    def verified(self, drafted: int, accepted: int) -> None:
        pass


def _draft_length(policy, remaining: int) -> int:
    """The policy's draft length, capped so that a step cannot pass the tokens asked for."""
    k = policy.draft_length()
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"a draft length must be an integer >= 0, got {k!r} from {type(policy).__name__}")
    return min(k, remaining - 1)


def quantize_fp8_(model: DeepSeek, block: int) -> DeepSeek:
    """Replace every projection and expert weight by float8_e4m3fn + per-block scales
    (amax / 448 per block), in place; the router, norms, embedding and head stay as they are."""
    from metainfer.kernels.fp8_gemm import quantize_weight

    for m in model.modules():
        if isinstance(m, Linear):
            w, s = quantize_weight(m.weight.detach().float(), block, block)
            m.weight = nn.Parameter(w, requires_grad=False)
            m.weight_scale_inv = nn.Parameter(s, requires_grad=False)
            m.block = block
        elif isinstance(m, MoE):
            for name in ("w1", "w2", "w3"):
                pairs = [quantize_weight(w.float(), block, block) for w in getattr(m, name).detach()]
                setattr(m, name, nn.Parameter(torch.stack([w for w, _ in pairs]), requires_grad=False))
                setattr(m, f"{name}_scale_inv", nn.Parameter(torch.stack([s for _, s in pairs]), requires_grad=False))
            m.block = block
    return model


def build(name_or_config: "str | DeepSeekConfig" = "deepseek-tiny", *, dtype=torch.float32, device="cpu",
          seed: int = 0, **overrides) -> DeepSeek:
    """A randomly initialised model in eval mode; FP8 configs are quantised after the cast to
    `dtype` (a later `.to(dtype)` would cast the FP8 weights too)."""
    cfg = CONFIGS[name_or_config] if isinstance(name_or_config, str) else name_or_config
    if overrides:
        cfg = replace(cfg, **overrides)
    # on "meta" the weights are never allocated: real-size configs can be analysed anywhere
    with torch.random.fork_rng(devices=[]), torch.device("meta" if str(device) == "meta" else "cpu"):
        torch.manual_seed(seed)
        model = DeepSeek(cfg)
    model = model.to(device=device, dtype=dtype).eval()
    for m in model.modules():  # the router and its bias stay float32, as DeepSeek keeps them
        if isinstance(m, Gate):
            m.float()
    if cfg.fp8:
        quantize_fp8_(model, cfg.quant_block)
    return model


def example_inputs(cfg: DeepSeekConfig, batch: int = 1, seq: int = 32, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device),)
