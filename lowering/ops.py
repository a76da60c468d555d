"""metainfer's custom ops: the opaque nodes passes put in the graph.

Each op is a `torch.library.custom_op` with a fake (shape/dtype) implementation, so Dynamo,
AOTAutograd and Inductor treat it as one extern call that no decomposition can undo. Its
body picks the implementation per call: the Triton kernel for CUDA tensors (and for CPU
tensors under the interpreter, see `metainfer.kernels.interpret_enabled`), else the
kernel's CPU path. Every output is contiguous, as the fakes promise.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from metainfer import kernels
from metainfer.kernels import attention as _attention
from metainfer.kernels import rmsnorm as _rmsnorm
from metainfer.kernels import rope as _rope
from metainfer.kernels import swiglu as _swiglu

from .kernel_configs import config_for

__all__ = ["attention", "rmsnorm", "add_rmsnorm", "swiglu", "rope"]


@torch.library.custom_op("metainfer::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float,
              causal: bool, causal_offset: int, zero_empty_rows: bool) -> Tensor:
    """softmax(q k^T * scale + mask) v with GQA, see metainfer.kernels.attention."""
    if kernels.use_triton(q):
        cfg = config_for("attention", q.device, head_dim=max(q.shape[-1], v.shape[-1]))
        return _attention.launch(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows, config=cfg)
    return _attention.cpu_forward(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows).contiguous()


@attention.register_fake
def _(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


@torch.library.custom_op("metainfer::rmsnorm", mutates_args=())
def rmsnorm(x: Tensor, weight: Tensor, eps: float, weight_offset: float, out_dtype: torch.dtype) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * (weight + weight_offset), see metainfer.kernels.rmsnorm."""
    if kernels.use_triton(x):
        return _rmsnorm.launch(x, weight, eps, weight_offset, out_dtype, config=config_for("rmsnorm", x.device))
    return _rmsnorm.cpu_forward(x, weight, eps, weight_offset, out_dtype).contiguous()


@rmsnorm.register_fake
def _(x, weight, eps, weight_offset, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("metainfer::add_rmsnorm", mutates_args=())
def add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, weight_offset: float,
                out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(rmsnorm(x + residual), x + residual) in one pass over the rows."""
    if kernels.use_triton(x):
        y, h = _rmsnorm.launch(x, weight, eps, weight_offset, out_dtype, residual=residual,
                               config=config_for("rmsnorm", x.device))
    else:
        y, h = _rmsnorm.cpu_forward(x, weight, eps, weight_offset, out_dtype, residual=residual)
    return y.contiguous(), h.contiguous()


@add_rmsnorm.register_fake
def _(x, residual, weight, eps, weight_offset, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape)


@torch.library.custom_op("metainfer::swiglu", mutates_args=())
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, see metainfer.kernels.swiglu."""
    if kernels.use_triton(gate):
        return _swiglu.launch(gate, up, config=config_for("swiglu", gate.device))
    return _swiglu.cpu_forward(gate, up).contiguous()


@swiglu.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=_swiglu.out_dtype(gate, up))


@torch.library.custom_op("metainfer::rope", mutates_args=())
def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, see metainfer.kernels.rope."""
    if kernels.use_triton(x):
        return _rope.launch(x, cos, sin, config=config_for("rope", x.device))
    return _rope.cpu_forward(x, cos, sin).contiguous()


@rope.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape, dtype=_rope.out_dtype(x, cos, sin))
