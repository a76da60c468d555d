"""Block sizes and launch settings for each kernel, per target architecture.

Kernels take their config as an argument; it comes from here: attention's rows per architecture
and head width are the table below, every other kernel's rows (one per device class) are its
file's DEFAULT_CONFIGS, found through its declaration (kernels/spec.py, `KernelSpec`). A target
selects a row by its `device.arch` (e.g. "sm_89" for the L40S of pcie8) and can override
any entry in its TOML under `[kernels.<kernel name>]`. CPU tensors running through Triton's
interpreter use the "interpreter" row: small blocks, so tests reach partial blocks cheaply.

Besides block sizes a row may hold:
- the decode key split of attention and mla_decode (flash-decoding) and fp8_gemm's split-K
  (kernels/_common.split_count): SM_COUNT (added here per architecture, or read from the device
  on a GPU), the launch's programs below which the long axis is split; SPLIT_MIN, the least
  keys (or K elements) one split gets; MAX_SPLITS; fp8_gemm's SPLIT_MAX_M, the largest M split;
  SPLITS forces a count (tests);
- AUTOTUNE: alternative block sizes / warps / stages that triton.autotune times against the
  row's own on a CUDA GPU (the interpreter and lowering/aot.py run the row's config alone);
- fp8_gemm's SMALL_M: rows for decode-sized M, the first with M <= MAX_M replacing the blocks.
A target's override of any block size, num_warps or num_stages pins it: the row's AUTOTUNE and
SMALL_M are dropped unless the target gives its own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from metainfer.kernels import _common, spec
from metainfer.kernels._common import TUNED_KEYS

# Attention rows are keyed by the largest head dim they serve at 2 bytes an element (registers
# and shared memory grow with it): a float32 head of 64 takes the row of a bf16 head of 128
# (compiled ahead of time, lowering/aot.py: fp32 d64 on the sm_89 d64 row needs 128 KiB of
# shared memory, more than Ada's 99 KiB).
# A decode step's query rows are clamped to a 16-row tile by the launcher; its keys are split
# over programs when batch x heads is below SM_COUNT, at least SPLIT_MIN keys per split.
# AUTOTUNE alternatives: compiled for every arch by `python -m metainfer.lowering.aot --autotune`
# (all fit the arch's shared memory); none timed on a GPU yet.
_DECODE_SPLIT = dict(SPLIT_MIN=256, MAX_SPLITS=16)
_ATTENTION = {
    # small blocks and splits of 16 keys: tests reach partial blocks and key splits cheaply
    "interpreter": [(256, dict(BLOCK_M=16, BLOCK_N=16, SPLIT_MIN=16, MAX_SPLITS=4))],
    # Ada (L40S/L20, 100 KB shared memory per SM): smaller tiles at large head dims.
    "sm_89": [(64, dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3, **_DECODE_SPLIT,
                        AUTOTUNE=(dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                                  dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=4)))),
              (128, dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2, **_DECODE_SPLIT,
                         AUTOTUNE=(dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
                                   dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3)))),
              (256, dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2, **_DECODE_SPLIT,
                         AUTOTUNE=(dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2),
                                   dict(BLOCK_M=64, BLOCK_N=16, num_warps=4, num_stages=2)))),
              # float32 heads of 192/256: the 256 row asks 139,520 B; this one 86,272 B
              (512, dict(BLOCK_M=64, BLOCK_N=16, num_warps=8, num_stages=1, **_DECODE_SPLIT,
                         AUTOTUNE=(dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1),
                                   dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2))))],
    # Hopper (H100/H200, 228 KB shared memory per SM).
    "sm_90": [(64, dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3, **_DECODE_SPLIT,
                        AUTOTUNE=(dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
                                  dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)))),
              (128, dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, **_DECODE_SPLIT,
                         AUTOTUNE=(dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
                                   dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                                   dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=4)))),
              # FP32: float32 heads' own blocks (lowering/aot.py, registers read from the cubin:
              # fp32 d128 on this row's 64 x 64 tiles spills 720 B a thread, 128 x 32 736 B,
              # 64 x 32 and 64 x 16 none)
              (256, dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2, **_DECODE_SPLIT,
                         AUTOTUNE=(dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),
                                   dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2)),
                         FP32=dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2,
                                   AUTOTUNE=(dict(BLOCK_M=64, BLOCK_N=16, num_warps=8, num_stages=2),)))),
              # float32 heads of 192/256: 64 x 32 tiles spill 952 B a thread, 64 x 16 none
              (512, dict(BLOCK_M=64, BLOCK_N=16, num_warps=8, num_stages=2, **_DECODE_SPLIT,
                         AUTOTUNE=(dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2),)))],
}
_ATTENTION["cuda"] = _ATTENTION["sm_89"]  # a GPU with no arch given: the conservative row



class _KernelNames(Sequence):
    """The kernels' names, read from their files' declarations (kernels/spec.py) when first used:
    the kernel files import this module, so it cannot read them while it loads."""

    def __getitem__(self, i):
        return tuple(_kernels())[i]

    def __len__(self) -> int:
        return len(_kernels())

    def __repr__(self) -> str:
        return repr(tuple(_kernels()))


@functools.cache
def _kernels() -> dict[str, spec.KernelSpec]:
    return {k.name: k for k in spec.kernel_specs()}


# every kernel with a row here: its name is its file's (attention's rows are the table above,
# the others' rows their file's DEFAULT_CONFIGS)
KERNELS = _KernelNames()

# Streaming multiprocessors of each row's GPU (NVIDIA's specifications: A100 108, L40S 142,
# H100/H200 132): the kernels that split work over more programs aim at this many. A CUDA
# device reports its own (config_for). The interpreter's row pretends to 4, so tests on tiny
# shapes reach the split paths.
_SM_COUNT = {"interpreter": 4, "sm_89": 142, "sm_90": 132, "cuda": 108}

# device type -> (arch, overrides) of the target metainfer last compiled for on it: the rows of
# an op called outside a compiled graph
_active: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {}
# (kernel, device, head_dim, dtype, id of the activation) -> (that activation, its config, read-only):
# a launch looks its row up per call, and building it (row, overrides, device SMs) costs microseconds
_configs: dict[tuple, tuple[Any, Mapping[str, Any]]] = {}
_ROW_SETS: dict[tuple, tuple] = {}  # one object (and one plan generation) per distinct set of rows


def rows_of(target) -> tuple:
    """(device type, (arch, overrides), plan generation) of `target`'s kernel rows, one object for
    equal targets, kept for the process (config_for's cache tells rows apart by identity)."""
    unknown = set(target.kernels) - set(KERNELS)
    if unknown:
        raise ValueError(f"target {target.name!r}: [kernels] names unknown kernels {sorted(unknown)}; "
                         f"known: {list(KERNELS)}")
    overrides = {k: dict(v) for k, v in target.kernels.items()}
    key = (target.device.kind, target.device.arch, repr(sorted((k, sorted(v.items())) for k, v in overrides.items())))
    if key not in _ROW_SETS:
        _ROW_SETS[key] = (target.device.kind, (target.device.arch, overrides), ("rows", len(_ROW_SETS)))
    return _ROW_SETS[key]


def activate(target) -> None:
    """Make `target`'s rows and overrides the ones kernels on its device type use outside a
    compiled graph (inside one, `using` names the rows of the target it was compiled for)."""
    kind, activation, _ = rows_of(target)
    _active[kind] = activation
    _common.CONFIG_GENERATION += 1  # launch plans that looked their rows up are made again


@contextlib.contextmanager
def using(rows):
    """Kernels launched meanwhile on this thread read these rows (`rows_of(target)`), whatever
    was activated last: each compiled graph runs under the rows of the target it was compiled
    for, so models compiled for different targets in one process keep their own."""
    token = _common.SCOPED_ROWS.set(rows)
    try:
        yield
    finally:
        _common.SCOPED_ROWS.reset(token)


def _activation(device_type: str):
    scoped = _common.SCOPED_ROWS.get()
    if scoped is not None and scoped[0] == device_type:
        return scoped[1]
    return _active.get(device_type)


def _row(device: torch.device) -> tuple[str, dict]:
    if device.type != "cuda":
        return "interpreter", {}
    arch, overrides = _activation("cuda") or ("", {})
    return (arch if arch in _ATTENTION else "cuda"), overrides


def config_for(kernel: str, device: torch.device, *, head_dim: int = 0, dtype: torch.dtype | None = None
               ) -> Mapping[str, Any]:
    """The launch config for `kernel` on `device` (attention: for `head_dim` in `dtype`), read-only."""
    activation = _activation(device.type)  # kept in the entry: `is` cannot match a reused id
    key = (kernel, device, head_dim, dtype, id(activation))  # rows of several targets side by side
    hit = _configs.get(key)
    if hit is not None and hit[0] is activation:
        return hit[1]
    cfg = MappingProxyType(_build_config(kernel, device, head_dim, dtype))
    _configs[key] = (activation, cfg)
    return cfg


def _build_config(kernel: str, device: torch.device, head_dim: int, dtype: torch.dtype | None) -> dict[str, Any]:
    arch, overrides = _row(device)
    over = overrides.get(kernel, {})
    cfg = {**config_for_arch(kernel, arch, head_dim=head_dim, dtype=dtype), **over}
    if any(key in over for key in TUNED_KEYS):
        # a target that sets blocks means them: no tuning, no per-M rows, unless it gives its own
        for key in ("AUTOTUNE", "SMALL_M", "WIDE_R"):
            if key not in over:
                cfg.pop(key, None)
    if device.type == "cuda" and "SM_COUNT" in cfg and "SM_COUNT" not in over:
        cfg["SM_COUNT"] = _device_sms(device)
    return cfg


@functools.lru_cache(maxsize=None)
def _device_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def arches() -> tuple[str, ...]:
    """The GPU architectures the tables have rows of their own for (AOT compiles each)."""
    return tuple(a for a in _ATTENTION if a.startswith("sm_"))


def config_for_arch(kernel: str, arch: str, *, head_dim: int = 0, dtype: torch.dtype | None = None
                    ) -> dict[str, Any]:
    """The table's row for `kernel` on `arch` ("interpreter", "sm_80", "sm_89", ...; an arch with
    no rows of its own gets the conservative CUDA row), without a target's overrides."""
    declared = _kernels().get(kernel)
    if declared is None:
        raise KeyError(f"no kernel named {kernel!r}; known: {list(KERNELS)}")
    if arch != "interpreter" and arch not in _ATTENTION:
        arch = "cuda"
    if declared.configs is None:  # attention: a row per head width
        rows = _ATTENTION[arch]
        width = head_dim * (dtype.itemsize if dtype is not None else 2) // 2
        # the GPU rows reach 512 (a float32 head of 256, attention's largest); the interpreter
        # has one row for every width
        cfg = dict(next((c for limit, c in rows if width <= limit), rows[-1][1]))
        fp32 = cfg.pop("FP32", None)
        if fp32 is not None and dtype == torch.float32:
            cfg.update(fp32)
    else:
        cfg = dict(declared.configs["interpreter" if arch == "interpreter" else "cuda"])
    if declared.splits:
        cfg.setdefault("SM_COUNT", _SM_COUNT[arch])
    return cfg
