"""A Llama-style decoder in plain PyTorch, written the way day-0 community ports are:
hand-written RMSNorm, SwiGLU MLP, rotate-half RoPE, eager attention with `repeat_kv` and a
causal mask built with tril + masked_fill in the forward, a KV cache written in place and a
greedy `generate` loop (prefill, then one token at a time) as Meta's reference code has them.
Nothing here is fused: this is the code metainfer's passes are meant to find.

Configs are data: tiny ones for tests and real-size shapes (Llama-3 8B/70B) for planning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    attention: str = "eager"  # "eager" (matmul/softmax/matmul, the day-0 form) or "sdpa"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.attention not in ("eager", "sdpa"):
            raise ValueError(f"attention must be 'eager' or 'sdpa', got {self.attention!r}")


CONFIGS = {
    # tests: 2 layers, GQA 4:2, head dim 16
    "llama-tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176,
                              max_seq_len=256),
    # demo / CPU benchmark: hidden 256, 8 heads / 2 kv heads (the shape of facts.md's baselines)
    "llama-small": LlamaConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=704,
                               max_seq_len=16384),
    # real shapes (Meta Llama 3 model cards / params.json), for planning; too big to build here
    "llama3-8b": LlamaConfig(),
    "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    # (B, Hkv, S, D) -> (B, Hkv * n_rep, S, D), head h reads kv head h // n_rep
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class KVCache(nn.Module):
    """Keys and values of the tokens seen so far, preallocated for (batch, max_len) as Meta's
    reference code keeps them: (B, Hkv, max_len, D) buffers written in place."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        self.register_buffer("k", torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v", torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device),
                             persistent=False)

    def update(self, start_pos: int, k: torch.Tensor, v: torch.Tensor):
        # write this step's (B, Hkv, S, D) at start_pos; return everything up to it
        b, _, s, _ = k.shape
        self.k[:b, :, start_pos:start_pos + s] = k
        self.v[:b, :, start_pos:start_pos + s] = v
        return self.k[:b, :, :start_pos + s], self.v[:b, :, :start_pos + s]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.sdpa = cfg.attention == "sdpa"
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # heads from the projections' widths: under tensor parallelism each rank has its share
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        past = 0
        if start_pos is not None:  # decode with the cache: attend over everything so far
            k, v = self.cache.update(start_pos, k, v)  # (B, Hkv, start_pos + S, D)
            past = start_pos
        if self.sdpa:  # what a user would write instead: torch's fused attention
            if s == 1:  # one new token sees everything: no mask
                out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            elif past == 0:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_mask(s, past, x.device),
                                                     enable_gqa=True)
            return self.wo(out.transpose(1, 2).reshape(b, s, -1))
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, H, S, past + S)
        if s > 1:  # one new token sees the whole cache: no mask
            scores = scores.masked_fill(~_causal_mask(s, past, x.device), float("-inf"))
        probs = F.softmax(scores.float(), dim=-1).type_as(q)
        out = torch.matmul(probs, v)  # (B, H, S, D)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def _causal_mask(s: int, past: int, device) -> torch.Tensor:
    # query i (position past + i) keeps key j iff j <= past + i
    return torch.ones(s, past + s, dtype=torch.bool, device=device).tril(diagonal=past)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, start_pos=None):
        h = x + self.attention(self.attention_norm(x), cos, sin, start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    # tensor parallelism (metainfer.parallel.sharding): heads and the MLP's hidden units split
    TP_PLAN = {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
               "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
               "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
               "layers.*.feed_forward.w2": "rowwise"}

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (Hugging Face's name for it): callers read the vocabulary here."""
        return self.tok_embeddings

    def rope(self, start: int, end: int, device, dtype):
        # positions start..end-1, in float32 whatever the model dtype, as the reference implementations do
        d, theta = self.config.head_dim, self.config.rope_theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
        pos = torch.arange(start, end, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # (S, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (S, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def setup_cache(self, batch: int, max_len: int) -> None:
        """Allocate each layer's KV cache for `batch` sequences of up to `max_len` tokens."""
        if not 0 < max_len <= self.config.max_seq_len:
            raise ValueError(f"cache length {max_len} must be in 1..max_seq_len ({self.config.max_seq_len})")
        p = self.output.weight
        for layer in self.layers:
            wk = layer.attention.wk.weight
            local = wk.to_local() if hasattr(wk, "to_local") else wk  # this rank's kv heads under TP
            layer.attention.cache = KVCache(batch, local.shape[0] // self.config.head_dim, max_len,
                                            self.config.head_dim, p.dtype, p.device)

    def forward(self, tokens: torch.Tensor, start_pos: int | None = None) -> torch.Tensor:
        """Logits (B, S, vocab) for tokens (B, S). Without `start_pos` the sequence stands
        alone; with it, the tokens continue a sequence whose first `start_pos` tokens are in
        the KV cache (see setup_cache), and are added to it."""
        b, s = tokens.shape
        past = 0 if start_pos is None else start_pos
        if past + s > self.config.max_seq_len:
            raise ValueError(f"sequence length {past + s} exceeds max_seq_len {self.config.max_seq_len}")
        if start_pos is not None:
            cache = self.layers[0].attention.cache
            if cache is None:
                raise ValueError("start_pos given but no KV cache: call setup_cache(batch, max_len) first")
            if b > cache.k.shape[0] or past + s > cache.k.shape[2]:
                raise ValueError(f"{b} x {past + s} tokens do not fit the KV cache of "
                                 f"{cache.k.shape[0]} x {cache.k.shape[2]}; call setup_cache again")
        x = self.tok_embeddings(tokens)  # (B, S, dim)
        cos, sin = self.rope(past, past + s, tokens.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, start_pos)
        return self.output(self.norm(x))  # (B, S, vocab)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding with the KV cache: (B, S) prompt -> (B, S + max_new_tokens)."""
        b, s = prompt.shape
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self.setup_cache(b, s + max_new_tokens)
        logits = self(prompt, start_pos=0)  # prefill
        out = [prompt]
        for i in range(max_new_tokens):
            tok = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            out.append(tok)
            if i + 1 < max_new_tokens:
                logits = self(tok, start_pos=s + i)  # decode one token
        return torch.cat(out, dim=1)


def build(name_or_config: "str | LlamaConfig" = "llama-tiny", *, dtype=torch.float32, device="cpu",
          seed: int = 0, **overrides) -> Llama:
    """A randomly initialised model in eval mode (no weights are downloaded); on device="meta"
    nothing is allocated."""
    cfg = CONFIGS[name_or_config] if isinstance(name_or_config, str) else name_or_config
    if overrides:
        cfg = replace(cfg, **overrides)
    # on "meta" the weights are never allocated: real-size configs can be analysed anywhere
    with torch.random.fork_rng(devices=[]), torch.device("meta" if str(device) == "meta" else "cpu"):
        torch.manual_seed(seed)
        model = Llama(cfg)
    return model.to(device=device, dtype=dtype).eval()


def example_inputs(cfg: LlamaConfig, batch: int = 1, seq: int = 32, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device),)
