"""pipeline_collectives: a matmul and the collective beside it split along tokens into k
chunks, so that chunk i's collective runs while chunk i+1 is computed.

Three forms, as tensor parallelism emits them (with and without sequence parallelism):

    row-parallel:      wait(all_reduce(mm(a, w)))
      -> cat([wait(all_reduce(mm(a[c_i], w))) for each chunk c_i of a's rows])
    row-parallel, SP:  wait(reduce_scatter(mm(a, w)))          # each rank keeps its T/n rows
      -> cat([wait(reduce_scatter(mm(a_i, w)))]) where a_i holds, for every rank j, the i-th
         sub-block of rank j's rows, so each rank's pieces are its own rows in order
    column-parallel, SP:  mm(wait(all_gather(x)), w_c) for each consumer c (q, k, v; gate, up)
      -> all_gather each chunk of x, multiply it as it arrives, and put the rows back in
         rank-major order (reshape (k, n, r, N) -> (n, k, r, N))

k is chosen per site by the cost model, from K_CHOICES: the graph is rewritten with each k on
a copy and priced whole by the simulator after this pipeline's later communication passes
(lookahead.predicted_step): each chunk's GEMM reads its weight again (why small decode GEMMs
stay whole), each chunk's collective runs on the algorithm select_collectives gives it, and
the copies that gather and join the chunks are kernels too. k = 1 (no rewrite) where
chunking does not pay, and the report says so with the figures. Rows of a
matmul do not depend on each other, so the result equals the unchunked one up to the GEMM's
rounding. Runs before select_collectives (each chunk's all-reduce is then selected on its
own size) and before overlap_collectives (which keeps this order and may fill the gaps
further).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import lookahead
from .base import Pass, PassContext, PassResult, register
from .options import Option
from .matching import Node, insert_call, is_op, is_reshape, location, peel, shape, tensor_val

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
K_CHOICES = (1, 2, 4, 8)


def _chunks(rows: int, k: int) -> list[int]:
    c = math.ceil(rows / k)
    return [min(c, rows - i * c) for i in range(k) if rows - i * c > 0]


def _static(*nodes) -> bool:
    return all(shape(n) is not None and all(isinstance(d, int) for d in shape(n)) for n in nodes)


def _mm_feeding(coll: Node) -> "Node | None":
    """The mm whose output (through single-use views) is `coll`'s input, used only there."""
    x, _ = peel(coll.args[0], is_reshape, single_use=True)
    if is_op(x, aten.mm) and len(x.users) == 1 and _static(x.args[0], x.args[1]):
        return x
    return None


def _consumers(wait: Node) -> "list[Node] | None":
    """The matmuls that take the gathered rows (through views back to the same 2-D shape) as
    their left operand, or None if anything else uses them."""
    out, todo = [], [(wait, u) for u in wait.users]
    while todo:
        v, u = todo.pop()
        if is_reshape(u):
            todo.extend((u, x) for x in u.users)
        elif is_op(u, aten.mm) and u.args[0] is v and u.args[1] is not v and shape(v) == shape(wait) \
                and _static(u.args[1]):
            out.append(u)
        else:
            return None
    return out or None


@register
class PipelineCollectives(Pass):
    """collective beside a matmul (all-reduce / reduce-scatter after it, all-gather before it) -> k token chunks overlapping each other"""

    name = "pipeline_collectives"
    options = (Option("pipeline_chunks", int, None, "split every pipelined collective into this many chunks "
                      "(unset: the cost model's choice per site)", choices=K_CHOICES),)
    needs_collectives = True

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        res = PassResult(modified=False)
        if not (dist.is_available() and dist.is_initialized()):
            return res
        target = ctx.target
        forced = ctx.options["pipeline_chunks"]
        kinds = {c10d.all_reduce.default: "all_reduce", c10d.reduce_scatter_tensor.default: "reduce_scatter",
                 c10d.all_gather_into_tensor.default: "all_gather"}
        unchanged = None
        decided: dict[tuple, dict[int, float]] = {}
        for node in list(graph.nodes):
            kind = kinds.get(node.target) if node.op == "call_function" else None
            if kind is None:
                continue
            found = _site(node, kind, target)
            if isinstance(found, str):
                res.near_misses.append(f"{location(node)}: {kind} not pipelined: {found}")
                continue
            if found is None:
                continue
            site, options, signature = found
            where, n = location(node), site[-1]
            _, rows, k_dim, widths = signature[:4]
            if signature in decided:  # sites of the same sizes (every layer's) decide alike
                times = decided[signature]
            else:
                if unchanged is None:  # the graph as it stands, priced once until a site is rewritten
                    unchanged = lookahead.predicted_step(graph, ctx)
                times = {1: unchanged}
                for k in options[1:] if forced is None else [forced] if forced in options and forced > 1 else []:
                    times[k] = lookahead.predicted_step(lookahead.trial(graph, lambda g, m: _rewrite(g, site, k, m)),
                                                        ctx)
                decided[signature] = times
            best = forced if forced is not None and forced in times else min(times, key=lambda k: (times[k], k))
            figures = ", ".join(f"k={k} step {t * 1e6:.1f} us" for k, t in sorted(times.items()))
            head = (f"{where}: {kind} over {n} ranks beside mm {rows}x{k_dim}x{'+'.join(map(str, widths))}")
            if best == 1 or not (forced or times[best] < times[1] * (1 - 1e-9)):
                res.decisions.append(f"{head}: k=1 (kept whole), predicted {figures}")
                continue
            _rewrite(graph, site, best)
            unchanged = None
            res.decisions.append(f"{head}: k={best} chunks, predicted {figures}"
                                 + (" (pipeline_chunks forced)" if forced else ""))
            res.matches += 1
            res.modified = True
        return res


def _site(node: Node, kind: str, target) -> "tuple | str | None":
    """(the site to rewrite, the chunk counts it allows, its signature: sites of equal
    signature decide alike) for a collective beside a matmul; why not (a near miss); or None
    (not a group of the target's ranks)."""
    waits = list(node.users)
    if len(waits) != 1 or waits[0].target is not c10d.wait_tensor.default or \
            (kind != "all_gather" and node.args[1] != "sum"):
        return "not a sum with a single wait"
    wait = waits[0]
    try:
        pg = dist.distributed_c10d._resolve_process_group(node.args[-1])
    except Exception:
        return None
    ranks = tuple(dist.get_process_group_ranks(pg))
    n = len(ranks)
    if n < 2 or max(ranks) >= target.num_devices:
        return None
    mm, users = None, []
    if kind == "all_gather":
        users = _consumers(wait) if _static(node.args[0]) and len(shape(node.args[0])) == 2 else None
        if users is None:
            return "its rows feed more than matmuls"
        rows, k_dim = shape(wait)
        widths = [shape(u)[1] for u in users]
        step = shape(node.args[0])[0]  # chunks of every rank's block
    else:
        mm = _mm_feeding(node)
        if mm is None:
            return "its input is not one static-shape matmul's"
        rows, k_dim = shape(mm.args[0])
        widths = [shape(mm)[1]]
        step = rows // n if kind == "reduce_scatter" else rows
    exact = kind != "all_reduce"  # the other two need equal chunks of each rank's block
    options = [k for k in K_CHOICES if k <= step and (not exact or step % k == 0)]
    signature = (kind, rows, k_dim, tuple(widths), n, str(tensor_val(node.args[0]).dtype))
    return (kind, node, wait, mm, users, n), options, signature


def _rewrite(graph, site: tuple, k: int, node_map: "dict | None" = None) -> None:
    """Chunk `site` k ways in `graph` (a copy of the graph the site was found in when
    `node_map` maps the original nodes to their copies)."""
    kind, coll, wait, mm, users, n = site
    if node_map is not None:
        coll, wait = node_map[coll], node_map[wait]
        mm = node_map[mm] if mm is not None else None
        users = [node_map[u] for u in users]
    if kind == "all_reduce":
        _rewrite_all_reduce(graph, coll, mm, mm.args[0], wait, k)
    elif kind == "reduce_scatter":
        _rewrite_reduce_scatter(graph, coll, mm, wait, n, k)
    else:
        _rewrite_all_gather(graph, coll, wait, users, n, k)


def _erase_collective(graph, coll: Node, wait: Node) -> None:
    """Collectives are side effects: dead-code elimination would keep them issuing."""
    graph.erase_node(wait)
    graph.erase_node(coll)


def _rewrite_all_reduce(graph, ar: Node, mm: Node, a: Node, wait: Node, k: int) -> None:
    group = ar.args[2]
    handles, start = [], 0
    for r in _chunks(shape(a)[0], k):
        part = insert_call(graph, ar, aten.slice.Tensor, (a, 0, start, start + r), meta_from=mm)
        y = insert_call(graph, ar, aten.mm.default, (part, mm.args[1]), meta_from=mm)
        handles.append(insert_call(graph, ar, c10d.all_reduce.default, (y, "sum", group), meta_from=ar))
        start += r
    done = [insert_call(graph, ar, c10d.wait_tensor.default, (h,), meta_from=wait) for h in handles]
    out = insert_call(graph, ar, aten.cat.default, (done, 0), meta_from=mm)
    out = insert_call(graph, ar, aten.reshape.default, (out, list(shape(wait))), meta_from=wait)
    wait.replace_all_uses_with(out)
    _erase_collective(graph, ar, wait)


def _rewrite_reduce_scatter(graph, rs: Node, mm: Node, wait: Node, n: int, k: int) -> None:
    a = mm.args[0]
    rows, width = shape(a)
    c = rows // (n * k)
    blocks = insert_call(graph, rs, aten.reshape.default, (a, [n, k, c, width]), meta_from=mm)
    handles = []
    for i in range(k):  # chunk i: the i-th sub-block of every rank's rows
        pick = insert_call(graph, rs, aten.select.int, (blocks, 1, i), meta_from=mm)
        part = insert_call(graph, rs, aten.reshape.default, (pick, [n * c, width]), meta_from=mm)
        y = insert_call(graph, rs, aten.mm.default, (part, mm.args[1]), meta_from=mm)
        handles.append(insert_call(graph, rs, c10d.reduce_scatter_tensor.default, (y, "sum", n, rs.args[3]),
                                   meta_from=rs))
    done = [insert_call(graph, rs, c10d.wait_tensor.default, (h,), meta_from=wait) for h in handles]
    out = insert_call(graph, rs, aten.cat.default, (done, 0), meta_from=wait)
    wait.replace_all_uses_with(insert_call(graph, rs, aten.reshape.default, (out, list(shape(wait))), meta_from=wait))
    _erase_collective(graph, rs, wait)


def _rewrite_all_gather(graph, ag: Node, wait: Node, users: list[Node], n: int, k: int) -> None:
    src = ag.args[0]
    r, width = shape(src)
    c = r // k
    gathered = []
    for i in range(k):
        part = insert_call(graph, ag, aten.slice.Tensor, (src, 0, i * c, (i + 1) * c), meta_from=ag)
        h = insert_call(graph, ag, c10d.all_gather_into_tensor.default, (part, n, ag.args[2]), meta_from=ag)
        gathered.append(h)
    done = [insert_call(graph, ag, c10d.wait_tensor.default, (h,), meta_from=wait) for h in gathered]
    for mm in users:
        w = mm.args[1]
        parts = [insert_call(graph, mm, aten.mm.default, (d, w), meta_from=mm) for d in done]
        # (k * n*c, N); cat, not stack: the graph is past Inductor's decompositions, and stack
        # is one of them (Inductor has no lowering for it)
        out = insert_call(graph, mm, aten.cat.default, (parts, 0), meta_from=mm)
        width_out = shape(mm)[1]
        out = insert_call(graph, mm, aten.reshape.default, (out, [k, n, c, width_out]), meta_from=mm)
        out = insert_call(graph, mm, aten.permute.default, (out, [1, 0, 2, 3]), meta_from=mm)
        out = insert_call(graph, mm, aten.reshape.default, (out, [n * k * c, width_out]), meta_from=mm)
        mm.replace_all_uses_with(out)
        graph.erase_node(mm)
    # the gathered whole and its views are unused now
    views = _descendant_views(wait)
    chain = [v for v in graph.nodes if v in views]  # in graph order
    for v in reversed(chain):
        if not v.users:
            graph.erase_node(v)
    _erase_collective(graph, ag, wait)


def _descendant_views(wait: Node) -> set[Node]:
    out, todo = set(), list(wait.users)
    while todo:
        v = todo.pop()
        if is_reshape(v) and v not in out:
            out.add(v)
            todo.extend(v.users)
    return out
