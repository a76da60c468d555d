"""RMSNorm, optionally fused with the residual add before it.

    y = x * rsqrt(mean(x^2, -1) + eps) * (weight + weight_offset)

computed in float32 and rounded once to `out_dtype`. `weight_offset` is 0 for Llama-style
norms and 1 for Gemma's `(1 + weight)`. With a residual, h = x + residual is rounded to x's
dtype, written out (the residual stream needs it), and normalised as rounded, exactly as
eager code normalises the stored sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs, spec  # (modules: configs reads the kernel files' declarations when first used)
from ._common import GuardedPlans, contiguous_like, fail, rows_of, check, check_float, next_pow2, signature

NAME = "rmsnorm"

# launch configs: rows of `elems_per_warp` elements a warp, at most `max_warps` warps
DEFAULT_CONFIGS = {"interpreter": dict(elems_per_warp=256, max_warps=1),
                   "cuda": dict(elems_per_warp=256, max_warps=16)}


@triton.jit
def _rmsnorm_fwd(
    X, R, W, Y, H,
    stride_x, stride_r, stride_y, stride_h,
    n_cols, eps, weight_offset,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        h = (x + r).to(H.dtype.element_ty)
        tl.store(H + row * stride_h + cols, h, mask=ok)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) + weight_offset
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=ok)


def check_inputs(x, weight, eps, weight_offset, out_dtype, residual=None) -> None:
    check_float(NAME, "x", x)
    check_float(NAME, "weight", weight)
    if not (weight.dim() == 1 and x.dim() >= 1 and weight.shape[0] == x.shape[-1]):
        fail(NAME, f"weight shape {tuple(weight.shape)} must be ({x.shape[-1] if x.dim() else '?'},) for x of shape {tuple(x.shape)}")
    check(weight.device == x.device, NAME, "x and weight are on different devices")
    if residual is not None:
        check_float(NAME, "residual", residual)
        if not residual.shape == x.shape:
            fail(NAME, f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if not residual.dtype == x.dtype:
            fail(NAME, f"residual dtype {residual.dtype} != x dtype {x.dtype}")
        check(residual.device == x.device, NAME, "x and residual are on different devices")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        fail(NAME, f"eps must be a number >= 0, got {eps!r}")
    if not isinstance(weight_offset, (int, float)):
        fail(NAME, f"weight_offset must be a number, got {weight_offset!r}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        fail(NAME, f"out_dtype {out_dtype} unsupported")


class _Launch:
    """A launch's checked decisions for one signature: rows and their strides, block, warps."""

    __slots__ = ("n_rows", "scalars", "meta", "same_layout")

    def __init__(self, x, weight, eps, weight_offset, out_dtype, residual, config):
        check_inputs(x, weight, eps, weight_offset, out_dtype, residual)
        config = configs.config_for(NAME, x.device) if config is None else config
        # outputs as empty_like(x) builds them when x is contiguous (the cheapest allocation)
        self.same_layout = x.is_contiguous()
        if not (weight.stride(0) == 1 or weight.numel() == 1):
            fail(NAME, "weight must be contiguous")
        self.n_rows, stride_x = rows_of(NAME, "x", x)
        stride_r = stride_x if residual is None else rows_of(NAME, "residual", residual)[1]
        n_cols = x.shape[-1]
        block_n = next_pow2(n_cols)
        if self.n_rows and not block_n <= config.get("MAX_BLOCK_N", 65536):
            fail(NAME, f"rows of {n_cols} elements exceed the kernel's block")
        self.scalars = (stride_x, stride_r, n_cols, n_cols, n_cols, float(eps), float(weight_offset))
        self.meta = dict(HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, num_warps=_warps(block_n, config))


_launches = GuardedPlans()


def _key(x, weight, eps, weight_offset, out_dtype, residual, config) -> tuple:
    """The plan's key behind the guards."""
    return signature(x, weight, eps, weight_offset, out_dtype, residual)


def launch(x, weight, eps: float, weight_offset: float, out_dtype: torch.dtype, residual=None, *,
           config: dict | None = None):
    """Returns y, or (y, x + residual) when a residual is given. Checks and decisions once per
    signature (a decode step's repeat every step); `config` None: the device's row."""
    plan = _launches.get_guarded((eps, weight_offset, out_dtype), (x, weight) if residual is None else (x, weight, residual),
                                 config, _key, _Launch, x, weight, eps, weight_offset, out_dtype, residual, config)
    y = contiguous_like(x, out_dtype, plan.same_layout)
    h = x if residual is None else contiguous_like(x, dense=plan.same_layout)
    if residual is None:
        residual = x  # not read; nor is h written
    if plan.n_rows:
        _rmsnorm_fwd[(plan.n_rows,)](x, residual, weight, y, h, *plan.scalars, **plan.meta)
    return (y, h) if h is not x else y


def _warps(block_n: int, config: dict) -> int:
    per = config.get("elems_per_warp", 256)
    return int(min(config.get("max_warps", 16), max(1, next_pow2(block_n // per))))


def reference(x, weight, eps, weight_offset=0.0, out_dtype=None, residual=None):
    """Eager math in float32, rounded once at the end."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if residual is not None:
        h = x + residual
        x = h
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + weight_offset)
    return (y.to(out_dtype), h) if residual is not None else y.to(out_dtype)


def cpu_forward(x, weight, eps, weight_offset, out_dtype, residual=None):
    check_inputs(x, weight, eps, weight_offset, out_dtype, residual)
    return reference(x, weight, eps, weight_offset, out_dtype, residual)


# ---- the declarations (kernels/spec.py) ---------------------------------------------------------

def _aot_cases():
    from .configs import config_for_arch

    _, randn = spec.aot_inputs()
    return [("bf16 4096 + residual",
             lambda arch: launch(randn(8, 4096), randn(4096), 1e-6, 0.0, torch.bfloat16, residual=randn(8, 4096),
                                 config=config_for_arch(NAME, arch)))]


KERNEL = spec.KernelSpec(NAME, DEFAULT_CONFIGS, _aot_cases)
OPS = (
    spec.OpSpec("rmsnorm", spec.POINTWISE, spec.per_output_element, spec.rows(0, token_wise=True),
                lambda: (torch.randn(3, 5, 32), torch.randn(32), 1e-6, 0.0, torch.float32), KERNEL),
    spec.OpSpec("add_rmsnorm", spec.POINTWISE, spec.per_output_element, spec.rows(0, 1, token_wise=True),
                lambda: (torch.randn(3, 5, 32), torch.randn(3, 5, 32), torch.randn(32), 1e-5, 0.0, torch.float32),
                KERNEL),
)
