"""The KV pool a serving step reads and writes, found by the paged attention op at run time.

The pool belongs to the serving engine (transformers' PagedAttentionCache) and is not a graph
input: a pool that a graph mutates in place is an input mutation, which AOTAutograd's
functionalization turns into a copy of the whole pool per call outside Inductor (measured on
this machine: 115 ms per call for a 64 MB pool under aot_eager, 0.06 ms under Inductor, which
re-inplaces it). So, as a collective reaches its process group, the op reaches the pool of the
step running on its thread: metainfer.runtime.serving sets it around each engine forward.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

from . import spec

# layer index -> (K rows, V rows) of that layer: (rows, kv heads, head_dim) views of the pool
PoolViews = Callable[[int], "tuple[torch.Tensor, torch.Tensor]"]

_active = threading.local()


@contextlib.contextmanager
def active(views: PoolViews):
    """Inside the block (one engine forward), paged attention on this thread reads and writes
    through `views`; the step's index tensors are graph inputs, not modified during it."""
    previous = getattr(_active, "views", None), getattr(_active, "plans", None)
    _active.views, _active.plans = views, {}
    try:
        yield
    finally:
        _active.views, _active.plans = previous


def step_plans() -> dict | None:
    """A dict that lives for the step running on this thread (None outside one): what the
    attention op derives from the step's indices, built by its first layer, reused by the rest."""
    return getattr(_active, "plans", None)


def layer_views(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    views = getattr(_active, "views", None)
    if views is None:
        raise RuntimeError("metainfer::paged_attention ran outside a serving step: no KV pool is active on this "
                           "thread (it runs inside OptimizedModel.generate_batch or a continuous-batching manager)")
    return views(layer)


# ---- the declaration (kernels/spec.py): metainfer::paged_latents (kernels/ops.py) writes and
# reads the pool in plain torch

def _paged_latents_example():
    """Two new tokens' latents and rotated keys, nothing cached (no pool is read)."""
    return torch.randn(2, 16), torch.randn(2, 4), torch.tensor([0, 1]), torch.tensor([], dtype=torch.int64), 0


OPS = (spec.OpSpec("paged_latents", spec.MEMORY, spec.by_bytes, spec.OPAQUE_LAYOUT, _paged_latents_example),)
