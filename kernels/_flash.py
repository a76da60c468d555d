"""Triton building blocks shared by the kernels: a dot that works around the interpreter,
logit soft-capping, a mask applied to a block of scores, the online-softmax step of the flash-attention kernels (attention, sparse_attention,
mla_decode, paged_attention), and the merge of a decode step's key splits (flash-decoding:
several programs share one row's keys, each keeping its own online-softmax state)."""

from __future__ import annotations

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


@triton.jit
def _combine_splits(
    WS, O, rows, dim, splits, stride_o,
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
    ML = WS + tl.cast(splits, tl.int64) * rows * dim  # SplitMerge.workspace's layout
    at = r  # row r of split s is at s * rows + r; stepped, so the index stays 64-bit
    for _ in range(0, splits):
        m_s = tl.load(ML + at * 2, mask=row_ok, other=float("-inf"))
        l_s = tl.load(ML + at * 2 + 1, mask=row_ok, other=0.0)
        a_s = tl.load(WS + at[:, None] * dim + d[None, :], mask=ok, other=0.0)
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


class SplitMerge:
    """The partial results of a launch's key splits (flash-decoding) for `rows` output rows of
    `dim`, and their merge into the output, set up once per launch signature (a decode step
    splits the same rows every step; only the split count moves with the context).

    `workspace(splits, like)`: one flat float32 buffer on `like`'s device, the accumulators
    (split, row, dim) then each row's max and sum of exp (split, row, 2) from `splits * rows *
    dim` on (the kernels compute that offset: one allocation per call, not two). Every program
    writes its part, empty splits included, so nothing needs zeroing.
    `combine(ws, splits, out)`: one small launch writing into `out` (unit stride along dim,
    rows `row_stride` apart, default contiguous) the exact merge; a row no split kept a key for
    gives NaN, or 0 with `zero_empty_rows`, as the unsplit kernels do."""

    __slots__ = ("rows", "dim", "per_split", "row_stride", "grid", "meta")

    def __init__(self, rows: int, dim: int, zero_empty_rows: bool, row_stride: int | None = None):
        self.rows, self.dim, self.per_split = rows, dim, rows * (dim + 2)
        self.row_stride = dim if row_stride is None else row_stride
        block_d = next_pow2(dim)
        block_r = max(1, min(64, 4096 // block_d))  # about 4096 float32 accumulators per program
        self.grid = (cdiv(rows, block_r),)
        self.meta = dict(ZERO_EMPTY_ROWS=bool(zero_empty_rows), BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)

    def workspace(self, splits: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_empty(splits * self.per_split, dtype=torch.float32)

    def combine(self, ws: torch.Tensor, splits: int, out: torch.Tensor) -> None:
        _combine_splits[self.grid](ws, out, self.rows, self.dim, splits, self.row_stride, **self.meta)
