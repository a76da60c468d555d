"""The pass contract: a named rewrite of the post-grad ATen graph that says what it did."""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace
from collections.abc import Mapping
from typing import Any, Callable

import torch.fx

from metainfer.hardware.targets import Target

from .matching import location


class NearMiss(Exception):
    """A pattern matched partway and stopped: the message says why, and the pass records it
    (with where) as a near miss in its result, never as a failure. Each pass raises its own
    subclass, so a pass that calls another's matcher catches only that matcher's misses."""


@dataclass
class PassResult:
    """What one run of a pass did to one graph."""

    modified: bool
    matches: int = 0
    decisions: list[str] = field(default_factory=list)  # one line per rewrite: where, what, why
    near_misses: list[str] = field(default_factory=list)  # patterns seen but not rewritten, and why
    # what the rewritten graph needs allocated before it runs, reserved at pass time and again
    # when Inductor's cache serves the graph without the passes: ("symm_mem", group, dtype, numel)
    resources: list[tuple] = field(default_factory=list)


@dataclass
class PassContext:
    target: Target
    graph_index: int = 0
    # every declared pass option's value (passes/options.py resolves them once per pipeline)
    options: Mapping[str, Any] = field(default_factory=dict)
    later: tuple = ()  # the passes that will run after this one on this graph (see passes/lookahead.py)
    # the manager's price of a graph for this pass's decisions: the predicted step after this
    # pipeline's later communication passes ran on a copy (PassManager.price_after_later)
    price: Any = None
    lookahead: bool = False  # running on a copy to price a later pass's choice: no exchanges between ranks


class Pass:
    """Base class. Subclasses set `name`, write a one-line `before -> after` docstring, and
    implement `run`. `device_kinds` lists the target device kinds the pass applies to."""

    name: str = ""
    device_kinds: tuple[str, ...] = ("cpu", "cuda")  # where it is correct
    profitable_kinds: tuple[str, ...] = ("cpu", "cuda")  # where the default pipeline runs it
    unprofitable_why: str = ""
    needs_collectives: bool = False  # rewrites collectives: nothing to do on one device or an unsharded graph
    # replaces work the lowering would run its own way (fused kernels, eager attention, an expert
    # loop) with a custom op: the manager keeps the rewrite only where the cost model predicts
    # the graph no slower with it, on targets that say what a custom-op call costs (PassManager)
    cost_gated: bool = False
    options: tuple = ()  # the passes.options.Option settings it reads from ctx.options

    def skip_reason(self, target: Target, explicit: bool = False) -> str | None:
        """None if the pass should run for `target`, else why not. A pass the user named
        explicitly runs wherever it is correct; a default one only where it pays."""
        kind = target.device.kind
        if kind not in self.device_kinds:
            return f"does not apply to {kind} targets"
        if self.needs_collectives and target.num_devices == 1:
            return f"a multi-device pass: target {target.name} has one device"
        if not explicit and kind not in self.profitable_kinds:
            why = f": {self.unprofitable_why}" if self.unprofitable_why else ""
            return f"not profitable on {kind} targets{why} (name it in passes= to force)"
        return None

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    @property
    def summary(self) -> str:
        doc = inspect.getdoc(type(self)) or ""
        return doc.splitlines()[0] if doc else ""

    def fingerprint(self) -> str:
        """Identifies this pass's implementation, for compile caches: its whole source file
        (helpers included); the manager adds the shared helper modules."""
        return f"{self.name}:{_file_digest(type(self))}"

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


class FunctionPass(Pass):
    """A pass made from a plain function `fn(graph, ctx) -> PassResult`."""

    def __init__(self, name: str, fn: Callable[[torch.fx.Graph, PassContext], PassResult],
                 device_kinds: tuple[str, ...] = ("cpu", "cuda")):
        self.name, self.fn, self.device_kinds = name, fn, device_kinds
        self.__doc__ = fn.__doc__

    @property
    def summary(self) -> str:
        return (self.fn.__doc__ or "").strip().splitlines()[0] if self.fn.__doc__ else ""

    def run(self, graph, ctx):
        return self.fn(graph, ctx)

    def fingerprint(self) -> str:
        return f"{self.name}:{_file_digest(self.fn)}"


class MatchPass(Pass):
    """The shape of every hand-written matcher: for each node of the graph, `match` finds the
    pattern found from it, ending or starting there (a site, None if there is none, or NearMiss
    if it is one that cannot be rewritten), `refuse` may say why a matched site is left alone
    (the target, the cost model), `rewrite` replaces it and `describe` writes its decision line. The loop, and how
    near misses are recorded (where, then what was not done, then why), is here once.

    Subclasses set `missed` ("attention not fused") and `misses` (the NearMiss subclasses their
    matcher raises), and implement match / rewrite / describe; `start` makes the per-run state
    handed to them (default: graph and ctx)."""

    missed: str = "not rewritten"
    misses: tuple[type[Exception], ...] = (NearMiss,)

    def start(self, graph: torch.fx.Graph, ctx: PassContext) -> Any:
        return SimpleNamespace(graph=graph, ctx=ctx)

    def match(self, node: torch.fx.Node, state) -> Any:
        raise NotImplementedError

    def refuse(self, node: torch.fx.Node, site, state) -> str | None:
        """Why this matched site is not rewritten (a whole near-miss line without its place),
        None to rewrite it."""
        return None

    def rewrite(self, node: torch.fx.Node, site, state) -> None:
        raise NotImplementedError

    def describe(self, node: torch.fx.Node, site) -> str:
        raise NotImplementedError

    def notes(self, site) -> list[str]:
        """Faster forms not taken at a site that was rewritten (recorded as near misses)."""
        return []

    def run(self, graph, ctx: PassContext) -> PassResult:
        res = PassResult(modified=False)
        state = self.start(graph, ctx)
        for node in list(graph.nodes):
            if node._erased:  # an earlier rewrite replaced it (a site can span nodes later in the order)
                continue
            try:
                site = self.match(node, state)
                why = None if site is None else self.refuse(node, site, state)
            except self.misses as e:
                res.near_misses.append(f"{location(node)}: {self.missed}: {e}")
                continue
            if site is None:
                continue
            if why:
                res.near_misses.append(f"{location(node)}: {why}")
                continue
            self.rewrite(node, site, state)
            res.matches += 1
            res.decisions.append(self.describe(node, site))
            res.near_misses.extend(f"{location(node)}: {w}" for w in self.notes(site))
        res.modified = res.matches > 0
        return res


def _file_digest(obj) -> str:
    try:
        path = inspect.getsourcefile(obj)
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except (OSError, TypeError):
        return repr(obj)


_REGISTRY: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass available by name."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a pass named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def registered_classes() -> list[type[Pass]]:
    return list(_REGISTRY.values())


def pass_names() -> list[str]:
    return list(_REGISTRY)


def get_pass(name: str) -> Pass:
    if name not in _REGISTRY:
        raise ValueError(f"unknown pass {name!r}; known passes: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]()
