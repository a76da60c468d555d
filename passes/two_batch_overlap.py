"""two_batch_overlap: a prefill batch split into two micro-batches that run the same layers,
so that one micro-batch's collectives overlap the other's compute (the scheduler,
overlap_collectives, interleaves them).

    out = layers(x)             # x: (B, S), every layer ends in an all-reduce
      -> out = cat([layers(x[:B/2]), layers(x[B/2:])])   # one graph, two independent chains

The batch dimension is traced through the graph (`batch_dims`): from the integer inputs
whose first dimension is the batch (token ids, position ids, masks) through every op by a
rule for its kind: pointwise ops by broadcasting, views by where the batch's contiguous
halves land, matmuls and row-wise metainfer kernels by their rows, reductions over other
dimensions, collectives that reduce element-wise. Values that do not depend on the batch
(weights, rotary tables) stay shared; a shared value with the batch's size on the batch
dimension (a mask built in the graph) is sliced. Any op without a rule, a reduction over the
batch, a write into an input or a symbolic size stops the pass, and the report names it.
Each sequence's result depends only on its own rows, so outputs equal the unsplit graph's.

It runs where the cost model predicts a shorter step for the split graph, scheduled by
overlap_collectives, than for the graph as it is: prefill, where each micro-batch's compute
is long enough to hide the other's communication. In decode each micro-batch reads the
weights again, and the pass declines.
"""

from __future__ import annotations

import math
import operator

import torch

from metainfer.hardware import fxops
from metainfer.kernels.spec import BATCH_FIRST, BROADCAST, OPAQUE_LAYOUT, ROWS, spec_for

from . import base
from .base import Pass, PassContext, PassResult, register
from .options import Option
from .matching import Node, insert_call, is_reshape, location, shape, tensor_val

aten = torch.ops.aten


def _name(n: Node) -> tuple[str, str]:
    """(namespace, name) of an ATen or metainfer op; ("", "") for a Python callable (getitem,
    SymInt arithmetic), which no rule below is about."""
    ns, name = fxops.op_name(n)
    return ("", "") if ns == "python" else (ns, name)


class Unsplittable(base.NearMiss):
    """The batch cannot be traced through this node."""


def _norm(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _dims(x, n: int) -> list[int]:
    x = [x] if isinstance(x, int) else list(x or [])
    return sorted(_norm(d, n) for d in x)


_SAME_LAYOUT = {"clone", "alias", "contiguous", "_to_copy", "convert_element_type", "detach", "lift_fresh_copy",
                "full_like", "ones_like", "zeros_like", "empty_like"}
_REDUCE = {"sum", "mean", "amax", "amin", "prod", "any", "all", "var", "var_mean", "argmax", "argmin", "logsumexp"}
_ALONG = {"_softmax", "softmax", "_log_softmax", "log_softmax", "cumsum", "topk", "sort"}  # one dim, shape kept
_ELEMENTWISE_COLLECTIVES = {"all_reduce", "wait_tensor"}



class BatchTrace:
    """For each node, the dimension that carries the batch (None: shared by both halves),
    and the shared values that must be sliced where they meet the batch."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        self.dim: dict[Node, object] = {}  # int | None, or a list of those for tuple outputs
        self.slices: dict[Node, dict[Node, int]] = {}  # node -> {shared arg: its dimension to slice}
        self.permuted: set[Node] = set()  # between a reduce-scatter and its all-gather
        self.halved: set[Node] = set()  # slices of the batch dimension whose bounds halve with it
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        ids = [n for n in graph.nodes if _name(n) == ("aten", "embedding")]
        if not ids:
            raise Unsplittable("no token-id input (no embedding): the batch cannot be found")
        self.batch = shape(ids[0].args[1])[0] if shape(ids[0].args[1]) else None
        if not isinstance(self.batch, int):
            raise Unsplittable("symbolic batch size")
        for n in inputs:  # token ids, position ids, attention masks: integer (B, ...) inputs
            v = tensor_val(n)
            batch_input = v is not None and v.ndim >= 2 and not v.is_floating_point() and v.shape[0] == self.batch
            self.dim[n] = 0 if batch_input and self.batch > 1 else None
        for n in graph.nodes:
            if n.op == "call_function":
                self.dim[n] = self._trace(n)
            elif n.op == "get_attr":
                self.dim[n] = None
            elif n.op == "output":
                bad = [a for a in n.all_input_nodes if a in self.permuted]
                if bad:
                    raise Unsplittable(f"output {bad[0].name} holds rows scattered over the ranks")

    # -- helpers
    def d(self, a):
        return self.dim.get(a) if isinstance(a, Node) else None

    def _need(self, n: Node, why: str):
        raise Unsplittable(f"{location(n)}: {n.target}: {why}")

    def _broadcast(self, n: Node, args) -> "int | None":
        out = tensor_val(n)
        tensors = [a for a in args if isinstance(a, Node) and tensor_val(a) is not None]
        split = [a for a in tensors if self.d(a) is not None]
        if not split:
            return None
        nd = out.ndim
        aligned = {self.d(a) + nd - tensor_val(a).ndim for a in split}
        if len(aligned) != 1:
            self._need(n, "inputs carry the batch on different dimensions")
        ob = aligned.pop()
        for a in tensors:
            if self.d(a) is None:
                j = ob - (nd - tensor_val(a).ndim)
                if j >= 0 and tensor_val(a).shape[j] != 1:
                    self._slice(n, a, j)
        return ob

    def _slice(self, n: Node, a: Node, j: int) -> None:
        v = tensor_val(a)
        if n in self.permuted:
            self._need(n, f"shared value {a.name} meets rows scattered over the ranks")
        if a.op == "placeholder" and v.is_floating_point():
            self._need(n, f"a float graph input {a.name} (a weight?) meets the batch on its dim {j}")
        if v.shape[j] != self.batch and v.shape[j] % 2:
            self._need(n, f"shared value {a.name} has odd size {v.shape[j]} on the batch dimension")
        self.slices.setdefault(n, {})[a] = j

    def _trace(self, n: Node):
        """The dimension of n's output that carries the batch (None: shared by both halves; a
        list for a tuple output), or Unsplittable."""
        ns, name = _name(n)
        args = n.args
        inner = {a in self.permuted for a in n.all_input_nodes if self.d(a) is not None}
        if inner == {True, False}:
            self._need(n, "mixes rows scattered over the ranks with whole rows")
        if inner == {True} and name != "all_gather_into_tensor":
            self.permuted.add(n)
        if n.target is operator.getitem:
            parent = self.d(args[0])
            return parent[args[1]] if isinstance(parent, list) else parent
        if not any(self.d(a) is not None for a in n.all_input_nodes):
            return None  # shared: computed once, for both halves
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and any(not isinstance(s, int) for s in v.shape):
            self._need(n, "symbolic size")
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            self._need(n, "writes into its input")
        x = args[0] if args else None
        bx = self.d(x)
        if ns == "aten" and name == "embedding":
            return self.d(args[1])
        if ns in ("aten", "prims") and (torch.Tag.pointwise in getattr(n.target, "tags", ()) or name in ("where",)):
            return self._broadcast(n, args)
        if name in _SAME_LAYOUT:
            return bx
        if is_reshape(n):
            return self._view(n, x, bx)
        if n.target is aten.view.dtype:  # the same bytes read as another dtype
            if tensor_val(n).dtype.itemsize != tensor_val(x).dtype.itemsize:
                self._need(n, "reinterprets the rows' bytes at another element width")
            return bx
        for applies, rule in _RULES:
            if applies(ns, name, args):
                return rule(self, n, name, x, bx, v)
        self._need(n, "no batch rule for this op")

    # -- batch rules, one per family of ops: (n, its op's name, first argument, its batch dim, n's value)
    def _layout(self, n, name, x, bx, v):
        args = n.args
        if name == "permute":
            return [_norm(d, tensor_val(x).ndim) for d in args[1]].index(bx)
        if name in ("transpose", "t"):
            nd = tensor_val(x).ndim
            a0, a1 = (0, 1) if name == "t" else (_norm(args[1], nd), _norm(args[2], nd))
            return a1 if bx == a0 else a0 if bx == a1 else bx
        if name == "unsqueeze":
            k = _norm(args[1], tensor_val(x).ndim + 1)
            return bx + 1 if k <= bx else bx
        if name == "squeeze":
            nd = tensor_val(x).ndim
            dims = _dims(args[1], nd) if len(args) > 1 else [i for i in range(nd) if tensor_val(x).shape[i] == 1]
            if bx in dims and tensor_val(x).shape[bx] != 1:
                dims = [d for d in dims if d != bx]
            return bx - sum(1 for d in dims if d < bx and tensor_val(x).shape[d] == 1)
        if name == "expand":
            return bx + len(args[1]) - tensor_val(x).ndim

    def _index(self, n, name, x, bx, v):
        args = n.args
        nd = tensor_val(x).ndim
        at = 2 if name in ("split", "split_with_sizes") else 1
        dim = _norm(args[at] if len(args) > at else n.kwargs.get("dim", 0), nd)
        if dim == bx and name == "slice" and _rows_of_this_rank(n, x, bx):
            # sequence parallelism's slice of this rank's rows: of each half, its half of the rows
            self.permuted.add(n)
            self.halved.add(n)
            return bx
        if dim == bx:
            self._need(n, "indexes the batch dimension")
        if name in ("select", "unbind"):
            out = bx - 1 if dim < bx else bx
            return [out] * len(v) if name == "unbind" else out
        return [bx] * len(v) if name in ("split", "split_with_sizes") else bx

    def _join(self, n, name, x, bx, v):
        args = n.args
        parts = args[0]
        nd = tensor_val(parts[0]).ndim
        dim = _norm(args[1] if len(args) > 1 else 0, nd + (name == "stack"))
        ds = {self.d(p) for p in parts if self.d(p) is not None}
        if len(ds) != 1:
            self._need(n, "parts carry the batch on different dimensions")
        b = ds.pop()
        if name == "cat" and dim == b:
            self._need(n, "concatenates along the batch dimension")
        for p in parts:
            if self.d(p) is None:
                self._slice(n, p, b)
        return b + 1 if name == "stack" and dim <= b else b

    def _matmul(self, n, name, x, bx, v):
        args = n.args
        a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
        if name in ("mm", "addmm"):
            if self.d(b) is not None or self.d(a) != 0:
                self._need(n, "the batch is not on the rows of the left operand")
            if name == "addmm" and self.d(args[0]) is None and tensor_val(args[0]).ndim == 2 \
                    and tensor_val(args[0]).shape[0] != 1:
                self._slice(n, args[0], 0)
            return 0
        if self.d(a) not in (0, None) or self.d(b) not in (0, None):
            self._need(n, "the batch is not the matmul's batch dimension")
        for t in (a, b) + ((args[0],) if name == "baddbmm" else ()):
            if self.d(t) is None and tensor_val(t).shape[0] != 1:
                self._slice(n, t, 0)
        return 0

    def _reduce(self, n, name, x, bx, v):
        args = n.args
        nd = tensor_val(x).ndim
        dims = _dims(args[1], nd) if len(args) > 1 and args[1] is not None else list(range(nd))
        keep = bool(args[2]) if len(args) > 2 and isinstance(args[2], bool) else bool(n.kwargs.get("keepdim", False))
        if bx in dims:
            self._need(n, "reduces over the batch")
        out = bx if keep else bx - sum(1 for d in dims if d < bx)
        return [out, out] if isinstance(v, (list, tuple)) else out

    def _along(self, n, name, x, bx, v):
        args = n.args
        nd = tensor_val(x).ndim
        dim = args[1] if len(args) > 1 else n.kwargs.get("dim", -1)
        if name == "topk":
            dim = args[2] if len(args) > 2 else n.kwargs.get("dim", -1)
        if _norm(dim, nd) == bx:
            self._need(n, "works along the batch dimension")
        return [bx, bx] if isinstance(v, (list, tuple)) else bx

    def _scatter(self, n, name, x, bx, v):
        args = n.args
        nd = tensor_val(x).ndim
        b = self.d(args[2])  # the index decides which rows are written
        if b is None or _norm(args[1], nd) == b or bx not in (None, b):
            self._need(n, "scatters along the batch, or its index does not carry it")
        if len(args) > 3 and isinstance(args[3], Node) and self.d(args[3]) != b:
            self._need(n, "its source does not carry the batch")
        if bx is None:
            self._slice(n, x, b)
        return b

    def _gather(self, n, name, x, bx, v):
        args = n.args
        nd = tensor_val(x).ndim
        if _norm(args[1], nd) == bx:
            self._need(n, "indexes along the batch dimension")
        idx = args[2]
        if name == "gather" and self.d(idx) != bx:
            self._need(n, "index does not carry the batch where the input does")
        if name == "index_select" and self.d(idx) is not None:
            self._need(n, "index carries the batch")
        return bx

    def _collective(self, n, name, x, bx, v):
        if name in _ELEMENTWISE_COLLECTIVES:
            return bx
        if name in ("reduce_scatter_tensor", "all_gather_into_tensor") and bx == 0:
            # a micro-batch's rows scattered over the ranks and gathered back (sequence
            # parallelism): in between, each half's rows are its own, not a half of the whole
            if name == "reduce_scatter_tensor":
                self.permuted.add(n)
            elif x not in self.permuted:
                self._need(n, "gathers rows that no reduce-scatter of this micro-batch scattered")
            return 0
        self._need(n, "no batch rule for this op")

    def _metainfer(self, n, name, x, bx, v):
        """By the op's declared layout (kernels/spec.py)."""
        args = n.args
        declared = spec_for(name)
        layout = declared.layout if declared is not None else OPAQUE_LAYOUT
        if layout.kind == ROWS:
            nd = tensor_val(x).ndim
            if bx is None or bx == nd - 1:
                self._need(n, "the batch is not on a row dimension")
            for i in layout.args[1:]:
                if self.d(args[i]) != bx:
                    names = [a.name for a in n.target._schema.arguments]
                    self._need(n, f"{names[layout.args[0]]} and {names[i]} carry the batch differently")
            return [bx] * len(v) if isinstance(v, (list, tuple)) else bx
        if layout.kind == BROADCAST:
            return self._broadcast(n, [args[i] for i in layout.args])
        if layout.kind == BATCH_FIRST:
            for i in layout.args:
                a = args[i]
                if isinstance(a, Node) and self.d(a) != 0:
                    if self.d(a) is None and tensor_val(a).shape[0] == self.batch:
                        self._slice(n, a, 0)
                    elif self.d(a) is not None or tensor_val(a).shape[0] != 1:
                        self._need(n, f"argument {i} does not carry the batch first")
            m = args[layout.mask] if layout.mask is not None else None
            if isinstance(m, Node):  # broadcast to (B, H, Sq, Sk): only a 4-d mask has a batch dim
                full = tensor_val(m).ndim == 4
                if self.d(m) not in ((0, None) if full else (None,)):
                    self._need(n, "mask carries the batch elsewhere")
                if full and self.d(m) is None and tensor_val(m).shape[0] != 1:
                    self._slice(n, m, 0)
            return 0
        self._need(n, "no batch rule for this op")

    def _view(self, n: Node, x: Node, bx: int) -> int:
        src, out = list(tensor_val(x).shape), list(tensor_val(n).shape)
        for j in range(len(out)):
            if _halves_match(src, bx, out, j):
                return j
        self._need(n, f"a view {src} -> {out} does not keep the batch's halves contiguous")


# (does the rule apply to (namespace, op name, args), the BatchTrace method), tried in order
_RULES = [
    (lambda ns, name, args: name in ("permute", "transpose", "t", "unsqueeze", "squeeze", "expand"), BatchTrace._layout),
    (lambda ns, name, args: name in ("slice", "select", "split", "split_with_sizes", "unbind", "narrow"),
     BatchTrace._index),
    (lambda ns, name, args: name in ("cat", "stack"), BatchTrace._join),
    (lambda ns, name, args: name in ("mm", "addmm", "bmm", "baddbmm"), BatchTrace._matmul),
    (lambda ns, name, args: name in _REDUCE or name in ("max", "min") and len(args) > 1, BatchTrace._reduce),
    (lambda ns, name, args: name in _ALONG, BatchTrace._along),
    (lambda ns, name, args: name in ("scatter", "scatter_add", "scatter_reduce"), BatchTrace._scatter),
    (lambda ns, name, args: name in ("gather", "index_select"), BatchTrace._gather),
    (lambda ns, name, args: ns == "_c10d_functional", BatchTrace._collective),
    (lambda ns, name, args: ns == "metainfer", BatchTrace._metainfer),
]


def _rows_of_this_rank(n: Node, x: Node, bx: int) -> bool:
    """slice(x, bx, start, end) with step 1 and even bounds inside the dimension: a block of
    rows, which in each micro-batch is the block at half the bounds."""
    args = list(n.args) + [None] * 5
    start, end, step = args[2] or 0, args[3], args[4] or 1
    size = tensor_val(x).shape[bx]
    return (step == 1 and isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= size
            and start % 2 == 0 and end % 2 == 0 and (end - start) < size)


def _halves_match(src: list, bx: int, out: list, j: int) -> bool:
    """Whether the first half of dim bx of `src` (in every prefix block) is exactly the first
    half of dim j of `out`: the same prefix, and the same number of elements per half."""
    return (math.prod(src[:bx]) == math.prod(out[:j])
            and (src[bx] // 2) * math.prod(src[bx + 1:]) == (out[j] // 2) * math.prod(out[j + 1:])
            and src[bx] % 2 == 0 and out[j] % 2 == 0)


# ---- the rewrite -------------------------------------------------------------------------------

def split(graph: torch.fx.Graph, trace: BatchTrace) -> int:
    """Rewrite `graph` into two micro-batch chains; returns how many nodes were duplicated."""
    copies: dict[Node, tuple] = {}
    cut: dict[tuple, Node] = {}
    nodes = list(graph.nodes)
    output = nodes[-1]
    first = next(n for n in nodes if n.op != "placeholder")

    def piece(a: Node, dim: int, mb: int, before: Node) -> Node:
        key = (a, dim, mb)
        if key not in cut:
            size = tensor_val(a).shape[dim] // 2
            where = first if a.op == "placeholder" else before
            cut[key] = insert_call(graph, where, aten.slice.Tensor, (a, dim, mb * size, (mb + 1) * size), meta_from=where)
        return cut[key]

    duplicated = 0
    for n in nodes:
        if n.op == "placeholder" and trace.d(n) == 0:
            copies[n] = (piece(n, 0, 0, first), piece(n, 0, 1, first))
            continue
        if n.op != "call_function" or trace.dim.get(n) is None:
            continue
        dn = trace.dim[n]
        sliced = trace.slices.get(n, {})
        pair = []
        for mb in (0, 1):
            def arg(a):
                if isinstance(a, Node):
                    if a in copies:
                        return copies[a][mb]
                    if a in sliced:
                        return piece(a, sliced[a], mb, n)
                    return a
                if isinstance(a, (list, tuple)):
                    return type(a)(arg(x) for x in a)
                return a

            new_args = [arg(a) for a in n.args]
            new_kwargs = {k: arg(v) for k, v in n.kwargs.items()}
            _, name = _name(n)
            if is_reshape(n) or name == "expand":
                size = list(tensor_val(n).shape)
                size[dn] //= 2
                new_args[1] = size
            if n in trace.halved:
                new_args[2], new_args[3] = n.args[2] // 2, n.args[3] // 2
            c = insert_call(graph, n, n.target, tuple(new_args), new_kwargs, meta_from=n)
            pair.append(c)
        copies[n] = tuple(pair)
        duplicated += 1
    # outputs: the halves joined where they leave the graph
    def joined(a):
        if isinstance(a, Node) and a in copies and a.op != "placeholder":
            d = trace.dim[a]
            return insert_call(graph, output, aten.cat.default, (list(copies[a]), d), meta_from=a)
        if isinstance(a, (list, tuple)):
            return type(a)(joined(x) for x in a)
        return a

    output.args = tuple(joined(a) for a in output.args)
    for n in reversed(nodes):
        if n in copies and n.op != "placeholder" and not n.users:
            graph.erase_node(n)
    return duplicated


@register
class TwoBatchOverlap(Pass):
    """one batch -> two micro-batches in one graph, so the scheduler overlaps one's collectives with the other's compute"""

    name = "two_batch_overlap"
    needs_collectives = True
    options = (Option("two_batch_overlap", bool, False, "split every graph it can, paying or not (to measure the "
                      "alternative)"),)

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        from .overlap_collectives import is_collective

        res = PassResult(modified=False)
        if not any(is_collective(n) for n in graph.nodes):
            return res
        try:
            trace = BatchTrace(graph)
        except Unsplittable as e:
            res.near_misses.append(f"two_batch_overlap: batch not split: {e}")
            return res
        if trace.batch < 2 or trace.batch % 2:
            res.near_misses.append(f"two_batch_overlap: batch of {trace.batch}: splitting a token range instead of "
                                   "sequences is not implemented (an even batch is split)")
            return res
        from . import lookahead

        trial = lookahead.copy_graph(graph)
        try:
            dup = split(trial, BatchTrace(trial))
            trial.eliminate_dead_code()
        except Unsplittable as e:
            res.near_misses.append(f"two_batch_overlap: batch not split: {e}")
            return res
        before, after = lookahead.predicted_step(graph, ctx), lookahead.predicted_step(trial, ctx)
        figures = (f"predicted step {before * 1e6:.0f} us as one batch, {after * 1e6:.0f} us as two micro-batches"
                   + lookahead.after_later(ctx))
        forced = ctx.options["two_batch_overlap"]
        if not (after < before * (1 - 1e-9) or forced):
            res.near_misses.append(f"two_batch_overlap: does not pay: {figures}")
            return res
        split(graph, trace)
        res.matches, res.modified = 1, True
        res.decisions.append(f"batch of {trace.batch} split into 2 micro-batches of {trace.batch // 2}: {dup} op(s) "
                             f"duplicated, {len(trace.slices)} shared value(s) sliced; {figures}"
                             + ("; forced (pass option two_batch_overlap)" if forced else ""))
        return res
