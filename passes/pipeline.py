"""The default pipeline for each target, in order."""

from __future__ import annotations

from collections.abc import Iterable

from metainfer.hardware.targets import Target

from .base import Pass, get_pass, pass_names

# fuse_moe and mla_decode read the FP8 dequantisation of their weights, so they run before
# fp8_gemm takes the remaining linears; mla_prefill claims the MLA attentions before
# fuse_attention takes the rest; sparse_mla and mla_decode rewrite fused attention ops;
# share_act_quant reads the W8A8 linears fp8_gemm writes, so it follows it; the pointwise/norm
# fusions come next; the communication passes last, on the final compute:
# sequence_parallel takes the all-reduces it pays for, select_collectives picks algorithms for the rest.
DEFAULT_ORDER = ("fuse_moe", "mla_prefill", "fuse_attention", "sparse_mla", "mla_decode", "fp8_gemm", "share_act_quant",
                 "int4_gemm", "fuse_rope", "fuse_rmsnorm", "fuse_swiglu", "fuse_geglu", "sequence_parallel", "two_batch_overlap",
                 "pipeline_collectives", "select_collectives", "overlap_collectives")
# registered passes that run only when named (passes=[...]); each with the reason it is not default
OPT_IN: dict[str, str] = {}


def default_pipeline(target: Target) -> list[str]:
    """Every pass in DEFAULT_ORDER; each one skips itself where it does not pay."""
    return list(DEFAULT_ORDER)


def resolve(target: Target, passes: Iterable | None = None, disable: Iterable[str] = ()) -> tuple[list[Pass], set[str], bool]:
    """(the Pass objects to run, the names disabled, whether the list was given explicitly).
    Unknown names are a ValueError."""
    disable = (disable,) if isinstance(disable, str) else tuple(disable)
    known = pass_names()
    explicit_names = {p.name for p in passes if isinstance(p, Pass)} if passes is not None else set()
    for name in disable:
        if name not in known and name not in explicit_names:
            raise ValueError(f"disable={name!r}: no such pass; known passes: {', '.join(known)}")
    chosen: list[Pass] = []
    for p in (default_pipeline(target) if passes is None else passes):
        if isinstance(p, Pass):
            chosen.append(p)
        elif isinstance(p, str):
            chosen.append(get_pass(p))
        else:
            raise TypeError(f"passes= takes pass names or Pass objects, got {type(p).__name__}")
    names = [p.name for p in chosen]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"passes listed twice: {sorted(dup)}")
    return chosen, set(disable), passes is not None
