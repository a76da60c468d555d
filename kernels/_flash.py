"""Triton building blocks shared by the kernels: a dot that works around the interpreter,
logit soft-capping, a mask applied to a block of scores, the online-softmax step of the flash-attention kernels (attention, sparse_attention,
mla_decode, paged_attention), and the merge of a decode step's key splits (flash-decoding:
several programs share one row's keys, each keeping its own online-softmax state)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import cdiv, interpreted, next_pow2, strides_as


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot, with both operands upcast to float32 first when UPCAST (see interpreted_dot_upcast)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap) (Gemma 2's logit soft-capping). tl has no tanh, so through exp of a
    non-positive argument: no overflow, |error| about one float32 ulp of cap."""
    x = s / cap
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return cap * tl.where(x < 0, -th, th)


@triton.jit
def masked_scores(s, keep, m_ptrs, MASK_KIND: tl.constexpr):
    """The scores with the mask applied where `keep` holds (MASK_KIND 1: added, read as float32;
    2: a boolean keep ANDed in) and -inf wherever no key is kept. Only kept entries of the mask
    are read: the others end at -inf whatever they hold."""
    if MASK_KIND == 1:
        s = s + tl.load(m_ptrs, mask=keep, other=0.0).to(tl.float32)
    if MASK_KIND == 2:
        keep = keep & (tl.load(m_ptrs, mask=keep, other=0) != 0)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def softmax_step(s, m_i, l_i):
    """One block of scores s (rows x keys, -inf where dropped) into the running max m_i and sum
    l_i: returns (p, alpha, m_new, l_new); the caller rescales its accumulator by alpha and adds
    p @ v."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # rows with nothing kept so far: subtract 0, not -inf, so exp gives 0 and not NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def normalise(acc, l_i, row_ok, ZERO_EMPTY_ROWS: tl.constexpr):
    """acc / l_i per row; a row with no key kept gives 0/0 = NaN as eager softmax does, or 0
    (SDPA's convention) with ZERO_EMPTY_ROWS."""
    l_div = tl.where(row_ok, l_i, 1.0)
    if ZERO_EMPTY_ROWS:
        l_div = tl.where(l_div == 0.0, 1.0, l_div)
    return acc / l_div[:, None]


# ---- launch arguments shared by the attention launchers -------------------------------------------

def mask_kind(mask) -> int:
    """The kernels' MASK_KIND: 0 no mask, 1 additive (float), 2 keep (bool)."""
    return 0 if mask is None else 2 if mask.dtype == torch.bool else 1


def mask_operand(mask, like: torch.Tensor, shape: tuple) -> tuple:
    """(tensor, strides) the kernels read a mask through: the mask broadcast to `shape` (stride 0
    on broadcast dims, nothing copied); without one, `like` and zero strides (never read)."""
    if mask is None:
        return like, (0, 0, 0, 0)
    return mask, strides_as(mask, shape)


def dot_flags(dtype: torch.dtype) -> dict:
    """DOT_PRECISION / DOT_UPCAST for `dot` on operands of `dtype`."""
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                # Triton 3.9's interpreter multiplies bfloat16 dot operands as their raw uint16
                # bits; under the interpreter they are upcast first (the GPU path is unaffected).
                DOT_UPCAST=interpreted() and dtype == torch.bfloat16)


# ---- key splits (flash-decoding) -----------------------------------------------------------------

def flash_meta(dtype: torch.dtype, mask, causal, zero_empty_rows, config=None, **constexprs) -> dict:
    """A flash kernel's launch constants: the mask kind, causal flag and SDPA's empty-row
    convention, the kernel's own `constexprs` (tiles), the dot flags for `dtype`, and, given a
    fixed config row, its warps and stages (none for an autotuned launch: the tuner picks)."""
    meta = dict(MASK_KIND=mask_kind(mask), CAUSAL=bool(causal), ZERO_EMPTY_ROWS=bool(zero_empty_rows),
                **constexprs, **dot_flags(dtype))
    if config is not None:
        meta.update(num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 2))
    return meta


def split_workspace(splits: int, rows: int, dim: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat float32 buffers on `like`'s device for `splits` partial results of `rows` output rows:
    accumulators (split, row, dim) and row max and sum of exp (split, row, 2), in that order.
    Every program writes its part, empty splits included, so nothing needs zeroing."""
    return like.new_empty(splits * rows * dim, dtype=torch.float32), like.new_empty(splits * rows * 2, dtype=torch.float32)


@triton.jit
def _combine_splits(
    ACC, ML, O, rows, dim, splits, stride_o,
    ZERO_EMPTY_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """O[r] = sum_s e^(m_s - m) acc_s[r] / sum_s e^(m_s - m) l_s[r]: the splits' online-softmax
    states merged exactly, as softmax_step merges key blocks."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < rows
    d = tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (d[None, :] < dim)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    at = r  # row r of split s is at s * rows + r; stepped, so the index stays 64-bit
    for _ in range(0, splits):
        m_s = tl.load(ML + at * 2, mask=row_ok, other=float("-inf"))
        l_s = tl.load(ML + at * 2 + 1, mask=row_ok, other=0.0)
        a_s = tl.load(ACC + at[:, None] * dim + d[None, :], mask=ok, other=0.0)
        m_new = tl.maximum(m_i, m_s)
        # a split that kept no key (m_s = -inf) weighs 0; so do rows with none kept yet
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w_i = tl.exp(m_i - m_safe)
        w_s = tl.exp(m_s - m_safe)
        acc = acc * w_i[:, None] + a_s * w_s[:, None]
        l_i = l_i * w_i + l_s * w_s
        m_i = m_new
        at += rows
    out = normalise(acc, l_i, row_ok, ZERO_EMPTY_ROWS)
    tl.store(O + r[:, None] * stride_o + d[None, :], out.to(O.dtype.element_ty), mask=ok)


def combine_splits(ws_acc: torch.Tensor, ws_ml: torch.Tensor, splits: int, out: torch.Tensor, rows: int, dim: int,
                   zero_empty_rows: bool, row_stride: int | None = None) -> None:
    """Write into `out` (`rows` rows of `dim`, unit stride along dim, rows `row_stride` apart;
    default: contiguous) the merge of the `splits` partial
    results in `split_workspace`'s buffers: one small launch. A row no split kept a key for gives
    NaN, or 0 with `zero_empty_rows`, as the unsplit kernels do."""
    grid, meta = _combine_launch(rows, dim, bool(zero_empty_rows))
    _combine_splits[grid](ws_acc, ws_ml, out, rows, dim, splits, dim if row_stride is None else row_stride, **meta)


@functools.lru_cache(maxsize=256)
def _combine_launch(rows: int, dim: int, zero_empty_rows: bool) -> tuple[tuple, dict]:
    """combine_splits' grid and constants (a decode step asks for the same ones every step)."""
    block_d = next_pow2(dim)
    block_r = max(1, min(64, 4096 // block_d))  # about 4096 float32 accumulators per program
    return (cdiv(rows, block_r),), dict(ZERO_EMPTY_ROWS=zero_empty_rows, BLOCK_R=block_r, BLOCK_D=block_d,
                                        num_warps=4)
