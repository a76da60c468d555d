"""Block sizes and launch settings for each kernel, per target architecture.

Kernels take their config as an argument; this table is where it comes from. A target
selects a row by its `device.arch` (e.g. "sm_89" for the L40S of pcie8) and can override
any entry in its TOML under `[kernels.<kernel name>]`. CPU tensors running through Triton's
interpreter use the "interpreter" row: small blocks, so tests reach partial blocks cheaply.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

# Attention rows are keyed by the largest head dim they serve at 2 bytes an element (registers
# and shared memory grow with it): a float32 head of 64 takes the row of a bf16 head of 128
# (compiled ahead of time, lowering/aot.py: fp32 d64 on the sm_89 d64 row needs 128 KiB of
# shared memory, more than Ada's 99 KiB).
_ATTENTION = {
    "interpreter": [(256, dict(BLOCK_M=16, BLOCK_N=16))],
    # Ada (L40S/L20, 100 KB shared memory per SM): smaller tiles at large head dims.
    "sm_89": [(64, dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)),
              (128, dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2)),
              (256, dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2))],
    # Hopper (H100/H200, 228 KB shared memory per SM).
    "sm_90": [(64, dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)),
              (128, dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)),
              (256, dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2))],
}
_ATTENTION["cuda"] = _ATTENTION["sm_89"]  # a GPU with no arch given: the conservative row

_POINTWISE = {
    "interpreter": {"swiglu": dict(BLOCK_R=8, BLOCK_N=32), "rope": dict(BLOCK_R=8),
                    "rmsnorm": dict(elems_per_warp=256, max_warps=1), "token_ids": dict(BLOCK=16),
                    "paged_attention": dict(BLOCK_M=16, BLOCK_N=16)},
    "cuda": {"swiglu": dict(BLOCK_R=4, BLOCK_N=1024, num_warps=4), "rope": dict(BLOCK_R=16, num_warps=4),
             "rmsnorm": dict(elems_per_warp=256, max_warps=16), "token_ids": dict(BLOCK=1024, num_warps=4),
             # rows are (token, query head of the group) pairs; decode splits keys 512 at a time
             "paged_attention": dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2, KEYS_PER_SPLIT=512,
                                     MAX_SPLITS=8)},
}

# Kernels with one row per device class, from each kernel file's DEFAULT_CONFIGS.
_TILED = {name: importlib.import_module(f"metainfer.kernels.{name}").DEFAULT_CONFIGS
          for name in ("fp8_gemm", "moe", "sparse_attention", "mla_decode")}

KERNELS = ("attention", "rmsnorm", "swiglu", "rope", "token_ids", "paged_attention", *_TILED)

# device type -> (arch, overrides) of the target metainfer last compiled for on it
_active: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {}


def activate(target) -> None:
    """Make `target`'s rows and overrides the ones kernels on its device type use."""
    unknown = set(target.kernels) - set(KERNELS)
    if unknown:
        raise ValueError(f"target {target.name!r}: [kernels] names unknown kernels {sorted(unknown)}; "
                         f"known: {list(KERNELS)}")
    _active[target.device.kind] = (target.device.arch, {k: dict(v) for k, v in target.kernels.items()})


def _row(device: torch.device) -> tuple[str, dict]:
    if device.type != "cuda":
        return "interpreter", {}
    arch, overrides = _active.get("cuda", ("", {}))
    return (arch if arch in _ATTENTION else "cuda"), overrides


def config_for(kernel: str, device: torch.device, *, head_dim: int = 0, dtype: torch.dtype | None = None
               ) -> dict[str, Any]:
    """The launch config for `kernel` on `device` (attention: for `head_dim` in `dtype`)."""
    arch, overrides = _row(device)
    return {**config_for_arch(kernel, arch, head_dim=head_dim, dtype=dtype), **overrides.get(kernel, {})}


def config_for_arch(kernel: str, arch: str, *, head_dim: int = 0, dtype: torch.dtype | None = None
                    ) -> dict[str, Any]:
    """The table's row for `kernel` on `arch` ("interpreter", "sm_80", "sm_89", ...; an arch with
    no rows of its own gets the conservative CUDA row), without a target's overrides."""
    if kernel not in KERNELS:
        raise KeyError(f"no kernel named {kernel!r}; known: {list(KERNELS)}")
    if arch != "interpreter" and arch not in _ATTENTION:
        arch = "cuda"
    if kernel == "attention":
        rows = _ATTENTION[arch]
        width = head_dim * (dtype.itemsize if dtype is not None else 2) // 2
        return dict(next((c for limit, c in rows if width <= limit), rows[-1][1]))
    if kernel in _TILED:
        return dict(_TILED[kernel]["interpreter" if arch == "interpreter" else "cuda"])
    return dict(_POINTWISE["interpreter" if arch == "interpreter" else "cuda"][kernel])
