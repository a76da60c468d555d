"""sparse_mla: dense attention under DSA's "top-k folded into the mask" -> metainfer::sparse_attention.

DeepSeek Sparse Attention selects `index_topk` keys per query with its lightning indexer.
The fallback scatters the selection into a dense (B, S, T) mask (fill everywhere but the
selected keys) and runs dense attention: O(S x T) work for O(S x topk) useful keys. The op
attends only to the selected indices; the rest of the mask (causal, padding) is read at the
selected positions only.

Mask forms recognised on a fused attention's mask (after fuse_attention / mla_prefill):
- additive: scatter(full(fill), -1, idx, 0) [+ base]  (DeepSeek's reference code, fill -inf);
- additive: where(scatter(full(True), -1, idx, False), fill, base)  (transformers, fill finfo.min);
- boolean keep: base & ~scatter(full(True), -1, idx, False), possibly turned additive by
  where(keep, 0, -inf)  (transformers with boolean masks / SDPA).
`idx` must be `topk(...).indices` over the key dimension (distinct indices: a pure
selection); any other scatter is left alone. A finite fill (finfo.min) makes a query row
whose selected keys are all masked attend to every key, as the dense form does; the op
recomputes such rows densely (see metainfer.kernels.sparse_attention.fix_unselected_rows).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch


from . import base
from .base import MatchPass, register
from .matching import (
    CONVERT_OPS, Node, aten, arg, constant_value, dtype, insert_call, is_op, location, maybe_same, ndim, same, shape, uncast,
)

_FLOOR = torch.finfo(torch.float16).min  # a fill at or below this drops a key exactly


class NotSelection(base.NearMiss):
    """A scatter that looks like DSA's but is not a pure top-k selection; the message says why."""


@register
class SparseMLA(MatchPass):
    """dense attention with a scattered top-k mask (DSA fallback) -> metainfer::sparse_attention"""

    name = "sparse_mla"
    missed = "sparse attention not used"
    misses = (NotSelection,)

    def match(self, node, state):
        if node.target is not torch.ops.metainfer.attention.default or node.args[3] is None:
            return None
        found = split_mask(node.args[3])
        if found is None:
            return None
        if (arg(node, 8, "softcap", 0.0), arg(node, 9, "window", 0)) != (0.0, 0):
            raise NotSelection("the attention is soft-capped or windowed, which metainfer.sparse_attention does "
                               "not compute")
        sel = found[0]
        q, k = node.args[:2]
        B, _, Sq, _ = shape(q)
        if not (same(sel.keys, shape(k)[2]) and maybe_same(shape(sel.idx)[0], B) and maybe_same(shape(sel.idx)[1], Sq)):
            raise NotSelection(f"selection over {sel.keys} keys, indices {list(shape(sel.idx))}, for q {list(shape(q))} "
                               f"and k {list(shape(k))}")
        return list(found)  # [selection, base mask, fill]; rewrite may lift the base mask to 4-D

    def rewrite(self, node, found, state):
        q, k, v, mask, scale, causal, offset, zero_empty = node.args[:8]
        sel, base, fill = found
        if base is not None and len(shape(base)) == 3:  # (B, S, T) from inside unsqueeze(., 1)
            base = found[1] = insert_call(state.graph, node, aten.unsqueeze.default, (base, 1))
        new = insert_call(state.graph, node, torch.ops.metainfer.sparse_attention.default,
                          (q, k, v, sel.idx, base, scale, causal, offset, zero_empty, fill))
        node.replace_all_uses_with(new)

    def describe(self, node, found):
        sel, base, fill = found
        q, k = node.args[:2]
        fix = "" if fill == -math.inf else f"; unselected keys filled with {fill:.3g}: fully masked rows recomputed densely"
        return (f"{location(node)}: top-{sel.k} selection folded into a dense mask -> metainfer.sparse_attention "
                f"({shape(q)[2]} queries x {sel.k} selected keys instead of x {shape(k)[2]}; base mask "
                f"{'none' if base is None else list(shape(base))}{fix})")


def _views(n):
    """(n without dtype-keeping casts, broadcasting expands and one unsqueeze(., 1), lifted):
    `lifted` says a (B, S, T) tensor was lifted to (B, 1, S, T) on the way."""
    lifted = False
    while True:
        if is_op(n, aten.unsqueeze) and n.args[1] == 1 and ndim(n.args[0]) == 3 and not lifted:
            lifted = True
        elif not (is_op(n, aten.expand) and ndim(n) == ndim(n.args[0])) and \
                not (is_op(n, *CONVERT_OPS) and dtype(n) == dtype(n.args[0])):
            return n, lifted
        n = n.args[0]


@dataclass
class Selection:
    idx: Node  # the topk indices (B, S, k)
    fill: float  # the value unselected keys get
    k: object  # top-k (an int or a symbolic size)
    lifted: bool | None  # lifted to (B, 1, S, T) on its own path; None: lifted twice
    keys: object  # T, the key dim the selection spans


def _scatter_selection(n, fill_pred, value) -> Selection | None:
    """scatter(full((B, S, T), fill), -1, idx, value) with idx = topk indices over T; None if n
    is not a scatter into a full; NotSelection if it is one but not a pure top-k selection."""
    n, lifted = _views(n)
    if not is_op(n, aten.scatter):
        return None
    if n.target is not aten.scatter.value or n.kwargs.get("reduce") is not None:
        raise NotSelection(f"{n.target} is not a plain scatter of one value (a reduce or a source tensor)")
    full, dim, idx, val = n.args[:4]
    if not (is_op(full, aten.full) and len(shape(full)) == 3):
        return None
    fill = full.args[1]
    if not fill_pred(fill) or val != value:
        return None
    if dim not in (-1, 2):
        raise NotSelection(f"the scatter runs along dim {dim}, not the key dim")
    topk_node = uncast(idx)
    if not (topk_node.target is operator.getitem and topk_node.args[1] == 1 and is_op(topk_node.args[0], aten.topk)):
        raise NotSelection("the scattered indices do not come from topk (duplicates would not be a selection)")
    tk = topk_node.args[0]
    tk_dim = tk.args[2] if len(tk.args) > 2 else tk.kwargs.get("dim", -1)
    src = tk.args[0]
    if tk_dim not in (-1, len(shape(src)) - 1) or not maybe_same(shape(src)[-1], shape(full)[-1]):
        raise NotSelection("topk does not select over the key dim")
    if tuple(shape(idx)) != tuple(shape(topk_node)) or not maybe_same(shape(idx)[0], shape(full)[0]):
        raise NotSelection("the indices' shape does not match the mask's")
    return Selection(topk_node, fill, shape(topk_node)[-1], lifted, shape(full)[-1])


def _is_drop_fill(c) -> bool:
    return isinstance(c, (int, float)) and not isinstance(c, bool) and c <= _FLOOR


def _drop_selection(n):
    """scatter(full(True), -1, idx, False): True where a key is NOT selected."""
    return _scatter_selection(n, lambda c: c is True, False)


def _keep_selection(n):
    """~drop_selection, or scatter(full(False), -1, idx, True): True where selected."""
    m, lifted = _views(n)
    if is_op(m, aten.bitwise_not, aten.logical_not):
        sel = _drop_selection(m.args[0])
    else:
        sel = _scatter_selection(m, lambda c: c is False, True)
    if sel is not None and lifted:
        sel.lifted = None if sel.lifted else True  # None: lifted twice, not a (B, 1, S, T) mask
    return sel


def _tensor(n) -> bool:
    return isinstance(n, Node) and shape(n) is not None


def split_mask(mask: Node):
    """(selection, base mask or None, fill of unselected keys) if `mask` (4-D, broadcast to
    (B, H, S, T)) is a top-k selection folded into a mask, else None. The selection is a
    (B, S, T) tensor lifted by exactly one unsqueeze(., 1); a base read from inside that lift
    is (B, S, T) or narrower (the caller lifts it again)."""
    if ndim(mask) != 4:
        return None
    m, lifted = _views(mask)
    found = _split(m) if dtype(m) != torch.bool else _split_keep(m, -math.inf)
    if found is None:
        return None
    sel, base, fill = found
    if sel.lifted is None or int(lifted) + int(bool(sel.lifted)) != 1:
        raise NotSelection("the (batch, query, key) selection is not lifted to (batch, 1, query, key) once")
    if base is not None and not _tensor(base):
        return None  # a scalar shift: not a mask to pass on
    return sel, base, fill


def _split(m):
    if is_op(m, aten.add):
        if m.kwargs.get("alpha", 1) != 1:
            return None
        for a, b in ((m.args[0], m.args[1]), (m.args[1], m.args[0])):
            sel = _scatter_selection(a, _is_drop_fill, 0)
            if sel is not None:
                if sel.fill != -math.inf:  # fill + base at unselected keys: not one value
                    raise NotSelection(f"an additive selection with finite fill {sel.fill:.3g} plus a base mask")
                return sel, b, -math.inf
        return None
    sel = _scatter_selection(m, _is_drop_fill, 0)
    if sel is not None:
        return sel, None, float(sel.fill)
    if is_op(m, aten.where):
        cond, a, b = m.args
        ca, cb = constant_value(a), constant_value(b)
        if ca is not None and _is_drop_fill(ca):  # where(drop_selection, fill, base)
            sel = _drop_selection(cond)
            if sel is not None:
                return sel, b, float(ca)
        if ca == 0 and cb is not None and _is_drop_fill(cb):  # where(keep, 0, fill): bool made additive
            return _split_keep(cond, float(cb))
    return None


def _split_keep(keep: Node, fill: float):
    keep, lifted = _views(keep)
    sel = _keep_selection(keep)
    base = None
    if sel is None and is_op(keep, aten.bitwise_and, aten.logical_and):
        for a, b in ((keep.args[0], keep.args[1]), (keep.args[1], keep.args[0])):
            sel = _keep_selection(a)
            if sel is not None and dtype(b) == torch.bool:
                base = b
                break
            sel = None
    if sel is None:
        return None
    if lifted:
        sel.lifted = None if sel.lifted else True
    return sel, base, fill
