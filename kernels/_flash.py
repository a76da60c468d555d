"""Triton building blocks shared by the kernels: a dot that works around the interpreter,
and the online-softmax step of the flash-attention kernels (attention, sparse_attention,
mla_decode)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot, with both operands upcast to float32 first when UPCAST (see interpreted_dot_upcast)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


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
