"""pipeline_collectives: a row-parallel matmul feeding an all-reduce split along its tokens
into k chunks, so that chunk i's all-reduce runs while chunk i+1 is computed.

    wait(all_reduce(reshape(mm(a, w))))
      -> reshape(cat([wait(all_reduce(mm(a[c0], w))), ..., wait(all_reduce(mm(a[ck], w)))]))
         issued as mm_0, all_reduce_0, mm_1, all_reduce_1, ..., then the waits

k is chosen per site by the cost model, from K_CHOICES: each chunk's GEMM is priced by the
roofline (its weight is read again per chunk, which is why small decode GEMMs stay whole),
each chunk's all-reduce on the best algorithm select_collectives may pick for the group, on
the simulator's two-stream timeline, plus the copy that joins the chunks. k = 1 (no rewrite)
where chunking does not pay, and the report says so with the figures. Rows of a matmul do
not depend on each other, so the result equals the unchunked one up to the GEMM's rounding.
Runs before select_collectives (each chunk's all-reduce is then selected on its own size)
and before overlap_collectives (which keeps this order and may fill the gaps further).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from metainfer import cost
from metainfer.simulate import Timeline

from .base import Pass, PassContext, PassResult, register
from .matching import VIEW_OPS, Node, insert_call, is_op, location, shape, tensor_val

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
K_CHOICES = (1, 2, 4, 8)


def _site(ar: Node) -> "tuple[Node, Node, Node | None, Node] | None":
    """(mm, its row input a, the reshape between or None, the wait) of `ar`, or None."""
    waits = list(ar.users)
    if len(waits) != 1 or waits[0].target is not c10d.wait_tensor.default or ar.args[1] != "sum":
        return None
    x, view = ar.args[0], None
    if is_op(x, *VIEW_OPS) and len(x.users) == 1:
        x, view = x.args[0], x
    if not is_op(x, aten.mm) or len(x.users) != 1:
        return None
    a = x.args[0]
    if shape(a) is None or not all(isinstance(d, int) for d in shape(a)) or not all(
            isinstance(d, int) for d in shape(x.args[1])):
        return None
    return x, a, view, waits[0]


def predicted(rows: int, k_dim: int, n: int, dtype: torch.dtype, k: int, target, ranks, allowed) -> float:
    """Predicted time of mm(rows x k_dim, k_dim x n) + all-reduce of the result, in k chunks."""
    item = torch.empty((), dtype=dtype).element_size()
    key = cost._peak_key(dtype)
    tl = Timeline(target)
    sizes = _chunks(rows, k)
    end = 0.0
    for r in sizes:
        mm = cost.roofline(2.0 * r * k_dim * n, (r * k_dim + k_dim * n + r * n) * item, key, target)
        ready = tl.compute("mm", mm.seconds)
        options = [c for c in cost.candidates("all_reduce", r * n * item, target, ranks=ranks) if c.algorithm in allowed]
        c = min(options, key=lambda c: c.seconds)
        end = tl.communicate(c, c.seconds, max(ready, tl.compute_free))
    tl.wait(end)
    if k > 1:  # the copy that joins the chunks
        tl.compute("cat", cost.roofline(0.0, 2.0 * rows * n * item, key, target).seconds)
    return tl.schedule().step_seconds


def _chunks(rows: int, k: int) -> list[int]:
    c = math.ceil(rows / k)
    return [min(c, rows - i * c) for i in range(k) if rows - i * c > 0]


@register
class PipelineCollectives(Pass):
    """wait(all_reduce(mm(a, w))) -> k token chunks, chunk i's all-reduce overlapping chunk i+1's matmul"""

    name = "pipeline_collectives"

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        from .select_collectives import allowed_algorithms

        res = PassResult(modified=False)
        if not (dist.is_available() and dist.is_initialized()):
            return res
        target = ctx.target
        forced = ctx.options.get("pipeline_chunks")
        if forced is not None and forced not in K_CHOICES:
            raise ValueError(f"pipeline_chunks must be one of {K_CHOICES}, got {forced!r}")
        for ar in list(graph.nodes):
            if ar.op != "call_function" or ar.target is not c10d.all_reduce.default:
                continue
            site = _site(ar)
            if site is None:
                res.near_misses.append(f"{location(ar)}: all_reduce not pipelined: not a sum of one static-shape "
                                       "mm with a single wait")
                continue
            mm, a, view, wait = site
            try:
                pg = dist.distributed_c10d._resolve_process_group(ar.args[2])
            except Exception:
                continue
            ranks = tuple(dist.get_process_group_ranks(pg))
            if len(ranks) < 2 or max(ranks) >= target.num_devices:
                continue
            rows, k_dim = shape(a)
            n = shape(mm)[1]
            dtype = tensor_val(mm).dtype
            allowed = allowed_algorithms(target, ranks)
            times = {k: predicted(rows, k_dim, n, dtype, k, target, ranks, allowed) for k in K_CHOICES if k <= rows}
            best = forced if forced is not None and forced in times else min(times, key=lambda k: (times[k], k))
            figures = ", ".join(f"k={k} {t * 1e6:.1f} us" for k, t in times.items())
            where = f"{location(ar)}: mm {rows}x{k_dim}x{n} + all_reduce over {len(ranks)} ranks"
            if best == 1 or not (forced or times[best] < times[1] * (1 - 1e-9)):
                res.decisions.append(f"{where}: k=1 (kept whole), predicted {figures}")
                continue
            _rewrite(graph, ar, mm, a, view, wait, best)
            res.decisions.append(f"{where}: k={best} chunks of {_chunks(rows, best)[0]} rows, predicted {figures}"
                                 + (" (pipeline_chunks forced)" if forced else ""))
            res.matches += 1
            res.modified = True
        return res


def _rewrite(graph, ar: Node, mm: Node, a: Node, view: "Node | None", wait: Node, k: int) -> None:
    group = ar.args[2]
    handles, start = [], 0
    for r in _chunks(shape(a)[0], k):
        part = insert_call(graph, ar, aten.slice.Tensor, (a, 0, start, start + r), meta_from=mm)
        y = insert_call(graph, ar, aten.mm.default, (part, mm.args[1]), meta_from=mm)
        handles.append(insert_call(graph, ar, c10d.all_reduce.default, (y, "sum", group), meta_from=ar))
        start += r
    done = [insert_call(graph, ar, c10d.wait_tensor.default, (h,), meta_from=wait) for h in handles]
    out = insert_call(graph, ar, aten.cat.default, (done, 0), meta_from=mm)
    if view is not None:
        out = insert_call(graph, ar, view.target, (out, list(shape(view))), meta_from=view)
    wait.replace_all_uses_with(out)
    graph.erase_node(wait)
    graph.erase_node(ar)
