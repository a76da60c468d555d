"""Fused attention: softmax(q k^T * scale + mask) v, flash-attention style.

Shapes: q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), Hq a multiple of Hkv (GQA:
query head h reads kv head h // (Hq // Hkv), K/V are never expanded). `mask` is optional,
broadcastable to (B, Hq, Sq, Sk): float = added to the scaled scores, bool = True keeps.
`causal` keeps key j for query i iff j <= i + causal_offset (offset 0 is torch's top-left
`is_causal`; Sk - Sq is the bottom-right form a decode step with a KV cache needs).
`window` W > 0 (causal only) also drops keys j <= i + causal_offset - W: each query sees its
last W positions, itself included (Hugging Face's sliding window: kv > q - W and kv <= q).
`softcap` c > 0 caps the scaled scores to c * tanh(scores / c) before any mask (Gemma 2).
A query row that keeps no key gives NaN, as softmax over an all -inf row does in eager code,
or 0 with `zero_empty_rows` (what torch's SDPA returns there).
D and Dv may differ (MLA), both up to 256. The output is (B, Hq, Sq, Dv), contiguous, in
q's dtype; accumulation is float32.

Three implementations of the same function:
- `_attention_fwd`: the Triton kernel (online softmax, the Sq x Sk matrix never exists). One
  program per (block of query rows, batch x head); key blocks above the causal diagonal are
  never visited, nor, with a window, those wholly before it. A decode step (one query block) with fewer batch x head programs than the GPU
  has SMs splits the keys over several programs (flash-decoding, grid axis 2): each writes its
  unnormalised accumulator, row max and sum of exp, and `_flash.SplitMerge` merges them
  exactly. The split count comes from the config (`_common.split_count`). On a CUDA GPU
  triton.autotune picks among the config row's AUTOTUNE alternatives per shape bucket;
- `cpu_forward`: the CPU path, torch's fused SDPA kernel where it applies, else a
  query-chunked exact softmax whose memory is O(chunk x Sk);
- `reference`: plain math, materialising everything, for tests.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _common
from . import configs, spec  # (modules: configs reads the kernel files' declarations when first used)
from ._flash import (SplitMerge, dot, flash_meta, mask_operand, masked_scores, normalise, soft_cap, softmax_step)
from ._common import (softmax_rows, FLOAT_DTYPES, GRID_YZ_MAX, TUNED_KEYS, GuardedPlans, autotuned, broadcasts_to, cdiv, check, check_grid,
                      check_qkv, fail, next_pow2, retries_smaller, SplitRule, tune_candidates)

NAME = "attention"
MAX_HEAD_DIM = 256


@triton.jit
def _attention_fwd(
    Q, K, V, M, O, WS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    num_heads, group, seq_q, seq_k, head_d, head_dv,
    scale, causal_offset, split_keys, softcap, window,
    MASK_KIND: tl.constexpr,  # 0 none, 1 additive float, 2 boolean keep
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,  # with CAUSAL: keys before the sliding window are dropped
    ZERO_EMPTY_ROWS: tl.constexpr,
    SPLIT: tl.constexpr,  # several key splits: write partial results to WS (_flash.SplitMerge)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # see `launch`
):
    # 64-bit offsets: a KV cache of batch x heads x tokens x head_dim passes 2^31 elements
    # (64 x 8 x 32k x 128), and int32 address arithmetic would wrap
    # batch x heads along x (up to 2^31 programs), query blocks along y (CUDA allows 65,535)
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    hk = h // group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seq_q

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < head_d), other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    m_base = M + b * stride_mb + h * stride_mh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    hi = seq_k
    if CAUSAL:
        # the last query row of this block sees keys up to (its index + offset)
        hi = tl.maximum(tl.minimum(seq_k, (pid_m + 1) * BLOCK_M + causal_offset), 0)
    # this program's share of the keys (all of them with one split)
    lo = split * split_keys
    hi = tl.minimum(hi, lo + split_keys)
    if WINDOW:
        # the first query row of this block sees keys from (its index + offset - window + 1):
        # start at the key block holding that one
        first = pid_m * BLOCK_M + causal_offset - window + 1
        lo = tl.maximum(lo, (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = (start_n + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = offs_n < hi
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=col_ok[None, :] & (offs_d[:, None] < head_d), other=0.0)
        s = dot(q, kt, DOT_PRECISION, DOT_UPCAST) * scale
        if SOFTCAP:
            s = soft_cap(s, softcap)
        keep = col_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        if WINDOW:
            keep = keep & (offs_n[None, :] > offs_m[:, None] + causal_offset - window)
        s = masked_scores(s, keep, m_base + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn, MASK_KIND)

        p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=col_ok[:, None] & (offs_dv[None, :] < head_dv), other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    if SPLIT:
        # partial results in the output's row order (b, h, query), merged by SplitMerge.combine;
        # a split past the causal limit still writes its empty state (m -inf, l 0)
        at = (split.to(tl.int64) * tl.num_programs(0) + pid_bh) * seq_q + offs_m
        WS_ML = WS + tl.num_programs(2).to(tl.int64) * tl.num_programs(0) * seq_q * head_dv
        tl.store(WS + at[:, None] * head_dv + offs_dv[None, :], acc,
                 mask=row_ok[:, None] & (offs_dv[None, :] < head_dv))
        tl.store(WS_ML + at * 2, m_i, mask=row_ok)
        tl.store(WS_ML + at * 2 + 1, l_i, mask=row_ok)
    else:
        out = normalise(acc, l_i, row_ok, ZERO_EMPTY_ROWS)
        tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < head_dv))


def check_inputs(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows=False, softcap=0.0,
                 window=0) -> None:
    """Raise KernelInputError unless the inputs are ones every implementation supports."""
    B, Hq, Sq, D, Hkv, Sk = check_qkv(NAME, q, k, v)
    Dv = v.shape[3]
    if not (0 < D <= MAX_HEAD_DIM and 0 < Dv <= MAX_HEAD_DIM):
        fail(NAME, f"head dims must be in 1..{MAX_HEAD_DIM}, got q/k {D}, v {Dv}")
    if mask is not None:
        check(isinstance(mask, torch.Tensor), NAME, "mask must be a tensor or None")
        if not (mask.dtype == torch.bool or mask.dtype in FLOAT_DTYPES):
            fail(NAME, f"mask dtype {mask.dtype} unsupported: use bool (True keeps) or a float additive mask")
        check(mask.device == q.device, NAME, "mask is on a different device than q")
        if not mask.dim() <= 4:
            fail(NAME, f"mask must have at most 4 dims, got {mask.dim()}")
        if not broadcasts_to(mask.shape, (B, Hq, Sq, Sk)):
            fail(NAME, f"mask shape {tuple(mask.shape)} does not broadcast to {(B, Hq, Sq, Sk)}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        fail(NAME, f"scale must be a finite number, got {scale!r}")
    if not isinstance(causal, bool):
        fail(NAME, f"causal must be a bool, got {causal!r}")
    if not isinstance(causal_offset, int):
        fail(NAME, f"causal_offset must be an int, got {causal_offset!r}")
    if not isinstance(zero_empty_rows, bool):
        fail(NAME, f"zero_empty_rows must be a bool, got {zero_empty_rows!r}")
    if not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and math.isfinite(softcap)
          and softcap >= 0):
        fail(NAME, f"softcap must be a finite number >= 0 (0: none), got {softcap!r}")
    if not (isinstance(window, int) and not isinstance(window, bool) and window >= 0):
        fail(NAME, f"window must be an int >= 0 (0: none), got {window!r}")
    if not (window == 0 or causal):
        fail(NAME, f"a sliding window ({window}) needs causal=True: it counts back from the "
                                       "causal diagonal")


# triton.autotune's shape buckets (CUDA only): query and key counts by powers of two, capped,
# so a decode context growing token by token is tuned once per doubling, not per step
_TUNE_KEY = ("BLOCK_D", "BLOCK_DV", "MASK_KIND", "CAUSAL", "SOFTCAP", "WINDOW", "SPLIT")
_MAX_Q_BUCKET, _MAX_K_BUCKET = 256, 16384


class _Launch:
    """What a launch decides from everything but the key count and causal offset (a decode step's
    context grows by one each step; those two are read per call): blocks, constexprs, tuner, and
    the kernel's arguments that follow from the signature."""

    __slots__ = ("B", "Hq", "Sq", "Hkv", "D", "Dv", "bh", "q_blocks", "split", "merge", "meta", "meta_split", "candidates",
                 "contiguous_out", "head", "dims", "tail", "last")

    def __init__(self, q, k, v, mask, scale, causal, zero_empty_rows, softcap, window, config):
        autotune = _common.autotune_enabled(q.device)
        B, Hq, Sq, D = q.shape
        self.B, self.Hq, self.Sq, self.D, self.Hkv, self.Dv = B, Hq, Sq, D, k.shape[1], v.shape[3]
        Dv = self.Dv
        self.bh = B * Hq
        # a decode step's few query rows get a tile of 16 rows, not 128 mostly masked off
        rows_cap = max(16, next_pow2(Sq))

        def clamp(c: dict) -> dict:
            return {**c, "BLOCK_M": min(c["BLOCK_M"], rows_cap)}

        fixed = clamp({key: config[key] for key in TUNED_KEYS if key in config})
        block_m, block_n = fixed["BLOCK_M"], fixed["BLOCK_N"]
        self.q_blocks = cdiv(Sq, block_m)
        # flash-decoding: one query block (decode) and few (batch x head) programs split the keys
        split_any = self.q_blocks == 1 or "SPLITS" in config
        self.split = SplitRule(config, self.q_blocks * B * Hq, block_n) if split_any else None
        self.merge = SplitMerge(B * Hq * Sq, Dv, zero_empty_rows) if split_any else None
        self.candidates = tune_candidates(config, clamp) if autotune else []
        check_grid((B * Hq, cdiv(Sq, min(c["BLOCK_M"] for c in self.candidates or [fixed])), 1), NAME,
                   f"{Sq} query rows")
        tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n) if len(self.candidates) <= 1 else {}
        self.meta = flash_meta(q.dtype, mask, causal, zero_empty_rows, fixed if tiles else None,
                               SOFTCAP=softcap > 0, WINDOW=window > 0, **tiles,
                               BLOCK_D=max(16, next_pow2(D)), BLOCK_DV=max(16, next_pow2(Dv)), SPLIT=False)
        self.meta_split = {**self.meta, "SPLIT": True}
        self.contiguous_out = Dv == D and q.is_contiguous()
        # the kernel's arguments around the key count, the causal offset and the split length (k's
        # and v's strides are read per call: a cache grown by concatenation moves them every step)
        self.head = q.stride()
        self.dims = (Hq * Sq * Dv, Sq * Dv, Dv, 1, Hq, Hq // self.Hkv, Sq)
        self.tail = (D, Dv, float(scale))
        self.last = (float(softcap or 1.0), int(window))


# k / v: the key count, and the strides a cache grown by concatenation moves; the mask: its shape
_launches = GuardedPlans(vary={1: ((2,), None), 2: ((2,), None), 3: (None, None)})


def _key(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows, softcap, window, config) -> tuple:
    """The plan's key behind the guards: everything check_inputs and _Launch read but the key
    count and causal offset (inputs that are not 4-D tensors get check_inputs' error)."""
    try:
        Bk, Hkv, _, Dk = k.shape
        Bv, Hv, _, Dv = v.shape
        mask_sig = None if mask is None else (mask.dtype, mask.device, mask.dim())
        return (q.shape, q.stride(), q.dtype, q.device, Bk, Hkv, Dk, k.dtype, k.device,
                Bv, Hv, Dv, v.dtype, v.device, mask_sig, scale, causal, zero_empty_rows, softcap, window)
    except (AttributeError, ValueError, TypeError):
        check_inputs(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows, softcap, window)
        raise


def default_config(q, k, v, *args) -> dict:
    """The config row for these inputs on their device (kernels/configs.py)."""
    return configs.config_for(NAME, q.device, head_dim=max(q.shape[-1], v.shape[-1]), dtype=q.dtype)


@retries_smaller(NAME, default_config)
def launch(q, k, v, mask, scale: float, causal: bool, causal_offset: int, zero_empty_rows: bool = False,
           softcap: float = 0.0, window: int = 0, *, config: dict | None = None) -> torch.Tensor:
    """Run the Triton kernel. `config` (kernels/configs.py; None: the row for the inputs' device,
    head dim and dtype, looked up once per signature) holds BLOCK_M, BLOCK_N,
    num_warps, num_stages; the key split's SM_COUNT, SPLIT_MIN, MAX_SPLITS (or SPLITS to
    force a count, see _common.split_count); and AUTOTUNE, alternatives that triton.autotune times
    against the row's own config on a CUDA GPU (elsewhere the row's config runs).

    The checks and decisions that do not depend on the key count are made once per signature
    (`_launches`); per call only the key count, the causal offset and the mask's shape are checked."""
    plan = _launches.get_guarded((scale, causal, zero_empty_rows, softcap, window),
                                 (q, k, v) if mask is None else (q, k, v, mask), config, _key, _checked_launch,
                                 q, k, v, mask, scale, causal, causal_offset, zero_empty_rows, softcap, window, config)
    Sk = k.shape[2]
    if not (v.shape[2] == Sk and type(causal_offset) is int
            and (mask is None or broadcasts_to(mask.shape, (plan.B, plan.Hq, plan.Sq, Sk)))):
        check_inputs(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows, softcap, window)
    out = torch.empty_like(q) if plan.contiguous_out else q.new_empty((plan.B, plan.Hq, plan.Sq, plan.Dv))
    if not plan.dims[0] * plan.B:
        return out
    m, mstrides = mask_operand(mask, q, (plan.B, plan.Hq, plan.Sq, Sk))
    splits, split_keys = plan.split(Sk) if plan.split is not None else (1, max(Sk, 1))
    if splits > 1:
        if splits > GRID_YZ_MAX:
            check_grid((plan.bh, plan.q_blocks, splits), NAME, f"{plan.Sq} query rows")
        ws = plan.merge.workspace(splits, q)
        meta = plan.meta_split
    else:
        ws = out  # not written
        meta = plan.meta
    args = (q, k, v, m, out, ws, *plan.head, *k.stride(), *v.stride(), *mstrides, *plan.dims, Sk, *plan.tail,
            causal_offset, split_keys, *plan.last)
    if len(plan.candidates) > 1:
        B, Hq, Sq = plan.B, plan.Hq, plan.Sq
        bucket = (min(next_pow2(Sq), _MAX_Q_BUCKET), min(next_pow2(Sk), _MAX_K_BUCKET))
        tuned = autotuned(_attention_fwd, plan.candidates, _TUNE_KEY, bucket)
        tuned[lambda meta: (B * Hq, cdiv(Sq, meta["BLOCK_M"]), splits)](*args, **meta)
    else:
        _attention_fwd[(plan.bh, plan.q_blocks, splits)](*args, **meta)
    if splits > 1:
        plan.merge.combine(ws, splits, out)
    return out


def _checked_launch(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows, softcap, window, config
                    ) -> _Launch:
    check_inputs(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows, softcap, window)
    return _Launch(q, k, v, mask, scale, causal, zero_empty_rows, softcap, window,
                   default_config(q, k, v) if config is None else config)


def _keep_mask(Sq: int, Sk: int, causal_offset: int, device, window: int = 0, key_start: int = 0) -> torch.Tensor:
    """Causal (and sliding-window) keep mask of Sq query rows over keys key_start .. key_start+Sk-1."""
    i = torch.arange(Sq, device=device)[:, None]
    j = torch.arange(key_start, key_start + Sk, device=device)[None, :]
    keep = j <= i + causal_offset
    return keep & (j > i + causal_offset - window) if window > 0 else keep


def reference(q, k, v, mask=None, scale=None, causal=False, causal_offset=0, zero_empty_rows=False,
              softcap=0.0, window=0) -> torch.Tensor:
    """Plain math in float32 (K/V expanded, full score matrix): the oracle for tests."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    if causal:
        s = s.masked_fill(~_keep_mask(q.shape[2], k.shape[2], causal_offset, q.device, window), float("-inf"))
    p = softmax_rows(s, zero_empty_rows)
    return (p @ vf).to(q.dtype)


# Score-matrix bytes per chunk in the CPU path: bounds its memory at O(chunk x Sk).
_CPU_CHUNK_BYTES = 64 * 2**20


def softcap_window(args, kwargs=None) -> tuple:
    """(softcap, window) from the arguments of a metainfer::attention call (positional as the
    op's schema orders them, or by name); (0.0, 0) where it has neither."""
    kwargs = kwargs or {}
    softcap = args[8] if len(args) > 8 else kwargs.get("softcap", 0.0)
    window = args[9] if len(args) > 9 else kwargs.get("window", 0)
    return softcap, window


def cpu_fused_path(head_dim, v_head_dim, mask_dtype, dtype, causal: bool, causal_offset, softcap=0.0,
                   window=0) -> bool:
    """Whether `cpu_forward` runs torch's fused SDPA kernel for these inputs (else the chunked
    path, which writes the score matrix); the cost model prices the two differently."""
    return (head_dim == v_head_dim  # the CPU flash kernel needs Dv == D, else torch materialises
            and (mask_dtype is None or mask_dtype in (torch.bool, dtype))
            and not (causal and (mask_dtype is not None or causal_offset != 0))
            and not softcap and not window)  # SDPA has neither


def chunk_keys(rows: int, keys: int, window: int) -> int:
    """Keys a chunk of `rows` query rows scores in the chunked path: with a window only those
    of its rows' windows (rows - 1 + window of them), else all."""
    return min(keys, rows - 1 + window) if window > 0 else keys


def _chunk_rows(B: int, Hq: int, Sq: int, Sk: int, window: int) -> int:
    return max(1, min(Sq, _CPU_CHUNK_BYTES // max(1, B * Hq * chunk_keys(Sq, Sk, window) * 4)))


def chunked_keys_per_row(B: int, Hq: int, Sq: int, Sk: int, window: int) -> int:
    """Keys the chunked path scores per query row (for the cost model)."""
    return chunk_keys(_chunk_rows(B, Hq, Sq, Sk, window), Sk, window)


def chunked_score_passes(has_mask: bool, causal: bool, softcap: bool = False) -> int:
    """Reads and writes of the fp32 score matrix by `_chunked`: the product written, scaled,
    soft-capped (divide, tanh, multiply), masked (and causally masked), softmax, read by p @ v."""
    return 1 + 2 + 6 * softcap + 2 * has_mask + 2 * causal + 2 + 1


def cpu_forward(q, k, v, mask, scale: float, causal: bool, causal_offset: int,
                zero_empty_rows: bool = False, softcap: float = 0.0, window: int = 0) -> torch.Tensor:
    """CPU path: torch's fused flash kernel where it computes exactly this, else chunked."""
    check_inputs(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows, softcap, window)
    if cpu_fused_path(q.shape[-1], v.shape[-1], None if mask is None else mask.dtype, q.dtype, causal, causal_offset,
                      softcap, window):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1]).contiguous()
        if mask is not None and not zero_empty_rows:
            # SDPA returns 0 for a query row with no key kept; softmax math gives NaN
            keeps = mask if mask.dtype == torch.bool else mask > float("-inf")
            empty = ~keeps.any(dim=-1, keepdim=True)
            if empty.any():
                out = out.masked_fill(empty, float("nan"))
        return out
    return _chunked(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows, softcap, window)


def _chunked(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows=False, softcap=0.0, window=0) -> torch.Tensor:
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    out = torch.empty((B, Hq, Sq, Dv), dtype=q.dtype, device=q.device)
    og = out.view(B, Hkv, G, Sq, Dv)
    qg = q.unflatten(1, (Hkv, G))  # (B, Hkv, G, Sq, D), a view
    kt = k.float().transpose(-1, -2).unsqueeze(2)  # (B, Hkv, 1, D, Sk)
    vf = v.float().unsqueeze(2)  # (B, Hkv, 1, Sk, Dv)
    m5 = None if mask is None else _grouped_mask(mask, Hkv, G)
    chunk = _chunk_rows(B, Hq, Sq, Sk, window)
    for i0 in range(0, Sq, chunk):
        i1 = min(Sq, i0 + chunk)
        # with a window only the keys these rows can see: O(rows x (rows + window)), not x Sk
        k0, k1 = (0, Sk) if window <= 0 else (
            min(Sk, max(0, i0 + causal_offset - window + 1)), min(Sk, max(0, i1 + causal_offset)))
        if k1 <= k0 and Sk > 0:  # no row sees a key: score one that the mask drops (NaN rows, as eager)
            k0, k1 = 0, 1
        s = (qg[:, :, :, i0:i1].float() @ kt[..., k0:k1]) * scale  # (B, Hkv, G, rows, keys)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if m5 is not None:
            mc = m5 if m5.shape[3] == 1 else m5[:, :, :, i0:i1]
            mc = mc if mc.shape[4] == 1 else mc[..., k0:k1]
            s = s.masked_fill(~mc, float("-inf")) if mc.dtype == torch.bool else s + mc.float()
        if causal:
            keep = _keep_mask(i1 - i0, k1 - k0, causal_offset + i0, q.device, window, key_start=k0)
            s = s.masked_fill(~keep, float("-inf"))
        p = softmax_rows(s, zero_empty_rows)
        og[:, :, :, i0:i1] = (p @ vf[..., k0:k1, :]).to(q.dtype)
    return out


def _grouped_mask(mask, Hkv, G):
    """A mask broadcastable to (B, Hq, Sq, Sk) as a view broadcastable to (B, Hkv, G, Sq, Sk)."""
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask
    return m.unflatten(1, (Hkv, G)) if m.shape[1] != 1 else m.unsqueeze(2)


# ---- the declaration (kernels/spec.py) ----------------------------------------------------------

def _flops(args, outs):
    q, k, v, causal = args[0], args[1], args[2], args[5]
    B, H, Sq, D = (spec.size_hint(s) for s in q.shape)
    keys = spec.size_hint(k.shape[2])
    fraction = 0.5 if causal and Sq > 1 else 1.0  # causal: about half the matrix
    window = int(spec.size_hint(softcap_window(args)[1]))
    if 0 < window < keys:  # a sliding window: about `window` keys per query
        keys, fraction = window, 1.0
    return 2 * B * H * Sq * keys * (D + spec.size_hint(v.shape[-1])) * fraction, spec.peak_key(q.dtype)


def _cpu_work(args, kwargs):
    """None where the CPU path is torch's fused SDPA kernel; else (FLOPs, extra bytes) of the
    chunked path, which computes every score (no causal skip; with a window only its chunk's
    window) into an fp32 matrix that several eager ops read and write."""
    q, k, v, mask = args[:4]
    causal, offset = args[5], args[6]
    offset = offset if isinstance(offset, int) else 1  # symbolic: not known to be 0 (and no guard)
    softcap, window = softcap_window(args, kwargs)
    window = int(spec.size_hint(window))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not isinstance(causal, bool):
        return None
    mask_dtype = mask.dtype if isinstance(mask, torch.Tensor) else None
    if cpu_fused_path(q.shape[-1], v.shape[-1], mask_dtype, q.dtype, causal, offset, softcap, window):
        return None
    B, H, Sq, D = (spec.size_hint(s) for s in q.shape)
    Sk, Dv = spec.size_hint(k.shape[2]), spec.size_hint(v.shape[-1])
    scores = B * H * Sq * chunked_keys_per_row(B, H, Sq, Sk, window)
    return 2 * scores * (D + Dv), chunked_score_passes(mask_dtype is not None, causal, bool(softcap)) * scores * 4


def _aot_cases():
    from .configs import config_for_arch

    bf16, f32 = torch.bfloat16, torch.float32
    g, randn = spec.aot_inputs()

    def attn(d, dtype, causal, mask, softcap=0.0, window=0):
        def call(arch):
            q, k, v = randn(1, 8, 64, d, dtype=dtype), randn(1, 2, 64, d, dtype=dtype), randn(1, 2, 64, d, dtype=dtype)
            m = (randn(1, 1, 64, 64, dtype=dtype) if mask == "additive"
                 else torch.rand(1, 1, 64, 64, generator=g) > 0.2 if mask == "bool" else None)
            cfg = config_for_arch(NAME, arch, head_dim=d, dtype=dtype)
            launch(q, k, v, m, d ** -0.5, causal, 0, softcap=softcap, window=window, config=cfg)
        return call

    def decode(d):
        def call(arch):  # batch 1: 8 (batch x head) programs, far below any GPU's SMs
            q, k, v = randn(1, 8, 1, d), randn(1, 2, 4096, d), randn(1, 2, 4096, d)
            launch(q, k, v, None, d ** -0.5, True, 4095, config=config_for_arch(NAME, arch, head_dim=d, dtype=bf16))
        return call

    return [
        ("bf16 d64 causal", attn(64, bf16, True, False)),
        ("bf16 d128 causal", attn(128, bf16, True, False)),
        ("bf16 d128 additive mask", attn(128, bf16, False, "additive")),
        ("bf16 d128 bool mask", attn(128, bf16, False, "bool")),
        ("bf16 d256 softcap 50, window 32", attn(256, bf16, True, None, softcap=50.0, window=32)),
        ("fp32 d64 causal", attn(64, f32, True, None)),
        ("fp32 d128 causal", attn(128, f32, True, None)),
        ("fp32 d192 causal", attn(192, f32, True, None)),
        ("fp32 d256 causal", attn(256, f32, True, None)),
        ("bf16 d256 causal", attn(256, bf16, True, None)),
        ("bf16 d128 decode, key splits", decode(128)),
    ]


def _aot_autotune_cases():
    """Every AUTOTUNE alternative of each head-dim row, prefill- and decode-sized (256 query
    rows: no candidate's 128-row tile is clamped); float32 heads take the rows of bf16 heads
    twice as wide."""
    from .configs import config_for_arch

    _, randn = spec.aot_inputs()

    def attn(d, sq, sk, dtype=torch.bfloat16):
        def call(arch):
            row = config_for_arch(NAME, arch, head_dim=d, dtype=dtype)
            q, k, v = randn(1, 8, sq, d, dtype=dtype), randn(1, 2, sk, d, dtype=dtype), randn(1, 2, sk, d, dtype=dtype)
            for alt in ({}, *row.get("AUTOTUNE", ())):
                launch(q, k, v, None, d ** -0.5, True, sk - sq, config={**row, **alt})
        return call

    cases = []
    for d in (64, 128, 256):
        cases.append((f"autotune d{d} prefill", attn(d, 256, 256)))
        cases.append((f"autotune d{d} decode", attn(d, 1, 4096)))
    for d in (64, 128, 256):
        cases.append((f"autotune fp32 d{d} prefill", attn(d, 256, 256, torch.float32)))
    return cases


def _example():
    return (torch.randn(2, 4, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 8), None, 0.25, True, 2, False)


# rows per architecture and head width: configs.py's attention table
KERNEL = spec.KernelSpec(NAME, configs=None, splits=True, aot_cases=_aot_cases, aot_autotune_cases=_aot_autotune_cases)
OPS = (spec.OpSpec("attention", spec.ATTENTION, _flops, spec.batch_first(0, 1, 2, mask=3), _example, KERNEL,
                   cpu_work=_cpu_work),)
