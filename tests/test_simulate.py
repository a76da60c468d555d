"""The schedule simulator on hand-built graphs with functional collectives: serial vs
overlapped communication, exposed time, the floor, and the Chrome trace."""

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from metainfer.hardware import cost, targets
from metainfer.hardware.simulate import simulate

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


class Builder:
    """A post-grad-style graph whose nodes carry fake values."""

    def __init__(self):
        self.g, self.mode = torch.fx.Graph(), FakeTensorMode()

    def input(self, name, *shape):
        n = self.g.placeholder(name)
        with self.mode:
            n.meta["val"] = torch.empty(*shape, dtype=torch.bfloat16)
        return n

    def call(self, op, *args):
        n = self.g.call_function(op, args)
        vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        with self.mode:
            n.meta["val"] = op(*vals)
        return n

    def done(self, out):
        self.g.output(out)
        return torch.fx.GraphModule(torch.nn.Module(), self.g)


def layer(overlap: bool):
    """h = x @ w1 (row-parallel partial sums) -> all_reduce -> wait -> @ w2; with `overlap`, an
    independent matmul sits between the all_reduce and its wait."""
    b = Builder()
    x, w1, w2, y = b.input("x", 4096, 4096), b.input("w1", 4096, 4096), b.input("w2", 4096, 4096), b.input("y", 4096, 4096)
    h = b.call(aten.mm.default, x, w1)
    ar = b.call(c10d.all_reduce.default, h, "sum", "0")
    other = b.call(aten.mm.default, y, w2) if overlap else None
    wt = b.call(c10d.wait_tensor.default, ar)
    out = b.call(aten.mm.default, wt, w2)
    if overlap:
        out = b.call(aten.add.Tensor, out, other)
    return b.done(out)


def test_serial_collective_is_exposed():
    t = targets.get("pcie8")
    s = simulate(layer(overlap=False), t)
    mm = cost.op_cost(next(n for n in layer(False).graph.nodes if n.target is aten.mm.default), t).seconds
    ar = cost.collective_cost("all_reduce", 4096 * 4096 * 2, t, "ring").seconds
    assert s.comm_seconds == pytest.approx(ar) and s.compute_seconds == pytest.approx(2 * mm)
    assert s.exposed_comm_seconds == pytest.approx(ar)
    assert s.step_seconds == pytest.approx(2 * mm + ar)
    best = cost.best("all_reduce", 4096 * 4096 * 2, t).seconds
    assert s.floor_seconds == pytest.approx(max(2 * mm, best))


def test_independent_compute_hides_communication_and_algorithms_change_it():
    t = targets.get("pcie8")
    serial, overlapped = simulate(layer(False), t), simulate(layer(True), t)
    assert overlapped.exposed_comm_seconds < serial.exposed_comm_seconds
    gm = layer(False)
    ar = next(n for n in gm.graph.nodes if "all_reduce" in str(n.target))
    hier = simulate(gm, t, algorithms={ar.name: "hierarchical"})
    assert hier.comm_seconds < serial.comm_seconds  # fewer bytes over the 10 GB/s boundary


@pytest.mark.parametrize("overlap", [0.0, 0.25, 1.0])
def test_communication_that_does_not_overlap_takes_the_compute_stream(overlap):
    """By hand: mm, all-reduce, (independent mm), wait, mm, add. With a share `overlap` of the
    all-reduce able to run beside compute, the rest of it occupies the compute stream from its
    issue, so the independent matmul hides at most that share."""
    import dataclasses

    t = dataclasses.replace(targets.get("pcie8"), comm_overlap=overlap)
    gm = layer(True)
    mm = cost.op_cost(next(n for n in gm.graph.nodes if n.target is aten.mm.default), t).seconds
    add = cost.op_cost(next(n for n in gm.graph.nodes if n.target is aten.add.Tensor), t).seconds
    ar = cost.collective_cost("all_reduce", 4096 * 4096 * 2, t, "ring").seconds
    s = simulate(gm, t)
    # the collective ends at mm + ar; the compute stream is busy with mm, the host share of the
    # collective, then the independent mm; the wait then holds it until the collective ends
    busy = mm + (1 - overlap) * ar + mm
    assert s.step_seconds == pytest.approx(max(busy, mm + ar) + mm + add)
    assert s.compute_seconds == pytest.approx(3 * mm + add + (1 - overlap) * ar)


def test_trace_is_chrome_json(tmp_path):
    s = simulate(layer(True), targets.get("pcie8"))
    s.save_trace(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {1, 2} and all(e["dur"] >= 0 for e in spans)
    assert "predicted step" in str(s)


def test_a_symmetric_memory_all_reduce_blocks_the_compute_stream():
    """metainfer::symm_mem_all_reduce (P2P kernels) is priced with its algorithm and, being a
    kernel on the compute stream, fully exposed."""
    import metainfer.kernels.ops  # noqa: F401  (registers the op)

    b = Builder()
    x, w = b.input("x", 64, 4096), b.input("w", 4096, 4096)
    h = b.call(aten.mm.default, x, w)
    out = b.call(torch.ops.metainfer.symm_mem_all_reduce.default, h, "one_shot", "0")
    t = targets.get("pcie8")
    s = simulate(b.done(out), t)
    expected = cost.collective_cost("all_reduce", 64 * 4096 * 2, t, "one_shot").seconds
    assert s.comm_seconds == pytest.approx(expected) and s.exposed_comm_seconds == pytest.approx(expected)
    assert not s.priced_by_bytes


def test_a_shared_memory_collective_is_priced_by_its_fit_and_fully_exposed():
    """metainfer::shm_* run on the rank's own core: latency + bytes / bandwidth from the
    target's [collectives.shm], the compute stream waiting for it (by hand: 64 x 4096 bf16)."""
    import dataclasses

    import metainfer.kernels.ops  # noqa: F401  (registers the ops)
    from metainfer.hardware.targets import LinkSpec

    t = dataclasses.replace(targets.get("pcie8"), device=dataclasses.replace(targets.get("pcie8").device, kind="cpu"),
                            shm_links={"all_reduce": LinkSpec(bandwidth=4e9, latency_s=10e-6),
                                       "all_gather": LinkSpec(bandwidth=8e9, latency_s=5e-6)})
    b = Builder()
    x, w = b.input("x", 64, 4096), b.input("w", 4096, 4096)
    h = b.call(aten.mm.default, x, w)
    r = b.call(torch.ops.metainfer.shm_all_reduce.default, h, "0")
    out = b.call(torch.ops.metainfer.shm_all_gather.default, r, 8, "0")
    s = simulate(b.done(out), t)
    nbytes = 64 * 4096 * 2
    expected = (10e-6 + nbytes / 4e9) + (5e-6 + 8 * nbytes / 8e9)  # all-gather: its output
    assert s.comm_seconds == pytest.approx(expected) and s.exposed_comm_seconds == pytest.approx(expected)
