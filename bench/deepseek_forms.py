"""Each DeepSeek fast path as a pair: the fallback models/deepseek.py runs (DeepSeek's reference
form, in torch) and the metainfer op the pass puts in its place. Shared by the CPU and GPU
benchmarks, so both measure the same two functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metainfer.kernels import ops
from metainfer.models.deepseek import weight_dequant


def fp8_fallback(x, w, s):
    """Dequantise the whole weight to x's dtype, then F.linear."""
    return F.linear(x, weight_dequant(w, s, 128, x.dtype))


def fp8_fast(x, w, s, act_quant=False):
    return ops.fp8_linear(x, w, s, None, 128, 128, act_quant)


def topk_dense(q, k, v, idx, causal, scale):
    """DSA's top-k folded into a -inf mask, then dense attention."""
    B, S, T = q.shape[0], q.shape[2], k.shape[2]
    mask = torch.full((B, S, T), float("-inf"), device=q.device).scatter_(-1, idx, 0) + causal
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale + mask.unsqueeze(1)
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).type_as(q), v)


def topk_sparse(q, k, v, idx, causal, scale):
    return ops.sparse_attention(q, k, v, idx, causal, scale, False, 0, False, float("-inf"))


def mla_decompressed(q_nope, q_pe, c, kpe, W, dv, scale):
    """Decompress the whole latent cache into per-head K/V, then attend (torch's SDPA)."""
    B, T = c.shape[:2]
    H, nope = q_nope.shape[1], q_nope.shape[-1]
    k_nope, v = torch.split(F.linear(c, W).view(B, T, H, nope + dv), [nope, dv], dim=-1)
    k = torch.cat([k_nope, kpe.unsqueeze(2).expand(-1, -1, H, -1)], -1).transpose(1, 2)
    return F.scaled_dot_product_attention(torch.cat([q_nope, q_pe], -1), k, v.transpose(1, 2), scale=scale)


def mla_absorbed(q_nope, q_pe, c, kpe, W, dv, scale):
    """W_UK folded into the query, attention over the latent cache, W_UV after."""
    H, nope = q_nope.shape[1], q_nope.shape[-1]
    w3 = W.view(H, nope + dv, W.shape[-1])
    o = ops.mla_decode(torch.matmul(q_nope, w3[:, :nope]), q_pe, c, kpe, None, None, scale, False, 0, False)
    return torch.matmul(o, w3[:, nope:].transpose(-1, -2))


def moe_loop(x, ids, wts, w1, w3, w2):
    """models/deepseek.py's loop over the experts."""
    y = torch.zeros_like(x)
    for i in range(w1.shape[0]):
        idx, top = torch.where(ids == i)
        h = x[idx]
        h = F.silu(F.linear(h, w1[i])) * F.linear(h, w3[i])
        y.index_add_(0, idx, F.linear(h, w2[i]) * wts[idx, top, None])
    return y


def moe_fused(x, ids, wts, w1, w3, w2):
    return ops.moe_experts(x, ids, wts, w1, w3, w2, None, None, None, 128, 128)
