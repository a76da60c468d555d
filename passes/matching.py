"""Helpers for reading and rewriting post-grad ATen graphs.

Post-grad graphs are functional ATen after Inductor's decompositions: softmax is
amax/sub/exp/sum/div, silu is neg/exp/add/div, tril and masked_fill are iota comparisons and
`where`, `matmul` is expand/reshape/bmm, and dtype casts are `prims.convert_element_type`.
Every node carries `meta["val"]`, a fake tensor, so shapes and dtypes are known; shapes may
be symbolic, so comparisons go through `same()`.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any, Iterable

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten
prims = torch.ops.prims
Node = torch.fx.Node

# reshapes, as exact overloads: aten.view.dtype (a reinterpretation of the bits) is not one
VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
CONVERT_OPS = (prims.convert_element_type, aten._to_copy)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def packet(n: Any):
    """The overload packet of a call_function node's target (aten.mul for aten.mul.Tensor)."""
    if not isinstance(n, Node) or n.op != "call_function":
        return None
    return getattr(n.target, "overloadpacket", n.target)


def is_op(n: Any, *ops) -> bool:
    """Whether `n` calls one of `ops`: an overload packet (any of its overloads) or an overload."""
    p = packet(n)
    return p is not None and any(p is o or n.target is o for o in ops)


def is_reshape(n: Any) -> bool:
    """view / reshape / _unsafe_view to a new shape (never view.dtype)."""
    return is_op(n, *VIEW_OPS)


def val(n: Any):
    return n.meta.get("val") if isinstance(n, Node) else None


def tensor_val(n: Any) -> torch.Tensor | None:
    v = val(n)
    return v if isinstance(v, torch.Tensor) else None


def shape(n: Any) -> tuple | None:
    v = tensor_val(n)
    return tuple(v.shape) if v is not None else None


def dtype(n: Any) -> torch.dtype | None:
    v = tensor_val(n)
    return v.dtype if v is not None else None


def ndim(n: Any) -> int | None:
    v = tensor_val(n)
    return v.dim() if v is not None else None


def same(a, b) -> bool:
    """a == b, provably (works for ints and SymInts)."""
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def maybe_same(a, b) -> bool:
    """a == b is possible: equal, or symbolic sizes not provably different. Only for sizes
    the op that consumes them checks again at run time (its launcher raises otherwise)."""
    try:
        return not bool(statically_known_true(a != b))
    except Exception:
        return True


def same_shape(a: Iterable, b: Iterable) -> bool:
    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def is_scalar(x: Any) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def arg(n: Node, i: int, name: str, default: Any = None) -> Any:
    """Argument `i` (positional) or `name` (keyword) of a call node."""
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def reduces_last_dim(n: Node, rank: int) -> bool:
    """A reduction node (amax/sum/mean) over exactly the last dim with keepdim=True."""
    dims = arg(n, 1, "dim")
    keep = arg(n, 2, "keepdim", False)
    if isinstance(dims, int):
        dims = [dims]
    return bool(keep) and isinstance(dims, (list, tuple)) and len(dims) == 1 and norm_dim(dims[0], rank) == rank - 1


def is_noop_expand(n: Node) -> bool:
    return is_op(n, aten.expand) and shape(n) is not None and same_shape(shape(n), shape(n.args[0]) or ())


def is_noop_slice(n: Node) -> bool:
    """x[:, 0:end] that keeps everything: graphs with symbolic sizes keep these (a static
    graph drops them), e.g. the `[:, :, None]` of repeat_kv."""
    if not is_op(n, aten.slice) or shape(n) is None:
        return False
    start = arg(n, 2, "start", 0)
    step = arg(n, 4, "step", 1)
    return start in (0, None) and step == 1 and same_shape(shape(n), shape(n.args[0]) or ())


def peel(n: Any, step, single_use: bool = False) -> "tuple[Any, list[Node]]":
    """Follow `n` back through its first argument while it is a step: a call of one of the
    ops in `step` (a tuple for `is_op`) or a node `step(n)` accepts; with `single_use`, only
    through nodes with one user. (source, the nodes walked, outermost first). The one walk
    back through views, casts and copies every matcher uses."""
    accepts = step if callable(step) else (lambda x: is_op(x, *step))
    chain = []
    while isinstance(n, Node) and n.op == "call_function" and accepts(n) and (not single_use or len(n.users) == 1):
        chain.append(n)
        n = n.args[0]
    return n, chain


def uncast(n: Any) -> Any:
    """The value under a chain of dtype casts."""
    return peel(n, CONVERT_OPS)[0]


def is_noop_view(n: Any) -> bool:
    """A clone, or a slice or expand that keeps the shape: the same values."""
    return is_op(n, aten.clone) or is_noop_slice(n) or is_noop_expand(n)


def skip_noop_views(n: Any) -> Any:
    """Follow clones, no-op slices and no-op expands back to their source."""
    return peel(n, is_noop_view)[0]


def escaping_uses(nodes: Iterable[Node], inside: "set[Node]", exits: Iterable[Node] = (),
                  size_reads: bool = False) -> "list[tuple[Node, Node]]":
    """(node, user) for every use of one of `nodes` by a node outside `inside`, in the order of
    `nodes`: what keeps a region a rewrite replaces alive. The `exits` (the region's results)
    may be used anywhere; with `size_reads`, so may a node's size (the rewrite rehomes those
    reads, see `rehome_size_reads`)."""
    exits = set(exits)
    return [(n, u) for n in nodes if n not in exits for u in n.users
            if u not in inside and not (size_reads and is_size_read(u))]


def location(n: Node) -> str:
    """Where a node came from in the model, e.g. 'model.layers.0.self_attn'."""
    stack = n.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        for prefix in ("L['self'].", "L['forward'].__self__.", "L['args'][0].", "L['mod'].", "L['model']."):
            if path.startswith(prefix):
                return path[len(prefix):]
        return path
    trace = (n.meta.get("stack_trace") or "").strip().splitlines()
    for line in reversed(trace):
        line = line.strip()
        if line.startswith("File "):
            return line
    return n.name


def order(graph: torch.fx.Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def fake_call(target, args: tuple, kwargs: dict | None = None):
    """meta["val"] for a new node: run `target` on the fake values of its Node arguments."""
    kwargs = kwargs or {}
    fvals = []

    def to_val(a):
        if isinstance(a, Node):
            v = val(a)
            fvals.append(v)
            return v
        if isinstance(a, (list, tuple)):
            return type(a)(to_val(x) for x in a)
        return a

    fargs = tuple(to_val(a) for a in args)
    fkwargs = {k: to_val(v) for k, v in kwargs.items()}
    leaves = torch.utils._pytree.tree_leaves(fvals)
    mode = torch._guards.detect_fake_mode([v for v in leaves if isinstance(v, torch.Tensor)])
    if mode is None:
        raise RuntimeError(f"cannot infer the value of a new {target} node: its inputs carry no fake tensors")
    with mode:
        return target(*fargs, **fkwargs)


def insert_call(graph: torch.fx.Graph, before: Node, target, args: tuple, kwargs: dict | None = None,
                meta_from: Node | None = None, exclude: "set[Node] | None" = None) -> Node:
    """Insert `target(*args, **kwargs)` before `before`, with meta["val"] and provenance set.
    Symbolic sizes among the arguments (SymInts from fake tensors' shapes) become nodes of
    the graph that compute them, read from nodes outside `exclude` (a region about to go),
    so the graph stays valid for every size. Check first with `sizes_available`."""
    fake_args, fake_kwargs = args, kwargs or {}
    args = _bind_symbols(graph, before, args, exclude)
    kwargs = _bind_symbols(graph, before, kwargs or {}, exclude)
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    node.meta["val"] = fake_call(target, fake_args, fake_kwargs)
    src = meta_from if meta_from is not None else before
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr"):
        if key in src.meta:
            node.meta[key] = src.meta[key]
    return node


def _bind_symbols(graph: torch.fx.Graph, before: Node, a: Any, exclude) -> Any:
    if isinstance(a, torch.SymInt):
        return sym_size_node(graph, before, a, exclude)
    if isinstance(a, (list, tuple)):
        return type(a)(_bind_symbols(graph, before, x, exclude) for x in a)
    if isinstance(a, dict):
        return {k: _bind_symbols(graph, before, v, exclude) for k, v in a.items()}
    return a


def sizes_available(graph: torch.fx.Graph, before: Node, args: Any, exclude: "set[Node] | None" = None) -> bool:
    """Whether every symbolic size inside `args` (nested lists/tuples/dicts) can be bound."""
    if isinstance(args, (list, tuple)):
        return all(sizes_available(graph, before, x, exclude) for x in args)
    if isinstance(args, dict):
        return all(sizes_available(graph, before, x, exclude) for x in args.values())
    return sym_size_available(graph, before, args, exclude)


# -- symbolic sizes as graph values ---------------------------------------------------------
# A size is resolved in two steps: `_size_plan` finds, without touching the graph, how to read
# it (an existing node, a tensor dimension, or integer sums/products of those); `_realise`
# adds the nodes. `sym_size_available` and `sym_size_node` share the plan, so a check that
# passes is a rewrite that cannot fail.

def _size_plan(graph: torch.fx.Graph, before: Node, size, exclude: "set[Node] | None"):
    if isinstance(size, int):
        return ("int", size)
    if not isinstance(size, torch.SymInt):
        return None
    expr = size.node.expr
    if expr.is_Integer:
        return ("int", int(expr))
    found = _find_size(graph, before, expr, exclude or set())
    if found is not None:
        return found
    if not (expr.is_Add or expr.is_Mul):
        return None
    shape_env = size.node.shape_env
    terms = []
    for term in expr.args:
        if term.is_number and not term.is_Integer:
            return None
        t = term if term.is_number else shape_env.create_symintnode(term, hint=None)
        plan = ("int", int(term)) if term.is_number else _size_plan(graph, before, t, exclude)
        if plan is None:
            return None
        terms.append(plan)
    return ("add" if expr.is_Add else "mul", terms, size)


def _find_size(graph: torch.fx.Graph, before: Node, expr, exclude: set[Node]):
    dim = None
    for n in graph.nodes:
        if n is before:
            break
        if n in exclude or (is_size_read(n) and n.args[0] in exclude):
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt) and v.node.expr == expr:
            return ("node", n)
        if dim is None and isinstance(v, torch.Tensor):
            d = next((d for d, s in enumerate(v.shape) if isinstance(s, torch.SymInt) and s.node.expr == expr), None)
            if d is not None:
                dim = ("dim", n, d, v.shape[d])
    return dim


def _realise(graph: torch.fx.Graph, before: Node, plan) -> "int | Node":
    kind = plan[0]
    if kind == "int":
        return plan[1]
    if kind == "node":
        return plan[1]
    if kind == "dim":
        _, src, d, value = plan
        with graph.inserting_before(before):
            node = graph.call_function(aten.sym_size.int, (src, d))
        node.meta["val"] = value
        return node
    combine = operator.add if kind == "add" else operator.mul
    acc = None
    for term in plan[1]:
        t = _realise(graph, before, term)
        if acc is None:
            acc = t
            continue
        with graph.inserting_before(before):
            acc = graph.call_function(combine, (acc, t))
    if isinstance(acc, Node):
        acc.meta["val"] = plan[2]
    return acc


def sym_size_available(graph: torch.fx.Graph, before: Node, size, exclude: "set[Node] | None" = None) -> bool:
    """Whether `sym_size_node` can express `size` before `before` (without changing the graph).
    Anything that is not a symbolic size is trivially available."""
    if not isinstance(size, torch.SymInt):
        return True
    return _size_plan(graph, before, size, exclude) is not None


def sym_size_node(graph: torch.fx.Graph, before: Node, size: "int | torch.SymInt",
                  exclude: "set[Node] | None" = None) -> "int | Node":
    """An FX argument equal to `size` at run time, usable before `before`, read from nodes
    outside `exclude`: the int itself, an existing node (or tensor dimension, read with
    `sym_size`) holding that value, or integer sums and products of such. Raises ValueError
    where `sym_size_available` says no."""
    if not isinstance(size, torch.SymInt):
        return size
    plan = _size_plan(graph, before, size, exclude)
    if plan is None:
        raise ValueError(f"no value before {before.name} holds the symbolic size {size.node.expr}")
    return _realise(graph, before, plan)


SIZE_READS = (aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset)


def is_size_read(n: Node) -> bool:
    """A node that reads only the size of its input (graphs with symbolic shapes have them)."""
    return is_op(n, *SIZE_READS)


def size_reads_rehomable(region: set[Node]) -> bool:
    """Whether every size read of `region`'s nodes can read the same size elsewhere."""
    for n in region:
        for u in n.users:
            if is_size_read(u):
                v = u.meta.get("val")
                if not isinstance(v, (int, torch.SymInt)) or not sym_size_available(u.graph, u, v, region):
                    return False
    return True


def rehome_size_reads(graph: torch.fx.Graph, region: set[Node]) -> None:
    """Make size reads of `region`'s nodes read the same size elsewhere, so the region can
    go (a size read alone would keep, say, an attention score matrix alive). Check first
    with `size_reads_rehomable`."""
    for n in region:
        for u in [u for u in n.users if is_size_read(u)]:
            u.replace_all_uses_with(sym_size_node(graph, u, u.meta["val"], exclude=region))


def silu_input(n: Any) -> "tuple[Node, list[Node]] | None":
    """(g, the nodes computing silu(g) from g) if `n` is silu(g) in any of its post-grad forms:
    aten.silu, g / (1 + exp(-g)) (Inductor's decomposition), g * sigmoid(g); casts around it
    are part of the chain, and g is read before an upcast that only silu uses."""
    n, chain = peel(n, CONVERT_OPS)
    g = None
    if is_op(n, aten.silu):
        g, chain = n.args[0], chain + [n]
    elif is_op(n, aten.div):
        den = n.args[1]
        if is_op(den, aten.add) and (den.args[1] == 1 or den.args[0] == 1):
            e = den.args[0] if den.args[1] == 1 else den.args[1]
            if is_op(e, aten.exp) and is_op(e.args[0], aten.neg) and e.args[0].args[0] is n.args[0]:
                g, chain = n.args[0], chain + [n, den, e, e.args[0]]
    elif is_op(n, aten.mul):
        for x, s in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
            if is_op(s, aten.sigmoid) and s.args[0] is x:
                g, chain = x, chain + [n, s]
                break
    if g is None:
        return None
    while is_op(g, *CONVERT_OPS) and all(u in chain for u in g.users) and dtype(g.args[0]) in FLOAT_DTYPES:
        chain = chain + [g]
        g = g.args[0]
    return g, chain


def constant_value(n: Any) -> float | None:
    """A Python number for scalars and for 0-dim `full`/`scalar_tensor` nodes, else None."""
    if is_scalar(n):
        return float(n)
    if is_op(n, aten.full) and len(n.args) >= 2 and is_scalar(n.args[1]) and tuple(n.args[0]) in ((), (1,)):
        return float(n.args[1])
    if is_op(n, aten.scalar_tensor) and is_scalar(n.args[0]):
        return float(n.args[0])
    return None


def untransposed(n: Any, rank: "int | None" = None) -> "Node | None":
    """W if `n` is W with its last two dims swapped (a permute, or aten.t of a 2-D W), of
    rank `rank` where given; else None."""
    if is_op(n, aten.t) and rank in (None, 2) and ndim(n.args[0]) == 2:
        return n.args[0]
    if is_op(n, aten.permute):
        r = len(n.args[1])
        perm = [norm_dim(d, r) for d in n.args[1]]
        if r >= 2 and rank in (None, r) and perm == [*range(r - 2), r - 1, r - 2]:
            return n.args[0]
    return None


def linear_operands(node: Node) -> "tuple[Any, Node, Any] | None":
    """(x, Wt, bias or None) if `node` computes x @ Wt (+ bias) for a 2-D `Wt` (F.linear's
    weight transposed): mm(x, Wt), addmm(bias, x, Wt) (bias (N,) or (M, N)), or
    bmm(x, expand(Wt, (B, K, N))), which is what matmul makes of a batched, non-contiguous input."""
    if is_op(node, aten.mm):
        return node.args[0], node.args[1], None
    if is_op(node, aten.addmm):
        if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1:
            return None
        bias = node.args[0]  # (N,), or (M, N) where Inductor folded an add into the GEMM
        if shape(bias) is None or len(shape(bias)) not in (1, 2):
            return None
        return node.args[1], node.args[2], bias
    if is_op(node, aten.bmm):
        w = node.args[1]
        # views that keep (batch, K, N) as they are, down to an expand of the 2-D weight
        w, _ = peel(w, lambda v: is_reshape(v) and ndim(v.args[0]) == 3 and same_shape(shape(v), shape(v.args[0])))
        if (is_op(w, aten.expand) and ndim(w.args[0]) == 2 and same_shape(shape(w)[1:], shape(w.args[0]))
                and same_shape(shape(w), shape(node.args[1]))):
            return node.args[0], w.args[0], None
    return None
