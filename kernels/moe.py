"""Routed-experts MoE (grouped GEMM): out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]).

Shapes: x (T, H); topk_ids (T, K) int32/int64; topk_weights (T, K) float32 or x.dtype;
w_gate, w_up (E, I, H); w_down (E, H, I). Expert e computes
`down_e(silu(x @ w_gate[e].T) * (x @ w_up[e].T))`. The output is (T, H), contiguous, in x.dtype.
w_gate/w_up may be strided views (e.g. the two halves of one (E, 2I, H) gate_up tensor): every
weight is read through its own strides and never copied.

Weights are x.dtype, or float8_e4m3fn (all three alike) with float32 block scales
s_gate/s_up (E, ceil(I/block_n), ceil(H/block_k)) and s_down (E, ceil(H/block_n), ceil(I/block_k)):
real w[e, n, k] = w8[e, n, k].float() * s[e, n // block_n, k // block_k] (DeepSeek-style 128x128
block FP8). FP8 tiles are dequantised in registers; activations stay in x.dtype (W8A16).

Numerics (those of the eager per-expert loop this replaces): gate and up accumulate in float32,
h = silu(g) * u is rounded once to x.dtype, the down GEMM accumulates in float32, and the routing
weight multiply and the sum over K are float32, rounded once to x.dtype at the end.

Expert ids outside [0, E) contribute zero in every implementation: the per-expert loop this op
replaces never visits them, and transformers marks expert-parallel slots of other ranks with
such ids (checking them would need a host sync on the GPU anyway).

Three implementations of the same function:
- `launch`: two Triton kernels over token rows sorted by expert (`_moe_align` in one program for
  a few hundred pairs, `align_by_expert`'s torch ops above), and one summing each token's pairs;
  for decode's fewest pairs (GEMV_MAX_PAIRS) instead two matrix-vector kernels, unsorted, the
  second summing each token's pairs itself;
- `cpu_forward`: the CPU path, a host loop over the experts that received tokens;
- `reference`: dense float32 math over every expert, for tests.
"""

from __future__ import annotations

import warnings


import torch
import triton
import triton.language as tl

from ._flash import dot, dot_flags
from . import configs, spec  # (modules: configs reads the kernel files' declarations when first used)
from ._common import (GuardedPlans, contiguous_like, fail, cdiv, retries_smaller, check, check_float, gpu_capability,
                      next_pow2, out_of_resources, signature)

NAME = "moe"

FP8_DTYPES = (torch.float8_e4m3fn,)

# Suggested launch rows (the lead wires them into kernels/configs.py). BLOCK_M tiles the
# sorted (token, k) rows, BLOCK_N a GEMM's output dim, BLOCK_K its reduction dim; with FP8
# weights BLOCK_N/BLOCK_K are clamped to block_n/block_k so one scale covers a whole tile.
DEFAULT_CONFIGS = {
    # ALIGN_MAX_PAIRS: up to this many (token, k) pairs the routing is sorted by one Triton
    # program (`_moe_align`, one launch: decode), above by `align_by_expert`'s torch ops (~20
    # launches, each parallel over the pairs: prefill). 1024 is not measured yet: bench/gpu_check.py
    # times both paths at the bound.
    # GEMV_MAX_PAIRS: up to this many pairs (decode) no sort and no tiles: two matrix-vector
    # kernels, one program per (pair, N tile) then per (token, N tile), GEMV_BLOCK_N x
    # GEMV_BLOCK_K weight tiles (two launches and two buffers instead of four and five; each pair
    # reads its expert's weights once either way). 64 (batch 8 at top-8) is not measured yet:
    # bench/gpu_check.py times both paths at the bound.
    "interpreter": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1,
                    "ALIGN_MAX_PAIRS": 1024, "GEMV_MAX_PAIRS": 64, "GEMV_BLOCK_N": 16, "GEMV_BLOCK_K": 32},
    # kernel 1 holds two accumulators (gate and up): 64x64 tiles keep it within registers, and
    # 3 stages x (64x64 + 2 x 64x64) x 2 bytes = 72 KB of shared memory fits Ada and Hopper.
    # The GEMV tiles: two 32 x 128 float32 weight tiles, 64 registers a thread at 4 warps.
    "cuda": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, "ALIGN_MAX_PAIRS": 1024,
             "GEMV_MAX_PAIRS": 64, "GEMV_BLOCK_N": 32, "GEMV_BLOCK_K": 128},
}


@triton.jit
def _w_tile(W, base_w, offs_n, offs_k, n_dim, k_dim, stride_wn, stride_wk):
    """A (BLOCK_K, BLOCK_N) tile of w[e].T, as stored (FP8 or x.dtype)."""
    return tl.load(W + base_w + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                   mask=(offs_n[None, :] < n_dim) & (offs_k[:, None] < k_dim), other=0.0)


@triton.jit
def _scale(S, base_s, n0, k0, bn, bk, stride_sn, stride_sk):
    """The one block scale covering a whole tile (BLOCK_N | bn and BLOCK_K | bk, see `launch`)."""
    return tl.load(S + base_s + (n0 // bn) * stride_sn + (k0 // bk) * stride_sk)


@triton.jit
def _tile(SORTED, EXPERT, num_pairs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile of the expert-sorted (token, k) pairs: (its expert, `num_experts`
    past the padded end; row offsets; pair ids with the padding rows' sentinel num_pairs
    replaced by 0; which rows are pairs; first output column; column offsets). SORTED holds a
    row for every tile of the grid, so reading it before the caller's end check stays in bounds."""
    pid_m = tl.program_id(0)
    e = tl.load(EXPERT + pid_m).to(tl.int64)
    offs_r = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SORTED + offs_r).to(tl.int64)
    row_ok = pair < num_pairs
    n0 = tl.program_id(1) * BLOCK_N
    return e, offs_r, tl.where(row_ok, pair, 0), row_ok, n0, n0 + tl.arange(0, BLOCK_N)


@triton.jit
def _moe_gate_up(
    X, W_G, W_U, S_G, S_U, SORTED, EXPERT, Hb,
    num_pairs, top_k, num_experts, hidden, inter, bn, bk,
    stride_xt, stride_xh,
    stride_ge, stride_gn, stride_gk,
    stride_ue, stride_un, stride_uk,
    stride_sge, stride_sgn, stride_sgk,
    stride_sue, stride_sun, stride_suk,
    stride_hm, stride_hn,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """h[rows of tile m, cols of tile n] = silu(x_rows @ w_gate[e].T) * (x_rows @ w_up[e].T)."""
    e, offs_r, pair, row_ok, n0, offs_n = _tile(SORTED, EXPERT, num_pairs, BLOCK_M, BLOCK_N)
    if e >= num_experts:  # a tile past the padded end (the grid is a static upper bound)
        return
    token = pair // top_k
    x_rows = X + token[:, None] * stride_xt
    base_g = e * stride_ge
    base_u = e * stride_ue
    base_sg = e * stride_sge
    base_su = e * stride_sue
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_rows + offs_k[None, :] * stride_xh,
                     mask=row_ok[:, None] & (offs_k[None, :] < hidden), other=0.0)
        wg = _w_tile(W_G, base_g, offs_n, offs_k, inter, hidden, stride_gn, stride_gk)
        wu = _w_tile(W_U, base_u, offs_n, offs_k, inter, hidden, stride_un, stride_uk)
        if FP8:
            # e4m3 -> fp16/bf16/fp32 is exact, so the dot on raw FP8 values times the tile's one
            # scale equals the dot on dequantised weights up to float32 accumulation order
            sg = _scale(S_G, base_sg, n0, k0, bn, bk, stride_sgn, stride_sgk)
            su = _scale(S_U, base_su, n0, k0, bn, bk, stride_sun, stride_suk)
            acc_g += dot(xt, wg.to(X.dtype.element_ty), DOT_PRECISION, DOT_UPCAST) * sg
            acc_u += dot(xt, wu.to(X.dtype.element_ty), DOT_PRECISION, DOT_UPCAST) * su
        else:
            acc_g += dot(xt, wg, DOT_PRECISION, DOT_UPCAST)
            acc_u += dot(xt, wu, DOT_PRECISION, DOT_UPCAST)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    # h is stored by sorted row, so kernel 2 reads one expert's rows contiguously
    tl.store(Hb + offs_r[:, None] * stride_hm + offs_n[None, :] * stride_hn, h.to(Hb.dtype.element_ty),
             mask=row_ok[:, None] & (offs_n[None, :] < inter))


@triton.jit
def _moe_down(
    Hb, W_D, S_D, SORTED, EXPERT, TW, OUT,
    num_pairs, top_k, num_experts, hidden, inter, bn, bk,
    stride_hm, stride_hn,
    stride_de, stride_dn, stride_dk,
    stride_sde, stride_sdn, stride_sdk,
    stride_tw_t, stride_tw_k,
    stride_op, stride_oh,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """out_pairs[pair, cols of tile n] = topk_weight[pair] * (h[row] @ w_down[e].T), in float32."""
    e, offs_r, pair, row_ok, n0, offs_n = _tile(SORTED, EXPERT, num_pairs, BLOCK_M, BLOCK_N)
    if e >= num_experts:
        return
    h_rows = Hb + offs_r[:, None] * stride_hm
    base_d = e * stride_de
    base_sd = e * stride_sde
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ht = tl.load(h_rows + offs_k[None, :] * stride_hn,
                     mask=row_ok[:, None] & (offs_k[None, :] < inter), other=0.0)
        wd = _w_tile(W_D, base_d, offs_n, offs_k, hidden, inter, stride_dn, stride_dk)
        if FP8:
            sd = _scale(S_D, base_sd, n0, k0, bn, bk, stride_sdn, stride_sdk)
            acc += dot(ht, wd.to(Hb.dtype.element_ty), DOT_PRECISION, DOT_UPCAST) * sd
        else:
            acc += dot(ht, wd, DOT_PRECISION, DOT_UPCAST)
    rw = tl.load(TW + (pair // top_k) * stride_tw_t + (pair % top_k) * stride_tw_k,
                 mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    tl.store(OUT + pair[:, None] * stride_op + offs_n[None, :] * stride_oh, acc,
             mask=row_ok[:, None] & (offs_n[None, :] < hidden))



@triton.jit
def _moe_gemv_gate_up(
    X, W_G, W_U, S_G, S_U, IDS, Hb,
    top_k, num_experts, hidden, inter, bn, bk,
    stride_xt, stride_xh, stride_it, stride_ik,
    stride_ge, stride_gn, stride_gk,
    stride_ue, stride_un, stride_uk,
    stride_sge, stride_sgn, stride_sgk,
    stride_sue, stride_sun, stride_suk,
    stride_hp, stride_hn,
    FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Decode's few pairs, unsorted: one program per (pair, N tile), h[pair, cols] =
    silu(w_gate[e] . x[t]) * (w_up[e] . x[t]) as matrix-vector products (the tile kernels would
    pad each pair to BLOCK_M rows, after a sort)."""
    pair = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    t = pair // top_k
    e = tl.load(IDS + t * stride_it + (pair % top_k) * stride_ik).to(tl.int64)
    if (e < 0) | (e >= num_experts):  # contributes nothing; _moe_gemv_down skips the pair too
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ok = n_ok[:, None] & (offs_k[None, :] < hidden)
        xk = tl.load(X + t * stride_xt + offs_k * stride_xh, mask=offs_k < hidden, other=0.0).to(tl.float32)
        # products of x.dtype (or e4m3) values are exact in float32, as in the tile kernels' dots
        wg = tl.load(W_G + e * stride_ge + offs_n[:, None] * stride_gn + offs_k[None, :] * stride_gk,
                     mask=ok, other=0.0).to(tl.float32)
        wu = tl.load(W_U + e * stride_ue + offs_n[:, None] * stride_un + offs_k[None, :] * stride_uk,
                     mask=ok, other=0.0).to(tl.float32)
        g = tl.sum(wg * xk[None, :], axis=1)
        u = tl.sum(wu * xk[None, :], axis=1)
        if FP8:
            g *= _scale(S_G, e * stride_sge, n0, k0, bn, bk, stride_sgn, stride_sgk)
            u *= _scale(S_U, e * stride_sue, n0, k0, bn, bk, stride_sun, stride_suk)
        acc_g += g
        acc_u += u
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(Hb + pair * stride_hp + offs_n * stride_hn, h.to(Hb.dtype.element_ty), mask=n_ok)


@triton.jit
def _moe_gemv_down(
    Hb, W_D, S_D, IDS, TW, OUT,
    top_k, num_experts, hidden, inter, bn, bk,
    stride_hp, stride_hn, stride_it, stride_ik, stride_tw_t, stride_tw_k,
    stride_de, stride_dn, stride_dk,
    stride_sde, stride_sdn, stride_sdk,
    stride_ot, stride_oh,
    FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[t, cols] = sum over k of topk_weight[t, k] * (w_down[e] . h[t*K + k]): the down
    products and the sum over the token's pairs in one program per (token, N tile), float32, in
    k order (as _moe_down + _moe_sum add them)."""
    t = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k in range(0, top_k):
        e = tl.load(IDS + t * stride_it + k * stride_ik).to(tl.int64)
        if (e >= 0) & (e < num_experts):
            pair = t * top_k + k
            part = tl.zeros([BLOCK_N], tl.float32)
            for i0 in range(0, inter, BLOCK_K):
                offs_i = i0 + tl.arange(0, BLOCK_K)
                i_ok = offs_i < inter
                hk = tl.load(Hb + pair * stride_hp + offs_i * stride_hn, mask=i_ok, other=0.0).to(tl.float32)
                wd = tl.load(W_D + e * stride_de + offs_n[:, None] * stride_dn + offs_i[None, :] * stride_dk,
                             mask=n_ok[:, None] & i_ok[None, :], other=0.0).to(tl.float32)
                d = tl.sum(wd * hk[None, :], axis=1)
                if FP8:
                    d *= _scale(S_D, e * stride_sde, n0, i0, bn, bk, stride_sdn, stride_sdk)
                part += d
            acc += part * tl.load(TW + t * stride_tw_t + k * stride_tw_k).to(tl.float32)
    tl.store(OUT + t * stride_ot + offs_n * stride_oh, acc.to(OUT.dtype.element_ty), mask=n_ok)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _is_pow2_at_least(v, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo and v & (v - 1) == 0


def _shape_ok(name: str, t, expected: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        fail(NAME, f"{name} must be a tensor, got {type(t).__name__}")
    if not tuple(t.shape) == expected:
        fail(NAME, f"{name} has shape {tuple(t.shape)}, expected {expected}")


def check_inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, s_gate=None, s_up=None, s_down=None,
                 block_n: int = 128, block_k: int = 128) -> None:
    """Raise KernelInputError unless the inputs are ones every implementation supports.

    Expert ids are not range-checked here (that needs a host sync): see the module docstring."""
    check_float(NAME, "x", x)
    if not x.dim() == 2:
        fail(NAME, f"x must be 2-D (tokens, hidden), got shape {tuple(x.shape)}")
    T, H = x.shape
    check(H >= 1, NAME, "x has hidden size 0")
    if not isinstance(topk_ids, torch.Tensor):
        fail(NAME, f"topk_ids must be a tensor, got {type(topk_ids).__name__}")
    if not topk_ids.dim() == 2:
        fail(NAME, f"topk_ids must be 2-D (tokens, top_k), got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        fail(NAME, f"topk_ids has dtype {topk_ids.dtype}; expert ids must be int32 or int64")
    if not topk_ids.shape[0] == T:
        fail(NAME, f"topk_ids has {topk_ids.shape[0]} rows, expected {T} (x's tokens)")
    K = topk_ids.shape[1]
    if not isinstance(topk_weights, torch.Tensor):
        fail(NAME, f"topk_weights must be a tensor, got {type(topk_weights).__name__}")
    if not tuple(topk_weights.shape) == tuple(topk_ids.shape):
        fail(NAME, f"topk_weights has shape {tuple(topk_weights.shape)}, expected {tuple(topk_ids.shape)} (topk_ids' shape)")
    if topk_weights.dtype not in (torch.float32, x.dtype):
        fail(NAME, f"topk_weights has dtype {topk_weights.dtype}; expected float32 or x's dtype {x.dtype}")

    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not isinstance(w, torch.Tensor):
            fail(NAME, f"{name} must be a tensor, got {type(w).__name__}")
        if not w.dim() == 3:
            fail(NAME, f"{name} must be 3-D (experts, out, in), got shape {tuple(w.shape)}")
    E, I = w_gate.shape[0], w_gate.shape[1]
    if not (E >= 1 and I >= 1):
        fail(NAME, f"w_gate has shape {tuple(w_gate.shape)}: needs at least one expert and I >= 1")
    if not (w_up.shape[0] == E and w_down.shape[0] == E):
        fail(NAME, f"expert counts differ: w_gate {E}, w_up {w_up.shape[0]}, w_down {w_down.shape[0]}")
    _shape_ok("w_gate", w_gate, (E, I, H))
    _shape_ok("w_up", w_up, (E, I, H))
    _shape_ok("w_down", w_down, (E, H, I))
    # K may exceed E: an expert-parallel rank holds E of the experts and drops the others' ids
    if not K >= 1:
        fail(NAME, f"top_k = {K} (topk_ids' second dim) must be at least 1")

    dtypes = {w_gate.dtype, w_up.dtype, w_down.dtype}
    if not len(dtypes) == 1:
        fail(NAME, f"w_gate, w_up, w_down dtypes differ: {w_gate.dtype}, {w_up.dtype}, {w_down.dtype}")
    wdt = w_gate.dtype
    fp8 = wdt in FP8_DTYPES
    if not (fp8 or wdt == x.dtype):
        fail(NAME, f"weight dtype {wdt} unsupported with x {x.dtype}: weights must be x's dtype or FP8 "
          f"(supported FP8 formats: {', '.join(str(d) for d in FP8_DTYPES)})")
    if not (_is_pow2_at_least(block_n, 16) and _is_pow2_at_least(block_k, 16)):
        fail(NAME, f"block_n/block_k must be powers of two >= 16, got {block_n!r}/{block_k!r}")
    scales = (("s_gate", s_gate, I, H), ("s_up", s_up, I, H), ("s_down", s_down, H, I))
    given = [s is not None for _, s, _, _ in scales]
    if not fp8:
        if not not any(given):
            fail(NAME, f"block scales given for {wdt} weights; scales are only for FP8 weights")
    else:
        missing = [n for (n, _, _, _), g in zip(scales, given) if not g]
        if not not missing:
            fail(NAME, f"FP8 weights need all of s_gate, s_up, s_down; missing {', '.join(missing)}")
        for name, s, n_dim, k_dim in scales:
            if not isinstance(s, torch.Tensor):
                fail(NAME, f"{name} must be a tensor, got {type(s).__name__}")
            if not s.dtype == torch.float32:
                fail(NAME, f"{name} has dtype {s.dtype}; block scales must be float32")
            _shape_ok(name, s, (E, _cdiv(n_dim, block_n), _cdiv(k_dim, block_k)))
    dev = x.device
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w_gate", w_gate),
                    ("w_up", w_up), ("w_down", w_down), ("s_gate", s_gate), ("s_up", s_up), ("s_down", s_down)):
        if not (t is None or t.device == dev):
            fail(NAME, f"{name} is on {t.device if t is not None else None}, x on {dev}")


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """A static bound on the BLOCK_M tiles `align_by_expert` produces.

    sum_e ceil(c_e / M) <= (sum_e c_e + n_nonempty (M - 1)) / M, with at most min(E, T*K) experts
    non-empty; never more than ceil(T*K / M) + E, and tight for decode (few pairs, many experts)."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the (token, k) pairs by expert, padding each expert's run to a multiple of `block_m`.

    Returns (sorted_pair_ids, expert_of_block, num_pairs_padded):
    - sorted_pair_ids (max_tiles * block_m,) int32/int64: pair ids t*K + k, stable-sorted by expert;
      padding rows (each expert's tail, and everything past the end) hold the sentinel T*K;
    - expert_of_block (max_tiles,) int64: the expert of each tile, `num_experts` past the end;
    - num_pairs_padded: a 1-element tensor, the used length of sorted_pair_ids.
    All torch ops on topk_ids' device, no host synchronisation (shapes depend only on T, K, E).
    Pairs whose id is outside [0, E) are dropped (no tile holds them).
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    n_tiles = max_tiles(P, num_experts, block_m)
    # ids out of range go to an extra bucket E that gets no tiles
    ids = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))  # bincount would sync on CUDA (for its max)
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends_padded = torch.cumsum(padded, 0)
    starts_padded = torch.cat([ends_padded.new_zeros(1), ends_padded[:num_experts - 1]])
    starts = torch.cumsum(counts, 0) - counts  # start of each bucket in the unpadded sorted order

    sorted_ids, order = torch.sort(ids, stable=True)
    rank = torch.arange(P, device=device) - starts[sorted_ids]
    n_rows = n_tiles * block_m
    # pairs in the out-of-range bucket land on one extra trash slot, cut off below
    starts_ext = torch.cat([starts_padded, starts_padded.new_full((1,), n_rows)])
    dest = torch.where(sorted_ids < num_experts, starts_ext[sorted_ids] + rank, n_rows)
    pair_dtype = torch.int32 if P < 2**31 - 1 else torch.long
    sorted_pair_ids = torch.full((n_rows + 1,), P, dtype=pair_dtype, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(pair_dtype))
    sorted_pair_ids = sorted_pair_ids[:n_rows]

    tile_starts = torch.arange(n_tiles, device=device, dtype=torch.long) * block_m
    expert_of_block = torch.searchsorted(ends_padded, tile_starts, right=True)  # == E past the end
    return sorted_pair_ids, expert_of_block, ends_padded[-1:]


@triton.jit
def _moe_align(
    IDS, SORTED, EXPERT, num_pairs, num_experts, n_rows,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """`align_by_expert` in one program: IDS (num_pairs,) the pairs' expert ids -> SORTED
    (n_rows,) pair ids stable-sorted by expert, each expert's run padded to BLOCK_M with the
    sentinel num_pairs, and EXPERT (n_rows / BLOCK_M,) each tile's expert (num_experts past the
    end). Ids outside [0, num_experts) are dropped. Padding and pair slots are disjoint, so the
    two store passes need no ordering between them."""
    experts = tl.arange(0, BLOCK_E)
    is_expert = experts < num_experts
    j = tl.arange(0, BLOCK_P)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        ids = tl.load(IDS + p0 + j, mask=p0 + j < num_pairs, other=-1)
        counts += tl.sum(((ids[:, None] == experts[None, :]) & is_expert[None, :]).to(tl.int32), axis=0)
    padded = tl.where(is_expert, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    # every row: its tile's expert (the experts whose padded runs end at or before it), padding or not
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        in_range = rows < n_rows
        expert = tl.sum(((ends[None, :] <= rows[:, None]) & is_expert[None, :]).to(tl.int32), axis=1)
        mine = experts[None, :] == expert[:, None]
        start = tl.sum(tl.where(mine, starts[None, :], 0), axis=1)
        count = tl.sum(tl.where(mine, counts[None, :], 0), axis=1)
        pad = (expert >= num_experts) | (rows - start >= count)
        sentinel = tl.zeros([BLOCK_R], tl.int64) + num_pairs
        tl.store(SORTED + rows, sentinel.to(SORTED.dtype.element_ty), mask=in_range & pad)
        tl.store(EXPERT + rows // BLOCK_M, expert.to(tl.int64), mask=in_range & (rows % BLOCK_M == 0))
    # every in-range pair: its expert's padded start + the expert's pairs before it (stable)
    taken = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        offs = p0 + j
        ids = tl.load(IDS + offs, mask=offs < num_pairs, other=-1)
        hit = (ids[:, None] == experts[None, :]) & is_expert[None, :]  # out-of-range ids hit none
        earlier = (ids[:, None] == ids[None, :]) & (j[None, :] < j[:, None])
        dest = tl.sum(tl.where(hit, (starts + taken)[None, :], 0), axis=1) + tl.sum(earlier.to(tl.int32), axis=1)
        valid = (ids >= 0) & (ids < num_experts) & (offs < num_pairs)
        tl.store(SORTED + dest, offs.to(SORTED.dtype.element_ty), mask=valid)
        taken += tl.sum(hit.to(tl.int32), axis=0)


@triton.jit
def _moe_sum(PAIRS, IDS, Y, num_experts, top_k, hidden, stride_it, stride_ik, BLOCK_H: tl.constexpr):
    """Y[t] = sum over k of PAIRS[t * top_k + k] (float32, k in order: deterministic), skipping
    pairs whose expert id is out of range (never written by the GEMMs), rounded once to Y's dtype."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < hidden
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in range(0, top_k):
        e = tl.load(IDS + t * stride_it + k * stride_ik)
        # the scalar test as a vector: the interpreter refuses a scalar-and-vector mask
        used = (tl.zeros([BLOCK_H], tl.int32) + ((e >= 0) & (e < num_experts)).to(tl.int32)) != 0
        acc += tl.load(PAIRS + (t * top_k + k) * hidden + cols, mask=ok & used, other=0.0)
    tl.store(Y + t * hidden + cols, acc.to(Y.dtype.element_ty), mask=ok)


def launch_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pair_ids, expert_of_block) as `align_by_expert` gives them, from one launch of
    `_moe_align` (one program: meant for decode's few pairs, see ALIGN_MAX_PAIRS)."""
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    return _Align(ids.numel(), num_experts, block_m)(ids)


_ALIGN_BLOCK_P, _ALIGN_BLOCK_R = 64, 64  # pairs and rows per step of _moe_align's loops


class _Align:
    """`launch_align` for P pairs over E experts in tiles of BLOCK_M, its sizes and constants
    decided once (a decode step routes the same number of pairs every step)."""

    __slots__ = ("P", "E", "rows", "n_tiles", "pair_dtype", "meta")

    def __init__(self, P: int, E: int, block_m: int):
        self.P, self.E, self.n_tiles = P, E, max_tiles(P, E, block_m)
        self.rows = self.n_tiles * block_m
        self.pair_dtype = torch.int32 if P < 2**31 - 1 else torch.long
        self.meta = dict(BLOCK_M=block_m, BLOCK_P=_ALIGN_BLOCK_P, BLOCK_E=max(16, next_pow2(E)),
                         BLOCK_R=_ALIGN_BLOCK_R, num_warps=4)

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: the contiguous (token, k) expert ids."""
        sorted_pairs = ids.new_empty(self.rows, dtype=self.pair_dtype)
        expert_of_block = ids.new_empty(self.n_tiles, dtype=torch.long)
        if self.n_tiles:
            _moe_align[(1,)](ids, sorted_pairs, expert_of_block, self.P, self.E, self.rows, **self.meta)
        return sorted_pairs, expert_of_block


def _clamped_blocks(config: dict, fp8: bool, block_n: int, block_k: int) -> tuple[int, int, int]:
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    for key, v in (("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bk)):
        if not _is_pow2_at_least(v, 16):
            fail(NAME, f"config {key} must be a power of two >= 16 (tl.dot), got {v!r}")
    if fp8:  # one scale per tile: tiles must not straddle scale blocks (all powers of two)
        bn, bk = min(bn, block_n), min(bk, block_k)
    return bm, bn, bk


class _Launch:
    """A launch's checks and decisions for one signature (a decode step's token count, top-k and
    weights repeat every step): blocks, tile bound, grids, strides, constexprs."""

    __slots__ = ("T", "H", "I", "K", "E", "P", "BM", "n_tiles", "align", "ids_contiguous", "grids", "strides",
                 "meta", "same_layout", "ids_strides", "gemv")

    def __init__(self, args: tuple, config):
        check_inputs(*args)
        config = default_config(args[0]) if config is None else config
        x, topk_ids, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down, block_n, block_k = args
        T, H = x.shape
        K = topk_ids.shape[1]
        E, I = w_gate.shape[0], w_gate.shape[1]
        fp8 = w_gate.dtype in FP8_DTYPES
        BM, BN, BK = _clamped_blocks(config, fp8, block_n, block_k)
        cap = gpu_capability(x.device)
        if fp8 and cap is not None and not cap >= (8, 9):
            # Triton has no float8_e4m3fn (fp8e4nv) type before sm_89: compiling would fail there
            fail(NAME, f"FP8 weights need a GPU of compute capability >= 8.9 for Triton's "
                       f"float8_e4m3fn, this one is {cap[0]}.{cap[1]}; dequantise the weights or use cpu_forward")
        self.T, self.H, self.I, self.K, self.E, self.P, self.BM = T, H, I, K, E, T * K, BM
        self.n_tiles = max_tiles(T * K, E, BM)
        # decode's few pairs are sorted by expert in one program, else by torch ops
        self.align = _Align(T * K, E, BM) if T * K <= config.get("ALIGN_MAX_PAIRS", 0) else None
        self.ids_contiguous, self.ids_strides = topk_ids.is_contiguous(), topk_ids.stride()
        self.same_layout = x.is_contiguous()
        self.grids = ((self.n_tiles, cdiv(I, BN)), (self.n_tiles, cdiv(H, BN)), (T, cdiv(H, _SUM_BLOCK_H)))
        zeros = (0, 0, 0)  # unused scale pointers get zero strides
        sg, su, sd = (s_gate.stride(), s_up.stride(), s_down.stride()) if fp8 else (zeros, zeros, zeros)
        self.strides = ((*x.stride(), *w_gate.stride(), *w_up.stride(), *sg, *su, I, 1),
                        (I, 1, *w_down.stride(), *sd, *topk_weights.stride(), H, 1))
        self.meta = dict(
            FP8=fp8, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
            **dot_flags(x.dtype),
            num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 2),
        )
        self.gemv = _Gemv(args, config, fp8) if T * K <= config.get("GEMV_MAX_PAIRS", 0) else None


class _Gemv:
    """The decode path's two launches (`_moe_gemv_gate_up`, `_moe_gemv_down`): grids, arguments
    and constants, all fixed by the signature."""

    __slots__ = ("h_numel", "grid_up", "grid_down", "args_up", "args_down", "meta")

    def __init__(self, args: tuple, config, fp8: bool):
        x, topk_ids, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down, block_n, block_k = args
        (T, H), K, (E, I) = x.shape, topk_ids.shape[1], w_gate.shape[:2]
        bn, bk = config["GEMV_BLOCK_N"], config["GEMV_BLOCK_K"]
        for key, v in (("GEMV_BLOCK_N", bn), ("GEMV_BLOCK_K", bk)):
            if not _is_pow2_at_least(v, 16):
                fail(NAME, f"config {key} must be a power of two >= 16, got {v!r}")
        if fp8:  # one scale per tile, as in the tile kernels
            bn, bk = min(bn, block_n), min(bk, block_k)
        zeros = (0, 0, 0)  # unused scale pointers get zero strides
        sg, su, sd = (s_gate.stride(), s_up.stride(), s_down.stride()) if fp8 else (zeros, zeros, zeros)
        self.h_numel = T * K * I  # (pairs, I), flat: an int size allocates faster than a shape
        self.grid_up, self.grid_down = (T * K, cdiv(I, bn)), (T, cdiv(H, bn))
        sizes = (K, E, H, I, block_n, block_k)
        self.args_up = (*sizes, *x.stride(), *topk_ids.stride(), *w_gate.stride(), *w_up.stride(), *sg, *su, I, 1)
        self.args_down = (*sizes, I, 1, *topk_ids.stride(), *topk_weights.stride(), *w_down.stride(), *sd, H, 1)
        self.meta = dict(FP8=fp8, BLOCK_N=bn, BLOCK_K=bk, num_warps=config.get("num_warps", 4))


_SUM_BLOCK_H = 1024  # hidden columns per program of _moe_sum
_launches = GuardedPlans()


def default_config(x, *args) -> dict:
    """The config row for the input's device (kernels/configs.py)."""
    return configs.config_for(NAME, x.device)


def _key(args: tuple, config) -> tuple:
    """The plan's key behind the guards: `_common.signature` of the launch's arguments."""
    return signature(*args)


@retries_smaller(NAME, default_config)
def launch(x, topk_ids, topk_weights, w_gate, w_up, w_down, s_gate=None, s_up=None, s_down=None,
           block_n: int = 128, block_k: int = 128, *, config: dict | None = None) -> torch.Tensor:
    """Route, run the two GEMM kernels, sum each token's pairs. `config` (None: the device's row):
    BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, ALIGN_MAX_PAIRS. Checks and decisions once
    per signature."""
    args = (x, topk_ids, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down, block_n, block_k)
    if s_gate is None:
        plan = _launches.get_guarded((block_n, block_k, s_up is None, s_down is None),
                                     (x, topk_ids, topk_weights, w_gate, w_up, w_down), config, _key, _Launch,
                                     args, config)
    else:
        plan = _launches.get_guarded((block_n, block_k, s_up is None, s_down is None),
                                     (x, topk_ids, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down), config,
                                     _key, _Launch, args, config)
    T, H, I, K, E, P = plan.T, plan.H, plan.I, plan.K, plan.E, plan.P
    out = contiguous_like(x, dense=plan.same_layout)
    if T == 0:
        return out
    if s_gate is None:  # unused pointers: any tensor (zero strides)
        s_gate = s_up = s_down = w_gate
    gemv = plan.gemv
    if gemv is not None:  # decode: two launches, no sort
        h = x.new_empty(gemv.h_numel)
        try:
            _moe_gemv_gate_up[gemv.grid_up](x, w_gate, w_up, s_gate, s_up, topk_ids, h, *gemv.args_up, **gemv.meta)
            _moe_gemv_down[gemv.grid_down](h, w_down, s_down, topk_ids, topk_weights, out, *gemv.args_down,
                                           **gemv.meta)
            return out
        except out_of_resources() as e:  # refused before running: the tile kernels, for this signature
            warnings.warn(f"{NAME}: decode kernels refused ({e}); the sorted tile kernels run instead", stacklevel=2)
            plan.gemv = None
    if plan.align is not None:
        sorted_pairs, expert_of_block = plan.align(topk_ids if plan.ids_contiguous else topk_ids.contiguous())
    else:
        sorted_pairs, expert_of_block, _ = align_by_expert(topk_ids, E, plan.BM)
    h = x.new_empty((plan.n_tiles * plan.BM, I))
    # pairs with an out-of-range expert are never written; _moe_sum skips them
    out_pairs = x.new_empty((P, H), dtype=torch.float32)
    grid_up, grid_down, grid_sum = plan.grids
    strides_up, strides_down = plan.strides
    _moe_gate_up[grid_up](
        x, w_gate, w_up, s_gate, s_up, sorted_pairs, expert_of_block, h,
        P, K, E, H, I, block_n, block_k, *strides_up, **plan.meta,
    )
    _moe_down[grid_down](
        h, w_down, s_down, sorted_pairs, expert_of_block, topk_weights, out_pairs,
        P, K, E, H, I, block_n, block_k, *strides_down, **plan.meta,
    )
    _moe_sum[grid_sum](out_pairs, topk_ids, out, E, K, H, *plan.ids_strides, BLOCK_H=_SUM_BLOCK_H, num_warps=4)
    return out


def dequantize(w: torch.Tensor, s: torch.Tensor | None, block_n: int, block_k: int) -> torch.Tensor:
    """float32 weights from (..., N, K) FP8 values and (..., ceil(N/bn), ceil(K/bk)) block scales."""
    if s is None:
        return w.float()
    n, k = w.shape[-2], w.shape[-1]
    full = s.repeat_interleave(block_n, dim=-2)[..., :n, :].repeat_interleave(block_k, dim=-1)[..., :k]
    return w.float() * full


def _reference_weights(w: torch.Tensor, s: torch.Tensor | None, block_n: int, block_k: int) -> torch.Tensor:
    """The oracle's own dequantisation, apart from the CPU path's `dequantize`: each element
    w[e, n, k] times the scale its block indexes, s[e, n // block_n, k // block_k]."""
    if s is None:
        return w.float()
    rows = torch.arange(w.shape[-2], device=w.device) // block_n
    cols = torch.arange(w.shape[-1], device=w.device) // block_k
    return w.float() * s[:, rows[:, None], cols[None, :]]


def reference(x, topk_ids, topk_weights, w_gate, w_up, w_down, s_gate=None, s_up=None, s_down=None,
              block_n: int = 128, block_k: int = 128) -> torch.Tensor:
    """Dense float32 math over every token for every expert, one expert's weights dequantised at a
    time (DeepSeek-V3's 256 experts in fp32 at once would be 42 GiB): the oracle for tests and
    gpu_check."""
    check_inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down, block_n, block_k)
    E = w_gate.shape[0]
    one = lambda w, s, e: _reference_weights(w[e:e + 1], None if s is None else s[e:e + 1], block_n, block_k)[0]  # noqa: E731
    xf = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(E):
        wg, wu, wd = one(w_gate, s_gate, e), one(w_up, s_up, e), one(w_down, s_down, e)
        h = (torch.nn.functional.silu(xf @ wg.T) * (xf @ wu.T)).to(x.dtype).float()
        coef = (topk_weights.float() * (topk_ids == e)).sum(dim=1)  # (T,), 0 for tokens not routed here
        out += coef[:, None] * (h @ wd.T)
    return out.to(x.dtype)


def cpu_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, s_gate=None, s_up=None, s_down=None,
                block_n: int = 128, block_k: int = 128) -> torch.Tensor:
    """CPU path: pairs sorted by expert, one expert at a time (FP8 dequantised per expert)."""
    check_inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down, block_n, block_k)
    T, H = x.shape
    K = topk_ids.shape[1]
    E = w_gate.shape[0]
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    if T == 0:
        return out.to(x.dtype)
    flat = topk_ids.reshape(-1).long()
    flat = torch.where((flat >= 0) & (flat < E), flat, E)  # out-of-range ids: a last, skipped bucket
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E + 1)[:E].tolist()
    rw = topk_weights.reshape(-1).float()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        pairs = order[start:start + c]
        start += c
        tokens = pairs // K
        # float32 matmuls: gate/up must not be rounded to x.dtype before silu * up
        xe = x.index_select(0, tokens).float()
        g = xe @ dequantize(w_gate[e], None if s_gate is None else s_gate[e], block_n, block_k).T
        u = xe @ dequantize(w_up[e], None if s_up is None else s_up[e], block_n, block_k).T
        del xe
        h = (torch.nn.functional.silu(g, inplace=True).mul_(u)).to(x.dtype).float()
        del g, u
        y = h @ dequantize(w_down[e], None if s_down is None else s_down[e], block_n, block_k).T
        out.index_add_(0, tokens, y.mul_(rw[pairs][:, None]))
    return out.to(x.dtype)


# ---- the declaration (kernels/spec.py) ----------------------------------------------------------

def _flops(args, outs):  # three GEMMs (gate, up, down) per (token, expert) pair
    x, topk_ids, w_gate = args[0], args[1], args[3]
    return 2 * spec.numel(topk_ids) * 3 * spec.size_hint(w_gate.shape[1]) * spec.size_hint(w_gate.shape[2]), \
        spec.peak_key(x.dtype)


def _experts(args):
    """The experts that can receive a token: no more than the pairs."""
    topk_ids, w_gate = args[1], args[3]
    if topk_ids is None or w_gate is None:
        return 1
    return min(spec.size_hint(w_gate.shape[0]), spec.numel(topk_ids))


def _aot_cases():
    from .configs import config_for_arch

    g, randn = spec.aot_inputs()
    e4m3 = torch.float8_e4m3fn

    def experts(fp8, T):  # T x K pairs above GEMV_MAX_PAIRS: the sort and the tile kernels; below: decode's two
        def call(arch):
            E, K, H, I = 8, 2, 256, 256
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
            w = (lambda *s: randn(*s, dtype=e4m3)) if fp8 else randn
            s = (lambda *s: torch.rand(*s, generator=g)) if fp8 else (lambda *s: None)
            launch(randn(T, H), ids, torch.rand(T, K, generator=g), w(E, I, H), w(E, I, H), w(E, H, I),
                   s(E, I // 128, H // 128), s(E, I // 128, H // 128), s(E, H // 128, I // 128),
                   config=config_for_arch(NAME, arch))
        return call

    return [
        ("bf16 experts", experts(False, 64)),
        ("fp8 experts", experts(True, 64)),
        ("bf16 experts, decode (matrix-vector)", experts(False, 4)),
        ("fp8 experts, decode (matrix-vector)", experts(True, 4)),
    ]


def _example():
    E, H, I = 4, 24, 16
    gate_up = torch.randn(E, 2 * I, H)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(6)])
    return (torch.randn(6, H), ids, torch.rand(6, 2), gate_up[:, :I], gate_up[:, I:], torch.randn(E, H, I),
            None, None, None, 128, 128)


KERNEL = spec.KernelSpec(NAME, DEFAULT_CONFIGS, _aot_cases)
# a grouped GEMM; tokens (x, topk_ids, topk_weights) batch-first
OPS = (spec.OpSpec("moe_experts", spec.GEMM, _flops, spec.batch_first(0, 1, 2), _example, KERNEL, experts=_experts),)
