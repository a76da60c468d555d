"""Schedule simulator: a captured graph run on one device's compute stream and communication
stream, with the cost model's times (metainfer.hardware.cost), honouring data dependencies and where
each `wait_tensor` sits.

- A compute op starts when the compute stream is free and its inputs are ready.
- A functional collective (`_c10d_functional.all_reduce`, `all_gather_into_tensor`,
  `reduce_scatter_tensor`, `all_to_all_single`) is issued on the communication stream when
  the compute stream reaches it in program order, that stream is free and its input is
  ready; its result is ready when it finishes. So where a collective sits matters: issued
  before independent compute, it runs beside it.
- `wait_tensor(x)` blocks the compute stream until x's collective is done: the time the
  compute stream spends blocked there is exposed communication.

Compute is priced as the lowering emits it (cost.price_graph): a fused group of pointwise
ops, reductions and copies is one kernel, charged where its last node sits.

`simulate(gm, target)` returns the predicted step time, the exposed communication, per-op
intervals, the floor (max(total compute, total communication with the best algorithm per
collective)), the ops the cost model priced by bytes only, and a Chrome trace (`trace()`,
JSON that Perfetto and chrome://tracing open). `Timeline` is the two-stream core; the
planner drives it directly with the ops of a modelled layer; `GraphTimeline` places graph
nodes one at a time (the overlap scheduler tries orders with it).
This is a model of hardware we may not have: every figure it gives is a prediction.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import torch

from metainfer.hardware import cost
from metainfer.hardware.fxops import is_c10d, op_name, spec_of
from metainfer.hardware.targets import Target
from metainfer.kernels import spec

COLLECTIVE_OPS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}

# functional collectives that take their group's size: its position
_GROUP_SIZE_ARG = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 2}


def collective_op(node: torch.fx.Node) -> "spec.Collective | None":
    """What a metainfer op that is a collective (the shm_* ops, symm_mem_all_reduce) does, from
    its declaration (kernels/spec.py); None for any other node."""
    declared = spec_of(node)
    return declared.collective if declared is not None else None


@dataclass
class Interval:
    name: str
    stream: str  # "compute" or "comm"
    start: float
    end: float
    detail: str = ""


@dataclass
class Schedule:
    target: str
    step_seconds: float
    compute_seconds: float
    comm_seconds: float
    exposed_comm_seconds: float
    floor_seconds: float
    intervals: list[Interval] = field(default_factory=list)
    priced_by_bytes: dict[str, int] = field(default_factory=dict)  # op name -> count the model does not know
    comm_floor_seconds: float = 0.0  # communication on the best algorithm per collective

    @property
    def gap_to_floor(self) -> float:
        """How far the predicted step is above the floor, as a fraction of the floor."""
        return self.step_seconds / self.floor_seconds - 1 if self.floor_seconds > 0 else 0.0

    def trace(self) -> dict:
        """Chrome trace events (microseconds), one track per stream."""
        tid = {"compute": 1, "comm": 2}
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": s}} for s, t in tid.items()]
        for iv in self.intervals:
            events.append({"name": iv.name, "ph": "X", "pid": 0, "tid": tid[iv.stream], "ts": iv.start * 1e6,
                           "dur": (iv.end - iv.start) * 1e6, "args": {"detail": iv.detail} if iv.detail else {}})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "metadata": {"target": self.target, "predicted": True}}

    def save_trace(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.trace(), f)

    def __str__(self) -> str:
        return (f"predicted step {self.step_seconds * 1e3:.3f} ms on {self.target} (compute "
                f"{self.compute_seconds * 1e3:.3f} ms, communication {self.comm_seconds * 1e3:.3f} ms, exposed "
                f"{self.exposed_comm_seconds * 1e3:.3f} ms); floor {self.floor_seconds * 1e3:.3f} ms "
                f"(+{self.gap_to_floor:.0%})")


class Timeline:
    """One device's compute stream and communication stream. Each call places one piece of
    work no earlier than `ready` (when its inputs exist) and returns when it ends."""

    def __init__(self, target: Target):
        self.target = target
        self.compute_free = self.comm_free = 0.0
        self.compute_total = self.comm_total = self.comm_floor = self.exposed = 0.0
        self.intervals: list[Interval] = []
        self.priced_by_bytes: Counter = Counter()

    def compute(self, name: str, seconds: float, ready: float = 0.0, detail: str = "") -> float:
        start = max(self.compute_free, ready)
        self.compute_free = start + seconds
        self.compute_total += seconds
        self.intervals.append(Interval(name, "compute", start, self.compute_free, detail))
        return self.compute_free

    def communicate(self, c: cost.CollectiveCost, best_seconds: float, ready: float = 0.0) -> float:
        """Issue collective `c` (priced with its algorithm) on the communication stream;
        `best_seconds` is what the best algorithm would take (for the floor)."""
        start = max(self.comm_free, ready)
        self.comm_free = start + c.seconds
        self.comm_total += c.seconds
        self.comm_floor += best_seconds
        host = (1 - self.target.comm_overlap) * c.seconds
        if host > 0:  # the part that cannot run beside compute takes the compute stream too
            begin = max(self.compute_free, start)
            self.compute_free = begin + host
            self.compute_total += host
            self.intervals.append(Interval(f"{c.kind} (not overlapped)", "compute", begin, self.compute_free,
                                           f"{1 - self.target.comm_overlap:.0%} of the collective's time"))
        self.intervals.append(Interval(f"{c.kind} {c.algorithm}", "comm", start, self.comm_free,
                                       f"{c.nbytes / 2**20:.2f} MiB over {c.ranks} ranks, "
                                       f"{c.bytes_inter / 2**20:.2f} MiB across islands"))
        return self.comm_free

    def wait(self, ready: float) -> float:
        """The compute stream blocks until `ready` (a collective's end): exposed communication."""
        blocked = max(0.0, ready - self.compute_free)
        if blocked > 0:
            self.intervals.append(Interval("wait", "compute", self.compute_free, ready, "exposed communication"))
            self.exposed += blocked
        self.compute_free = max(self.compute_free, ready)
        return self.compute_free

    def schedule(self) -> Schedule:
        step = max(self.compute_free, self.comm_free)
        return Schedule(self.target.name, step, self.compute_total, self.comm_total, self.exposed,
                        max(self.compute_total, self.comm_floor), self.intervals, dict(self.priced_by_bytes),
                        self.comm_floor)



def _collective_bytes(node: torch.fx.Node, kind: str) -> float:
    """The message size the cost model takes: one rank's buffer; for all-gather the output."""
    val = node.meta.get("val") if kind == "all_gather" else node.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    return cost.tensor_bytes(val)


def group_name(node: torch.fx.Node) -> "str | None":
    """The process group a functional collective names (its last positional argument or
    `group_name`), or None."""
    group = node.args[-1] if node.args and isinstance(node.args[-1], str) else node.kwargs.get("group_name")
    return group if isinstance(group, str) else None


def group_ranks(node: torch.fx.Node, target: Target) -> "int | tuple[int, ...]":
    """The devices of a functional collective's group: the ranks of the process group it
    names (when torch.distributed knows it), else its group_size argument (the first n
    devices), else the whole target."""
    _, name = op_name(node)
    collective = collective_op(node)
    size_arg = collective.group_size_arg if collective is not None else _GROUP_SIZE_ARG.get(name)
    group = group_name(node)
    import torch.distributed as dist

    if group is not None and dist.is_available() and dist.is_initialized():
        try:
            ranks = dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group))
            if all(r < target.num_devices for r in ranks):
                return tuple(ranks)
        except Exception:  # a name from another process (a cached graph): fall back below
            pass
    if size_arg is not None:
        size = node.args[size_arg]
        if isinstance(size, int):
            return min(size, target.num_devices)
    return target.num_devices


class GraphTimeline:
    """The FX walk over a `Timeline`: `place(node)` runs one node where the program order has
    put it (after everything placed before), so a scheduler can try orders node by node.

    A collective is issued when the compute stream reaches it in program order (the host
    enqueues it then; on a GPU its stream waits for the compute stream's work so far), and
    its input is ready; `wait_tensor` blocks the compute stream until it ends."""

    def __init__(self, target: Target, algorithms: dict | None = None,
                 prices: "dict[torch.fx.Node, cost.OpCost] | None" = None):
        self.target = target
        self.algorithms = algorithms or {}
        self.ready: dict[torch.fx.Node, float] = {}
        self.tl = Timeline(target)
        # what the lowering emits (cost.price_graph); walks of one graph in several orders share it
        self.prices: dict[torch.fx.Node, cost.OpCost] = {} if prices is None else prices

    def price(self, node: torch.fx.Node) -> cost.OpCost:
        if node not in self.prices:
            self.prices.update(cost.price_graph(node.graph, self.target))
        return self.prices.get(node) or cost.op_cost(node, self.target)

    def inputs_ready(self, node: torch.fx.Node) -> float:
        return max((self.ready.get(a, 0.0) for a in node.all_input_nodes), default=0.0)

    def place(self, node: torch.fx.Node) -> float:
        tl, target = self.tl, self.target
        deps = self.inputs_ready(node)
        if node.op != "call_function":
            self.ready[node] = deps
            return deps
        _, name = op_name(node)
        if is_c10d(node) and name in COLLECTIVE_OPS:
            kind = COLLECTIVE_OPS[name]
            nbytes = _collective_bytes(node, kind)
            ranks = group_ranks(node, target)
            c = cost.collective_cost(kind, nbytes, target, self.algorithms.get(node.name), ranks=ranks)
            end = tl.communicate(c, cost.best(kind, nbytes, target, ranks=ranks).seconds, max(deps, tl.compute_free))
        elif is_c10d(node) and name == "wait_tensor":
            end = tl.wait(deps)
        elif (collective := collective_op(node)) is not None:
            # metainfer's collectives (shared memory on the rank's own core, a P2P kernel): the
            # compute stream waits for them
            kind = collective.kind
            algorithm = collective.algorithm if isinstance(collective.algorithm, str) else node.args[collective.algorithm]
            nbytes = _collective_bytes(node, kind)
            ranks = group_ranks(node, target)
            c = cost.collective_cost(kind, nbytes, target, algorithm, ranks=ranks)
            end = tl.wait(tl.communicate(c, cost.best(kind, nbytes, target, ranks=ranks).seconds,
                                         max(deps, tl.compute_free)))
        else:
            c = self.price(node)
            if c.priced_by_bytes:
                tl.priced_by_bytes[name] += 1
            end = deps if c.seconds == 0 else tl.compute(name, c.seconds, deps, f"{c.bound}-bound")
        self.ready[node] = end
        return end


def simulate(gm: "torch.fx.GraphModule | torch.fx.Graph", target: Target, algorithms: dict | None = None) -> Schedule:
    """Predicted schedule of one call of `gm` on one device of `target`. `algorithms` maps a
    collective node's name to the algorithm it runs (default: the library's, i.e. the first
    listed in metainfer.hardware.cost.ALGORITHMS)."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    walk = GraphTimeline(target, algorithms)
    for node in graph.nodes:
        walk.place(node)
    return walk.tl.schedule()
