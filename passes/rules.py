"""Rewrites as data: a Rule is a pattern written as a plain torch function beside its
replacement (a call to a metainfer op), with the proofs a pattern cannot express (a weight's
shape, dtypes, broadcasting) as a check attached to it.

Rules are traced into Inductor's pattern matcher (`register_replacement` with `fwd_only`),
so a pattern is written once as the model writes the math and matched in the form
Inductor's decompositions give it. A RulePass applies its rules and reports, per match, a
decision, and per anchor node left unmatched (an rsqrt, a sigmoid), a near miss: the failed
proof, an intermediate used outside the pattern, or that no form matched around it.

Before matching, commutative products and sums are put in one operand order (canonicalize),
in the graph and in every traced pattern alike, so a rule lists no commuted copies where
the operands differ in shape (x * rsqrt(...), weight * normed, normed * (1 + weight)).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch._inductor import pattern_matcher as pm
from torch._inductor.virtualized import V

from .base import Pass, PassContext, PassResult
from .matching import Node, aten, location

COMMUTATIVE = (aten.mul.Tensor, aten.add.Tensor)


@dataclass(frozen=True)
class Rule:
    name: str  # what a decision calls a match ("add+rmsnorm")
    op: str  # the metainfer op it becomes ("add_rmsnorm")
    pattern: Callable  # plain torch; its parameters are the rule's tensors and scalars
    replacement: Callable  # same parameters; calls a metainfer op
    example: Callable[[torch.dtype], list]  # example tensors to trace the pattern with
    dtype: torch.dtype = torch.float32  # casts appear in a trace only below float32
    scalars: dict = field(default_factory=dict)  # scalar parameter -> a value used nowhere else in the trace
    check: Callable[[pm.Match], str | None] = lambda m: None  # the proof: None, or why the rule does not apply
    describe: Callable[[pm.Match], str] = lambda m: ""  # detail for the decision line


def positional(fn, names: tuple[str, ...]):
    """`fn` called with keyword arguments, as a function of exactly `names` (the tracer binds
    a rule's tensors and scalars by parameter name): one body serves every form of a rule."""
    def call(*args):
        return fn(**dict(zip(names, args)))

    call.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                            for n in names])
    return call


def canonicalize(graph: torch.fx.Graph) -> torch.fx.Graph:
    """Each two-tensor mul/add (no alpha) takes the operand of more dimensions, then of more
    non-unit dimensions, first; ties keep their order. Exact: both ops commute, dtype
    promotion included."""
    for n in graph.nodes:
        if n.op == "call_function" and n.target in COMMUTATIVE and not n.kwargs and len(n.args) == 2 \
                and all(isinstance(a, Node) for a in n.args) and _rank_key(n.args[1]) > _rank_key(n.args[0]):
            n.args = (n.args[1], n.args[0])
    return graph


def _rank_key(n: Node) -> tuple:
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return (-1, -1)
    return (v.dim(), sum(1 for s in v.shape if not (isinstance(s, int) and s == 1)))


def _trace(fn, args, **kw) -> torch.fx.GraphModule:
    gm = pm.fwd_only(fn, args, **kw)
    canonicalize(gm.graph)
    return gm


class RulePass(Pass):
    """A pass made of rules: subclasses set `rules` and `anchor(node)`, true for a node whose
    presence says one of the rules was meant (a near miss is reported where no rule took it)."""

    rules: tuple[Rule, ...] = ()
    what: str = ""  # what a near miss says was not fused ("rmsnorm")

    @staticmethod
    def anchor(n: Node) -> bool:
        return False

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        res = PassResult(modified=False)
        canonicalize(graph)
        matcher = _matcher(type(self))
        anchors = [n for n in graph.nodes if n.op == "call_function" and self.anchor(n)]
        why_not: dict[Node, str] = {}
        _active.append((res, why_not))
        try:
            fake = torch._guards.detect_fake_mode([n.meta.get("val") for n in graph.find_nodes(op="placeholder")])
            with V.set_fake_mode(fake) if fake is not None else contextlib.nullcontext():
                res.matches = _apply(matcher, graph)
        finally:
            _active.pop()
        for a in anchors:
            if a._erased:
                continue
            why = why_not.get(a) or _structural_miss(matcher, a)
            res.near_misses.append(f"{location(a)}: {self.what} not fused: {why}")
        res.modified = res.matches > 0
        return res


def _apply(matcher: pm.PatternMatcherPass, graph: torch.fx.Graph) -> int:
    """PatternMatcherPass.apply without its skip of nodes Inductor cannot lower (meta tensors:
    analyze() on a real-size model) or of mutation regions (these graphs are functional)."""
    count = 0
    nodes = itertools.chain.from_iterable(graph.find_nodes(op=op, target=t, sort=False) for op, t in matcher.patterns)
    for node in sorted(nodes, reverse=True):
        for entry in matcher.patterns[(node.op, node.target)]:
            if node._erased:
                break
            m = entry.pattern.match(node)
            if pm.is_match(m) and entry.extra_check(m):
                count += 1
                entry.apply(m, graph, node)
    return count


_active: list = []  # (PassResult, {anchor: why not}) of the RulePass now applying its matcher
_MATCHERS: dict[type, pm.PatternMatcherPass] = {}


def _matcher(cls: type[RulePass]) -> pm.PatternMatcherPass:
    """The rules of `cls` traced into one PatternMatcherPass, once per process."""
    if cls not in _MATCHERS:
        matcher = pm.PatternMatcherPass(pass_name=cls.name)
        for rule in cls.rules:
            pm.register_replacement(rule.pattern, rule.replacement, rule.example(rule.dtype), _trace, matcher,
                                    extra_check=_checked(rule, cls.anchor), scalar_workaround=dict(rule.scalars),
                                    skip_duplicates=True)  # forms that trace alike at a dtype count once
        _MATCHERS[cls] = matcher
    return _MATCHERS[cls]


def _checked(rule: Rule, is_anchor: Callable[[Node], bool]):
    def extra_check(m: pm.Match) -> bool:
        res, why_not = _active[-1]
        why = rule.check(m)
        anchor = next((n for n in m.nodes if is_anchor(n)), None)
        if why is not None:
            if anchor is not None:
                why_not.setdefault(anchor, why)
            return False
        out = m.output_nodes()[0]
        detail = rule.describe(m)
        res.decisions.append(f"{location(out)}: {rule.name} -> metainfer.{rule.op}" + (f" ({detail})" if detail else ""))
        return True

    return extra_check


def _structural_miss(matcher: pm.PatternMatcherPass, anchor: Node) -> str:
    """Why no rule matched around `anchor`: the patterns tried at the nodes a few steps
    downstream of it; an intermediate read outside the pattern is the failure worth naming."""
    frontier, seen = [anchor], {anchor}
    for _ in range(6):
        frontier = [u for n in frontier for u in n.users if u not in seen and not seen.add(u)]
        for node in frontier:
            for entry in matcher.patterns.get((node.op, node.target), ()):
                m = entry.pattern.match(node)
                if not pm.is_match(m) and m.format_string.startswith("multiple_users"):
                    inner = m.args[0] if m.args else None
                    op = getattr(inner, "fns", ["an intermediate"])[0]
                    return f"an intermediate ({op}) is also used outside the pattern"
    return "no form of the pattern matched the nodes around it"


class PointwiseRulePass(RulePass):
    """A rule pass whose ops replace a chain of pointwise math (RMSNorm, RoPE, gated units): on
    GPUs the chain is several kernels Inductor may not fuse into one; on CPU Inductor's C++
    loops already fuse it, so the default pipeline runs these passes on CUDA targets only."""

    cost_gated = True
    profitable_kinds = ("cuda",)
    unprofitable_why = "Inductor's C++ loops already fuse this chain"
