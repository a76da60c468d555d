"""What the rest of metainfer needs to know about each op and each Triton kernel, declared once,
in the op's kernel file.

A kernel file declares `KERNEL = KernelSpec(...)` when it holds a Triton kernel (its row in the
launch-config table, its ahead-of-time compile cases) and `OPS = (OpSpec(...), ...)` for the
`torch.ops.metainfer` ops it implements (kernels/ops.py registers them). The readers:

- kernels/configs.py: the kernels and their rows (`KERNELS`, `KernelSpec.configs`, `splits`);
- lowering/aot.py: the kernels to compile and their cases (`aot_cases`, `aot_autotune_cases`);
- metainfer/hardware/cost.py: FLOPs (`flops`), GEMM streaming (`kind`), a CPU path's extra work
  (`cpu_work`), the experts a call reaches (`experts`);
- metainfer/hardware/simulate.py: collectives run as ops (`collective`);
- passes/two_batch_overlap.py and passes/sequence_parallel.py: how the op's arguments are
  laid out over the batch and the tokens (`layout`).

`specs()` and `spec_for(name)` collect the declarations from the kernel files; tests/test_op_specs.py
checks that every op registered in the dispatcher has a complete one.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

# ---- sizes of fake tensors, for the FLOP formulas (the cost model uses the same) ----------------


def size_hint(x) -> float:
    """A size as a number; symbolic sizes at their hint (an estimate, never a guard)."""
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        return float(hint) if hint is not None else 1.0
    return float(x)


def numel(t: torch.Tensor) -> float:
    return math.prod(size_hint(s) for s in t.shape)


def tensor_bytes(t: torch.Tensor) -> float:
    return numel(t) * t.element_size()


def peak_key(dtype: torch.dtype) -> str:
    """The name of the device's peak FLOP rate that work in `dtype` runs at."""
    if dtype in (torch.bfloat16,):
        return "bf16"
    if dtype in (torch.float16,):
        return "fp16"
    if dtype.is_floating_point and dtype.itemsize == 1:
        return "fp8"
    return "fp32"


# ---- FLOP formulas: (args, outputs) -> (FLOPs, peak key) ----------------------------------------
# `args` are the call's positional arguments with graph values replaced by their fake values
# (tensors, SymInts); `outs` its output tensors. A key of None: the cost model prices the op by
# its bytes and lists it among the ops whose FLOPs it does not count.

FlopFormula = Callable[[list, list], "tuple[float, Optional[str]]"]


def per_output_element(args: list, outs: list) -> tuple[float, Optional[str]]:
    """One FLOP-ish per output element: fused pointwise ops, whose bytes dominate."""
    return sum(numel(t) for t in outs), peak_key(outs[0].dtype) if outs else "fp32"


def by_bytes(args: list, outs: list) -> tuple[float, Optional[str]]:
    """No FLOPs counted: the op moves data, or its work is not modelled yet; priced by its bytes
    and listed as such in reports."""
    return 0.0, None


# ---- kinds: what the cost model and the simulator do with an op ---------------------------------

POINTWISE = "pointwise"  # fused element-wise or row-wise work: bytes dominate
GEMM = "gemm"  # a matmul: its operands stream at the device's GEMM rate
ATTENTION = "attention"  # scores over keys
MEMORY = "memory"  # moves or unpacks data (a dequantize, a cache write)
COLLECTIVE = "collective"  # communication between ranks (see `Collective`)
KINDS = (POINTWISE, GEMM, ATTENTION, MEMORY, COLLECTIVE)


@dataclass(frozen=True)
class Collective:
    """An op that is a collective: the simulator prices it with the cost model's `kind` of
    collective on `algorithm` (a name, or the index of the argument naming it), over the group
    its last argument names (or `group_size_arg` ranks), while the compute stream waits."""

    kind: str  # "all_reduce", "all_gather", "reduce_scatter"
    algorithm: "str | int"
    group_size_arg: int | None = None


# ---- layouts: how an op's tensor arguments carry the batch and the tokens ------------------------

ROWS, BROADCAST, BATCH_FIRST, OPAQUE = "rows", "broadcast", "batch_first", "opaque"


@dataclass(frozen=True)
class Layout:
    """How an op's tensor arguments (positions in its schema) carry a batch or the tokens, for
    the passes that split or shard through it (two_batch_overlap, sequence_parallel).

    - rows: `args` hold rows (any leading dims, features last; the first is the op's input) and
      the outputs have the same rows; each output row depends on those rows alone. `token_wise`:
      every other tensor argument is per feature (a norm's weight), so the op can run on any
      subset of the tokens, as sequence parallelism runs it on a rank's share.
    - broadcast: `args` broadcast together, as an ATen pointwise op's (rope's x, cos, sin).
    - batch_first: `args` have the batch in dim 0, as do the outputs; `mask`, the mask argument,
      has it there only when it is 4-D (else it is shared by the batch).
    - opaque: nothing is known; the passes do not split or shard through the op.
    """

    kind: str
    args: tuple[int, ...] = ()
    token_wise: bool = False
    mask: int | None = None


def rows(*args: int, token_wise: bool = False) -> Layout:
    return Layout(ROWS, args, token_wise=token_wise)


def broadcast(*args: int) -> Layout:
    return Layout(BROADCAST, args)


def batch_first(*args: int, mask: int | None = None) -> Layout:
    return Layout(BATCH_FIRST, args, mask=mask)


OPAQUE_LAYOUT = Layout(OPAQUE)


# ---- the declarations ---------------------------------------------------------------------------

AotCase = tuple[str, Callable[[str], Any]]  # (what it compiles, call(arch) that launches it)


@dataclass(frozen=True)
class KernelSpec:
    """A Triton kernel file: `name` is its module's name and its row in kernels/configs.py.

    configs: its launch configs, {"interpreter": {...}, "cuda": {...}} (None: attention's rows
    per architecture and head width, in configs.py); splits: it splits work over the device's
    SMs (its rows get SM_COUNT); aot_cases: the launches lowering/aot.py compiles for every
    architecture; aot_autotune_cases: each AUTOTUNE alternative as a fixed config (`--autotune`)."""

    name: str
    configs: Mapping[str, Mapping[str, Any]] | None
    aot_cases: Callable[[], list[AotCase]]
    splits: bool = False
    aot_autotune_cases: Callable[[], list[AotCase]] | None = None


@dataclass(frozen=True)
class OpSpec:
    """One `torch.ops.metainfer` op.

    kind: one of KINDS; flops: its FLOP formula (see above); layout: how its arguments carry
    the batch and the tokens (required: OPAQUE_LAYOUT says nothing is known); example: small
    arguments to call it with (tests run its fake on them); kernel:
    its Triton kernel (None: it runs plain torch or a library's code); cpu_work: on a CPU device,
    (FLOPs, extra bytes) of its CPU path where that path does other work than the kernel, else
    None (args, kwargs as for `flops`); experts: the experts a call can reach, each paying the
    target's per-expert call overhead; collective: for a collective, what it is."""

    name: str
    kind: str
    flops: FlopFormula
    layout: Layout
    example: Callable[[], tuple]
    kernel: KernelSpec | None = None
    cpu_work: Callable[[list, dict], "tuple[float, float] | None"] | None = None
    experts: Callable[[list], float] | None = None
    collective: Collective | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"op {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if (self.kind == COLLECTIVE) != (self.collective is not None):
            raise ValueError(f"op {self.name!r}: a collective kind and a Collective go together")


@functools.cache
def _declarations() -> tuple[dict[str, KernelSpec], dict[str, OpSpec]]:
    """Every kernel file's KERNEL and OPS, found by importing the package's modules (the kernel
    files import configs, which reads this, so nothing here runs while they load)."""
    import importlib
    import pkgutil

    import metainfer.kernels as package

    kernel_specs, op_specs = {}, {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        kernel = getattr(module, "KERNEL", None)
        if isinstance(kernel, KernelSpec):
            kernel_specs[kernel.name] = kernel
        for op in getattr(module, "OPS", ()):
            if op.name in op_specs:
                raise ValueError(f"op {op.name!r} is declared twice (again in {module.__name__})")
            op_specs[op.name] = op
    return kernel_specs, op_specs


def kernel_specs() -> tuple[KernelSpec, ...]:
    """Every Triton kernel file's declaration, in file-name order."""
    return tuple(_declarations()[0].values())


def specs() -> tuple[OpSpec, ...]:
    """Every op's declaration."""
    return tuple(_declarations()[1].values())


def spec_for(name: str) -> OpSpec | None:
    """The declaration of metainfer's op `name` ("rmsnorm"), or None."""
    return _declarations()[1].get(name)


def aot_inputs(seed: int = 0):
    """(generator, randn(*shape, dtype=bf16)) for a kernel's AOT cases: their values do not
    matter, their shapes, dtypes and alignment do."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    return g, randn
