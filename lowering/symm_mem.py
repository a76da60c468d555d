"""`metainfer::symm_mem_all_reduce`: one-shot / two-shot all-reduce on CUDA symmetric memory
(torch.distributed._symmetric_memory), the P2P fast path select_collectives may pick where
CUDA and peer-to-peer access exist (never on CPU: there the op has no implementation and the
pass does not select it).

The input is copied into a symmetric buffer kept per (group, dtype, size) — allocated and
exchanged with the peers (`rendezvous`, a collective) the first time, which every rank reaches
at the same point of the same graph — then torch's kernels run: one-shot (each rank reads
every peer's buffer and reduces) or two-shot (reduce-scatter then all-gather by direct reads).
"""

from __future__ import annotations

import torch
from torch import Tensor

_BUFFERS: dict[tuple, Tensor] = {}
ALGORITHMS = ("one_shot", "two_shot")


def available(device_kind: str) -> bool:
    """Symmetric memory can run here: CUDA, torch's module present, peers reachable."""
    if device_kind != "cuda" or not torch.cuda.is_available():
        return False
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return False
    here, count = torch.cuda.current_device(), torch.cuda.device_count()
    return count > 1 and all(torch.cuda.can_device_access_peer(here, p) for p in range(count) if p != here)


def _buffer(x: Tensor, group_name: str) -> Tensor:
    from torch.distributed import _symmetric_memory as symm_mem

    key = (group_name, x.dtype, x.numel(), x.device.index)
    buf = _BUFFERS.get(key)
    if buf is None:
        buf = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buf, group_name)
        _BUFFERS[key] = buf
    return buf


@torch.library.custom_op("metainfer::symm_mem_all_reduce", mutates_args=(), device_types="cuda")
def symm_mem_all_reduce(x: Tensor, algorithm: str, group_name: str) -> Tensor:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"symm_mem_all_reduce: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    buf = _buffer(x, group_name)
    buf.copy_(x.reshape(-1))
    if algorithm == "one_shot":
        out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)
    else:
        out = torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name).clone()
    return out.view(x.shape)


@symm_mem_all_reduce.register_fake
def _(x: Tensor, algorithm: str, group_name: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)
