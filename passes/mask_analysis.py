"""Prove what an attention mask built inside the graph is, without running it.

Models build causal masks from index arithmetic: `arange`/`tril`/`triu` become `iota`, index
comparisons and `where` in post-grad graphs. This module interprets such a subgraph
abstractly, over the index of each axis, and can say "this is key j kept for query i iff
j <= i + offset" for every shape, not just the example's. A subgraph that reads any graph
input (a padding mask, a cache position tensor) or uses an op not modelled here is
`None`: unknown, and the caller keeps the mask as a tensor.

Values, all with an `ndim` and aligned to the right like broadcasting:
- `Affine`: integer tensor, value = sum_a coeff[a] * index[a] + const (const may be a
  symbolic size, e.g. the length of a KV cache: comparisons on it are decided only where the
  shape environment proves them, never by adding a guard)
- `Const`: a scalar broadcast to the shape
- `Pred`: boolean expression over comparisons of affines
- `Select`: where(pred, a, b) with scalar a and b
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Union

import torch

from torch.fx.experimental.symbolic_shapes import statically_known_true

from .matching import Node, aten, is_op, is_reshape, is_scalar, ndim, norm_dim, prims, same, shape


@dataclass(frozen=True, eq=False)
class Affine:
    ndim: int
    coeffs: tuple[tuple[int, int], ...]  # (axis counted from the right: -1, -2, ...; coefficient)
    const: "int | torch.SymInt"

    def coeff(self, axis: int) -> int:
        return dict(self.coeffs).get(axis, 0)


@dataclass(frozen=True)
class Const:
    ndim: int
    value: float


@dataclass(frozen=True)
class Pred:
    ndim: int
    expr: tuple  # ("cmp", Affine, op) | ("and"|"or", Pred, Pred) | ("not", Pred) | ("true",) | ("false",)


@dataclass(frozen=True)
class Select:
    ndim: int
    pred: Pred
    a: float
    b: float


Value = Union[Affine, Const, Pred, Select]

_CMP = {aten.le: "<=", aten.lt: "<", aten.ge: ">=", aten.gt: ">", aten.eq: "==", aten.ne: "!="}
_PY_CMP = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt,
           "==": operator.eq, "!=": operator.ne}
_FLIP = {"<=": ">=", "<": ">", ">=": "<=", ">": "<", "==": "==", "!=": "!="}
_NEGATE = {"<=": ">", "<": ">=", ">=": "<", ">": "<=", "==": "!=", "!=": "=="}


def _with_ndim(v: Value, n: int) -> Value:
    """The same value seen with more leading (broadcast) dims."""
    if isinstance(v, Affine):
        return Affine(n, v.coeffs, v.const)
    if isinstance(v, Const):
        return Const(n, v.value)
    if isinstance(v, Pred):
        return Pred(n, v.expr)
    return Select(n, _with_ndim(v.pred, n), v.a, v.b)


def _affine_add(x: Affine, y: Affine, sign: int = 1) -> Affine:
    c = dict(x.coeffs)
    for a, k in y.coeffs:
        c[a] = c.get(a, 0) + sign * k
    return Affine(max(x.ndim, y.ndim), tuple(sorted((a, k) for a, k in c.items() if k)), x.const + sign * y.const)


def _as_affine(v: Value) -> Affine | None:
    if isinstance(v, Affine):
        return v
    if isinstance(v, Const) and float(v.value).is_integer():
        return Affine(v.ndim, (), int(v.value))
    return None


def _remap_axes(v: Value, fn) -> Value | None:
    """Apply an axis map (right-aligned axis -> new axis, or None to drop) to a value."""
    if isinstance(v, Affine):
        out = []
        for a, k in v.coeffs:
            b = fn(a)
            if b is None:
                return None  # an axis with a coefficient cannot vanish
            out.append((b, k))
        return Affine(v.ndim, tuple(sorted(out)), v.const)
    if isinstance(v, Const):
        return v
    if isinstance(v, Pred):
        e = _remap_expr(v.expr, fn)
        return None if e is None else Pred(v.ndim, e)
    p = _remap_axes(v.pred, fn)
    return None if p is None else Select(v.ndim, p, v.a, v.b)


def _remap_expr(e: tuple, fn):
    if e[0] == "cmp":
        a = _remap_axes(e[1], fn)
        return None if a is None else ("cmp", a, e[2])
    if e[0] in ("and", "or"):
        x, y = _remap_expr(e[1], fn), _remap_expr(e[2], fn)
        return None if x is None or y is None else (e[0], x, y)
    if e[0] == "not":
        x = _remap_expr(e[1], fn)
        return None if x is None else ("not", x)
    return e


def _set_ndim(v: Value, n: int) -> Value:
    if isinstance(v, Select):
        return Select(n, _set_ndim(v.pred, n), v.a, v.b)
    return _with_ndim(v, n)


def _not(p: Pred) -> Pred:
    e = p.expr
    if e[0] == "true":
        return Pred(p.ndim, ("false",))
    if e[0] == "false":
        return Pred(p.ndim, ("true",))
    if e[0] == "not":
        return Pred(p.ndim, e[1])
    return Pred(p.ndim, ("not", e))


def _to_pred(v: Value) -> Pred | None:
    """Truthiness of a value (x != 0), as bool conversion and masked_fill read it."""
    if isinstance(v, Pred):
        return v
    if isinstance(v, Const):
        return Pred(v.ndim, ("true",) if v.value != 0 else ("false",))
    if isinstance(v, Select):
        a, b = v.a != 0, v.b != 0
        if a and not b:
            return v.pred
        if b and not a:
            return _not(v.pred)
        return Pred(v.ndim, ("true",) if a else ("false",))
    if isinstance(v, Affine):
        return Pred(v.ndim, ("cmp", v, "!="))
    return None


def _compare(x: Value, y: Value, op: str, n: int, sizes: dict[int, int] | None = None) -> Value | None:
    # Select(p, a, b) OP c: decide each branch
    for s, other, o in ((x, y, op), (y, x, _FLIP[op])):
        if isinstance(s, Select) and isinstance(other, Const):
            ta, tb = _PY_CMP[o](s.a, other.value), _PY_CMP[o](s.b, other.value)
            if ta and not tb:
                return _set_ndim(s.pred, n)
            if tb and not ta:
                return _set_ndim(_not(s.pred), n)
            return Pred(n, ("true",) if ta else ("false",))
    ax, ay = _as_affine(x), _as_affine(y)
    if ax is None or ay is None:
        return None
    return Pred(n, _atom(_affine_add(ax, ay, -1), op, sizes or {}))


def _decide(op: str, x, y=0) -> bool | None:
    """x OP y when it is known (for symbolic x: provable without a guard), else None."""
    if not isinstance(x, torch.SymInt) and not isinstance(y, torch.SymInt):
        return _PY_CMP[op](x, y)
    if statically_known_true(_PY_CMP[op](x, y)):
        return True
    if statically_known_true(_PY_CMP[_NEGATE[op]](x, y)):
        return False
    return None


def _atom(a: Affine, op: str, sizes: dict[int, int]) -> tuple:
    """("cmp", a, op), or ("true",)/("false",) when the index ranges decide it: every index is
    >= 0 and below its axis size (an int, or a symbol the shape environment can bound)."""
    if not a.coeffs:
        known = _decide(op, a.const)
        return ("cmp", a, op) if known is None else ("true",) if known else ("false",)
    if all(isinstance(sizes.get(ax), (int, torch.SymInt)) for ax, _ in a.coeffs):
        # index a runs over 0..size-1: k * index spans [k * (size - 1), 0] or [0, k * (size - 1)]
        # (sign by k, so no comparison of symbolic sizes is needed)
        lo = a.const + sum(k * (sizes[ax] - 1) for ax, k in a.coeffs if k < 0)
        hi = a.const + sum(k * (sizes[ax] - 1) for ax, k in a.coeffs if k > 0)
        if op in ("<=", "<", ">=", ">"):
            at_hi, at_lo = _decide(op, hi), _decide(op, lo)
            if at_hi is True and at_lo is True:
                return ("true",)
            if at_hi is False and at_lo is False:
                return ("false",)
    if len(a.coeffs) == 1:
        k = a.coeffs[0][1]
        # k * i + c over i >= 0 is smallest (k > 0) or largest (k < 0) at i = 0
        if (k > 0 and op in (">=", ">")) or (k < 0 and op in ("<=", "<")):
            if _decide(op, a.const) is True:
                return ("true",)
    return ("cmp", a, op)


def _combine(op: str, x: Value, y: Value, n: int) -> Value | None:
    px, py = _to_pred(x), _to_pred(y)
    if px is None or py is None:
        return None
    absorbing, neutral = ("false", "true") if op == "and" else ("true", "false")
    for p, q in ((px, py), (py, px)):
        if p.expr[0] == absorbing:
            return Pred(n, (absorbing,))
        if p.expr[0] == neutral:
            return Pred(n, q.expr)
    return Pred(n, (op, px.expr, py.expr))


def _drop_axes(v: Value, axes: set[int]) -> Value:
    """Remove coefficients on `axes` (axes of size 1, whose index is always 0)."""
    if isinstance(v, Affine):
        return Affine(v.ndim, tuple((a, k) for a, k in v.coeffs if a not in axes), v.const)
    if isinstance(v, Pred):
        return Pred(v.ndim, _drop_expr(v.expr, axes))
    if isinstance(v, Select):
        return Select(v.ndim, _drop_axes(v.pred, axes), v.a, v.b)
    return v


def _drop_expr(e, axes):
    if e[0] == "cmp":
        return ("cmp", _drop_axes(e[1], axes), e[2])
    if e[0] in ("and", "or"):
        return (e[0], _drop_expr(e[1], axes), _drop_expr(e[2], axes))
    if e[0] == "not":
        return ("not", _drop_expr(e[1], axes))
    return e


class MaskInterpreter:
    """Abstract values for the nodes of a mask subgraph; None where unknown."""

    def __init__(self):
        self.memo: dict[Node, Value | None] = {}

    def value(self, n) -> Value | None:
        if is_scalar(n) or isinstance(n, bool):
            return Const(0, float(n))
        if isinstance(n, torch.SymInt):
            return _symbolic(n)
        if not isinstance(n, Node):
            return None
        if isinstance(n.meta.get("val"), torch.SymInt):  # a size computed in the graph
            return _symbolic(n.meta["val"])
        if n not in self.memo:
            self.memo[n] = None  # cycles are impossible in a DAG; this also guards recursion
            try:
                v = self._eval(n)
            except (TypeError, ValueError, IndexError, KeyError):
                v = None
            s = shape(n)
            if v is not None and s is not None and not isinstance(v, Const):
                # an axis of size 1 has index 0 only; drop its coefficient so that implicit
                # broadcasting against a longer axis stays exact
                ones = {i - len(s) for i, d in enumerate(s) if same(d, 1)}
                if ones:
                    v = _drop_axes(v, ones)
            self.memo[n] = v
        return self.memo[n]

    def _eval(self, n: Node) -> Value | None:
        rank = ndim(n)
        if rank is None:
            return None
        a = n.args
        if is_op(n, prims.iota):
            start, step = n.kwargs.get("start", 0), n.kwargs.get("step", 1)
            if not (isinstance(start, int) and isinstance(step, int)):
                return None
            return Affine(1, ((-1, step),), start)
        if is_op(n, aten.full):
            return Const(rank, float(a[1])) if is_scalar(a[1]) or isinstance(a[1], bool) else None
        if is_op(n, aten.scalar_tensor):
            return Const(0, float(a[0])) if is_scalar(a[0]) or isinstance(a[0], bool) else None
        if is_op(n, aten.ones, aten.zeros):
            return Const(rank, 1.0 if is_op(n, aten.ones) else 0.0)
        if is_op(n, aten.clone, aten.alias, aten.lift_fresh_copy, aten.contiguous):
            return self.value(a[0])
        if is_op(n, prims.convert_element_type, aten._to_copy):
            src = self.value(a[0])
            target = n.meta["val"].dtype
            if src is None:
                return None
            if target == torch.bool:
                return _to_pred(src)
            if isinstance(src, Pred):
                return Select(src.ndim, src, 1.0, 0.0)
            return src
        if is_op(n, aten.unsqueeze):
            src = self.value(a[0])
            if src is None:
                return None
            d = norm_dim(a[1], rank)  # position in the output
            neg = d - rank  # the new axis, counted from the right
            moved = _remap_axes(src, lambda ax: ax - 1 if ax <= neg else ax)
            return None if moved is None else _set_ndim(moved, rank)
        if is_op(n, aten.squeeze):
            return self._reshape_like(n)
        if is_reshape(n):
            return self._reshape_like(n)
        if is_op(n, aten.expand):
            src = self.value(a[0])
            if src is None:
                return None
            src_shape = shape(a[0])
            # an axis of size 1 has index 0 only: its coefficient is moot, and must go
            # before the axis is broadcast
            ones = {i - len(src_shape) for i, s in enumerate(src_shape) if same(s, 1)}
            if isinstance(src, (Affine, Pred, Select)) and ones:
                src = _drop_axes(src, ones)
            return _set_ndim(src, rank)
        if is_op(n, aten.permute):
            src = self.value(a[0])
            if src is None:
                return None
            perm = [norm_dim(p, rank) for p in a[1]]
            # output axis i holds input axis perm[i]
            inv = {perm[i] - rank: i - rank for i in range(rank)}
            return _remap_axes(src, lambda ax: inv[ax])
        if is_op(n, aten.slice):
            src = self.value(a[0])
            if src is None:
                return None
            dim = norm_dim(a[1] if len(a) > 1 else 0, rank)
            start = a[2] if len(a) > 2 else 0
            step = a[4] if len(a) > 4 else 1
            start = 0 if start is None else start
            if not (isinstance(start, int) and isinstance(step, int)) or start < 0:
                return None
            return self._shift_axis(src, dim - rank, start, step)
        if is_op(n, aten.select):
            return None  # removes an axis: not needed by the masks seen so far
        if is_op(n, aten.add, aten.sub, aten.mul):
            return self._arith(n, rank)
        for op, sym in _CMP.items():
            if is_op(n, op):
                x, y = self.value(a[0]), self.value(a[1])
                if x is None or y is None:
                    return None
                out_shape = shape(n)
                sizes = {i - rank: d for i, d in enumerate(out_shape) if isinstance(d, (int, torch.SymInt))}
                return _compare(x, y, sym, rank, sizes)
        for ops, how in (((aten.logical_and, aten.bitwise_and), "and"), ((aten.logical_or, aten.bitwise_or), "or")):
            if is_op(n, *ops):
                x, y = self.value(a[0]), self.value(a[1])
                return None if x is None or y is None else _combine(how, x, y, rank)
        if is_op(n, aten.logical_not, aten.bitwise_not):
            src = self.value(a[0])
            p = _to_pred(src) if src is not None else None
            return None if p is None else _set_ndim(_not(p), rank)
        if is_op(n, aten.where):
            c, x, y = self.value(a[0]), self.value(a[1]), self.value(a[2])
            p = _to_pred(c) if c is not None else None
            if p is None or not isinstance(x, Const) or not isinstance(y, Const):
                return None
            return Select(rank, _set_ndim(p, rank), x.value, y.value)
        return None

    def _reshape_like(self, n: Node) -> Value | None:
        """Reshapes that only add or remove size-1 axes."""
        src = self.value(n.args[0])
        if src is None:
            return None
        ins, outs = shape(n.args[0]), shape(n)
        keep_in = [i for i, s in enumerate(ins) if not same(s, 1)]
        keep_out = [i for i, s in enumerate(outs) if not same(s, 1)]
        if len(keep_in) != len(keep_out) or not all(same(ins[i], outs[j]) for i, j in zip(keep_in, keep_out)):
            return None
        mapping = {i - len(ins): j - len(outs) for i, j in zip(keep_in, keep_out)}
        moved = _remap_axes(src, lambda ax: mapping.get(ax))
        return None if moved is None else _set_ndim(moved, len(outs))

    def _shift_axis(self, v: Value, axis: int, start: int, step: int) -> Value | None:
        """index' = start + step * index along `axis`."""
        if isinstance(v, Affine):
            k = v.coeff(axis)
            coeffs = tuple(sorted((a, c * step if a == axis else c) for a, c in v.coeffs))
            return Affine(v.ndim, coeffs, v.const + k * start)
        if isinstance(v, Const):
            return v
        if isinstance(v, Pred):
            e = _shift_expr(v.expr, axis, start, step)
            return Pred(v.ndim, e)
        return Select(v.ndim, self._shift_axis(v.pred, axis, start, step), v.a, v.b)

    def _arith(self, n: Node, rank: int) -> Value | None:
        x, y = self.value(n.args[0]), self.value(n.args[1])
        alpha = n.kwargs.get("alpha", 1)
        if x is None or y is None or alpha != 1:
            return None
        if is_op(n, aten.mul):
            for s, c in ((x, y), (y, x)):
                if isinstance(c, Const):
                    if isinstance(s, Affine) and float(c.value).is_integer():
                        k = int(c.value)
                        return Affine(rank, tuple((a, v * k) for a, v in s.coeffs if v * k), s.const * k)
                    if isinstance(s, Select):
                        return Select(rank, s.pred, s.a * c.value, s.b * c.value)
                    if isinstance(s, Const):
                        return Const(rank, s.value * c.value)
            return None
        sign = 1 if is_op(n, aten.add) else -1
        if isinstance(x, Select) and isinstance(y, Const):
            return Select(rank, x.pred, x.a + sign * y.value, x.b + sign * y.value)
        if isinstance(y, Select) and isinstance(x, Const) and sign == 1:
            return Select(rank, y.pred, y.a + x.value, y.b + x.value)
        if isinstance(x, Const) and isinstance(y, Const):
            return Const(rank, x.value + sign * y.value)
        ax, ay = _as_affine(x), _as_affine(y)
        if ax is None or ay is None:
            return None
        return _set_ndim(_affine_add(ax, ay, sign), rank)


def _symbolic(v: torch.SymInt) -> Affine:
    expr = v.node.expr
    return Affine(0, (), int(expr) if expr.is_number else v)


def _shift_expr(e, axis, start, step):
    if e[0] == "cmp":
        a = e[1]
        k = a.coeff(axis)
        coeffs = tuple(sorted((x, c * step if x == axis else c) for x, c in a.coeffs))
        return ("cmp", Affine(a.ndim, coeffs, a.const + k * start), e[2])
    if e[0] in ("and", "or"):
        return (e[0], _shift_expr(e[1], axis, start, step), _shift_expr(e[2], axis, start, step))
    if e[0] == "not":
        return ("not", _shift_expr(e[1], axis, start, step))
    return e


# ---- reading a predicate as a causal mask -------------------------------------------------

def _atom_causal_offset(e) -> int | None:
    """If `e` keeps key j for query i iff j <= i + offset, the offset; else None.

    Queries index the second-to-last axis (-2), keys the last (-1)."""
    if e[0] == "not":
        inner = e[1]
        if inner[0] == "cmp":
            negated = {"<=": ">", "<": ">=", ">=": "<", ">": "<="}.get(inner[2])
            return None if negated is None else _atom_causal_offset(("cmp", inner[1], negated))
        return None
    if e[0] != "cmp":
        return None
    a, op = e[1], e[2]
    if any(ax not in (-1, -2) for ax, _ in a.coeffs):
        return None
    ck, cq, c0 = a.coeff(-1), a.coeff(-2), a.const
    # normalise to  j - i + c0 OP 0
    if (ck, cq) == (-1, 1):
        c0, op = -c0, _FLIP[op]
    elif (ck, cq) != (1, -1):
        return None
    if op == "<=":  # j <= i - c0
        return -c0
    if op == "<":  # j < i - c0  <=>  j <= i - c0 - 1
        return -c0 - 1
    return None


def causal_offset_of_keep(keep: Pred | None) -> int | None:
    """The offset if `keep` is exactly `key <= query + offset`, else None."""
    if keep is None:
        return None
    return _atom_causal_offset(keep.expr)


def keep_of_additive(v: Value | None, score_dtype: torch.dtype) -> Pred | None:
    """For an additive mask that is 0 where kept and a 'minus infinity' where dropped, the
    keep predicate. A dropped value must send exp() to exactly 0 after the softmax's max
    subtraction: -inf, or at most the most negative float16 (HF uses finfo(dtype).min)."""
    if not isinstance(v, Select):
        return None
    floor = torch.finfo(torch.float16).min

    def dropped(x: float) -> bool:
        return x == -math.inf or x <= floor

    if v.a == 0.0 and dropped(v.b):
        return v.pred
    if v.b == 0.0 and dropped(v.a):
        return _not(v.pred)
    return None


def keep_predicate(node, interp: MaskInterpreter, *, kind: str, score_dtype: torch.dtype) -> Pred | None:
    """Which keys a mask node keeps (`kind` "additive", "keep" (True keeps) or "drop"), if known."""
    v = interp.value(node)
    if v is None:
        return None
    if kind == "additive":
        if isinstance(v, Const):
            return Pred(v.ndim, ("true",)) if v.value == 0.0 else None
        return keep_of_additive(v, score_dtype)
    p = _to_pred(v)
    return p if kind == "keep" or p is None else _not(p)


def causal_offset(node, interp: MaskInterpreter, *, kind: str, score_dtype: torch.dtype) -> int | None:
    """Offset of a causal mask node (`kind` "additive", "keep" (True keeps) or "drop"), else None."""
    return causal_offset_of_keep(keep_predicate(node, interp, kind=kind, score_dtype=score_dtype))


def keeps_everything(node, interp: MaskInterpreter, *, kind: str, score_dtype: torch.dtype) -> bool:
    """Whether a mask node provably keeps every key for every query (e.g. one query token
    over the whole cache): such a mask can be dropped."""
    keep = keep_predicate(node, interp, kind=kind, score_dtype=score_dtype)
    return keep is not None and keep.expr == ("true",)
