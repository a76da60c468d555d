"""SwiGLU gate: silu(gate) * up, in float32, rounded once to promote(gate, up).

gate and up may be strided views (e.g. the two halves of one fused gate_up projection),
as long as each is (rows, N) with unit stride along N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import as_rows, check, check_float

NAME = "swiglu"


@triton.jit
def _swiglu_fwd(G, U, Y, n_rows, n_cols, stride_g, stride_u, stride_y,
                BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)


def check_inputs(gate, up) -> None:
    check_float(NAME, "gate", gate)
    check_float(NAME, "up", up)
    check(gate.shape == up.shape, NAME, f"gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    check(gate.device == up.device, NAME, "gate and up are on different devices")
    check(gate.dim() >= 1, NAME, "gate must have at least one dimension")


def out_dtype(gate, up) -> torch.dtype:
    return torch.promote_types(gate.dtype, up.dtype)


def launch(gate, up, *, config: dict) -> torch.Tensor:
    check_inputs(gate, up)
    g2, u2 = as_rows(NAME, "gate", gate), as_rows(NAME, "up", up)
    y = torch.empty(gate.shape, dtype=out_dtype(gate, up), device=gate.device)
    y2 = y.view(-1, gate.shape[-1])
    n_rows, n_cols = g2.shape
    if y.numel():
        br, bn = config["BLOCK_R"], config["BLOCK_N"]
        grid = (triton.cdiv(n_rows, br), triton.cdiv(n_cols, bn))
        _swiglu_fwd[grid](g2, u2, y2, n_rows, n_cols, g2.stride(0), u2.stride(0), y2.stride(0),
                          BLOCK_R=br, BLOCK_N=bn, num_warps=config.get("num_warps", 4))
    return y


def reference(gate, up) -> torch.Tensor:
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(out_dtype(gate, up))


def cpu_forward(gate, up) -> torch.Tensor:
    check_inputs(gate, up)
    return reference(gate, up)
