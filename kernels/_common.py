"""Small helpers shared by the kernel launchers."""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KernelInputError(ValueError):
    """A launcher was called with inputs its kernel does not support."""


def check(cond: bool, kernel: str, msg: str) -> None:
    if not cond:
        raise KernelInputError(f"{kernel}: {msg}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check_float(kernel: str, name: str, t: torch.Tensor) -> None:
    check(isinstance(t, torch.Tensor), kernel, f"{name} must be a tensor, got {type(t).__name__}")
    check(t.dtype in FLOAT_DTYPES, kernel,
          f"{name} has dtype {t.dtype}; supported: float32, bfloat16, float16")


def as_rows(kernel: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """View `t` (..., N) as (rows, N) without copying; its last dim must have stride 1."""
    check(t.dim() >= 1, kernel, f"{name} must have at least one dimension")
    n = t.shape[-1]
    check(t.stride(-1) == 1 or n == 1, kernel,
          f"{name} must have unit stride in its last dimension (got strides {tuple(t.stride())}); "
          "call .contiguous() first")
    try:
        return t.view(-1, n)
    except RuntimeError:
        raise KernelInputError(f"{kernel}: {name} with shape {tuple(t.shape)} and strides "
                               f"{tuple(t.stride())} cannot be viewed as rows; call .contiguous() first")


def interpreted() -> bool:
    """Whether the kernels were built for Triton's interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# Set by lowering/aot.py while it records launches for a GPU architecture it compiles for
# ahead of time: launchers then decide as they would on a GPU of that compute capability.
AOT_CAPABILITY: tuple[int, int] | None = None


def gpu_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability the kernels are built for: the ahead-of-time recording's, a
    CUDA device's, or None (the interpreter on CPU tensors)."""
    if AOT_CAPABILITY is not None:
        return AOT_CAPABILITY
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)
