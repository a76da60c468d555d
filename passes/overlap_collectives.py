"""overlap_collectives: the graph re-ordered so that each collective is issued as soon as its
input is ready and its `wait_tensor` sits as late as the work that needs it allows, with
independent compute (shared experts beside routed experts, the other micro-batch, the next
chunk of a pipelined matmul) placed in the gap.

    y = mm(a); ar = all_reduce(y); w = wait(ar); s = shared_mlp(x); out = w + s
      -> y = mm(a); ar = all_reduce(y); s = shared_mlp(x); w = wait(ar); out = w + s

The order comes from a list scheduler driven by the simulator's clock (metainfer.hardware.simulate):
among the nodes whose inputs are placed, collectives go first; then compute, preferring the
work that feeds the earliest pending collective; a `wait_tensor` whose collective would
still be running goes last, when nothing else is ready. Nodes with side effects (in-place
writes into graph inputs) are barriers nothing moves across.

The new order is kept only if the simulator predicts a shorter step, its peak of live
activations stays within the memory bound (pass option / target `[passes]`
`overlap_memory_bytes`, else the old peak plus OVERLAP_MEMORY_FRACTION of device memory),
and every rank of every group the graph's collectives run on has the same collective
sequence (checked across the ranks; see metainfer.passes.ranks.collective_order_mismatch).
Otherwise the graph is left as it was and the report says why.
"""

from __future__ import annotations

import heapq
import math

import torch

from metainfer.hardware import cost
from metainfer.hardware.fxops import VIEW_NAMES, is_c10d, op_name
from metainfer.hardware.simulate import COLLECTIVE_OPS, GraphTimeline, group_name

from . import ranks
from .base import Pass, PassContext, PassResult, register
from .options import Option
from .matching import Node, location, tensor_val

OVERLAP_MEMORY_FRACTION = 0.02  # of device memory: what re-ordering may add to the live activations


def is_collective(n: Node) -> bool:
    return n.op == "call_function" and is_c10d(n) and op_name(n)[1] in COLLECTIVE_OPS


def is_wait(n: Node) -> bool:
    return n.op == "call_function" and is_c10d(n) and op_name(n)[1] == "wait_tensor"


def _is_barrier(n: Node) -> bool:
    if n.op != "call_function" or is_c10d(n):
        return False
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable) or n.is_impure()


def _dependencies(nodes: list[Node]) -> dict[Node, set[Node]]:
    """Data inputs plus barrier edges: a barrier comes after everything before it, and
    everything after it comes after it."""
    deps = {n: set(n.all_input_nodes) for n in nodes}
    since: list[Node] = []
    last = None
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        if last is not None:
            deps[n].add(last)
        if _is_barrier(n):
            deps[n].update(since)
            since, last = [], n
        else:
            since.append(n)
    return deps


def schedule(graph: torch.fx.Graph, target, prices: "dict | None" = None) -> list[Node]:
    """The list scheduler's order of `graph`'s nodes (placeholders first, output last);
    `prices`: the graph's cost.price_graph, if already computed."""
    nodes = list(graph.nodes)
    idx = {n: i for i, n in enumerate(nodes)}
    deps = _dependencies(nodes)
    users: dict[Node, list[Node]] = {n: [] for n in nodes}
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)
    feeds: dict[Node, float] = {}  # the earliest (original position) collective a node leads to
    for n in reversed(nodes):
        own = idx[n] if is_collective(n) else math.inf
        feeds[n] = min([own] + [feeds[u] for u in users[n]])
    walk = GraphTimeline(target, prices=prices)
    order: list[Node] = []
    missing = {n: len(deps[n]) for n in nodes}
    collectives: list[tuple] = []
    compute: list[tuple] = []
    waits: list[Node] = []
    output = nodes[-1]

    def release(n: Node) -> None:
        if n is output:
            return
        if is_collective(n):
            heapq.heappush(collectives, (idx[n], id(n), n))
        elif is_wait(n):
            waits.append(n)
        else:
            heapq.heappush(compute, (feeds[n], idx[n], id(n), n))

    def placed(n: Node) -> None:
        walk.place(n)
        order.append(n)
        for u in users[n]:
            missing[u] -= 1
            if not missing[u]:
                release(u)

    inputs = [n for n in nodes if n.op == "placeholder"]  # the graph's signature: never re-ordered
    for n in nodes:
        if not missing[n] and n.op != "placeholder":
            release(n)
    for n in inputs:
        placed(n)
    while collectives or compute or waits:
        if collectives:
            n = heapq.heappop(collectives)[-1]
        else:
            now = walk.tl.compute_free
            done = [w for w in waits if walk.inputs_ready(w) <= now]  # costs nothing now: place like compute
            first = min(done, key=lambda w: (feeds[w], idx[w])) if done else None
            if first is not None and (not compute or (feeds[first], idx[first]) < compute[0][:2]):
                n = first
                waits.remove(n)
            elif compute:
                n = heapq.heappop(compute)[-1]
            else:  # nothing else to do: the wait whose collective ends first
                n = min(waits, key=lambda w: (walk.inputs_ready(w), idx[w]))
                waits.remove(n)
        placed(n)
    if len(order) != len(nodes) - 1:
        raise RuntimeError(f"overlap scheduler placed {len(order)} of {len(nodes) - 1} nodes (a cycle?)")
    return order + [output]


# ---- memory ------------------------------------------------------------------------------------

def _aliases(n: Node) -> bool:
    return n.op == "call_function" and op_name(n)[1] in VIEW_NAMES


def peak_live_bytes(order: list[Node]) -> float:
    """The most bytes of intermediate values alive at once when the nodes run in `order`
    (graph inputs not counted; a view shares its base's storage and keeps it alive)."""
    pos = {n: i for i, n in enumerate(order)}
    root: dict[Node, Node] = {}
    for n in order:
        base = n.args[0] if _aliases(n) and n.args and isinstance(n.args[0], Node) else None
        root[n] = root.get(base, base) if base is not None else n
    end: dict[Node, int] = {}
    for n in order:
        r = root[n]
        last = max([pos[u] for u in n.users if u in pos], default=pos[n])
        end[r] = max(end.get(r, pos[r]), last)
    delta = [0.0] * (len(order) + 1)
    for r, last in end.items():
        if r.op != "call_function" or _aliases(r):
            continue
        v = r.meta.get("val")
        vals = v if isinstance(v, (list, tuple)) else [v]
        b = sum(cost.tensor_bytes(x) for x in vals if isinstance(x, torch.Tensor))
        delta[pos[r]] += b
        delta[last + 1] -= b
    live = peak = 0.0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak


def memory_bound(ctx: PassContext, before_peak: float) -> float:
    given = ctx.options["overlap_memory_bytes"]
    if given is not None:
        return given
    return before_peak + OVERLAP_MEMORY_FRACTION * ctx.target.device.memory_bytes


# ---- the pass ----------------------------------------------------------------------------------

def _timeline(order: list[Node], target, prices: dict) -> tuple[GraphTimeline, dict[Node, float]]:
    """The simulator run over `order`, and how long each wait blocks the compute stream."""
    walk = GraphTimeline(target, prices=prices)
    blocked = {}
    for n in order:
        if is_wait(n):
            blocked[n] = max(0.0, walk.inputs_ready(n) - walk.tl.compute_free)
        walk.place(n)
    return walk, blocked


def _compute_between(order: list[Node], coll: Node, wait: Node, target) -> int:
    pos = {n: i for i, n in enumerate(order)}
    return sum(1 for n in order[pos[coll] + 1:pos[wait]]
               if n.op == "call_function" and not is_c10d(n) and not _aliases(n) and cost.op_cost(n, target).seconds > 0)


def _group_size(n: Node) -> int:
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._resolve_process_group(group_name(n)).size()
    except Exception:  # no job (a graph analysed alone): the size argument where the op has one
        sizes = [a for a in n.args[1:] if isinstance(a, int)]
        return sizes[0] if sizes else 0


def collective_signature(order: list[Node]) -> list[tuple]:
    """The collective sequence as every rank must issue it: kind, group size, shape, dtype
    (group sizes, not names: replicas and islands run isomorphic groups of their own)."""
    out = []
    for n in order:
        if is_collective(n):
            v = tensor_val(n)
            out.append((op_name(n)[1], _group_size(n), tuple(str(s) for s in v.shape) if v is not None else (),
                        str(v.dtype) if v is not None else ""))
    return out


def group_names(order: list[Node]) -> list[str]:
    return sorted({g for n in order if is_collective(n) and (g := group_name(n)) is not None})


def _moved(old: list[Node], new: list[Node], target, blocked_before: dict, blocked_after: dict) -> list[str]:
    """A decision line per collective the new order gives more compute to hide behind, or less
    exposed time."""
    lines = []
    waits = {n.args[0]: n for n in new if is_wait(n) and isinstance(n.args[0], Node)}
    for c in (n for n in new if is_collective(n)):
        w = waits.get(c)
        if w is None:
            continue
        gained = _compute_between(new, c, w, target) - _compute_between(old, c, w, target)
        if gained <= 0 and blocked_after[w] >= blocked_before[w]:
            continue
        lines.append(f"{location(c)}: {op_name(c)[1]} {cost.tensor_bytes(tensor_val(c)) / 2**10:.1f} KiB: "
                     f"{_compute_between(new, c, w, target)} compute op(s) now between issue and wait "
                     f"({_compute_between(old, c, w, target)} before); predicted exposed "
                     f"{blocked_before[w] * 1e6:.1f} -> {blocked_after[w] * 1e6:.1f} us")
    return lines


@register
class OverlapCollectives(Pass):
    """collective ... wait(collective) -> collective issued early, wait late, independent compute between"""

    name = "overlap_collectives"
    options = (Option("overlap_memory_bytes", float, None, "the most live activation bytes a re-ordered schedule "
                      f"may hold (unset: the graph's peak + {OVERLAP_MEMORY_FRACTION:.0%} of device memory)",
                      minimum=0),)
    needs_collectives = True

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        res = PassResult(modified=False)
        old = list(graph.nodes)
        if not any(is_collective(n) for n in old):
            return res
        target = ctx.target
        prices = cost.price_graph(graph, target)  # the same kernels in either order
        new = schedule(graph, target, prices)
        before, blocked_before = _timeline(old, target, prices)
        after, blocked_after = _timeline(new, target, prices)
        t0, t1 = before.tl.schedule(), after.tl.schedule()
        figures = (f"predicted step {t0.step_seconds * 1e6:.0f} -> {t1.step_seconds * 1e6:.0f} us, exposed "
                   f"communication {t0.exposed_comm_seconds * 1e6:.0f} -> {t1.exposed_comm_seconds * 1e6:.0f} us")
        peak0, peak1 = peak_live_bytes(old), peak_live_bytes(new)
        bound = memory_bound(ctx, peak0)
        memory = f"peak live activations {peak0 / 2**20:.2f} -> {peak1 / 2**20:.2f} MiB (bound {bound / 2**20:.2f} MiB)"
        why = None
        if new == old:
            why = f"overlap_collectives: the graph's order is already the scheduler's ({figures})"
        elif not t1.step_seconds < t0.step_seconds * (1 - 1e-9):
            why = f"overlap_collectives: no independent compute to hide communication behind; order kept ({figures})"
        elif peak1 > bound:
            why = f"overlap_collectives refused: the new schedule exceeds the memory bound: {memory}; order kept ({figures})"
        from .lookahead import in_lookahead

        lookahead = in_lookahead(ctx)
        if not lookahead:  # every rank takes part, so every rank takes the same decision
            disagree = ranks.collective_order_mismatch(collective_signature(new if why is None else old),
                                                             group_names(old), proposing=why is None)
            if why is None and disagree:
                why = f"overlap_collectives refused: collective order differs between ranks ({disagree}); order kept"
        if why is not None:
            res.near_misses.append(why)
            return res
        for prev, n in zip(new, new[1:]):
            prev.append(n)
        res.modified = True
        if lookahead:  # a copy priced for another pass's decision: the order is all that counts
            res.matches = 1
            return res
        moved = _moved(old, new, target, blocked_before, blocked_after)
        res.matches += len(moved)
        res.decisions.extend(moved)
        res.decisions.append(f"graph re-ordered: {figures}; {memory}")
        res.modified = True
        return res
