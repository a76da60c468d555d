"""Token-id range check for GPUs, without stopping the host: one pass over the ids writes a
copy in which every id outside [0, vocab) is replaced by 0, and the flat position of the
first such id (n when there is none).

A compiled graph's embedding lookup asserts on an out-of-range id inside a GPU kernel, which
poisons the CUDA context; checking on the host first would stall every step on a copy. So
the graph runs on the safe copy while the position travels to the host behind it, and the
caller raises once it arrives (metainfer.runtime.inputs.TokenGuard).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import spec
from ._common import cdiv, fail

NAME = "token_ids"
ID_DTYPES = (torch.int64, torch.int32)
DEFAULT_CONFIGS = {"interpreter": dict(BLOCK=16), "cuda": dict(BLOCK=1024, num_warps=4)}


@triton.jit
def _check_ids(IDS, SAFE, FIRST_BAD, n, vocab, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    t = tl.load(IDS + offs, mask=inside, other=0)
    bad = inside & ((t < 0) | (t >= vocab))
    tl.store(SAFE + offs, tl.where(bad, 0, t), mask=inside)
    first = tl.min(tl.where(bad, offs, n), axis=0)
    tl.atomic_min(FIRST_BAD, first, sem="relaxed")


def check_inputs(ids: torch.Tensor, vocab: int) -> None:
    if not isinstance(ids, torch.Tensor):
        fail(NAME, f"ids must be a tensor, got {type(ids).__name__}")
    if ids.dtype not in ID_DTYPES:
        fail(NAME, f"ids have dtype {ids.dtype}; supported: int64, int32")
    if not (isinstance(vocab, int) and vocab >= 1):
        fail(NAME, f"vocab must be a positive int, got {vocab!r}")


def launch(ids: torch.Tensor, vocab: int, *, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids with out-of-range entries set to 0, int64[1] flat position of the first one or n)."""
    check_inputs(ids, vocab)
    flat = ids.reshape(-1)  # copies only a non-contiguous input
    n = flat.numel()
    safe = torch.empty_like(flat)
    first = torch.full((1,), n, dtype=torch.int64, device=ids.device)
    if n:
        block = config["BLOCK"]
        _check_ids[(cdiv(n, block),)](flat, safe, first, n, vocab, BLOCK=block,
                                             num_warps=config.get("num_warps", 4))
    return safe.view(ids.shape), first


def reference(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = ids.reshape(-1)
    bad = (flat < 0) | (flat >= vocab)
    where = bad.nonzero()
    first = where[0] if where.numel() else torch.tensor([flat.numel()], device=ids.device)
    return torch.where(bad, 0, flat).view(ids.shape), first.to(torch.int64)


# ---- the declaration (kernels/spec.py): a kernel of the serving runtime's, no op ----------------

def _aot_cases():
    from .configs import config_for_arch

    g, _ = spec.aot_inputs()
    return [("int64 ids", lambda arch: launch(torch.randint(0, 100, (2, 64), generator=g), 100,
                                              config=config_for_arch(NAME, arch)))]


KERNEL = spec.KernelSpec(NAME, DEFAULT_CONFIGS, _aot_cases)
