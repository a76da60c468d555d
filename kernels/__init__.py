"""Triton kernels, one per file, each with its launcher and its plain-torch reference.

Kernels are plain functions here; `metainfer.kernels.ops` registers them as dispatcher ops
(torch.ops.metainfer.*, what the passes insert) and decides, per call, whether the Triton kernel
or the CPU path runs. `configs` holds their launch configs per GPU architecture and target;
`kv_pool` and `symm_mem` the runtime state some ops read (the serving step's KV pool, CUDA
symmetric-memory buffers); `shm_collectives` the collectives between CPU ranks of one host
through a shared-memory segment (its C beside it).

Triton's interpreter (which runs kernels on CPU tensors) is chosen when a kernel is
*decorated*, so the switch is made when the metainfer package is imported, before anything
can import triton: on a machine without CUDA, or with METAINFER_TRITON_INTERPRET=1, kernels
are built for the interpreter. Whether a CPU tensor then goes through the interpreted kernel or through
the kernel's CPU path is decided at call time by `interpret_enabled()`.
"""

from __future__ import annotations

import contextlib
import os

import torch

# Triton reads TRITON_INTERPRET when @triton.jit runs, for its own library functions too;
# metainfer/__init__.py set it (no CUDA, or METAINFER_TRITON_INTERPRET=1) before anything
# could import triton.language.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

from . import attention, fp8_gemm, int4_gemm, mla_decode, moe, paged_attention, rmsnorm, rope, sparse_attention, glu, token_ids  # noqa: E402  (after the switch above)
from ._common import KernelInputError  # noqa: E402

_override: list[bool] = []


def interpret_enabled() -> bool:
    """True if CPU tensors should run the Triton kernels through the interpreter."""
    if not INTERPRETED:
        return False
    if _override:
        return _override[-1]
    return os.environ.get("METAINFER_TRITON_INTERPRET") == "1"


@contextlib.contextmanager
def interpret(enabled: bool = True):
    """Run CPU tensors through the interpreted Triton kernels (or not) inside the block."""
    if enabled and not INTERPRETED:
        raise RuntimeError("Triton kernels were built for the GPU; set METAINFER_TRITON_INTERPRET=1 "
                           "before importing metainfer to run them on CPU tensors")
    _override.append(enabled)
    try:
        yield
    finally:
        _override.pop()


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on `t` runs its Triton kernel (else its CPU path)."""
    if t.is_cuda:  # (t.device.type costs ~0.3 us, a launch pays it per call)
        return True
    return t.is_cpu and interpret_enabled()


_KERNEL_FILES = (attention, fp8_gemm, int4_gemm, mla_decode, moe, paged_attention, rmsnorm, rope, sparse_attention, glu,
                 token_ids)  # each declares its kernel and its ops (kernels/spec.py)
__all__ = [m.__name__.rpartition(".")[2] for m in _KERNEL_FILES] + [
    "KernelInputError", "INTERPRETED", "interpret", "interpret_enabled", "use_triton"]
