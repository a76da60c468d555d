"""sequence_parallel: between tensor-parallel regions, work on this rank's share of the tokens.

    wait(all_reduce(x)) -> add(residual, .) -> RMSNorm -> (column-parallel matmuls)
      -> wait(reduce_scatter(x)) -> add(residual[my tokens], .) -> RMSNorm on my tokens
         -> wait(all_gather(.)) -> (column-parallel matmuls)

The token-wise region after the all-reduces (residual adds, norms, casts, reshapes that keep the
last dim) is found by closure over the graph: a node joins when its op is token-wise (ATen
pointwise, a reduction over the last dim with keepdim, a reshape keeping the last dim, a cast, a
metainfer op whose declaration says token-wise, `layout.token_wise` in kernels/spec.py) and every
tensor input is in the region, free of token dims (a weight broadcast over the last dim) or a
replicated tensor of the same tokens (sliced to this rank's share). The region runs on tokens
[r T/n, (r+1) T/n) of the flattened token order, as 2-D [tokens, features]: the reduce-scatter
of the flattened all-reduce input yields exactly those rows, and an all-gather restores the full
tensor where a value leaves the region (one per value). Bytes on a ring are the same as the
all-reduces' (reduce-scatter + all-gather = all-reduce); the norms and adds run on 1/n of the tokens
and the residual stream between regions is 1/n of its size. The cost model decides whether it
pays on the target (an island-aware all-reduce can beat two flat rings): the graph is rewritten
on a copy and both are priced by the simulator after the later communication passes.
`pass_options={"sequence_parallel": True}` applies it regardless (to measure the alternative).
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.distributed as dist

from metainfer.hardware.fxops import spec_of

from . import lookahead
from .base import Pass, PassContext, PassResult, register
from .options import Option
from .matching import CONVERT_OPS, Node, insert_call, is_op, is_reshape, location, shape, tensor_val

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

_LAST_DIM_REDUCTIONS = (aten.mean, aten.sum, aten.amax, aten.amin)


def _is_pointwise(node: Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags or is_op(node, *CONVERT_OPS)


def _is_token_wise_op(node: Node) -> bool:
    """A metainfer op declared token-wise (kernels/spec.py): rmsnorm, add_rmsnorm, ..."""
    declared = spec_of(node)
    return declared is not None and declared.layout.token_wise


def _static(s) -> bool:
    return s is not None and all(isinstance(d, int) for d in s)


class _Region:
    def __init__(self, tokens: int):
        self.tokens = tokens
        self.nodes: list[Node] = []
        self.members: set[Node] = set()
        self.invariant: dict[Node, bool] = {}

    def token_tensor(self, n: Node) -> bool:
        """A tensor whose leading dims hold exactly the T tokens (any last dim)."""
        s = shape(n)
        return _static(s) and len(s) >= 2 and math.prod(s[:-1]) == self.tokens

    def token_free(self, n: Node) -> bool:
        """A tensor that broadcasts over the tokens: leading dims all 1 (e.g. a norm weight)."""
        s = shape(n)
        return _static(s) and all(d == 1 for d in s[:-1])


_RANK_DEPENDENT = (aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.linear, aten.convolution, aten.mv,
                   aten.addmv, aten.dot, aten._scaled_mm, aten._int_mm)


def _rank_invariant(node: Node, memo: dict) -> bool:
    """Whether a value is the same on every rank: computed from the graph's inputs (the same
    on every rank, by optimize()'s contract) without a matmul, a collective or a custom op,
    the ways a rank's own weight shard reaches activations."""
    stack, order = [node], []
    while stack:
        v = stack.pop()
        if v in memo or v in order:
            continue
        order.append(v)
        stack.extend(v.all_input_nodes)
    for v in reversed(order):  # inputs before users
        if v in memo:
            continue
        if v.op == "placeholder" or v.op == "get_attr":
            memo[v] = True
            continue
        # only ATen/prims ops are judged; anything else (custom ops, higher-order ops) may vary
        ok = (v.op == "call_function" and isinstance(v.target, torch._ops.OpOverload)
              and v.target.namespace in ("aten", "prims") and not is_op(v, *_RANK_DEPENDENT)
              and not v.target._schema.is_mutable)
        ok = ok or v.target is operator.getitem
        memo[v] = ok and all(memo.get(a, False) for a in v.all_input_nodes)
    return memo[node]


def _joins(node: Node, region: _Region) -> bool:
    if node.op != "call_function":
        return False
    ins = [a for a in node.all_input_nodes]
    if not any(a in region.members for a in ins):
        return False
    if node.target is operator.getitem:
        return True
    val = tensor_val(node)
    if val is None and not _is_token_wise_op(node):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return False  # an in-place op would write through a view of this rank's rows only
    if is_reshape(node):
        src = node.args[0]
        return src in region.members and region.token_tensor(node) and shape(node)[-1] == shape(src)[-1]
    if is_op(node, *_LAST_DIM_REDUCTIONS):
        src, dims = node.args[0], node.args[1] if len(node.args) > 1 else None
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        rank = len(shape(src))
        if not (isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] % rank == rank - 1 and keep):
            return False
        return src in region.members and not node.kwargs.get("dtype")
    if not (_is_pointwise(node) or _is_token_wise_op(node)):
        return False
    for a in ins:
        if a in region.members:
            if shape(a) is not None and not region.token_tensor(a):
                return False
        elif region.token_tensor(a):
            if not _rank_invariant(a, region.invariant):
                return False  # e.g. a rank's own activations: its rows elsewhere would differ
        elif not region.token_free(a) or not _rank_invariant(a, region.invariant):
            return False  # a per-rank scalar or vector would differ between the gathered rows
    if val is not None and not region.token_tensor(node):
        return False
    return True


@register
class SequenceParallel(Pass):
    """all_reduce -> residual add / RMSNorm -> column-parallel input  =>  reduce_scatter -> the same on this rank's tokens -> all_gather"""

    name = "sequence_parallel"
    needs_collectives = True
    options = (Option("sequence_parallel", bool, False, "apply it at every site, paying or not (to measure the "
                      "alternative)"),)

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        res = PassResult(modified=False)
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return res
        site = _find(graph, res)
        if site is None:
            return res
        ranks = tuple(dist.get_process_group_ranks(site.pg))
        if max(ranks) >= ctx.target.num_devices:
            res.near_misses.append(f"sequence_parallel not applied on {ctx.target.name}: the group's ranks {ranks} "
                                   "are not devices of the target")
            return res
        # decided by the one cost model: the whole graph priced with and without the rewrite,
        # each as this pipeline's later communication passes would leave it
        trial = lookahead.trial(graph, lambda g, _: _rewrite(g, _find(g, PassResult(modified=False))))
        with_sp, without = lookahead.predicted_step(trial, ctx), lookahead.predicted_step(graph, ctx)
        figures = (f"predicted step {with_sp * 1e6:.0f} us with it, {without * 1e6:.0f} us without"
                   + lookahead.after_later(ctx))
        forced = ctx.options["sequence_parallel"]
        if not (with_sp < without * (1 - 1e-6) or forced):  # a tie is not a reason to rewrite
            res.near_misses.append(f"sequence_parallel not applied on {ctx.target.name}: {figures}")
            return res
        if forced:
            figures += "; forced (pass option sequence_parallel)"
        gathers = _rewrite(graph, site)
        res.modified, res.matches = True, len(site.roots)
        res.decisions.append(
            f"{len(site.roots)} all-reduce(s) -> reduce-scatter on {site.n} ranks; {len(site.region.nodes)} token-wise "
            f"op(s) (residual adds, norms) now on {site.tokens // site.n} of {site.tokens} tokens; {gathers} "
            f"all-gather(s) where values leave the region; {figures}")
        return res


@dataclasses.dataclass
class _Site:
    roots: list  # (all_reduce, wait) pairs
    region: _Region
    boundary: list  # region values used outside it
    group: str
    pg: object
    n: int
    me: int
    tokens: int


def _find(graph: torch.fx.Graph, res: PassResult) -> "_Site | None":
    """The all-reduces and the token-wise region after them, or None (near misses in `res`)."""
    roots = []
    for node in graph.nodes:
        if node.target is not c10d.all_reduce.default:
            continue
        waits = list(node.users)
        if (len(waits) == 1 and waits[0].target is c10d.wait_tensor.default and node.args[1] == "sum"
                and _static(shape(node.args[0]))):
            roots.append((node, waits[0]))
        else:
            res.near_misses.append(f"{location(node)}: all_reduce not made sequence-parallel: not a single wait "
                                   "of a static-shape sum")
    if not roots:
        return None
    groups = {r.args[2] for r, _ in roots}
    if len(groups) != 1:
        res.near_misses.append("sequence_parallel: all-reduces over several groups; not applied")
        return None
    group = groups.pop()
    pg = dist.distributed_c10d._resolve_process_group(group)
    n, me = pg.size(), dist.get_rank(pg)
    x0 = shape(roots[0][0].args[0])
    tokens = math.prod(x0[:-1])
    if tokens % n or any(math.prod(shape(r.args[0])[:-1]) != tokens for r, _ in roots):
        res.near_misses.append(f"sequence_parallel: {tokens} tokens do not split over {n} ranks "
                               "(or the all-reduces differ in tokens); not applied")
        return None
    region = _Region(tokens)
    for _, w in roots:
        region.members.add(w)
    for node in graph.nodes:  # topological: inputs are decided before their users
        if node not in region.members and _joins(node, region):
            region.members.add(node)
            region.nodes.append(node)
    boundary = [v for v in [w for _, w in roots] + region.nodes
                if tensor_val(v) is not None and any(u not in region.members for u in v.users)]
    return _Site(roots, region, boundary, group, pg, n, me, tokens)




def _rewrite(graph, site: _Site) -> int:
    """Apply `site` (found in `graph`); returns the number of all-gathers added."""
    roots, region, boundary, group, n, me, tokens = (site.roots, site.region, site.boundary, site.group, site.n,
                                                     site.me, site.tokens)
    rows = tokens // n
    local: dict[Node, Node] = {}
    sliced: dict[Node, Node] = {}

    def as_local_input(a, before):
        if not isinstance(a, Node):
            return a
        if a in local:
            return local[a]
        s = shape(a)
        if s is None:
            return a
        if math.prod(s[:-1]) == tokens and len(s) >= 2:  # replicated tokens: this rank's rows
            if a not in sliced:
                flat = insert_call(graph, before, aten.reshape.default, (a, [tokens, s[-1]]), meta_from=before)
                sliced[a] = insert_call(graph, before, aten.slice.Tensor, (flat, 0, me * rows, (me + 1) * rows),
                                        meta_from=before)
            return sliced[a]
        if len(s) > 1:  # a broadcast weight: drop its leading 1s so it meets 2-D rows
            return insert_call(graph, before, aten.reshape.default, (a, [s[-1]]), meta_from=before)
        return a

    for ar, w in roots:
        x = ar.args[0]
        flat = insert_call(graph, w, aten.reshape.default, (x, [tokens, shape(x)[-1]]), meta_from=ar)
        rs = insert_call(graph, w, c10d.reduce_scatter_tensor.default, (flat, "sum", n, group), meta_from=ar)
        local[w] = insert_call(graph, w, c10d.wait_tensor.default, (rs,), meta_from=w)
    for v in region.nodes:
        if is_reshape(v):
            local[v] = local[v.args[0]]
            continue
        if v.target is operator.getitem:
            local[v] = insert_call(graph, v, operator.getitem, (local[v.args[0]], v.args[1]), meta_from=v)
            continue
        args = tuple(as_local_input(a, v) if not isinstance(a, (list, tuple)) else
                     type(a)(as_local_input(b, v) for b in a) for a in v.args)
        if is_op(v, *_LAST_DIM_REDUCTIONS):
            args = (args[0], [-1], *args[2:])
        local[v] = insert_call(graph, v, v.target, args, dict(v.kwargs), meta_from=v)
    gathered: dict[Node, Node] = {}
    for v in boundary:
        src = local[v]
        if src not in gathered:
            after = _after(src)
            ag = insert_call(graph, after, c10d.all_gather_into_tensor.default, (src, n, group), meta_from=v)
            gathered[src] = insert_call(graph, after, c10d.wait_tensor.default, (ag,), meta_from=v)
        full = insert_call(graph, _after(gathered[src]), aten.reshape.default, (gathered[src], list(shape(v))),
                           meta_from=v)
        outside = [u for u in v.users if u not in region.members]
        for u in outside:
            u.replace_input_with(v, full)
    # the whole-token region and its all-reduces are now unused; collectives count as side
    # effects, so dead-code elimination would keep them issuing: erase them here
    for v in reversed(region.nodes):
        if not v.users:
            graph.erase_node(v)
    for ar, w in roots:
        if not w.users:
            graph.erase_node(w)
        if not ar.users:
            graph.erase_node(ar)
    return len(gathered)


def _after(node: Node) -> Node:
    return node.next
