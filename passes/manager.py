"""The PassManager: runs a pipeline of passes over one graph and records what each did.

It is installed as Inductor's `post_grad_custom_post_pass` (one object per slot), so it sees
the functional ATen graph after Inductor's own post-grad passes and before lowering. Its
`uuid()` hashes the passes' source, their options and the target, so Inductor's FX graph
cache stays enabled and is invalidated whenever any of those change.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from metainfer.hardware.fxops import is_c10d

from . import ranks
from .base import Pass, PassContext, PassResult
from .matching import shape, tensor_val
from .options import resolve as resolve_options

PIPELINE_VERSION = "1"


class PassError(RuntimeError):
    """A pass raised while rewriting a graph."""

    def __init__(self, pass_name: str, graph_index: int, cause: BaseException):
        super().__init__(f"pass {pass_name!r} failed on graph {graph_index}: {type(cause).__name__}: {cause} "
                         f"(disable it with disable=({pass_name!r},) to compile without it)")
        self.pass_name = pass_name


@dataclass
class PassRecord:
    name: str
    ran: bool
    skipped_reason: str | None = None
    matches: int = 0
    decisions: list[str] = field(default_factory=list)
    near_misses: list[str] = field(default_factory=list)
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    graph: int = 0
    graph_before: str | None = None  # set only when the pass changed the graph
    graph_after: str | None = None
    # the simulator's prediction for one call of the graph on the target, before and after
    # this pass (seconds), and the floor after it; None where it was not simulated
    predicted_before_s: float | None = None
    predicted_after_s: float | None = None
    floor_after_s: float | None = None
    exposed_before_s: float | None = None  # communication the compute stream waits for
    exposed_after_s: float | None = None
    resources: list = field(default_factory=list)  # PassResult.resources, as lists (JSON)

    @property
    def gap_to_floor(self) -> float | None:
        if self.predicted_after_s is None or not self.floor_after_s:
            return None
        return self.predicted_after_s / self.floor_after_s - 1

    @property
    def changed(self) -> bool:
        return self.graph_before is not None

    def to_dict(self, with_graphs: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_graphs:
            d.pop("graph_before")
            d.pop("graph_after")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PassRecord":
        return cls(**d)


def graph_text(graph: torch.fx.Graph) -> str:
    """One line per node, with dtype and shape: the format of the graph dumps."""
    lines = []
    for n in graph.nodes:
        v = tensor_val(n)
        ty = f"{str(v.dtype).replace('torch.', '')}{list(shape(n))}" if v is not None else ""
        if n.op == "placeholder":
            lines.append(f"{n.name}: {ty} = input")
        elif n.op == "output":
            lines.append(f"return {_fmt(n.args[0])}")
        else:
            target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            if hasattr(n.target, "_schema"):
                target = str(n.target)
            args = ", ".join([_fmt(a) for a in n.args] + [f"{k}={_fmt(v)}" for k, v in n.kwargs.items()])
            lines.append(f"{n.name}: {ty} = {target}({args})")
    return "\n".join(lines) + "\n"


def _fmt(a) -> str:
    if isinstance(a, torch.fx.Node):
        return "%" + a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.dtype):
        return str(a).replace("torch.", "")
    return repr(a)


def _package_digest() -> str:
    """The source of every module in this package (shared matchers and analyses)."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def pipeline_fingerprint(passes: list[Pass], disabled: set[str], target, options: dict) -> str:
    h = hashlib.sha256()
    h.update(PIPELINE_VERSION.encode())
    h.update(_package_digest().encode())
    for p in passes:
        h.update(p.fingerprint().encode())
        h.update(b"\0disabled" if p.name in disabled else b"\0on")
    h.update(json.dumps(target.to_dict(), sort_keys=True, default=str).encode())
    h.update(json.dumps(options, sort_keys=True, default=str).encode())
    return h.hexdigest()


class PassManager(CustomGraphPass):
    """Runs `passes` in order on a graph; `records` holds what the last run did."""

    def __init__(self, passes: list[Pass], target, *, disabled=(), explicit: bool = False,
                 options: Mapping[str, Any] | None = None, graph_index: int = 0, keep_graphs: bool = True,
                 simulate: bool = True, lookahead: bool = False):
        self.passes = list(passes)
        self.explicit = explicit
        self.target = target
        self.disabled = set(disabled)
        self.options = resolve_options(target, options, self.passes)  # every declared option, checked
        self.lookahead = lookahead
        self.graph_index = graph_index
        self.keep_graphs = keep_graphs
        self.simulate = simulate  # predict the graph's time on the target before and after each pass
        self.records: list[PassRecord] = []
        self.schedule = None  # the simulator's Schedule of the graph after the last pass
        self.simulation_error: str | None = None
        self.invocations = 0
        job = ranks.job_identity()  # each rank compiles (and agrees) for itself
        self._uuid = pipeline_fingerprint(self.passes, self.disabled, target,
                                          {**self.options, "explicit": explicit, "lookahead": lookahead, **job})

    def uuid(self) -> str:
        return self._uuid

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.records = self.run(graph)
        self.invocations += 1

    def run(self, graph: torch.fx.Graph) -> list[PassRecord]:
        records = []
        ctx = PassContext(target=self.target, graph_index=self.graph_index, options=self.options,
                          lookahead=self.lookahead)
        self.simulation_error = None
        schedule = self._predict(graph)
        unsharded = not any(is_c10d(n) for n in graph.nodes)

        def skip_reason(p: Pass) -> str | None:
            if p.name in self.disabled:
                return "disabled"
            reason = p.skip_reason(self.target, self.explicit)
            if reason is None and p.needs_collectives and unsharded:
                reason = "a multi-device pass: this graph has no collectives (the model is not sharded here)"
            return reason

        runnable = [p for p in self.passes if skip_reason(p) is None]
        for p in self.passes:
            ctx.later = tuple(runnable[runnable.index(p) + 1:]) if p in runnable else ()
            ctx.price = lambda g, later=ctx.later: self.price_after_later(g, later)
            n0 = len(graph.nodes)
            rec = PassRecord(name=p.name, ran=False, nodes_before=n0, nodes_after=n0, graph=self.graph_index)
            reason = skip_reason(p)
            if reason is not None:
                rec.skipped_reason = reason
                records.append(rec)
                continue
            before = graph_text(graph) if self.keep_graphs else None
            t0 = time.perf_counter()
            declined = self._declined_by_cost(p, graph, ctx, schedule)
            if declined is not None:
                rec.seconds, rec.ran, rec.decisions = time.perf_counter() - t0, True, [declined]
                if schedule is not None:
                    rec.predicted_before_s = rec.predicted_after_s = schedule.step_seconds
                    rec.floor_after_s, rec.exposed_after_s = schedule.floor_seconds, schedule.exposed_comm_seconds
                records.append(rec)
                continue
            try:
                result = p.run(graph, ctx)
                if not isinstance(result, PassResult):
                    raise TypeError(f"run() returned {type(result).__name__}, not PassResult")
                if result.modified:
                    graph.eliminate_dead_code()
                    graph.lint()
            except PassError:
                raise
            except Exception as e:
                raise PassError(p.name, self.graph_index, e) from e
            rec.seconds = time.perf_counter() - t0
            rec.ran = True
            rec.matches = result.matches
            rec.decisions = list(result.decisions)
            rec.near_misses = list(result.near_misses)
            rec.resources = [list(r) for r in result.resources]
            rec.nodes_after = len(graph.nodes)
            if result.modified and self.keep_graphs:
                rec.graph_before, rec.graph_after = before, graph_text(graph)
            if schedule is not None:
                rec.predicted_before_s, rec.exposed_before_s = schedule.step_seconds, schedule.exposed_comm_seconds
                if result.modified:
                    schedule = self._predict(graph) or schedule
                rec.predicted_after_s, rec.floor_after_s = schedule.step_seconds, schedule.floor_seconds
                rec.exposed_after_s = schedule.exposed_comm_seconds
            records.append(rec)
        self.schedule = schedule
        return records

    def price_after_later(self, graph: torch.fx.Graph, later: tuple) -> float:
        """The predicted step of `graph` once the communication passes among `later` have run
        on a copy of it, each deciding as it would here (with its own look-ahead, exchanging
        nothing between ranks): what a communication pass compares its alternatives by."""
        from metainfer.hardware.simulate import simulate

        from .lookahead import COMMUNICATION_PASSES, copy_graph

        comm = [p for p in later if p.name in COMMUNICATION_PASSES]
        if comm:
            graph = copy_graph(graph)
            PassManager(comm, self.target, explicit=True, options=self.options, keep_graphs=False,
                        simulate=False, lookahead=True)(graph)
        return simulate(graph, self.target).step_seconds

    def _declined_by_cost(self, p: Pass, graph: torch.fx.Graph, ctx: PassContext, schedule) -> str | None:
        """For a cost-gated pass: run it on a copy, and if the simulator predicts the copy
        slower than the graph, the reason to leave the graph as it is (None: run the pass).
        Only on a target that says what a custom-op call costs (`custom_op_overhead_us`, which
        `metainfer calibrate` measures): without it the model cannot weigh a custom op against
        the kernels the lowering would generate. Option `cost_gates=False` turns the gate off."""
        if (not p.cost_gated or schedule is None or not self.options["cost_gates"]
                or not self.target.device.knows_custom_op_costs):
            return None
        from .lookahead import copy_graph

        trial = copy_graph(graph)
        try:
            result = p.run(trial, ctx)
        except Exception as e:
            raise PassError(p.name, self.graph_index, e) from e
        if not result.modified:
            return None
        trial.eliminate_dead_code()
        after = self._predict(trial)
        if after is None or after.step_seconds <= schedule.step_seconds:
            return None
        return (f"declined {result.matches} match(es): the cost model predicts the graph slower with them on "
                f"{self.target.name} ({schedule.step_seconds * 1e6:.1f} -> {after.step_seconds * 1e6:.1f} us: the "
                f"fused op costs more than the kernels the lowering fuses by itself)")

    def _predict(self, graph: torch.fx.Graph):
        """The simulator's schedule of `graph` on the target; None (and the reason kept) if it
        cannot be simulated, which never stops compilation."""
        if not self.simulate or self.simulation_error is not None:
            return None
        from metainfer.hardware.simulate import simulate

        try:
            return simulate(graph, self.target)
        except Exception as e:  # a prediction is a report's extra, never a reason to fail a compile
            self.simulation_error = f"{type(e).__name__}: {e}"
            return None
