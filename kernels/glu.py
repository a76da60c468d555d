"""Gated linear units: act(gate) * up, in float32, rounded once to promote(gate, up).

act is silu (SwiGLU: Llama, Mistral, Qwen) or GeLU's tanh approximation (GeGLU: Gemma's
`gelu_pytorch_tanh`), chosen at compile time. gate and up may be strided views (e.g. the two
halves of one fused gate_up projection), as long as each is (rows, N) with unit stride along N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs, spec  # (modules: configs reads the kernel files' declarations when first used)
from ._common import GuardedPlans, contiguous_like, fail, cdiv, rows_of, check, check_float, signature

NAME = "glu"
ACTIVATIONS = ("silu", "gelu_tanh")
DEFAULT_CONFIGS = {"interpreter": dict(BLOCK_R=8, BLOCK_N=32), "cuda": dict(BLOCK_R=4, BLOCK_N=1024, num_warps=4)}


@triton.jit
def _glu_fwd(G, U, Y, n_rows, n_cols, stride_g, stride_u, stride_y,
             ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if ACT == "silu":
        a = g / (1.0 + tl.exp(-g))
    else:  # gelu_tanh: 0.5 g (1 + tanh(z)), tanh(z) = 1 - 2 / (1 + exp(2z)) (exact at both ends)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) * (...)
        a = 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * z)))
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (a * u).to(Y.dtype.element_ty), mask=ok)


def check_inputs(gate, up, activation: str = "silu") -> None:
    if activation not in ACTIVATIONS:
        fail(NAME, f"activation {activation!r} is not one of {ACTIVATIONS}")
    check_float(NAME, "gate", gate)
    check_float(NAME, "up", up)
    if not gate.shape == up.shape:
        fail(NAME, f"gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    check(gate.device == up.device, NAME, "gate and up are on different devices")
    check(gate.dim() >= 1, NAME, "gate must have at least one dimension")


def out_dtype(gate, up) -> torch.dtype:
    return torch.promote_types(gate.dtype, up.dtype)


class _Launch:
    """A launch's checked decisions for one signature: output dtype, grid, row strides."""

    __slots__ = ("dtype", "grid", "scalars", "meta", "same_layout")

    def __init__(self, gate, up, activation, config):
        check_inputs(gate, up, activation)
        config = configs.config_for(NAME, gate.device) if config is None else config
        self.same_layout = gate.is_contiguous()
        (n_rows, stride_g), stride_u = rows_of(NAME, "gate", gate), rows_of(NAME, "up", up)[1]
        self.dtype = out_dtype(gate, up)
        n_cols = gate.shape[-1]
        br, bn = config["BLOCK_R"], config["BLOCK_N"]
        self.grid = (cdiv(n_rows, br), cdiv(n_cols, bn)) if n_rows and n_cols else None
        self.scalars = (n_rows, n_cols, stride_g, stride_u, n_cols)
        self.meta = dict(ACT=activation, BLOCK_R=br, BLOCK_N=bn, num_warps=config.get("num_warps", 4))


_launches = GuardedPlans()


def _key(gate, up, activation, config) -> tuple:
    """The plan's key behind the guards."""
    return signature(gate, up, activation)


def launch(gate, up, *, config: dict | None = None, activation: str = "silu") -> torch.Tensor:
    """Checks and decisions once per signature (a decode step's repeat every step); `config`
    None: the device's row."""
    plan = _launches.get_guarded((activation,), (gate, up), config, _key, _Launch, gate, up, activation, config)
    y = contiguous_like(gate, plan.dtype, plan.same_layout)
    if plan.grid is not None:
        _glu_fwd[plan.grid](gate, up, y, *plan.scalars, **plan.meta)
    return y


def reference(gate, up, activation: str = "silu") -> torch.Tensor:
    g = gate.float()
    act = torch.nn.functional.silu(g) if activation == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
    return (act * up.float()).to(out_dtype(gate, up))


def cpu_forward(gate, up, activation: str = "silu") -> torch.Tensor:
    check_inputs(gate, up, activation)
    return reference(gate, up, activation)


# ---- the declarations (kernels/spec.py) ---------------------------------------------------------

def _aot_cases():
    from .configs import config_for_arch

    _, randn = spec.aot_inputs()
    return [
        ("silu, bf16 8 x 11008", lambda arch: launch(randn(8, 11008), randn(8, 11008), config=config_for_arch(NAME, arch))),
        ("gelu_tanh, bf16 8 x 16384",
         lambda arch: launch(randn(8, 16384), randn(8, 16384), config=config_for_arch(NAME, arch),
                             activation="gelu_tanh")),
    ]


def _example():
    gate_up = torch.randn(3, 2 * 24)
    return gate_up[:, :24], gate_up[:, 24:]


KERNEL = spec.KernelSpec(NAME, DEFAULT_CONFIGS, _aot_cases)
OPS = tuple(spec.OpSpec(name, spec.POINTWISE, spec.per_output_element, spec.rows(0, 1, token_wise=True), _example,
                        KERNEL) for name in ("swiglu", "geglu"))
