"""MLA attention over the compressed (latent) KV cache, in the "absorbed" form DeepSeek decodes with.

Shapes: q_latent (B, H, Sq, R) (q's no-rope part already multiplied by W_UK), q_pe (B, H, Sq, P),
ckv (B, T, R) (latent cache, shared by all heads), kpe (B, T, P) (rope key, shared by all heads),
optional indices (B, Sq, TOPK) int32/int64 (DSA sparse variant: key t is kept for query i only
if t is in indices[b, i, :]; an index < 0 or >= T is an empty slot; indices are assumed
distinct, a duplicate counts twice in `launch`/`cpu_forward` and once in `reference`),
optional mask broadcastable to (B, H, Sq, T) (float: added to the scaled scores; bool: True
keeps; with indices it is read only at the selected positions).

    scores[b,h,i,t] = (q_latent[b,h,i] . ckv[b,t] + q_pe[b,h,i] . kpe[b,t]) * scale  (+ mask)
    out[b,h,i]      = sum_t softmax_t(scores[b,h,i]) * ckv[b,t]        -> (B, H, Sq, R)

`causal` keeps t for query i iff t <= i + causal_offset (T - Sq for a decode step); a query
row with no key kept gives NaN, or 0 with `zero_empty_rows`. R up to 1024 (DeepSeek: 512),
P up to 128 (DeepSeek: 64). Output contiguous in q_latent's dtype; accumulation float32.

- `_mla_fwd`: Triton kernel. One program per (query row i, batch, block of BLOCK_H heads): the
  heads of one query row share every ckv/kpe tile they load, as FlashMLA does. It walks T (or
  the row's TOPK indices) in blocks of BLOCK_N; each ckv tile (BLOCK_N x R) is loaded ONCE and
  used as the key (transposed, for q_latent . ckv) and as the value (p @ ckv).
  R is not tiled: the whole latent row stays in the program, so the accumulator is
  BLOCK_H x next_pow2(R) float32 (16 x 512 x 4 B = 32 KiB, spread over the warps' registers)
  and the ckv tile BLOCK_N x R. Tiling R for the score dot would mean loading each ckv tile
  twice (R chunks for the scores, then the full rows for p @ ckv), and splitting the output R
  across programs would re-read all of ckv per split; DeepSeek's R=512 fits whole with
  BLOCK_H=16, BLOCK_N=32, 8 warps, 1 stage (at most 8 B of register spills on sm_90). Larger
  R (up to 1024) wants BLOCK_N=16 (~100 B of spills there).
  With few (query x batch x head-block) programs (batch-1 decode: one) the cache, or the row's
  TOPK index slots, is split over several programs (flash-decoding, grid axis 2): each writes its
  unnormalised accumulator, row max and sum of exp to a float32 workspace, and
  `_flash.SplitMerge` merges them exactly. How many splits: `_common.split_count` from the
  config (kernels/configs.py: below SM_COUNT programs, >= SPLIT_MIN keys each).
  Causal: a program's keys stop at its row's limit, so splits past it write an empty state.
- `cpu_forward`: torch, chunked over queries (dense: O(chunk x T) scores; sparse: gathers the
  selected ckv/kpe rows, O(chunk x TOPK x R)).
- `reference`: dense float32 math (index set scattered into a keep-mask), for tests.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._flash import SplitMerge, dot, flash_meta, mask_operand, masked_scores, normalise, softmax_step
from ._common import (softmax_rows, contiguous_like, dot_block, GRID_YZ_MAX, GuardedPlans, SplitRule, broadcasts_to, fail, cdiv, retries_smaller, check, check_float,
                      check_grid, next_pow2)
from . import configs, spec  # (modules: configs reads the kernel files' declarations when first used)
from .sparse_attention import check_indices, check_mask, check_scalars, gather_mask, index_keep_mask

NAME = "mla_decode"
MAX_LATENT_DIM = 1024
MAX_ROPE_DIM = 128

# Suggested launch rows (the lead wires them into kernels/configs.py).
# BLOCK_H: heads per program (power of two >= 16; the tile is min(BLOCK_H, max(16, next_pow2(H)))
# rows); BLOCK_N: cache positions (or selected indices) per step (>= 16).
# SPLIT_MIN / MAX_SPLITS: the decode key split (see launch), with SM_COUNT from
# kernels/configs.py.
DEFAULT_CONFIGS = {
    "interpreter": {"BLOCK_H": 16, "BLOCK_N": 16, "SPLIT_MIN": 16, "MAX_SPLITS": 4},
    # R=512, P=64, bf16, sm_90: compiled ahead of time with Triton 3.9 (no run): 255 registers,
    # 0-8 B spilled; 2 stages spilled ~30 B, BLOCK_H=64 ~600 B. Not timed on a GPU yet.
    # Splits of >= 256 keys: 8 blocks of 32 per program amortise the combine's extra pass.
    # WIDE_R: the blocks for a latent dim above MAX_R (lowering/aot.py, sm_89: R=1024 with the
    # row's BLOCK_N=32 asks 165,888 B of shared memory, Ada has 101,376; BLOCK_N=16 with 2 stages
    # asks 70,144 B, with 1 stage 100,352 B).
    "cuda": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "SPLIT_MIN": 256,
             "MAX_SPLITS": 16, "WIDE_R": {"MAX_R": 512, "BLOCK_N": 16, "num_stages": 2}},
}


@triton.jit
def _mla_fwd(
    QL, QP, CKV, KPE, IDX, M, O, WS,
    stride_qlb, stride_qlh, stride_qlm, stride_qlr,
    stride_qpb, stride_qph, stride_qpm, stride_qpp,
    stride_cb, stride_cn, stride_cr,
    stride_pb, stride_pn, stride_pp,
    stride_ib, stride_im, stride_it,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_or,
    num_heads, head_blocks, seq_kv, topk, dim_r, dim_p,
    scale, causal_offset, split_keys,
    HAS_INDICES: tl.constexpr,
    MASK_KIND: tl.constexpr,  # 0 none, 1 additive float, 2 boolean keep
    CAUSAL: tl.constexpr,
    ZERO_EMPTY_ROWS: tl.constexpr,
    SPLIT: tl.constexpr,  # several key splits: write partial results to WS (_flash.SplitMerge)
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # see `launch`
):
    # 64-bit row, head and batch offsets: B x T x R of a long latent cache (or a long-context
    # mask row) can pass 2**31 elements
    # batch x head blocks along x (up to 2^31 programs), query rows along y (CUDA allows 65,535)
    pid = tl.program_id(0)
    i = tl.program_id(1).to(tl.int64)  # query row
    split = tl.program_id(2)
    hb = pid % head_blocks
    b = (pid // head_blocks).to(tl.int64)

    heads = (hb * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    row_ok = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_ok = offs_r < dim_r
    p_ok = offs_p < dim_p

    ql = tl.load(QL + b * stride_qlb + i * stride_qlm + heads[:, None] * stride_qlh + offs_r[None, :] * stride_qlr,
                 mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    qp = tl.load(QP + b * stride_qpb + i * stride_qpm + heads[:, None] * stride_qph + offs_p[None, :] * stride_qpp,
                 mask=row_ok[:, None] & p_ok[None, :], other=0.0)
    c_base = CKV + b * stride_cb
    p_base = KPE + b * stride_pb
    m_base = M + b * stride_mb + i * stride_mm + heads[:, None] * stride_mh

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)

    if HAS_INDICES:
        hi = topk
    else:
        hi = seq_kv
        if CAUSAL:
            # this program serves one query row: keys past i + offset are never visited
            hi = tl.maximum(tl.minimum(seq_kv, i + causal_offset + 1), 0)
    # this program's share of the keys, or of the index slots (all of them with one split)
    lo = split * split_keys
    hi = tl.minimum(hi, lo + split_keys)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if HAS_INDICES:
            cols = tl.load(IDX + b * stride_ib + i * stride_im + offs_n * stride_it,
                           mask=offs_n < hi, other=-1).to(tl.int64)
            col_ok = (cols >= 0) & (cols < seq_kv)
        else:
            cols = offs_n.to(tl.int64)
            col_ok = cols < hi
        if CAUSAL:
            col_ok = col_ok & (cols <= i + causal_offset)
        cols = tl.where(col_ok, cols, 0)

        # one load of the latent tile serves as key and as value
        c = tl.load(c_base + cols[:, None] * stride_cn + offs_r[None, :] * stride_cr,
                    mask=col_ok[:, None] & r_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_R)
        kp = tl.load(p_base + cols[None, :] * stride_pn + offs_p[:, None] * stride_pp,
                     mask=col_ok[None, :] & p_ok[:, None], other=0.0)  # (BLOCK_P, BLOCK_N)
        s = dot(ql, tl.trans(c), DOT_PRECISION, DOT_UPCAST)
        s = (s + dot(qp, kp, DOT_PRECISION, DOT_UPCAST)) * scale
        keep = col_ok[None, :] & row_ok[:, None]
        s = masked_scores(s, keep, m_base + cols[None, :] * stride_mn, MASK_KIND)

        p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + dot(p.to(c.dtype), c, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    if SPLIT:
        # partial results in the output's row order (b, head, query), merged by SplitMerge.combine
        batch = tl.num_programs(0) // head_blocks
        seq_q = tl.num_programs(1)
        at = ((split * batch + b) * num_heads + heads) * seq_q + i
        WS_ML = WS + tl.num_programs(2).to(tl.int64) * batch * num_heads * seq_q * dim_r
        tl.store(WS + at[:, None] * dim_r + offs_r[None, :], acc, mask=row_ok[:, None] & r_ok[None, :])
        tl.store(WS_ML + at * 2, m_i, mask=row_ok)
        tl.store(WS_ML + at * 2 + 1, l_i, mask=row_ok)
    else:
        out = normalise(acc, l_i, row_ok, ZERO_EMPTY_ROWS)
        tl.store(O + b * stride_ob + i * stride_om + heads[:, None] * stride_oh + offs_r[None, :] * stride_or,
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & r_ok[None, :])



def check_inputs(q_latent, q_pe, ckv, kpe, indices, mask, scale, causal, causal_offset,
                 zero_empty_rows=False) -> None:
    """Raise KernelInputError unless the inputs are ones every implementation supports."""
    for name, t, nd, dims in (("q_latent", q_latent, 4, "(batch, heads, seq, latent_dim)"),
                              ("q_pe", q_pe, 4, "(batch, heads, seq, rope_dim)"),
                              ("ckv", ckv, 3, "(batch, cache_len, latent_dim)"),
                              ("kpe", kpe, 3, "(batch, cache_len, rope_dim)")):
        check_float(NAME, name, t)
        if not t.dim() == nd:
            fail(NAME, f"{name} must be {nd}-D {dims}, got shape {tuple(t.shape)}")
    if not q_latent.dtype == q_pe.dtype == ckv.dtype == kpe.dtype:
        fail(NAME, f"q_latent, q_pe, ckv, kpe dtypes differ: {q_latent.dtype}, {q_pe.dtype}, {ckv.dtype}, {kpe.dtype}")
    check(q_latent.device == q_pe.device == ckv.device == kpe.device, NAME,
          "q_latent, q_pe, ckv, kpe are on different devices")
    B, H, Sq, R = q_latent.shape
    P = q_pe.shape[3]
    if not tuple(q_pe.shape[:3]) == (B, H, Sq):
        fail(NAME, f"q_pe shape {tuple(q_pe.shape)} does not match q_latent shape {tuple(q_latent.shape)} "
          "in batch/heads/seq")
    if not (ckv.shape[0] == B and kpe.shape[0] == B):
        fail(NAME, f"batch sizes differ: q_latent {B}, ckv {ckv.shape[0]}, kpe {kpe.shape[0]}")
    T = ckv.shape[1]
    if not kpe.shape[1] == T:
        fail(NAME, f"ckv and kpe cache lengths differ: {T} vs {kpe.shape[1]}")
    check(T > 0, NAME, "the latent cache is empty (cache_len 0)")
    if not ckv.shape[2] == R:
        fail(NAME, f"q_latent and ckv latent dims differ: {R} vs {ckv.shape[2]}")
    if not kpe.shape[2] == P:
        fail(NAME, f"q_pe and kpe rope dims differ: {P} vs {kpe.shape[2]}")
    if not 0 < R <= MAX_LATENT_DIM:
        fail(NAME, f"latent dim must be in 1..{MAX_LATENT_DIM}, got {R}")
    if not 0 < P <= MAX_ROPE_DIM:
        fail(NAME, f"rope dim must be in 1..{MAX_ROPE_DIM}, got {P}")
    if indices is not None:
        check_indices(NAME, indices, B, Sq, q_latent.device)
    check_mask(NAME, mask, (B, H, Sq, T), q_latent.device)
    check_scalars(NAME, scale, causal, causal_offset, zero_empty_rows)


class _Launch:
    """What a launch decides from everything but the cache length and causal offset (read per
    call: a decode step's cache grows by one each step): blocks, splits rule, constexprs."""

    __slots__ = ("B", "H", "Sq", "R", "P", "topk", "block_h", "head_blocks", "split", "merge", "meta", "meta_split",
                 "same_layout", "head", "index_strides", "dims")

    def __init__(self, q_latent, q_pe, ckv, kpe, indices, mask, causal, zero_empty_rows, config):
        config = default_config(q_latent) if config is None else config
        B, H, Sq, R = q_latent.shape
        P = q_pe.shape[3]
        self.B, self.H, self.Sq, self.R, self.P = B, H, Sq, R, P
        self.topk = 0 if indices is None else indices.shape[2]
        wide = config.get("WIDE_R")
        if wide is not None and R > wide["MAX_R"]:
            config = {**config, **{k: v for k, v in wide.items() if k != "MAX_R"}}
        # the head tile is padded to 16 rows (tl.dot's minimum) when there are fewer heads
        self.block_h = block_h = min(dot_block(NAME, config, "BLOCK_H"), max(16, next_pow2(H)))
        block_n = dot_block(NAME, config, "BLOCK_N")
        self.head_blocks = cdiv(H, block_h)
        check_grid((B * self.head_blocks, Sq, 1), NAME, f"{Sq} query rows")
        # flash-decoding: few (query x batch x head block) programs, batch-1 decode above all,
        # split the cache (or the top-k slots) over several programs
        self.split = SplitRule(config, Sq * B * self.head_blocks, block_n)
        self.merge = SplitMerge(B * H * Sq, R, zero_empty_rows)
        self.meta = flash_meta(q_latent.dtype, mask, causal, zero_empty_rows, config, HAS_INDICES=indices is not None,
                               BLOCK_H=block_h, BLOCK_N=block_n,
                               BLOCK_R=max(16, next_pow2(R)), BLOCK_P=max(16, next_pow2(P)), SPLIT=False)
        self.meta_split = {**self.meta, "SPLIT": True}
        self.same_layout = q_latent.is_contiguous()
        # the kernel's arguments that follow from the signature, around the per-call ones
        # (the caches' strides are read per call: a cache grown by concatenation moves them every step)
        self.head = (*q_latent.stride(), *q_pe.stride())
        self.index_strides = (0, 0, 0) if indices is None else indices.stride()
        self.dims = (H * Sq * R, Sq * R, R, 1, H, self.head_blocks)


# one per (index given, mask given): the guarded tensors are (q_latent, q_pe, ckv, kpe[, indices][, mask]);
# the caches' length, and the strides a cache grown by concatenation moves; the mask's shape
_CACHES = {2: ((1,), None), 3: ((1,), None)}
_launches = {(False, False): GuardedPlans(vary=_CACHES), (True, False): GuardedPlans(vary=_CACHES),
             (False, True): GuardedPlans(vary={**_CACHES, 4: (None, None)}),
             (True, True): GuardedPlans(vary={**_CACHES, 5: (None, None)})}


def _key(args: tuple, config) -> tuple:
    """The plan's key behind the guards: everything check_inputs and _Launch read but the cache
    length and causal offset (inputs that are not tensors of the right rank get check_inputs' error)."""
    q_latent, q_pe, ckv, kpe, indices, mask, scale, causal, _, zero_empty_rows = args
    try:
        Bc, _, Rc = ckv.shape
        Bk, _, Pk = kpe.shape
        index_sig = None if indices is None else (indices.shape, indices.stride(), indices.dtype, indices.device)
        mask_sig = None if mask is None else (mask.dtype, mask.device, mask.dim())
        return (q_latent.shape, q_latent.stride(), q_latent.dtype, q_latent.device, q_pe.shape, q_pe.stride(),
                q_pe.dtype, q_pe.device, Bc, Rc, ckv.dtype, ckv.device, Bk, Pk, kpe.dtype, kpe.device, index_sig,
                mask_sig, scale, causal, zero_empty_rows)
    except (AttributeError, ValueError, TypeError):
        check_inputs(*args)
        raise


def default_config(q_latent, *args) -> dict:
    """The config row for the inputs' device (kernels/configs.py)."""
    return configs.config_for(NAME, q_latent.device)


@retries_smaller(NAME, default_config)
def launch(q_latent, q_pe, ckv, kpe, indices, mask, scale: float, causal: bool, causal_offset: int,
           zero_empty_rows: bool = False, *, config: dict | None = None) -> torch.Tensor:
    """Run the Triton kernel. `config` (None: the device's row) holds BLOCK_H, BLOCK_N, num_warps, num_stages, and the key
    split's SM_COUNT, SPLIT_MIN, MAX_SPLITS (or SPLITS to force a count; _common.SplitRule).
    Checks and decisions that do not depend on the cache length are made once per signature."""
    args = (q_latent, q_pe, ckv, kpe, indices, mask, scale, causal, causal_offset, zero_empty_rows)
    tensors = (q_latent, q_pe, ckv, kpe)
    if indices is not None:
        tensors += (indices,)
    if mask is not None:
        tensors += (mask,)
    plan = _launches[indices is not None, mask is not None].get_guarded((scale, causal, zero_empty_rows), tensors,
                                                                        config, _key, _checked_launch, args, config)
    T = ckv.shape[1]
    B, H, Sq, R = plan.B, plan.H, plan.Sq, plan.R
    if not (kpe.shape[1] == T > 0 and type(causal_offset) is int
            and (mask is None or broadcasts_to(mask.shape, (B, H, Sq, T)))):
        check_inputs(*args)
    out = contiguous_like(q_latent, dense=plan.same_layout)
    if B * H * Sq * R == 0:
        return out
    m, mstrides = mask_operand(mask, q_latent, (B, H, Sq, T))
    idx = q_latent if indices is None else indices
    splits, split_keys = plan.split(T if indices is None else plan.topk)
    if splits > 1:
        if splits > GRID_YZ_MAX:
            check_grid((B * plan.head_blocks, Sq, splits), NAME, f"{Sq} query rows")
        ws = plan.merge.workspace(splits, q_latent)
        meta = plan.meta_split
    else:
        ws = out  # not written
        meta = plan.meta
    _mla_fwd[(B * plan.head_blocks, Sq, splits)](
        q_latent, q_pe, ckv, kpe, idx, m, out, ws, *plan.head, *ckv.stride(), *kpe.stride(),
        *plan.index_strides, *mstrides, *plan.dims,
        T, plan.topk, R, plan.P, float(scale), causal_offset, split_keys, **meta,
    )
    if splits > 1:
        plan.merge.combine(ws, splits, out)
    return out


def _checked_launch(args: tuple, config) -> _Launch:
    check_inputs(*args)
    q_latent, q_pe, ckv, kpe, indices, mask, _, causal, _, zero_empty_rows = args
    return _Launch(q_latent, q_pe, ckv, kpe, indices, mask, causal, zero_empty_rows, config)


def reference(q_latent, q_pe, ckv, kpe, indices=None, mask=None, scale=None, causal=False,
              causal_offset=0, zero_empty_rows=False) -> torch.Tensor:
    """Dense float32 math (scores over the whole cache, index set as a keep-mask): the test oracle.
    `scale=None` means 1/sqrt(R + P); DeepSeek passes its own (1/sqrt(nope + rope head dim))."""
    R, P = q_latent.shape[-1], q_pe.shape[-1]
    scale = 1.0 / math.sqrt(R + P) if scale is None else scale
    Sq, T = q_latent.shape[2], ckv.shape[1]
    cf = ckv.float()[:, None]  # (B, 1, T, R): one latent row serves every head
    s = (q_latent.float() @ cf.transpose(-1, -2) + q_pe.float() @ kpe.float()[:, None].transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    if causal:
        i = torch.arange(Sq, device=s.device)[:, None]
        t = torch.arange(T, device=s.device)[None, :]
        s = s.masked_fill(t > i + causal_offset, float("-inf"))
    if indices is not None:
        s = s.masked_fill(~index_keep_mask(indices, T)[:, None], float("-inf"))
    p = softmax_rows(s, zero_empty_rows)
    return (p @ cf).to(q_latent.dtype)


# Bytes per query chunk in the CPU path (scores, or gathered ckv/kpe rows + scores).
_CPU_CHUNK_BYTES = 64 * 2**20


def cpu_forward(q_latent, q_pe, ckv, kpe, indices, mask, scale: float, causal: bool, causal_offset: int,
                zero_empty_rows: bool = False) -> torch.Tensor:
    """CPU path: exact softmax chunked over queries; gathers the selected rows when indices are given."""
    check_inputs(q_latent, q_pe, ckv, kpe, indices, mask, scale, causal, causal_offset, zero_empty_rows)
    B, H, Sq, R = q_latent.shape
    P, T = q_pe.shape[3], ckv.shape[1]
    dev = q_latent.device
    out = torch.empty((B, H, Sq, R), dtype=q_latent.dtype, device=dev)
    if indices is None:
        cf = ckv.float()[:, None]  # (B, 1, T, R)
        pf = kpe.float()[:, None]  # (B, 1, T, P)
        per_row = B * H * T * 4 * 3  # mask, scores, probabilities
    else:
        topk = indices.shape[2]
        bidx = torch.arange(B, device=dev)[:, None, None]
        per_row = B * topk * 4 * (R + P + 3 * H)  # gathered ckv, kpe; mask, scores, probabilities
    chunk = max(1, min(Sq, _CPU_CHUNK_BYTES // max(1, per_row)))
    for i0 in range(0, Sq, chunk):
        i1 = min(Sq, i0 + chunk)
        ql = q_latent[:, :, i0:i1].float()
        qp = q_pe[:, :, i0:i1].float()
        rows = torch.arange(i0, i1, device=dev)
        if indices is None:
            s = (ql @ cf.transpose(-1, -2) + qp @ pf.transpose(-1, -2)) * scale  # (B, H, c, T)
            keep = None
            if causal:
                keep = (torch.arange(T, device=dev)[None, :] <= rows[:, None] + causal_offset)[None, None]
            if mask is not None:
                mc = mask.expand(B, H, Sq, T)[:, :, i0:i1]
                if mc.dtype == torch.bool:
                    keep = mc if keep is None else keep & mc
                else:
                    s = s + mc.float()
        else:
            idx = indices[:, i0:i1].long()  # (B, c, TOPK)
            ok = (idx >= 0) & (idx < T)
            if causal:
                ok = ok & (idx <= rows[None, :, None] + causal_offset)
            idx = torch.where(ok, idx, 0)
            cg = ckv[bidx, idx].float()  # (B, c, TOPK, R)
            pg = kpe[bidx, idx].float()  # (B, c, TOPK, P)
            s = (torch.einsum("bhcr,bctr->bhct", ql, cg) + torch.einsum("bhcp,bctp->bhct", qp, pg)) * scale
            keep = ok[:, None]  # (B, 1, c, TOPK)
            if mask is not None:
                mg = gather_mask(mask, (B, H, Sq, T), i0, i1, idx)
                if mg.dtype == torch.bool:
                    keep = keep & mg
                else:
                    s = s + mg.float()
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        p = softmax_rows(s, zero_empty_rows)
        if indices is None:
            o = p @ cf
        else:
            o = torch.einsum("bhct,bctr->bhcr", p, cg)
        out[:, :, i0:i1] = o.to(out.dtype)
    return out


# ---- the declaration (kernels/spec.py) ----------------------------------------------------------

def _flops(args, outs):  # scores over the latent and rotated keys, values from the latent
    q_latent, q_pe, ckv, indices = args[0], args[1], args[2], args[4]
    B, H, Sq, R = (spec.size_hint(s) for s in q_latent.shape)
    keys = spec.size_hint(ckv.shape[1]) if indices is None else spec.size_hint(indices.shape[-1])
    return 2 * B * H * Sq * keys * (2 * R + spec.size_hint(q_pe.shape[-1])), spec.peak_key(q_latent.dtype)


def _aot_cases():
    from .configs import config_for_arch

    g, randn = spec.aot_inputs()

    def mla(sparse_indices, Sq=2, T=300, topk=64, R=512, mask=None):
        def call(arch):
            B, H, P = 1, 16, 64
            idx = torch.randint(0, T, (B, Sq, topk), generator=g, dtype=torch.int32) if sparse_indices else None
            m = (randn(B, 1, Sq, T) if mask == "additive"
                 else torch.rand(B, 1, Sq, T, generator=g) > 0.2 if mask == "bool" else None)
            launch(randn(B, H, Sq, R), randn(B, H, Sq, P), randn(B, T, R), randn(B, T, P), idx, m,
                   (R + P) ** -0.5, m is None, T - Sq, config=config_for_arch(NAME, arch))
        return call

    return [
        ("bf16 dense", mla(False)),
        ("bf16 sparse top-64", mla(True)),
        ("bf16 dense decode, key splits", mla(False, Sq=1, T=4096)),
        ("bf16 sparse top-2048 decode, key splits", mla(True, Sq=1, T=4096, topk=2048)),
        ("bf16 R=1024 dense", mla(False, R=1024)),
        ("bf16 R=1024 decode, key splits", mla(False, Sq=1, T=4096, R=1024)),
        ("bf16 additive mask", mla(False, mask="additive")),
        ("bf16 sparse top-64, bool mask", mla(True, mask="bool")),
    ]


def _example():
    return (torch.randn(2, 4, 1, 32), torch.randn(2, 4, 1, 8), torch.randn(2, 9, 32), torch.randn(2, 9, 8), None, None,
            0.2, True, 8, False)


KERNEL = spec.KernelSpec(NAME, DEFAULT_CONFIGS, _aot_cases, splits=True)
OPS = (spec.OpSpec("mla_decode", spec.ATTENTION, _flops, spec.batch_first(0, 1, 2, 3, 4, mask=5), _example, KERNEL),)
