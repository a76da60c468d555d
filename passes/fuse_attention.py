"""fuse_attention: every form of softmax(q k^T * scale + mask) v -> metainfer::attention.

The forms models write (eager matmul/softmax/matmul with casts, scales, GQA repeat_kv, masks
and soft-capping; SDPA and its backend ops) are read into one canonical `Site` by
`attention_forms`; this pass proves what the op can take of each site and rewrites it.

Masks built inside the graph are proven causal, or causal with a sliding window (keys
i + offset - W < j <= i + offset), by `mask_analysis` and dropped in favour of the kernel's
causal flag and window; any other mask is passed to the op as a tensor. K/V are passed
un-repeated, so GQA costs no copies. The pass does not fire when an intermediate (the
scores or probabilities) has another user, when there is dropout, or when shapes, dtypes,
scales or masks fall outside what the op computes; such near misses go to the report.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from metainfer.kernels.attention import MAX_HEAD_DIM

from . import mask_analysis as ma
from .attention_forms import SDPA_OPS, NearMiss, Operand, Site, read, strip_gqa
from .base import MatchPass, register
from .matching import (
    Node, aten, dtype, insert_call, location, maybe_same, rehome_size_reads, same, shape, sizes_available,
    sym_size_available,
)

__all__ = ["FuseAttention", "match_site", "rewrite", "describe"]


@register
class FuseAttention(MatchPass):
    """softmax(q k^T * scale + mask) v (eager and SDPA forms) -> metainfer::attention"""

    name = "fuse_attention"
    cost_gated = True
    missed = "attention not fused"
    misses = (NearMiss,)

    def start(self, graph, ctx):
        return ma.MaskInterpreter()

    def match(self, node, interp):
        return match_site(node, interp)

    def rewrite(self, node, m, interp):
        rewrite(node.graph, m)

    def describe(self, node, m):
        return describe(m, node)

    def notes(self, m):
        return m.misses


def match_site(node: Node, interp: ma.MaskInterpreter) -> Site | None:
    """The attention whose last node is `node` (the p @ v bmm or an SDPA op), read and proven
    rewritable; None if it is not one, NearMiss if it is one the op cannot compute."""
    site = read(node)
    if site is None:
        return None
    _resolve_masks(site, interp)
    strip_gqa(site)
    _check_fits(site)
    _check_sizes_bindable(site)
    return site


# ---- proofs ----------------------------------------------------------------------------

def _resolve_masks(m: Site, interp: ma.MaskInterpreter) -> None:
    """The written masks as the op takes them: dropped where proven to keep every key, a
    causal flag (offset, window) where proven a band, else one tensor."""
    bands, tensors, dropped = [], [], 0  # bands: (node, kind, offset, window) proven in the graph
    score_dtype = m.score_dtype
    for node, kind in m.mask_parts:
        if ma.keeps_everything(node, interp, kind=kind, score_dtype=score_dtype):
            dropped += 1
            continue
        found = ma.causal_window(node, interp, kind=kind, score_dtype=score_dtype)
        if found is not None and not isinstance(found[1], int):
            m.misses.append(f"sliding-window mask {node.name} passed as a tensor: its width {found[1]} is not a "
                            "constant")
            found = None
        if found is None:
            tensors.append((node, kind))
        else:
            bands.append((node, kind, *found))
    if dropped:
        m.notes.append("a mask that keeps every key (proven) dropped")
    if bands:
        off, window = _intersect([(o, w) for _, _, o, w in bands])
        why = _unusable_band(off, window, m)
        if why is None:
            m.causal, m.causal_offset, m.window = True, off, window
            m.notes.append(f"causal, offset {off}" + (f", sliding window {window}" if window else "")
                           + " (mask built in the graph, proven)")
        else:
            if window:
                m.misses.extend(f"sliding-window mask {n.name} passed as a tensor: {why}" for n, *_ in bands)
            tensors += [(n, kind) for n, kind, _, _ in bands]
    if len(tensors) > 1:
        raise NearMiss(f"{len(tensors)} separate masks on the scores; the op takes one")
    if tensors:
        node, kind = tensors[0]
        if kind != "additive" and dtype(node) != torch.bool:
            raise NearMiss(f"where() condition of dtype {dtype(node)}")
        m.mask, m.mask_negate = node, kind == "drop"
        m.notes.append(f"{'additive' if kind == 'additive' else 'boolean'} mask {_fmt_shape(shape(node))}")
    if not m.causal and m.mask is None:
        m.notes.append("no mask")


def _const_diff(a, b) -> int | None:
    """a - b for sizes (ints or SymInts) whose difference is a constant, else None."""
    d = a - b
    if isinstance(d, int):
        return d
    e = d.node.expr
    return int(e) if e.is_Integer else None


def _intersect(bands: list[tuple]) -> tuple:
    """(offset, window) of what several causal / sliding-window masks keep together: the
    lowest diagonal and the highest window start (keys i + lower <= j <= i + upper)."""
    ref = bands[0][0]
    rel = [_const_diff(o, ref) for o, _ in bands]
    if any(r is None for r in rel):
        raise NearMiss(f"several causal masks with offsets {[str(o) for o, _ in bands]} that differ by a size")
    upper = min(rel)
    off = bands[rel.index(upper)][0]
    lowers = [r - w + 1 for r, (_, w) in zip(rel, bands) if w]
    if not lowers:
        return off, 0
    window = upper - max(lowers) + 1
    if window < 1:
        raise NearMiss("the causal and sliding-window masks together keep no key")
    return off, window


def _unusable_band(off, window, m: Site) -> str | None:
    """Why a proven causal (sliding-window) mask cannot become the op's causal flag (and window),
    None if it can. With a finite fill (HF's finfo.min) a query row that keeps no key is uniform
    in eager code and NaN in the op, so every row must provably keep one: offset >= 0 (row 0
    keeps key 0) and, with a window, offset + Sq <= Sk + window - 1 (the last row's window
    reaches a key)."""
    if not _usable_offset(off, m):
        return f"its offset {off} is not provably >= 0 or not computable outside the attention"
    if window:
        B, Hq, Sq, D, Hkv, Sk, Dv, _, _ = m.dims()
        if not statically_known_true(off + Sq <= Sk + window - 1):
            return (f"cannot prove every query row keeps a key (offset {off} + {Sq} queries <= {Sk} keys + "
                    f"{window - 1})")
    return None


def _usable_offset(off, m: Site) -> bool:
    """A causal offset the op can take instead of the mask: provably >= 0, so every query row
    keeps key 0 (with a finfo.min fill an empty row would not be NaN), and, if symbolic,
    computable from sizes the graph has outside what the op replaces."""
    if off is None or not (same(off, 0) or statically_known_true(off >= 0)):
        return False
    return sym_size_available(m.anchor.graph, m.anchor, off, m.region)


def _check_fits(m: Site) -> None:
    B, Hq, Sq, D, Hkv, Sk, Dv, ks, vs = m.dims()
    dts = {dtype(m.q.node), dtype(m.k.node), dtype(m.v.node)}
    if len(dts) != 1:
        raise NearMiss(f"q, k, v have different dtypes {sorted(map(str, dts))}")
    dt = dts.pop()
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise NearMiss(f"dtype {dt} is not supported by the attention op")
    if not (isinstance(D, int) and isinstance(Dv, int)) or D > MAX_HEAD_DIM or Dv > MAX_HEAD_DIM:
        raise NearMiss(f"head dims q/k {D}, v {Dv}: the op supports up to {MAX_HEAD_DIM}")
    # K and V read from a growing cache are separate graph inputs, each with its own symbolic
    # length: equal lengths (and batches) need only be possible here, as the op checks them
    # on every call and eager code would fail on a mismatch too
    if not (same(ks[3], D) and maybe_same(vs[2], Sk) and same(vs[1], Hkv)):
        raise NearMiss(f"q/k/v shapes do not line up: q {_fmt_shape(shape(m.q.node))}, "
                       f"k {_fmt_shape(ks)}, v {_fmt_shape(vs)}")
    if not same(vs[2], Sk):
        m.notes.append("k/v lengths equal at run time (checked by the op)")
    if not (isinstance(Hq, int) and isinstance(Hkv, int)) or Hq % Hkv:
        raise NearMiss(f"{Hq} query heads are not a multiple of {Hkv} kv heads")
    for name, op, s in (("k", m.k, ks), ("v", m.v, vs)):
        if not maybe_same(s[0], B) and op.expand_batch is None:
            raise NearMiss(f"{name} batch {s[0]} != q batch {B}")


def _check_sizes_bindable(m: Site) -> None:
    """Every symbolic size the rewrite will put in the graph can be read outside the region
    it removes (checked before the graph is touched)."""
    B, Hq, Sq, D, Hkv, Sk, Dv, _, _ = m.dims()
    needed = [m.causal_offset]
    if m.replace_3d:
        needed.append([B * Hq, Sq, Dv])
    for op in (m.q, m.k, m.v):
        if op.expand_batch is not None:
            needed.append(op.expand_batch)
    if not sizes_available(m.anchor.graph, m.anchor, needed, m.region):
        raise NearMiss("a symbolic size the fused op needs is not available outside the attention")


# ---- rewrite ---------------------------------------------------------------------------

def _materialise(graph, m: Site, op: Operand) -> Node:
    n = op.node
    if m.unsqueeze_batch:
        n = insert_call(graph, m.anchor, aten.unsqueeze.default, (n, 0))
    if op.transpose:
        n = insert_call(graph, m.anchor, aten.permute.default, (n, [0, 1, 3, 2]))
    if op.expand_batch is not None:
        s = shape(n)
        n = insert_call(graph, m.anchor, aten.expand.default, (n, [op.expand_batch, *s[1:]]), exclude=m.region)
    return n


def rewrite(graph, m: Site) -> None:
    rehome_size_reads(graph, m.region)
    q, k, v = (_materialise(graph, m, x) for x in (m.q, m.k, m.v))
    mask = m.mask
    if mask is not None and m.mask_negate:
        mask = insert_call(graph, m.anchor, aten.logical_not.default, (mask,))
    args = (q, k, v, mask, float(m.scale), bool(m.causal), m.causal_offset, m.zero_empty_rows)
    if m.softcap or m.window:  # the op's optional arguments, left out where they are the defaults
        args += (float(m.softcap), int(m.window))
    out = insert_call(graph, m.anchor, torch.ops.metainfer.attention.default, args, exclude=m.region)
    for r in m.replace:
        r.replace_all_uses_with(out)
    for r in m.replace_3d:
        B, Hq, Sq, Dv = shape(out)
        flat = insert_call(graph, m.anchor, aten.reshape.default, (out, [B * Hq, Sq, Dv]), exclude=m.region)
        r.replace_all_uses_with(flat)
    if m.anchor.target in SDPA_OPS:
        # SDPA ops are tagged random (dropout): dead-code elimination would keep them
        erased = set()
        for n in [*m.replace, *list(m.anchor.users), m.anchor]:
            if n not in erased and not n.users:
                graph.erase_node(n)
                erased.add(n)


def _fmt_shape(s) -> str:
    return "[" + ", ".join(str(x) for x in (s or ())) + "]"


def describe(m: Site, node: Node) -> str:
    B, Hq, Sq, D, Hkv, Sk, Dv, _, _ = m.dims()
    v = f", v dim {Dv}" if not same(Dv, D) else ""
    return (f"{location(node)}: {m.form} attention -> metainfer.attention "
            f"({Hq} q heads / {Hkv} kv heads x {D}{v}, {Sq} x {Sk} tokens, scale {m.scale:.4g}; {'; '.join(m.notes)})")
