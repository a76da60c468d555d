"""Schedule simulator: a captured graph run on one device's compute stream and communication
stream, with the cost model's times (metainfer.cost), honouring data dependencies and where
each `wait_tensor` sits.

- A compute op starts when the compute stream is free and its inputs are ready.
- A functional collective (`_c10d_functional.all_reduce`, `all_gather_into_tensor`,
  `reduce_scatter_tensor`, `all_to_all_single`) is issued on the communication stream when
  that stream is free and its input is ready; its result is ready when it finishes.
- `wait_tensor(x)` blocks the compute stream until x's collective is done: the time the
  compute stream spends blocked there is exposed communication.

`simulate(gm, target)` returns the predicted step time, the exposed communication, per-op
intervals, the floor (max(total compute, total communication with the best algorithm per
collective)) and a Chrome trace (`trace()`, JSON that Perfetto and chrome://tracing open).
This is a model of hardware we may not have: every figure it gives is a prediction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from metainfer import cost
from metainfer.targets import Target

_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


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


def _op_name(node: torch.fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", getattr(node.target, "__name__", str(node.target)))


def _is_c10d(node: torch.fx.Node) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    return packet is not None and getattr(packet, "_qualified_op_name", "").startswith("_c10d_functional::")


def _collective_bytes(node: torch.fx.Node, kind: str) -> float:
    """The message size the cost model takes: one rank's buffer; for all-gather the output."""
    val = node.meta.get("val") if kind == "all_gather" else node.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    return cost.tensor_bytes(val)


def simulate(gm: torch.fx.GraphModule, target: Target, algorithms: dict | None = None) -> Schedule:
    """Predicted schedule of one call of `gm` on one device of `target`. `algorithms` maps a
    collective node's name to the algorithm it runs (default: the library's, i.e. the first
    listed in metainfer.cost.ALGORITHMS)."""
    algorithms = algorithms or {}
    ready: dict[torch.fx.Node, float] = {}
    compute_free = comm_free = 0.0
    compute_total = comm_total = comm_floor = exposed = 0.0
    intervals: list[Interval] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            ready[node] = 0.0 if node.op == "placeholder" else max((ready.get(a, 0.0) for a in node.all_input_nodes),
                                                                    default=0.0)
            continue
        deps = max((ready.get(a, 0.0) for a in node.all_input_nodes), default=0.0)
        name = _op_name(node)
        if _is_c10d(node) and name in _COLLECTIVES:
            kind = _COLLECTIVES[name]
            nbytes = _collective_bytes(node, kind)
            c = cost.collective_cost(kind, nbytes, target, algorithms.get(node.name))
            start = max(comm_free, deps)
            comm_free = ready[node] = start + c.seconds
            comm_total += c.seconds
            comm_floor += cost.best(kind, nbytes, target).seconds
            intervals.append(Interval(f"{kind} {c.algorithm}", "comm", start, comm_free,
                                      f"{nbytes / 2**20:.2f} MiB, {c.bytes_inter / 2**20:.2f} MiB across islands"))
        elif _is_c10d(node) and name == "wait_tensor":
            start = max(compute_free, deps)
            blocked = max(0.0, deps - compute_free)
            exposed += blocked
            if blocked > 0:
                intervals.append(Interval("wait", "compute", compute_free, deps, "exposed communication"))
            compute_free = ready[node] = start
        else:
            c = cost.op_cost(node, target)
            if c.seconds == 0:
                ready[node] = deps
                continue
            start = max(compute_free, deps)
            compute_free = ready[node] = start + c.seconds
            compute_total += c.seconds
            intervals.append(Interval(name, "compute", start, compute_free, f"{c.bound}-bound"))
    step = max(compute_free, comm_free)
    return Schedule(target.name, step, compute_total, comm_total, exposed, max(compute_total, comm_floor), intervals)
