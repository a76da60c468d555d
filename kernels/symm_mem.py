"""`metainfer::symm_mem_all_reduce`: one-shot / two-shot all-reduce on CUDA symmetric memory
(torch.distributed._symmetric_memory), the P2P fast path select_collectives may pick where
CUDA and peer-to-peer access exist (never on CPU: there the op has no implementation and the
pass does not select it).

The input is copied into a symmetric buffer kept per (group, dtype, size), then torch's
kernels run: one-shot (each rank reads every peer's buffer and reduces) or two-shot
(reduce-scatter then all-gather by direct reads). The buffer is allocated and exchanged with
the peers (`rendezvous`) by select_collectives at pass time (`reserve`), before it picks
one-/two-shot: where the allocation or the exchange fails (a container that refuses CUDA IPC)
the pass declines with the reason and the graph never holds the op. Buffers belong to the
optimized models whose graphs use them (`owned_by`) and are freed when the last one is. A graph
Inductor serves from its cache did not run the pass: the pass recorded each buffer with its
record (PassResult.resources), and lowering/backend.py reserves them when it loads the graph,
owned as at compile time; the op's own allocation on first use is the last resort.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref

import torch
from torch import Tensor

from . import spec

_BUFFERS: dict[tuple, Tensor] = {}
_USERS: dict[tuple, int] = {}  # key -> models owning it
_OWNED: "weakref.WeakKeyDictionary[object, set]" = weakref.WeakKeyDictionary()
_owner: contextvars.ContextVar = contextvars.ContextVar("symm_mem_owner", default=None)
ALGORITHMS = ("one_shot", "two_shot")


@contextlib.contextmanager
def owned_by(owner):
    """Buffers reserved inside the block belong to `owner` (a model's backend) and are freed
    when it is garbage collected (and no other owner holds them)."""
    token = _owner.set(owner)
    try:
        yield
    finally:
        _owner.reset(token)


def _allocate(numel: int, dtype: torch.dtype, device: torch.device, group_name: str) -> Tensor:
    from torch.distributed import _symmetric_memory as symm_mem

    buf = symm_mem.empty(numel, dtype=dtype, device=device)
    symm_mem.rendezvous(buf, group_name)
    return buf


def reserve(group_name: str, dtype: torch.dtype, numel: int, device: torch.device | None = None) -> str | None:
    """Allocate the symmetric buffer for an all-reduce of `numel` `dtype` elements over
    `group_name` on `device` (default: the current CUDA device) and exchange it with the peers,
    now; None, or why it cannot be."""
    if device is None:
        if not torch.cuda.is_available():
            return "no CUDA device in this process"
        device = torch.device("cuda", torch.cuda.current_device())
    key = (group_name, dtype, numel, device.index)
    if key not in _BUFFERS:
        try:
            _BUFFERS[key] = _allocate(numel, dtype, device, group_name)
        except Exception as e:  # noqa: BLE001 - any failure is the reason the pass declines
            return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        _USERS[key] = 0
    owner = _owner.get()
    if owner is not None:
        keys = _OWNED.get(owner)
        if keys is None:
            keys = _OWNED[owner] = set()
            weakref.finalize(owner, _release, keys)
        if key not in keys:
            keys.add(key)
            _USERS[key] += 1
    return None


def _release(keys: set) -> None:
    for key in keys:
        _USERS[key] -= 1
        if _USERS[key] <= 0:
            _BUFFERS.pop(key, None)
            _USERS.pop(key, None)


def reserved() -> list[tuple]:
    """The (group, dtype, numel, device index) of every buffer held now."""
    return list(_BUFFERS)


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
    key = (group_name, x.dtype, x.numel(), x.device.index)
    buf = _BUFFERS.get(key)
    if buf is None:  # a graph from Inductor's cache: the pass did not reserve it in this process
        buf = _BUFFERS[key] = _allocate(x.numel(), x.dtype, x.device, group_name)
        _USERS[key] = _USERS.get(key, 0)
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


# ---- the declaration (kernels/spec.py): the algorithm is the op's second argument -------------

OPS = (spec.OpSpec("symm_mem_all_reduce", spec.COLLECTIVE, spec.by_bytes, spec.OPAQUE_LAYOUT,
                   lambda: (torch.randn(4, 8), "one_shot", "example_group"),
                   collective=spec.Collective("all_reduce", algorithm=1)),)
