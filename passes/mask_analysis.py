"""Prove what an attention mask built inside the graph is, without running it.

Models build causal masks from index arithmetic: `arange`/`tril`/`triu` become `iota`, index
comparisons and `where` in post-grad graphs. This module interprets such a subgraph
abstractly, over the index of each axis, and can say "this is key j kept for query i iff
j <= i + offset" for every shape, not just the example's. A subgraph that reads any graph
input (a padding mask, a cache position tensor) or uses an op not modelled here is
`None`: unknown, and the caller keeps the mask as a tensor.

A value is a sympy expression over one index symbol per axis, counted from the right as
broadcasting aligns axes (`index(1)` is the last axis: keys; `index(2)` queries):
- an integer tensor is an integer expression (iota is an index; a symbolic size is the shape
  environment's expression for it);
- a boolean tensor is a sympy boolean: relationals joined by And / Or / Not;
- a constant is a number (-inf is -oo), and `where(p, a, b)` with constant a and b is
  `Piecewise((a, p), (b, True))`.
Shape ops rename or substitute indices. At each node a comparison that its index ranges
decide becomes True or False; where that needs a fact about symbolic sizes, only one the
shape environment already proves counts, never one it would have to guard.
"""

from __future__ import annotations

import operator

import sympy
import torch
from sympy import ITE, Piecewise, piecewise_fold
from sympy.logic.boolalg import Boolean
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .matching import Node, arg, aten, dtype, is_reshape, is_scalar, ndim, norm_dim, packet, prims, same, shape

_INEQUALITIES = (sympy.Le, sympy.Lt, sympy.Ge, sympy.Gt)
_COMPARE = {aten.le: sympy.Le, aten.lt: sympy.Lt, aten.ge: sympy.Ge, aten.gt: sympy.Gt,
            aten.eq: sympy.Eq, aten.ne: sympy.Ne}
_ARITH = {aten.add: operator.add, aten.sub: operator.sub, aten.mul: operator.mul}
_LOGIC = {aten.logical_and: sympy.And, aten.bitwise_and: sympy.And, aten.logical_or: sympy.Or,
          aten.bitwise_or: sympy.Or, aten.logical_not: sympy.Not, aten.bitwise_not: sympy.Not}
_PASS_THROUGH = (aten.clone, aten.alias, aten.lift_fresh_copy, aten.contiguous,
                 aten.expand)  # expand: a broadcast axis had size 1, so its index is already 0
_MODELLED = {prims.iota, aten.full, aten.scalar_tensor, aten.ones, aten.zeros, prims.convert_element_type,
             aten._to_copy, aten.unsqueeze, aten.permute, aten.squeeze, aten.slice, aten.where,
             *_PASS_THROUGH, *_COMPARE, *_ARITH, *_LOGIC}


def index(k: int) -> sympy.Symbol:
    """The index along the k-th axis from the right (1: the last axis)."""
    return sympy.Symbol(f"index{k}", integer=True, nonnegative=True)


KEY, QUERY = index(1), index(2)


def _indices(e: sympy.Basic) -> set[sympy.Symbol]:
    return {s for s in e.free_symbols if s.name.startswith("index")}


def _number(x) -> sympy.Number:
    """A Python scalar as a sympy number; an integral float as an Integer, since sympy keeps
    Float(1.0) apart from 1, in == and in its integer reasoning."""
    return sympy.Integer(int(x)) if float(x).is_integer() else sympy.Float(float(x))


def _is_boolean(v) -> bool:
    return isinstance(v, Boolean) and not isinstance(v, sympy.Expr)  # a Symbol is both


def _as_number(v):
    """A boolean as the 1 / 0 it is in arithmetic."""
    return Piecewise((1, v), (0, True)) if _is_boolean(v) else v


def _boolean(v) -> Boolean:
    """A Piecewise of booleans (a folded comparison) as a plain boolean."""
    return v.rewrite(ITE) if isinstance(v, Piecewise) else v


def _truth(v) -> Boolean:
    """Where v is nonzero, as bool conversion and masked_fill read it."""
    return v if _is_boolean(v) else _boolean(piecewise_fold(sympy.Ne(v, 0)))


def _cast(v, dt: torch.dtype):
    """v stored as `dt`, or None where that is not modelled exactly. Constants are rounded
    as torch rounds them; indices are exact in int and 32/64-bit floats (float16 and
    bfloat16 would round them past 2048 and 256); float to int truncation is not modelled."""
    if dt == torch.bool:
        return _truth(v)
    v = _as_number(v)
    if not dt.is_floating_point:
        return v if v.is_integer else None
    pieces = v.args if isinstance(v, Piecewise) else ((v, sympy.true),) if v.is_Number else None
    if pieces is None:
        return v if dt.itemsize >= 4 else None
    if not all(x.is_Number for x, _ in pieces):
        return None
    return Piecewise(*[(_number(torch.tensor(float(x), dtype=dt).item()), c) for x, c in pieces])


class MaskInterpreter:
    """Abstract values for the nodes of a mask subgraph; None where unknown."""

    def __init__(self):
        self.memo: dict[Node, sympy.Basic | None] = {}
        self.shape_env = None  # from the first symbolic size seen; proves facts about sizes

    def value(self, n) -> sympy.Basic | None:
        if isinstance(n, bool) or is_scalar(n):
            return _number(n)
        if isinstance(n, Node) and isinstance(n.meta.get("val"), torch.SymInt):  # a size computed in the graph
            n = n.meta["val"]
        if isinstance(n, torch.SymInt):
            return self._size(n)
        if not isinstance(n, Node):
            return None
        if n not in self.memo:
            self.memo[n] = None  # cycles are impossible in a DAG; this also guards recursion
            try:
                v = self._eval(n)
                self.memo[n] = None if v is None else self._restrict(v, shape(n))
            except (TypeError, ValueError, IndexError, KeyError):
                self.memo[n] = None
        return self.memo[n]

    def _size(self, s: "int | torch.SymInt") -> sympy.Expr:
        if isinstance(s, torch.SymInt):
            self.shape_env = s.node.shape_env
            return s.node.expr
        return sympy.Integer(s)

    def symint(self, e: sympy.Expr) -> "int | torch.SymInt":
        """An expression over sizes as the int or SymInt the graph's users take."""
        # hint=None: the SymInt works its hint out from the sizes' own, where they have one
        return int(e) if e.is_Integer else self.shape_env.create_symintnode(e, hint=None)

    def known(self, claim: Boolean) -> bool | None:
        """Whether a claim over sizes (no indices) holds, where that is provable without a guard."""
        if claim in (sympy.true, sympy.false):
            return bool(claim)
        if self.shape_env is None:
            return None
        if statically_known_true(self.shape_env.create_symboolnode(claim)):
            return True
        if statically_known_true(self.shape_env.create_symboolnode(sympy.Not(claim))):
            return False
        return None

    def _restrict(self, v, dims) -> sympy.Basic:
        """v over this node's indices only: an axis of size 1 has index 0 (which keeps
        implicit broadcasting against a longer axis exact), and a comparison that holds at
        every index, or at none, is True or False."""
        sizes = {index(len(dims) - p): self._size(d) for p, d in enumerate(dims)}
        v = v.xreplace({ix: sympy.S.Zero for ix, size in sizes.items() if size == 1})
        return v.xreplace({r: self._decide(r, sizes) for r in v.atoms(sympy.core.relational.Relational)})

    def _decide(self, rel, sizes: dict) -> Boolean:
        """rel, or True / False where its two ends over the node's indices agree. An affine
        form in indices that run over 0..size-1 is extreme at the corners, each index at 0 or
        size-1 by the sign of its coefficient (so no comparison of sizes is needed)."""
        d = sympy.expand(rel.lhs - rel.rhs)
        slopes = {ix: d.diff(ix) for ix in _indices(d)}
        if (slopes and not isinstance(rel, _INEQUALITIES)) or not all(k.is_Integer for k in slopes.values()):
            return rel
        low = d.xreplace({ix: sympy.S.Zero if k > 0 else sizes[ix] - 1 for ix, k in slopes.items()})
        high = d.xreplace({ix: sizes[ix] - 1 if k > 0 else sympy.S.Zero for ix, k in slopes.items()})
        at_low, at_high = self.known(rel.func(low, 0)), self.known(rel.func(high, 0))
        return sympy.sympify(at_low) if at_low is not None and at_low == at_high else rel

    def _eval(self, n: Node):
        rank, a, op = ndim(n), n.args, packet(n)
        if rank is None or not (op in _MODELLED or is_reshape(n)):
            return None  # before reading inputs: an op not modelled ends the walk up the graph
        if op is prims.iota:
            start, step = self.value(n.kwargs.get("start", 0)), self.value(n.kwargs.get("step", 1))
            return None if start is None or step is None else start + step * index(1)
        if op in (aten.ones, aten.zeros):
            return _cast(sympy.Integer(op is aten.ones), dtype(n))
        src = self.value(a[1] if op is aten.full else a[0])
        if src is None:
            return None
        if op in (aten.full, aten.scalar_tensor, prims.convert_element_type, aten._to_copy):
            return _cast(src, dtype(n))
        if op in _PASS_THROUGH:
            return src
        if op is aten.unsqueeze:
            new = rank - norm_dim(a[1], rank)  # the new axis, counted from the right
            return _move(src, {k: k + 1 for k in range(new, rank)})
        if op is aten.permute:  # output axis p holds input axis perm[p]
            return _move(src, {rank - norm_dim(q, rank): rank - p for p, q in enumerate(a[1])})
        if op is aten.squeeze or is_reshape(n):
            return self._drop_or_add_ones(src, shape(a[0]), shape(n))
        if op is aten.slice:
            return self._slice(n, src, rank)
        rest = [_as_number(self.value(x)) for x in a[1:]]
        if any(v is None for v in rest):
            return None
        if op in _COMPARE:
            return _boolean(piecewise_fold(_COMPARE[op](_as_number(src), rest[0])))
        if op in _ARITH and n.kwargs.get("alpha", 1) == 1:
            return _cast(piecewise_fold(_ARITH[op](_as_number(src), rest[0])), dtype(n))
        if op in _LOGIC and dtype(n) == torch.bool:  # bitwise ops on integers are not logic
            return _LOGIC[op](_truth(src), *map(_truth, rest))
        if op is aten.where and all(b.is_Number for b in rest):  # scalar branches only
            return _cast(Piecewise((rest[0], _truth(src)), (rest[1], True)), dtype(n))
        return None

    def _drop_or_add_ones(self, src, ins, outs):
        """Reshapes that only add or remove size-1 axes; others are not modelled."""
        kept_in = [i for i, d in enumerate(ins) if not same(d, 1)]
        kept_out = [o for o, d in enumerate(outs) if not same(d, 1)]
        if len(kept_in) != len(kept_out) or not all(same(ins[i], outs[o]) for i, o in zip(kept_in, kept_out)):
            return None
        return _move(src, {len(ins) - i: len(outs) - o for i, o in zip(kept_in, kept_out)})

    def _slice(self, n: Node, src, rank: int):
        """index -> start + step * index along the sliced axis. A start that may be negative
        counts from the end, which is not modelled."""
        start = arg(n, 2, "start")
        start, step = self.value(0 if start is None else start), self.value(arg(n, 4, "step", 1))
        if start is None or step is None or _indices(start) or self.known(start >= 0) is not True:
            return None
        ix = index(rank - norm_dim(arg(n, 1, "dim", 0), rank))
        return src.xreplace({ix: start + step * ix})


def _move(v, axes: dict[int, int]):
    """v with the index of axis k renamed to that of axes[k] (all at once)."""
    return v.xreplace({index(k): index(m) for k, m in axes.items() if k != m})


# ---- reading a predicate as a mask ---------------------------------------------------------

def keep_of_additive(v) -> Boolean | None:
    """For an additive mask that is 0 where kept and a 'minus infinity' where dropped, the
    keep predicate. A dropped value must send exp() to exactly 0 after the softmax's max
    subtraction: -inf, or at most the most negative float16 (HF uses finfo(dtype).min)."""
    floor = torch.finfo(torch.float16).min
    pieces = v.args if isinstance(v, Piecewise) else ((v, sympy.true),)
    if not all(x.is_Number and (x == 0 or (x.is_extended_negative and x <= floor)) for x, _ in pieces):
        return None
    return _boolean(Piecewise(*[(sympy.sympify(x == 0), c) for x, c in pieces]))


def keep_predicate(node, interp: MaskInterpreter, *, kind: str, score_dtype: torch.dtype) -> Boolean | None:
    """Which keys a mask node keeps (`kind` "additive", "keep" (True keeps) or "drop"), if known."""
    v = interp.value(node)
    if v is None:
        return None
    if kind == "additive":
        return keep_of_additive(v)
    return _truth(v) if kind == "keep" else sympy.Not(_truth(v))


def _key_minus_query_bound(rel) -> tuple[str, sympy.Expr] | None:
    """An inequality read as a bound on key - query: ("upper", u) for key - query <= u,
    ("lower", l) for key - query >= l, with u, l integers free of indices; else None."""
    if not isinstance(rel, _INEQUALITIES):
        return None
    d = sympy.expand(rel.lhs - rel.rhs)
    # as e <= 0 over the integers
    e = {sympy.Le: d, sympy.Lt: d + 1, sympy.Ge: -d, sympy.Gt: 1 - d}[type(rel)]
    c = e.diff(KEY)
    if c not in (1, -1) or e.diff(QUERY) != -c:
        return None
    rest = sympy.expand(e - c * (KEY - QUERY))
    if _indices(rest) or not rest.is_integer:
        return None
    return ("upper", -rest) if c == 1 else ("lower", rest)


def _extreme(values: set, pick):
    """The min or max of expressions that differ by integer constants; None if there are none
    or two differ by something symbolic."""
    values = list(values)
    if not values or not all(sympy.expand(v - values[0]).is_Integer for v in values[1:]):
        return None
    return values[0] + pick(sympy.expand(v - values[0]) for v in values)


def causal_window(node, interp: MaskInterpreter, *, kind: str, score_dtype: torch.dtype):
    """(offset, window) of a causal or sliding-window causal mask node: it keeps key j for
    query i iff i + offset - window < j <= i + offset (window 0: no lower bound), as Hugging
    Face's sliding window (kv > q - W and kv <= q) does. The offset is an int or SymInt; the
    window an int, or the sympy expression of a width that is not a constant (the caller says
    why it cannot use it). None if the mask is not exactly of that form."""
    keep = keep_predicate(node, interp, kind=kind, score_dtype=score_dtype)
    if keep is None or keep in (sympy.true, sympy.false):
        return None
    atoms = sympy.logic.boolalg.to_nnf(keep)
    atoms = atoms.args if isinstance(atoms, sympy.And) else (atoms,)
    bounds: dict[str, set] = {"upper": set(), "lower": set()}
    for a in atoms:
        b = _key_minus_query_bound(a)
        if b is None:
            return None
        bounds[b[0]].add(b[1])
    # several bounds of a kind: the tightest, where they differ by constants
    upper, lower = _extreme(bounds["upper"], min), _extreme(bounds["lower"], max)
    if upper is None:
        return None
    if lower is None:
        return (interp.symint(upper), 0) if not bounds["lower"] else None
    window = sympy.expand(upper - lower + 1)
    if window.is_Integer:
        return (interp.symint(upper), int(window)) if window >= 1 else None  # < 1: keeps nothing
    return interp.symint(upper), window


def keeps_everything(node, interp: MaskInterpreter, *, kind: str, score_dtype: torch.dtype) -> bool:
    """Whether a mask node provably keeps every key for every query (e.g. one query token
    over the whole cache): such a mask can be dropped."""
    return keep_predicate(node, interp, kind=kind, score_dtype=score_dtype) is sympy.true
