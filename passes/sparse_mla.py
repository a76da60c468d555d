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

import torch

from metainfer.lowering import ops  # noqa: F401  (registers torch.ops.metainfer.*)

from .base import Pass, PassContext, PassResult, register
from .matching import CONVERT_OPS, Node, aten, constant_value, dtype, insert_call, is_op, location, maybe_same, shape

_FLOOR = torch.finfo(torch.float16).min  # a fill at or below this drops a key exactly


class NotSelection(Exception):
    """A scatter that looks like DSA's but is not a pure top-k selection; the message says why."""


@register
class SparseMLA(Pass):
    """dense attention with a scattered top-k mask (DSA fallback) -> metainfer::sparse_attention"""

    name = "sparse_mla"

    def run(self, graph, ctx: PassContext) -> PassResult:
        res = PassResult(modified=False)
        for node in list(graph.nodes):
            if node.target is not torch.ops.metainfer.attention.default:
                continue
            q, k, v, mask, scale, causal, offset, zero_empty = node.args
            if mask is None:
                continue
            try:
                found = split_mask(mask)
            except NotSelection as e:
                res.near_misses.append(f"{location(node)}: sparse attention not used: {e}")
                continue
            if found is None:
                continue
            idx, base, fill, topk = found
            if base is not None and len(shape(base)) == 3:  # (B, S, T) from inside unsqueeze(., 1)
                base = insert_call(graph, node, aten.unsqueeze.default, (base, 1))
            B, _, Sq, _ = shape(q)
            if not (maybe_same(shape(idx)[0], B) and maybe_same(shape(idx)[1], Sq)):
                res.near_misses.append(f"{location(node)}: sparse attention not used: indices "
                                       f"{list(shape(idx))} do not match queries {list(shape(q))}")
                continue
            new = insert_call(graph, node, torch.ops.metainfer.sparse_attention.default,
                              (q, k, v, idx, base, scale, causal, offset, zero_empty, fill))
            node.replace_all_uses_with(new)
            res.matches += 1
            Sk = shape(k)[2]
            fix = "" if fill == -math.inf else f"; unselected keys filled with {fill:.3g}: fully masked rows recomputed densely"
            res.decisions.append(
                f"{location(node)}: top-{topk} selection folded into a dense mask -> metainfer.sparse_attention "
                f"({Sq} queries x {topk} selected keys instead of x {Sk}; base mask "
                f"{'none' if base is None else list(shape(base))}{fix})")
        res.modified = res.matches > 0
        return res


def _views(n):
    """Look through unsqueeze(., 1) and expands that only broadcast (the selection is (B, S, T))."""
    while is_op(n, aten.unsqueeze, aten.expand, *CONVERT_OPS):
        if is_op(n, aten.unsqueeze) and n.args[1] != 1:
            return n
        if is_op(n, *CONVERT_OPS) and dtype(n) != dtype(n.args[0]):
            return n
        n = n.args[0]
    return n


def _scatter_selection(n, fill_pred, value):
    """(idx, fill, topk) if n is scatter(full((B, S, T), fill), -1, idx, value) with idx = topk
    indices over T; None if n is not a scatter into a full; NotSelection if it is one but not a
    pure top-k selection."""
    n = _views(n)
    if not is_op(n, aten.scatter):
        return None
    full, dim, idx, val = n.args[:4]
    if not (is_op(full, aten.full) and len(shape(full)) == 3):
        return None
    fill = full.args[1]
    if not fill_pred(fill) or val != value:
        return None
    if dim not in (-1, 2):
        raise NotSelection(f"the scatter runs along dim {dim}, not the key dim")
    topk_node = idx
    while is_op(topk_node, *CONVERT_OPS):
        topk_node = topk_node.args[0]
    if not (topk_node.target is operator.getitem and topk_node.args[1] == 1 and is_op(topk_node.args[0], aten.topk)):
        raise NotSelection("the scattered indices do not come from topk (duplicates would not be a selection)")
    tk = topk_node.args[0]
    tk_dim = tk.args[2] if len(tk.args) > 2 else tk.kwargs.get("dim", -1)
    src = tk.args[0]
    if tk_dim not in (-1, len(shape(src)) - 1) or not maybe_same(shape(src)[-1], shape(full)[-1]):
        raise NotSelection("topk does not select over the key dim")
    if tuple(shape(idx)) != tuple(shape(topk_node)) or not maybe_same(shape(idx)[0], shape(full)[0]):
        raise NotSelection("the indices' shape does not match the mask's")
    return topk_node, fill, shape(topk_node)[-1]


def _is_drop_fill(c) -> bool:
    return isinstance(c, (int, float)) and not isinstance(c, bool) and c <= _FLOOR


def _drop_selection(n):
    """scatter(full(True), -1, idx, False): True where a key is NOT selected."""
    return _scatter_selection(n, lambda c: c is True, False)


def _keep_selection(n):
    """~drop_selection, or scatter(full(False), -1, idx, True): True where selected."""
    m = _views(n)
    if is_op(m, aten.bitwise_not, aten.logical_not):
        return _drop_selection(m.args[0])
    return _scatter_selection(m, lambda c: c is False, True)


def split_mask(mask: Node):
    """(topk indices node, base mask or None, fill of unselected keys, k) if `mask` is a
    top-k selection folded into a mask, else None. A base mask read from inside an
    unsqueeze(., 1) of a (B, S, T) combination is returned as (B, S, T): see `base_4d`."""
    m = _views(mask)
    if dtype(m) == torch.bool:
        return _split_keep(m, fill=-math.inf)
    # additive
    if is_op(m, aten.add):
        for sel, base in ((m.args[0], m.args[1]), (m.args[1], m.args[0])):
            got = _scatter_selection(sel, _is_drop_fill, 0)
            if got is not None:
                idx, fill, k = got
                return idx, base, float(fill), k
        return None
    got = _scatter_selection(m, _is_drop_fill, 0)
    if got is not None:
        idx, fill, k = got
        return idx, None, float(fill), k
    if is_op(m, aten.where):
        cond, a, b = m.args
        ca, cb = constant_value(a), constant_value(b)
        if ca is not None and _is_drop_fill(ca):  # where(drop_selection, fill, base)
            got = _drop_selection(cond)
            if got is not None:
                idx, _, k = got
                return idx, b, float(ca), k
        if ca == 0 and cb is not None and _is_drop_fill(cb):  # where(keep, 0, fill): bool made additive
            return _split_keep(cond, fill=float(cb))
    return None


def _split_keep(keep: Node, fill: float):
    got = _keep_selection(keep)
    if got is not None:
        idx, _, k = got
        return idx, None, fill, k
    if is_op(keep, aten.bitwise_and, aten.logical_and):
        for sel, base in ((keep.args[0], keep.args[1]), (keep.args[1], keep.args[0])):
            got = _keep_selection(sel)
            if got is not None and dtype(base) == torch.bool:
                idx, _, k = got
                return idx, base, fill, k
    return None
