"""Rotary position embedding, rotate-half form: x * cos + rotate_half(x) * sin.

rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]). x has up to 4 dims (e.g. (B, H, S, D),
any strides); cos and sin broadcast to x's shape (e.g. (B, 1, S, D)). Computed in float32,
rounded once to promote(x, cos, sin); the output is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs, spec  # (modules: configs reads the kernel files' declarations when first used)
from ._common import GuardedPlans, contiguous_like, fail, broadcasts_to, cdiv, check_float, next_pow2, signature, strides_as

NAME = "rope"
DEFAULT_CONFIGS = {"interpreter": dict(BLOCK_R=8), "cuda": dict(BLOCK_R=16, num_warps=4)}


@triton.jit
def _rope_fwd(
    X, C, S, Y, n_rows, n1, n2, half,
    sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    i2 = rows % n2
    i1 = (rows // n2) % n1
    i0 = rows // (n2 * n1)
    cols = tl.arange(0, BLOCK_H)
    ok = (rows < n_rows)[:, None] & (cols < half)[None, :]
    xo = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None]
    co = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None]
    so = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None]
    lo = cols[None, :]
    hi = cols[None, :] + half
    x1 = tl.load(X + xo + lo * sx3, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(X + xo + hi * sx3, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(C + co + lo * sc3, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(C + co + hi * sc3, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(S + so + lo * ss3, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(S + so + hi * ss3, mask=ok, other=0.0).to(tl.float32)
    yo = rows[:, None] * (2 * half)
    tl.store(Y + yo + lo, (x1 * c1 - x2 * s1).to(Y.dtype.element_ty), mask=ok)
    tl.store(Y + yo + hi, (x2 * c2 + x1 * s2).to(Y.dtype.element_ty), mask=ok)


def check_inputs(x, cos, sin) -> None:
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        check_float(NAME, name, t)
    if not x.device == cos.device == sin.device:
        fail(NAME, f"{'cos' if cos.device != x.device else 'sin'} is on a different device than x")
    if not 1 <= x.dim() <= 4:
        fail(NAME, f"x must have 1 to 4 dims, got shape {tuple(x.shape)}")
    if not x.shape[-1] % 2 == 0:
        fail(NAME, f"rotary dim {x.shape[-1]} must be even")
    for name, t in (("cos", cos), ("sin", sin)):
        if not broadcasts_to(t.shape, x.shape):
            fail(NAME, f"{name} shape {tuple(t.shape)} does not broadcast to x shape {tuple(x.shape)}")


def out_dtype(x, cos, sin) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


class _Launch:
    """A launch's checked decisions for one signature: output dtype, grid, strides, constexprs."""

    __slots__ = ("dtype", "grid", "scalars", "meta", "same_layout")

    def __init__(self, x, cos, sin, config):
        check_inputs(x, cos, sin)
        config = configs.config_for(NAME, x.device) if config is None else config
        self.same_layout = x.is_contiguous()
        self.dtype = out_dtype(x, cos, sin)
        shape = x.shape
        shape4 = (1,) * (4 - len(shape)) + tuple(shape)
        n0, n1, n2, d = shape4
        n_rows, half = n0 * n1 * n2, d // 2
        br = config["BLOCK_R"]
        self.grid = (cdiv(n_rows, br),) if x.numel() else None
        # strides of the 4-D views (x, cos, sin expanded to x) without building them
        self.scalars = (n_rows, n1, n2, half, *strides_as(x, shape4), *strides_as(cos, shape4), *strides_as(sin, shape4))
        self.meta = dict(BLOCK_R=br, BLOCK_H=max(1, next_pow2(half)), num_warps=config.get("num_warps", 4))


_launches = GuardedPlans()


def _key(x, cos, sin, config) -> tuple:
    """The plan's key behind the guards."""
    return signature(x, cos, sin)


def launch(x, cos, sin, *, config: dict | None = None) -> torch.Tensor:
    """Checks and decisions once per signature (a decode step's repeat every step); `config`
    None: the device's row."""
    plan = _launches.get_guarded((), (x, cos, sin), config, _key, _Launch, x, cos, sin, config)
    y = contiguous_like(x, plan.dtype, plan.same_layout)
    if plan.grid is not None:
        _rope_fwd[plan.grid](x, cos, sin, y, *plan.scalars, **plan.meta)
    return y


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def reference(x, cos, sin) -> torch.Tensor:
    xf = x.float()
    return (xf * cos.float() + rotate_half(xf) * sin.float()).to(out_dtype(x, cos, sin))


def cpu_forward(x, cos, sin) -> torch.Tensor:
    check_inputs(x, cos, sin)
    return reference(x, cos, sin).contiguous()


# ---- the declaration (kernels/spec.py) ----------------------------------------------------------

def _aot_cases():
    from .configs import config_for_arch

    _, randn = spec.aot_inputs()
    return [("bf16 d128", lambda arch: launch(randn(1, 8, 16, 128), randn(1, 1, 16, 128), randn(1, 1, 16, 128),
                                              config=config_for_arch(NAME, arch)))]


KERNEL = spec.KernelSpec(NAME, DEFAULT_CONFIGS, _aot_cases)
# x, cos and sin broadcast together, as an ATen pointwise op's operands
OPS = (spec.OpSpec("rope", spec.POINTWISE, spec.per_output_element, spec.broadcast(0, 1, 2),
                   lambda: (torch.randn(2, 4, 5, 16), torch.randn(5, 16), torch.randn(1, 1, 5, 16)), KERNEL),)
