"""The Dynamo backend: each captured graph -> AOTAutograd -> metainfer passes -> lowering.

Two lowerings:
- "inductor" (default): Inductor's `compile_fx`, with the PassManager in its post-grad
  custom-pass slot. On CPU Inductor emits C++; on CUDA, Triton.
- "aot_eager": the same functional ATen graph (Inductor's decompositions), the same passes,
  then run as an FX graph without Inductor. Much faster to compile: for multi-rank tests
  and for bisection runs where compile time dominates.

When Inductor's FX graph cache serves a compiled graph, the passes do not run; their
records then come from metainfer's record cache, or the graph is compiled once more with
the caches off so the report is never empty.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._dynamo.utils import counters

from metainfer.passes import PassManager
from metainfer.passes.options import resolve as resolve_options

from metainfer.kernels import configs as kernel_configs, symm_mem

from . import compile_cache, direct_calls  # noqa: F401  (direct_calls: ops called without the dispatcher)
from .section import GraphSection

LOWERINGS = ("inductor", "aot_eager")


def _describe_input(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}"
    if isinstance(x, torch.SymInt):
        return f"Sym({x})"
    return repr(x)


def _graph_input_values(gm: torch.fx.GraphModule, example_inputs: list) -> list:
    """Each graph input as the graph sees it (fake tensors with symbolic sizes), else the
    example inputs Dynamo passed (real tensors of the first call)."""
    vals = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    if len(vals) != len(example_inputs) or any(v is None for v in vals):
        return list(example_inputs)
    return vals


def graph_input_labels(gm: torch.fx.GraphModule, example_inputs: list) -> list[str]:
    """dtype[shape] of each graph input as the graph sees it: symbolic sizes stay symbols."""
    return [_describe_input(v) for v in _graph_input_values(gm, example_inputs)]


def graph_input_specs(gm: torch.fx.GraphModule, example_inputs: list) -> list[str]:
    """What identifies a graph's inputs for the record cache: dtype, shape and strides with
    symbols where the graph has them (so a symbolic graph keys the same for any first call)."""
    out = []
    for v in _graph_input_values(gm, example_inputs):
        if isinstance(v, torch.Tensor):
            out.append(f"T({v.dtype},{tuple(map(str, v.shape))},{tuple(map(str, v.stride()))},{v.device.type})")
        else:
            out.append(f"{type(v).__name__}({v})")
    return out


def _guard_failure_counts() -> dict:
    try:
        from torch._dynamo.utils import guard_failures

        return {code: len(reasons) for code, reasons in guard_failures.items()}
    except Exception:  # a private table of Dynamo's; without it the report gives no reasons
        return {}


def _new_guard_failures(seen: dict, ours: set[str]) -> list[str]:
    """Guard failures Dynamo recorded since `seen` on graphs this backend compiled (`ours`:
    their compile ids, "frame/n"): why the graph now compiling was needed. Failures of other
    backends' graphs of the same code (another optimize() of the same model class), and our
    graphs' mismatches with another backend (BACKEND_MATCH), are not."""
    try:
        from torch._dynamo.utils import guard_failures

        items = list(guard_failures.items())
    except Exception:
        return []
    out = []
    for code, reasons in items:
        start = seen.get(code, 0)
        if start > len(reasons):  # the table was cleared (torch._dynamo.reset())
            start = 0
        for r in reasons[start:]:
            cid, _, text = str(r).partition(": ")
            lines = text.strip().splitlines()
            if cid not in ours or not lines or lines[0].startswith("BACKEND_MATCH"):
                continue
            if lines[0] not in out:
                out.append(lines[0])
    return out


def _current_compile_id() -> str | None:
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
    except Exception:
        return None
    return None if cid is None else str(cid)


def _break_text(reason: str) -> str:
    lines = [l.strip() for l in reason.strip().splitlines() if l.strip()]
    head = lines[0] if lines else reason
    detail = ""
    for label in ("Explanation:", "Developer debug context:"):
        line = next((l for l in lines[1:] if l.startswith(label)), "")
        detail = detail or line[len(label):].strip()
    return f"{head} ({detail})" if detail else head


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A deep copy of a Dynamo graph that AOTAutograd can compile again: with the input sources
    Dynamo set on its placeholders (`_dynamo_source`, which a deep copy drops and AOTAutograd
    asks for when the graph's parameters came in as inputs)."""
    fresh = copy.deepcopy(gm)
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), fresh.graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return fresh


@dataclass(frozen=True)
class CallContext:
    """What the caller of the compiled code is running, read by the graphs that call compiles.
    phase: "forward", "prefill", "decode" (generate) or a serving step's "prefill" / "decode" /
    "mixed"; a function is called only when a graph compiles. replayable: whether the graph may
    be replayed from a CUDA graph (a decode step whose shapes do not grow with the context: a
    static KV cache)."""

    phase: "str | Callable[[], str]" = "forward"
    replayable: bool = False

    def phase_name(self) -> str:
        return self.phase() if callable(self.phase) else self.phase


class MetainferBackend:
    """A Dynamo backend bound to one target, pipeline and report."""

    def __init__(self, target, passes, disabled=(), *, report, explicit: bool = False,
                 lowering: str = "inductor", options: dict | None = None, capture: bool = False,
                 cache_dir=None, cuda_graphs: bool = True):
        if lowering not in LOWERINGS:
            raise ValueError(f"unknown lowering {lowering!r}; known: {', '.join(LOWERINGS)}")
        self.target = target
        self.passes = list(passes)
        self.disabled = set(disabled)
        self.explicit = explicit
        self.lowering = lowering
        self.options = dict(options or {})
        resolve_options(target, self.options, self.passes)  # a misspelt or ill-typed option fails here, not at a compile
        self.cache_dir = compile_cache.cache_dir(cache_dir)
        self.report = report  # metainfer.report.Report (or anything with a `sections` list)
        self.capture = capture  # keep (graph, inputs) per section, for bisection
        self.captured: list[list] = []  # [Dynamo graph, its first real inputs] per section
        self._breaks_seen = dict(counters["graph_break"])
        self._guards_seen = _guard_failure_counts()
        self._compile_ids: set[str] = set()
        # each thread's innermost call (a serving engine runs its steps on a thread of its own)
        self._calls = threading.local()
        # record each compiled graph's wall time per call in its section (the cost model's
        # validation benchmark compares them with the predictions); set before the graphs compile
        self.time_calls = False
        self.cuda_graphs = cuda_graphs  # optimize(cuda_graphs=...)
        kernel_configs.activate(target)  # the rows of ops called outside a graph, and while compiling
        self._kernel_rows = kernel_configs.rows_of(target)  # those its graphs launch with

    @contextlib.contextmanager
    def calling(self, context: CallContext):
        """A caller runs the compiled code under `context`: graphs compiled meanwhile on this
        thread are labelled by it, and guard failures from here on are this caller's (not those
        of other code that ran the same model in between)."""
        self._guards_seen = _guard_failure_counts()
        stack = self._calls.__dict__.setdefault("stack", [])
        stack.append(context)
        try:
            with kernel_configs.using(self._kernel_rows):  # an eager step's ops too
                yield
        finally:
            stack.pop()

    def current_call(self) -> CallContext:
        """The context of this thread's innermost call; a plain forward outside any."""
        stack = getattr(self._calls, "stack", None)
        return stack[-1] if stack else _PLAIN_CALL

    def _new_breaks(self) -> list[str]:
        now = dict(counters["graph_break"])
        new = [r for r, c in now.items() if c > self._breaks_seen.get(r, 0)]
        self._breaks_seen = now
        return [_break_text(r) for r in new]

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        recompiled_because = _new_guard_failures(self._guards_seen, self._compile_ids)
        self._guards_seen = _guard_failure_counts()
        cid = _current_compile_id()
        if cid is not None:
            self._compile_ids.add(cid)
        call = self.current_call()
        section = GraphSection(index=len(self.report.sections), break_reasons=self._new_breaks(),
                               inputs=graph_input_labels(gm, example_inputs), lowering=self.lowering,
                               phase=call.phase_name(),
                               recompile_reasons=recompiled_because[:4],
                               cuda_graphs=uses_cuda_graphs(self.target, self.lowering, self.cuda_graphs,
                                                            call.replayable))
        original = copy_graph(gm) if self.capture else None
        t0 = time.perf_counter()
        with symm_mem.owned_by(self):  # symmetric buffers the passes reserve live as long as this model
            compiled = compile_graph(gm, example_inputs, self.passes, self.target, disabled=self.disabled,
                                     explicit=self.explicit, lowering=self.lowering, options=self.options,
                                     graph_index=section.index, section=section, cache_dir=self.cache_dir,
                                     cuda_graphs=section.cuda_graphs)
        section.compile_seconds = time.perf_counter() - t0
        self.report.sections.append(section)  # only graphs that compiled
        if self.capture:
            compiled = self._capturing(compiled, original)
        if self.time_calls:
            compiled = timed(compiled, section.call_seconds)
        if section.cuda_graphs:
            compiled = marked_section(compiled, section.index)
        return with_kernel_rows(compiled, self._kernel_rows)

    def _capturing(self, compiled, original: torch.fx.GraphModule):
        """Record the first real inputs of a graph (example inputs hold SymInts when shapes
        are dynamic), so bisection can re-run it."""
        entry = [original, None]
        self.captured.append(entry)

        def run(*args):
            if entry[1] is None:
                entry[1] = list(args)
            return compiled(*args)

        return run


_PLAIN_CALL = CallContext()


def with_kernel_rows(compiled: Callable, rows) -> Callable:
    """`compiled` launching its kernels with `rows` (kernels/configs.using): the config a graph's
    ops read is its target's, not that of the target some other model was compiled for last."""
    def run(*args):
        with kernel_configs.using(rows):
            return compiled(*args)

    run.__wrapped__ = compiled
    return run


def uses_cuda_graphs(target, lowering: str, enabled: bool, replayable: bool) -> bool:
    """Whether a graph is compiled to replay from CUDA graphs (Inductor's CUDA-graph trees: one
    capture per distinct input shape, replayed with the kernels' launches skipped): on a CUDA
    target, through Inductor, for a call whose shapes stay fixed from step to step (a decode step
    over a static cache; its lengths are read from device tensors). A cache that grows every step
    would capture a graph per step."""
    return enabled and replayable and target.device.kind == "cuda" and lowering == "inductor"


# The index of the CUDA-graph section running now (None outside one): what lets a check count the
# replays of metainfer's own graphs (torch.cuda.CUDAGraph.replay while it is set), not the engine's.
RUNNING_SECTION: contextvars.ContextVar = contextvars.ContextVar("metainfer_running_section", default=None)


def marked_section(compiled: Callable, index: int) -> Callable:
    def run(*args):
        token = RUNNING_SECTION.set(index)
        try:
            return compiled(*args)
        finally:
            RUNNING_SECTION.reset(token)

    return run


def timed(compiled: Callable, seconds: list) -> Callable:
    """`compiled` that appends the wall time of each call to `seconds`."""
    def run(*args):
        t0 = time.perf_counter()
        out = compiled(*args)
        seconds.append(time.perf_counter() - t0)
        return out

    return run


def compile_graph(gm, example_inputs, passes, target, *, disabled=(), explicit=False, lowering="inductor",
                  options=None, graph_index=0, section=None, cache_dir=None, cuda_graphs: bool = False):
    """Compile one Dynamo graph with a pipeline; fill `section.records` if given."""
    manager = PassManager(passes, target, disabled=disabled, explicit=explicit, options=options,
                          graph_index=graph_index)
    if lowering == "aot_eager":
        compiled = _aot_eager(gm, example_inputs, manager)
    else:
        root = compile_cache.cache_dir(cache_dir)
        key = compile_cache.key(manager.uuid(), gm, graph_input_specs(gm, example_inputs))
        compile_cache.point_inductor_at(root)
        compiled = _inductor(gm, example_inputs, manager, caches=True, cuda_graphs=cuda_graphs)
        if manager.invocations == 0:  # Inductor served it from its cache: the passes did not run
            cached = compile_cache.load(root, key)
            if cached is not None:
                if section is not None:
                    section.records, section.from_cache = cached, True
                reserve_resources(cached)
                return compiled
            compiled = _inductor(gm, example_inputs, manager, caches=False, cuda_graphs=cuda_graphs)
        compile_cache.store(root, key, manager.records)
    if section is not None:
        section.records = manager.records
        section.schedule, section.simulation_error = manager.schedule, manager.simulation_error
    return compiled


def reserve_resources(records) -> None:
    """What a graph served from Inductor's cache needs allocated, reserved now as its passes did
    when they compiled it (in this model's ownership, see symm_mem.owned_by), not inside the first
    call: the symmetric buffers select_collectives exchanged with the peers."""
    for rec in records:
        for kind, *spec in rec.resources:
            if kind == "symm_mem":
                from metainfer.kernels import symm_mem

                group, dtype, numel = spec
                why = symm_mem.reserve(group, getattr(torch, dtype), int(numel))
                if why is not None:
                    raise RuntimeError(f"a cached graph's symmetric buffer ({numel} x {dtype} over {group}) could not "
                                       f"be reserved: {why}")


def _inductor(gm, example_inputs, manager: PassManager, caches: bool, cuda_graphs: bool = False):
    from torch._inductor.compile_fx import compile_fx

    patches = {"post_grad_custom_post_pass": manager}
    if cuda_graphs:
        patches["triton.cudagraphs"] = True
    if not caches:
        patches["fx_graph_cache"] = False
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, config_patches=patches)
    return compile_fx(gm, example_inputs, config_patches=patches)


def _aot_eager(gm, example_inputs, manager: PassManager):
    from .capture import post_grad

    def run_passes(fx_gm: torch.fx.GraphModule):
        manager(fx_gm.graph)
        fx_gm.recompile()

    return post_grad(gm, example_inputs, run_passes)
