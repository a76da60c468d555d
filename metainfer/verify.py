"""Output equivalence, and bisection to the first pass that breaks it.

Tolerances are per dtype, on the norm of the difference relative to the norm of the
reference (element-wise checks would flag harmless reassociation in long reductions):
float32 1e-5, float16 5e-3, bfloat16 2e-2. Integer and bool outputs must match exactly, and
NaN/inf must appear in the same places.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


class EquivalenceError(AssertionError):
    """The optimized model's outputs differ from the eager model's."""

    def __init__(self, message: str, pass_name: str | None = None, graph_index: int | None = None):
        super().__init__(message)
        self.pass_name = pass_name
        self.graph_index = graph_index


@dataclass
class BisectResult:
    equivalent: bool
    pass_name: str | None = None  # first pass whose inclusion breaks equivalence
    graph_index: int | None = None
    detail: str = ""


def leaves(obj, path: str = "out", seen: set | None = None) -> list[tuple[str, object]]:
    """(path, value) for every tensor and plain number inside nested outputs (tuples,
    dicts, Hugging Face ModelOutputs and caches)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, (bool, int, float, complex, str, type(None))):
        return [(path, obj)]
    if id(obj) in seen or isinstance(obj, (torch.nn.Module, type)) or callable(obj) and not hasattr(obj, "__dict__"):
        return []
    seen.add(id(obj))
    if isinstance(obj, Mapping):
        return [x for k, v in obj.items() for x in leaves(v, f"{path}[{k!r}]", seen)]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in leaves(v, f"{path}[{i}]", seen)]
    if hasattr(obj, "__dict__"):
        return [x for k, v in sorted(vars(obj).items()) if not k.startswith("_")
                for x in leaves(v, f"{path}.{k}", seen)]
    return []


def tensor_mismatch(ref: torch.Tensor, out: torch.Tensor) -> str | None:
    if ref.shape != out.shape:
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if ref.dtype != out.dtype:
        return f"dtype {out.dtype} != {ref.dtype}"
    if ref.numel() == 0:
        return None
    if not ref.is_floating_point():
        return None if torch.equal(ref, out) else f"{int((ref != out).sum())} of {ref.numel()} values differ"
    r, o = ref.detach().double().cpu(), out.detach().double().cpu()
    fin_r, fin_o = torch.isfinite(r), torch.isfinite(o)
    if not torch.equal(fin_r, fin_o) or not torch.equal(torch.isnan(r), torch.isnan(o)):
        return f"non-finite values differ: {int((fin_r != fin_o).sum())} positions"
    if not torch.equal(r[~fin_r & ~torch.isnan(r)], o[~fin_o & ~torch.isnan(o)]):
        return "infinities differ in sign"
    r, o = r[fin_r], o[fin_o]
    err = (r - o).norm().item() / max(r.norm().item(), 1e-30)
    tol = TOLERANCE.get(ref.dtype, 1e-5)
    if err > tol:
        return f"relative error {err:.3g} > {tol:g} (max abs diff {(r - o).abs().max().item():.3g})"
    return None


def mismatch(ref, out) -> str | None:
    """None if `out` is equivalent to `ref`, else what differs (the first few)."""
    a, b = leaves(ref), leaves(out)
    if [p for p, _ in a] != [p for p, _ in b]:
        return f"output structure differs: {[p for p, _ in a][:6]} vs {[p for p, _ in b][:6]}"
    problems = []
    for (p, x), (_, y) in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            problems.append(f"{p}: tensor vs {type(y).__name__}")
        elif isinstance(x, torch.Tensor):
            why = tensor_mismatch(x, y)
            if why:
                problems.append(f"{p}: {why}")
        elif x != y and not (isinstance(x, float) and x != x and y != y):
            problems.append(f"{p}: {y!r} != {x!r}")
    if not problems:
        return None
    return "; ".join(problems[:4]) + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else "")


def _fakes(inputs) -> list:
    """Fake copies of a graph's inputs, in a mode with a shape environment, as Dynamo hands
    them to a backend (a graph with data-dependent output shapes compiles only so)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    return [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in inputs]


def _fresh_copy(gm):
    """A copy without the captured run's fake values (their unbacked sizes belong to that run)."""
    from metainfer.lowering.backend import copy_graph

    fresh = copy_graph(gm)
    for n in fresh.graph.nodes:
        for key in ("val", "example_value", "unbacked_bindings"):
            n.meta.pop(key, None)
    return fresh


def bisect_captured(backend) -> BisectResult:
    """Search the graphs a MetainferBackend captured (capture=True) for the first pass whose
    inclusion makes a graph's outputs differ from running that graph eagerly."""
    from metainfer.lowering.capture import DYNAMO_CONFIG
    from metainfer.lowering.backend import compile_graph

    for index, (gm, inputs) in enumerate(backend.captured):
        if inputs is None:
            continue  # compiled but never run
        section = backend.report.sections[index]
        ran = [r.name for r in section.records if r.ran]
        active = [p for p in backend.passes if p.name in ran]
        with torch.no_grad(), torch._dynamo.config.patch(**DYNAMO_CONFIG):  # as the graph was captured
            ref = copy.deepcopy(gm)(*inputs)
            for k in range(len(active) + 1):
                compiled = compile_graph(_fresh_copy(gm), _fakes(inputs), active[:k], backend.target,
                                         explicit=True, lowering=backend.lowering, options=backend.options,
                                         graph_index=index, cache_dir=backend.cache_dir)
                why = mismatch(ref, compiled(*inputs))
                if why is None:
                    continue
                if k == 0:
                    return BisectResult(False, None, index, f"graph {index} differs with no metainfer pass at all "
                                                            f"({backend.lowering} lowering): {why}")
                return BisectResult(False, active[k - 1].name, index,
                                    f"graph {index} differs once pass {active[k - 1].name!r} runs: {why}")
    return BisectResult(True, detail="every graph matches its eager run with the full pipeline")
