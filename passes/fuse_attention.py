"""fuse_attention: every form of softmax(q k^T * scale + mask) v -> metainfer::attention.

Forms recognised (post-grad ATen):
- eager: bmm(softmax(scale * bmm(q, k^T) [+ mask | where(keep, ., -inf)]), v), with the
  expand/reshape that `matmul` decomposes into, dtype casts around the softmax (HF's
  float32 softmax), the scale as mul or div on the scores, GQA `repeat_kv`
  (unsqueeze/expand/reshape) or broadcasting of single-head K/V, masks added or
  applied with `where`, and logit soft-capping before the mask (Gemma 2:
  c * tanh(scores / c); any positive factors inside and outside the tanh, read as
  softcap = the factor outside, scale = softcap x the factors inside);
- SDPA: `scaled_dot_product_attention` and its backend ops (flash/efficient/cudnn/CPU),
  with an explicit mask or `is_causal`.

Masks built inside the graph are proven causal, or causal with a sliding window (keys
i + offset - W < j <= i + offset), by `mask_analysis` and dropped in favour of the kernel's
causal flag and window; any other mask is passed to the op as a tensor. K/V are passed
un-repeated, so GQA costs no copies. The pass does not fire when an intermediate (the
scores or probabilities) has another user, when there is dropout, or when shapes, dtypes,
scales or masks fall outside what the op computes; such near misses go to the report.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.operator_schemas import normalize_function

from metainfer.kernels.attention import MAX_HEAD_DIM

from . import base
from . import mask_analysis as ma
from .base import MatchPass, register
from .matching import (
    CONVERT_OPS, VIEW_OPS, Node, aten, constant_value, dtype, insert_call, is_noop_view,
    is_op, is_reshape, is_scalar, peel, rehome_size_reads, size_reads_rehomable, skip_noop_views,
    location, maybe_same, ndim, reduces_last_dim, same, same_shape, shape, sizes_available, sym_size_available,
    uncast, untransposed, escaping_uses,
)

SDPA_OPS = {
    aten.scaled_dot_product_attention.default: "sdpa",
    aten._scaled_dot_product_flash_attention_for_cpu.default: "sdpa (cpu flash)",
    aten._scaled_dot_product_flash_attention.default: "sdpa (flash)",
    aten._scaled_dot_product_efficient_attention.default: "sdpa (efficient)",
    aten._scaled_dot_product_cudnn_attention.default: "sdpa (cudnn)",
}
_NEG_INF_FLOOR = torch.finfo(torch.float16).min  # fill values at or below this drop a key exactly


class NearMiss(base.NearMiss):
    """Attention recognised, but not rewritten; the message says why."""


@dataclass
class Operand:
    """A 4-D (batch, heads, seq, dim) tensor feeding the op, and how to get it."""

    node: Node
    transpose: bool = False  # node holds the last two dims swapped (k^T)
    expand_batch: int | None = None  # broadcast batch of size 1 to this


@dataclass
class Match:
    form: str
    anchor: Node  # inserted before this node
    replace: list[Node]  # nodes whose uses the 4-D output replaces
    replace_3d: list[Node]  # nodes (bmm outputs) whose uses a 3-D view of it replaces
    q: Operand
    k: Operand
    v: Operand
    scale: float
    causal: bool = False
    causal_offset: int = 0
    mask: Node | None = None
    mask_negate: bool = False  # mask is a "drop" predicate: pass logical_not(mask)
    softcap: float = 0.0  # scores -> softcap * tanh(scores / softcap) before the mask (0: none)
    window: int = 0  # sliding window on top of the causal mask (0: none)
    unsqueeze_batch: bool = False  # operands were 3-D (batch*heads, seq, dim)
    zero_empty_rows: bool = False  # SDPA's convention for query rows with no key kept
    notes: list[str] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)  # a faster form not taken (the op still fires)
    region: set[Node] = field(default_factory=set)  # nodes the op replaces (size reads rehomed)


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


def match_site(node: Node, interp: ma.MaskInterpreter) -> Match | None:
    """The attention whose last node is `node` (the p @ v bmm or an SDPA op), None if it is
    not one; NearMiss if it is one that cannot be rewritten."""
    if is_op(node, aten.bmm):
        return _match_eager(node, interp)
    if node.target in SDPA_OPS:
        return _match_sdpa(node, interp)
    return None


# ---- eager form ------------------------------------------------------------------------

def _match_eager(pv: Node, interp: ma.MaskInterpreter) -> Match | None:
    p3, v3 = pv.args[0], pv.args[1]
    p4, p_views = _peel(p3)
    probs_region = [pv, *p_views]
    probs = p4 if p4 is not None else p3
    probs, casts = peel(probs, CONVERT_OPS)
    safe = _safe_softmax(probs)
    if safe is not None:  # SDPA's math decomposition: rows with every key masked give 0
        probs, safe_nodes = safe
        casts += safe_nodes
    sm = _softmax(probs)
    if sm is None:
        return None  # not attention
    logits, sm_nodes = sm
    if safe is not None and safe_nodes[-1].args[0] is not logits:
        return None
    probs_region += casts + sm_nodes[:1]
    region = probs_region + sm_nodes[1:]

    scale, softcap, masks, keeps, chain, qk = _parse_scores(logits)
    region += chain
    a3, b3 = qk.args[0], qk.args[1]
    q4, q_views = _peel(a3)
    kt4, k_views = _peel(b3)
    # SDPA's math decomposition scales q and k^T by sqrt(scale) each
    q4, q_views, scale = _unscale(q4, q_views, scale, region)
    kt4, k_views, scale = _unscale(kt4, k_views, scale, region)
    v4, v_views = _peel(v3)
    three_d = q4 is None or kt4 is None or v4 is None
    if three_d:
        if not (p4 is None and all(ndim(x) == 3 for x in (a3, b3, v3))):
            raise NearMiss("could not follow q, k or v back to 4-D (batch, heads, seq, dim) tensors")
        q, kt, v = Operand(a3), Operand(b3), Operand(v3)
    else:
        # every 3-D (batch*heads) tensor must split into the same (batch, heads) as q
        bh = shape(q4)[:2]
        splits = [shape(t)[:2] for t in (kt4, v4, p4)] + [shape(n)[:2] for n in chain if ndim(n) == 4]
        if not all(same_shape(s, bh) for s in splits):
            raise NearMiss("the batch*heads dim is split differently on q, k, v, scores or probabilities")
        q, kt, v = _operand(q4, q_views), _operand(kt4, k_views), _operand(v4, v_views)

    # k^T -> k (reuse the transpose the model wrote, else add one)
    if ndim(kt.node) in (3, 4) and untransposed(kt.node) is not None:
        k = Operand(untransposed(kt.node), expand_batch=kt.expand_batch)
    else:
        k = Operand(kt.node, transpose=True, expand_batch=kt.expand_batch)

    _check_exclusive(region, probs=set(probs_region), allowed_exit=pv)
    m = Match(form="eager" if safe is None else "sdpa (math)", anchor=pv, replace=[], replace_3d=[], q=q, k=k,
              v=v, scale=scale, softcap=softcap, unsqueeze_batch=three_d, region=set(region) - {pv},
              zero_empty_rows=safe is not None)
    if softcap:
        m.notes.append(f"soft-capped at {softcap:.4g}")
    _resolve_masks(m, masks, keeps, interp, score_dtype=dtype(logits))
    _strip_gqa(m)
    _check_fits(m)
    # outputs: reshape(pv) to 4-D users get the 4-D result; anything else a 3-D view
    out_shape = _out_shape(m)
    for u in list(pv.users):
        # a (batch*heads) -> (batch, heads) reshape of the output, in q's order
        if not three_d and is_reshape(u) and same_shape(shape(u), out_shape):
            m.replace.append(u)
    if len(m.replace) != len(pv.users):
        m.replace_3d.append(pv)
    _check_sizes_bindable(m)
    return m


def _peel(n: Node) -> tuple[Node | None, list[Node]]:
    """A 3-D bmm operand (N, S, D) made by reshaping a 4-D (B, H, S, D) tensor: that tensor,
    after dropping no-op clones/expands (broadcasting expands are kept for `_operand`)."""
    s3 = shape(n)
    if not is_reshape(n) or s3 is None or len(s3) != 3:
        return None, []
    t = n.args[0]
    s4 = shape(t)
    if s4 is None or len(s4) != 4 or not (same(s4[0] * s4[1], s3[0]) and same(s4[2], s3[1])
                                            and same(s4[3], s3[2])):
        return None, []
    t, noops = peel(t, is_noop_view)
    return t, [n, *noops]


def _operand(t: Node, views: list[Node]) -> Operand:
    """Look through a broadcasting expand of the batch or head dim (size 1 -> B or H)."""
    if is_op(t, aten.expand) and ndim(t.args[0]) == 4:
        src, full = shape(t.args[0]), shape(t)
        if same(src[2], full[2]) and same(src[3], full[3]):
            batch = None if same(src[0], full[0]) else full[0] if same(src[0], 1) else False
            heads_ok = same(src[1], full[1]) or same(src[1], 1)
            if batch is not False and heads_ok:
                return Operand(t.args[0], expand_batch=batch)
    return Operand(t)


def _softmax(p: Node) -> tuple[Node, list[Node]] | None:
    """softmax over the last dim: (its input, the nodes computing it), else None."""
    r = ndim(p)
    if r is None:
        return None
    if is_op(p, aten._softmax, aten._safe_softmax):
        d = p.args[1]
        return (p.args[0], [p]) if isinstance(d, int) and (d == -1 or d == r - 1) else None
    if not is_op(p, aten.div):
        return None
    e, s = p.args[0], p.args[1]
    if not (is_op(e, aten.exp) and is_op(s, aten.sum) and s.args[0] is e and reduces_last_dim(s, r)):
        return None
    d = e.args[0]
    rewritten = _inductor_scaled_softmax(d)
    if rewritten is not None:
        x, nodes = rewritten
        return x, [p, s, e, *nodes]
    if not (is_op(d, aten.sub) and is_op(d.args[1], aten.amax)):
        return None
    x, mx = d.args[0], d.args[1]
    if mx.args[0] is not x or not reduces_last_dim(mx, r):
        return None
    return x, [p, s, e, d, mx]


def _unscale(t, views, scale, region):
    """Look through a positive scalar multiply of a 4-D operand, folding it into the scale."""
    if (is_op(t, aten.mul) and is_scalar(t.args[1]) and ndim(t.args[0]) == 4
            and all(len(n.users) == 1 for n in [*views, t])):
        if not t.args[1] > 0:
            raise NearMiss(f"operand scale {t.args[1]} is not positive")
        region.extend([*views, t])  # the multiply and the views of it die with the op
        return t.args[0], views + [t], scale * t.args[1]
    return t, views, scale


def _safe_softmax(p: Node) -> tuple[Node, list[Node]] | None:
    """where(no key of the row is finite, 0, probs) -> (probs, [nodes..., eq(logits, -inf)])."""
    if not is_op(p, aten.where):
        return None
    cond, zero, probs = p.args
    is_zero = constant_value(zero) == 0 or (is_op(zero, aten.full) and zero.args[1] == 0)
    if not is_zero or not same_shape(shape(p), shape(probs) or ()):
        return None
    if not is_op(cond, aten.logical_not) or not is_op(cond.args[0], aten.any):
        return None
    anyn = cond.args[0]
    if not reduces_last_dim(anyn, ndim(anyn.args[0]) or 0) or not is_op(anyn.args[0], aten.logical_not):
        return None
    ne = anyn.args[0]
    eq = ne.args[0]
    if not (is_op(eq, aten.eq) and constant_value(eq.args[1]) == -math.inf):
        return None
    nodes = [p, cond, anyn, ne, eq]
    if isinstance(p.args[1], Node):
        nodes.insert(1, p.args[1])
    return probs, nodes


def _inductor_scaled_softmax(d: Node) -> tuple[Node, list[Node]] | None:
    """Inductor's joint-graph rewrite of softmax(x * c) or softmax(x / c) for a scalar c (when
    no mask sits in between, e.g. a decode step): exp(where(row finite, (x*sign - amax(x*sign))
    * (sign*c) [or / (sign*c)], x*c - amax(x*c) [x/c - ...])). Both branches are the same
    logits; below float32 the scaled logits are upcast (convert(x * c)) and the stable branch
    upcasts x before its sign. Returns (the logits, the nodes)."""
    if not is_op(d, aten.where):
        return None
    cond, stable, plain = d.args
    if not (is_op(plain, aten.sub) and is_op(plain.args[1], aten.amax) and plain.args[1].args[0] is plain.args[0]):
        return None
    logits = plain.args[0]
    scaled = uncast(logits)
    scaling = next((op for op in (aten.mul, aten.div) if is_op(scaled, op)), None)
    if scaling is None or not (is_scalar(scaled.args[1]) and isinstance(scaled.args[0], Node)):
        return None
    x, c = scaled.args
    if not (is_op(stable, scaling) and is_scalar(stable.args[1]) and is_op(stable.args[0], aten.sub)):
        return None
    sub = stable.args[0]
    signed, mx = sub.args[0], sub.args[1]
    if not (is_op(mx, aten.amax) and mx.args[0] is signed and is_op(signed, aten.mul)
            and (signed.args[0] is x or uncast(signed.args[0]) is x)
            and signed.args[1] in (1, -1) and stable.args[1] == signed.args[1] * c):
        return None
    # the condition is a function of the logits alone (which rows are all finite)
    cond_nodes, todo = [], [cond]
    while todo:
        n = todo.pop()
        if n is logits or n in cond_nodes:
            continue
        if not isinstance(n, Node) or n.op != "call_function" or not n.all_input_nodes:
            return None
        cond_nodes.append(n)
        todo.extend(n.all_input_nodes)
    upcast = peel(signed.args[0], CONVERT_OPS)[1]  # the stable branch's own cast of x
    return logits, [d, stable, sub, mx, signed, *upcast, plain, plain.args[1], *cond_nodes]


def _fill_drops(v) -> bool:
    c = constant_value(v)
    return c is not None and (c == -math.inf or c <= _NEG_INF_FLOOR)


def _chain_inputs(n) -> list | None:
    """The inputs an op of the score chain continues through (casts, views, scalar scales,
    a mask's add or where), [] at the q k^T bmm, None for an op the chain cannot hold."""
    if is_op(n, aten.bmm):
        return []
    if is_op(n, *CONVERT_OPS, *VIEW_OPS, aten.tanh) or (is_op(n, aten.mul, aten.div) and is_scalar(n.args[1])):
        return [n.args[0]]
    if is_op(n, aten.mul) and is_scalar(n.args[0]):
        return [n.args[1]]
    if is_op(n, aten.add):
        return list(n.args[:2])
    if is_op(n, aten.where):
        return list(n.args[1:3])
    return None


def _reaches_bmm(n, depth: int = 12) -> bool:
    """Whether n is computed from a bmm through score-chain ops (to tell scores from mask)."""
    ins = _chain_inputs(n) if isinstance(n, Node) and depth > 0 else None
    return ins is not None and (is_op(n, aten.bmm) or any(_reaches_bmm(i, depth - 1) for i in ins))


def _blocked_by(n) -> str:
    """The near miss for an op between the q k^T matmul and the softmax."""
    return f"unsupported op {getattr(n, 'target', n)} between the q k^T matmul and the softmax"


def _off_chain_op(n, depth: int = 12, seen: set | None = None):
    """The first op on a path from `n` down to a bmm that the score chain cannot hold (what
    stopped _reaches_bmm), or None if no such path is near."""
    seen = set() if seen is None else seen
    if depth == 0 or not isinstance(n, Node) or n.op != "call_function" or n in seen:
        return None
    seen.add(n)
    on_chain = _chain_inputs(n) is not None
    for src in n.all_input_nodes:
        if _reaches_bmm(src):
            return None if on_chain else n
        found = _off_chain_op(src, depth - 1, seen)
        if found is not None:
            return found if on_chain else n
    return None


def _parse_scores(x: Node):
    """Walk from the softmax input down to the q k^T bmm: scale, soft-cap, masks, the chain's
    nodes. Soft-capping c2 * tanh(c1 * s) is exactly softcap * tanh(scale * s / softcap) with
    softcap = c2 and scale = c1 * c2: the factors outside the tanh (gathered when it is met)
    are the soft-cap, and the walk goes on multiplying the scale by those inside."""
    scale, softcap, masks, keeps, chain = 1.0, 0.0, [], [], []
    scaled = False  # a scale seen above (applied after) the current point
    capped = None  # the tanh, once passed: masks below it would be inside the soft-cap
    while True:
        if capped is not None and is_op(x, aten.add, aten.where):
            raise NearMiss(f"a mask or bias is applied inside the soft-cap ({capped.name}): the op applies "
                           "masks after it")
        if is_op(x, *CONVERT_OPS):
            chain.append(x)
            x = x.args[0]
        elif is_op(x, aten.mul, aten.div) and (is_scalar(x.args[1]) or (is_op(x, aten.mul) and is_scalar(x.args[0]))):
            c, src = (x.args[1], x.args[0]) if is_scalar(x.args[1]) else (x.args[0], x.args[1])
            if not c > 0:
                raise NearMiss(f"score scale {c} is not positive")
            scale = scale * c if is_op(x, aten.mul) else scale / c
            scaled = True
            chain.append(x)
            x = src
        elif is_op(x, aten.add):
            if x.kwargs.get("alpha", 1) != 1:
                raise NearMiss("score add with alpha != 1")
            a, b = x.args[0], x.args[1]
            ra, rb = _reaches_bmm(a), _reaches_bmm(b)
            if ra and rb:
                raise NearMiss("cannot tell the scores from the mask in an add: both come from a q k^T matmul")
            if not ra and not rb:  # the scores' side reaches the matmul only through an op the op lacks
                blocker = _off_chain_op(a) or _off_chain_op(b)
                raise NearMiss(_blocked_by(blocker) if blocker is not None else
                               "cannot tell the scores from the mask in an add: neither comes from a q k^T matmul")
            scores, mask = (a, b) if ra else (b, a)
            if not isinstance(mask, Node) or not same_shape(shape(x), shape(scores) or ()):
                raise NearMiss("the mask added to the scores changes their shape or is not a tensor")
            if dtype(mask) not in (torch.float32, torch.bfloat16, torch.float16):
                raise NearMiss(f"additive mask of dtype {dtype(mask)}")
            if scaled:
                raise NearMiss("the scores are scaled after an additive mask is added (the mask would be scaled too)")
            masks.append(mask)
            chain.append(x)
            x = scores
        elif is_op(x, aten.where):
            cond, a, b = x.args
            if _fill_drops(b) and _reaches_bmm(a):
                keeps.append((cond, True))
                x_next = a
            elif _fill_drops(a) and _reaches_bmm(b):
                keeps.append((cond, False))
                x_next = b
            else:
                raise NearMiss("where() on the scores does not fill with -inf (or a value that acts as -inf)")
            if not same_shape(shape(x), shape(x_next) or ()):
                raise NearMiss("where() on the scores broadcasts them to a larger shape")
            chain.append(x)
            x = x_next
        elif is_op(x, aten.tanh):
            if capped is not None:
                raise NearMiss(f"two tanh soft-caps on the scores ({x.name}, {capped.name})")
            softcap, capped = scale, x
            chain.append(x)
            x = x.args[0]
        elif is_reshape(x) and is_op(x.args[0], aten.bmm) and ndim(x) == 4:
            chain.append(x)
            x = x.args[0]
        elif is_op(x, aten.bmm):
            chain.append(x)
            return scale, softcap, masks, keeps, chain, x
        else:
            raise NearMiss(_blocked_by(x))


def _check_exclusive(region: list[Node], probs: set[Node], allowed_exit: Node) -> None:
    inside = set(region)
    escaped = escaping_uses(region, inside, exits=(allowed_exit,), size_reads=True)
    if escaped:
        n, u = escaped[0]
        what = "probabilities" if n in probs else "scores"
        raise NearMiss(f"the attention {what} ({n.name}) are also used by {u.name}")
    if not size_reads_rehomable(inside - {allowed_exit}):
        raise NearMiss("a size of the scores is read and exists nowhere else in the graph")


def _resolve_masks(m: Match, masks: list[Node], keeps: list[tuple[Node, bool]],
                   interp: ma.MaskInterpreter, score_dtype) -> None:
    bands, tensors, dropped = [], [], 0  # bands: (node, kind, offset, window) proven in the graph
    parts = [(mk, "additive") for mk in masks] + [(c, "keep" if k else "drop") for c, k in keeps]
    for node, kind in parts:
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


def _unusable_band(off, window, m: Match) -> str | None:
    """Why a proven causal (sliding-window) mask cannot become the op's causal flag (and window),
    None if it can. With a finite fill (HF's finfo.min) a query row that keeps no key is uniform
    in eager code and NaN in the op, so every row must provably keep one: offset >= 0 (row 0
    keeps key 0) and, with a window, offset + Sq <= Sk + window - 1 (the last row's window
    reaches a key)."""
    if not _usable_offset(off, m):
        return f"its offset {off} is not provably >= 0 or not computable outside the attention"
    if window:
        B, Hq, Sq, D, Hkv, Sk, Dv, _, _ = dims(m)
        if not statically_known_true(off + Sq <= Sk + window - 1):
            return (f"cannot prove every query row keeps a key (offset {off} + {Sq} queries <= {Sk} keys + "
                    f"{window - 1})")
    return None


def _usable_offset(off, m: Match) -> bool:
    """A causal offset the op can take instead of the mask: provably >= 0, so every query row
    keeps key 0 (with a finfo.min fill an empty row would not be NaN), and, if symbolic,
    computable from sizes the graph has outside what the op replaces."""
    if off is None or not (same(off, 0) or statically_known_true(off >= 0)):
        return False
    return sym_size_available(m.anchor.graph, m.anchor, off, m.region)


def _check_sizes_bindable(m: Match) -> None:
    """Every symbolic size the rewrite will put in the graph can be read outside the region
    it removes (checked before the graph is touched)."""
    B, Hq, Sq, D, Hkv, Sk, Dv, _, _ = dims(m)
    needed = [m.causal_offset]
    if m.replace_3d:
        needed.append([B * Hq, Sq, Dv])
    for op in (m.q, m.k, m.v):
        if op.expand_batch is not None:
            needed.append(op.expand_batch)
    if not sizes_available(m.anchor.graph, m.anchor, needed, m.region):
        raise NearMiss("a symbolic size the fused op needs is not available outside the attention")


def _strip_repeat_kv(n: Node) -> tuple[Node, int] | None:
    """reshape(expand(unsqueeze(kv, 2), (B, Hkv, rep, S, D)), (B, Hkv*rep, S, D)) -> (kv, rep).

    Only this (interleaved) form maps query head h to kv head h // rep."""
    if not is_reshape(n) or ndim(n) != 4:
        return None
    e, _ = peel(n.args[0], (aten.clone,))
    if not is_op(e, aten.expand) or ndim(e) != 5:
        return None
    u = skip_noop_views(e.args[0])
    src = None
    if is_op(u, aten.unsqueeze) and u.args[1] in (2, -3):
        src = skip_noop_views(u.args[0])
    elif is_reshape(u) and ndim(u) == 5 and ndim(u.args[0]) == 4 and same(shape(u)[2], 1):
        src = skip_noop_views(u.args[0])
    if src is None or ndim(src) != 4:
        return None
    B, Hkv, rep, S, D = shape(e)
    s = shape(src)
    if not (same(s[0], B) and same(s[1], Hkv) and same(s[2], S) and same(s[3], D)):
        return None
    if not same_shape(shape(n), (B, Hkv * rep, S, D)) or not isinstance(rep, int):
        return None
    return src, rep


def _strip_gqa(m: Match) -> None:
    if m.unsqueeze_batch or m.k.transpose:
        return
    rk, rv = _strip_repeat_kv(m.k.node), _strip_repeat_kv(m.v.node)
    if rk and rv and rk[1] == rv[1]:
        m.k = Operand(rk[0], expand_batch=m.k.expand_batch)
        m.v = Operand(rv[0], expand_batch=m.v.expand_batch)
        m.notes.append(f"GQA, {rk[1]} query heads per kv head (repeat_kv removed)")


def dims(m: Match):
    """(B, Hq, Sq, D, Hkv, Sk, Dv) as the op will see them."""
    qs = shape(m.q.node)
    ks = shape(m.k.node)
    vs = shape(m.v.node)
    if m.unsqueeze_batch:
        qs, ks, vs = (1, *qs), (1, *ks), (1, *vs)
    if m.k.transpose:
        ks = (*ks[:2], ks[3], ks[2])
    return qs[0], qs[1], qs[2], qs[3], ks[1], ks[2], vs[3], ks, vs


def _check_fits(m: Match) -> None:
    B, Hq, Sq, D, Hkv, Sk, Dv, ks, vs = dims(m)
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


def _out_shape(m: Match):
    B, Hq, Sq, D, Hkv, Sk, Dv, _, _ = dims(m)
    return (B, Hq, Sq, Dv)


# ---- SDPA form -------------------------------------------------------------------------

def _match_sdpa(node: Node, interp: ma.MaskInterpreter) -> Match | None:
    form = SDPA_OPS[node.target]
    norm = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    kw = norm.kwargs if norm is not None else {}
    q, k, v = kw.get("query"), kw.get("key"), kw.get("value")
    if q is None or any(ndim(t) != 4 for t in (q, k, v)):
        return None
    if kw.get("dropout_p", 0.0) not in (0, 0.0):
        raise NearMiss(f"dropout_p={kw['dropout_p']}")
    mask = kw.get("attn_mask", kw.get("attn_bias"))
    scale = kw.get("scale")
    if scale is None:
        d = shape(q)[-1]
        if not isinstance(d, int):
            raise NearMiss("default scale of a symbolic head dim")
        scale = 1.0 / math.sqrt(d)
    if not is_scalar(scale) or not scale > 0:
        raise NearMiss(f"scale {scale!r}")

    if node.target is aten.scaled_dot_product_attention.default:
        anchor_outs = [node]
    else:
        anchor_outs = []
        for u in node.users:
            if u.target is not operator.getitem:
                raise NearMiss(f"output used by {u.name} directly")
            if u.args[1] == 0:
                anchor_outs.append(u)
            elif u.users:
                raise NearMiss(f"auxiliary output {u.args[1]} (e.g. logsumexp) is used")
    m = Match(form=form, anchor=node, replace=anchor_outs, replace_3d=[], q=Operand(q), k=Operand(k),
              v=Operand(v), scale=float(scale), zero_empty_rows=True)
    if kw.get("is_causal", False):
        m.causal, m.causal_offset = True, 0
        m.notes.append("causal (is_causal)")
    if mask is not None:
        if m.causal:
            raise NearMiss("both is_causal and a mask")
        kind = "keep" if dtype(mask) == torch.bool else "additive"
        _resolve_masks(m, [mask] if kind == "additive" else [], [(mask, True)] if kind == "keep" else [],
                       interp, score_dtype=dtype(q))
    elif not m.causal:
        m.notes.append("no mask")
    _strip_gqa(m)
    _check_fits(m)
    _check_sizes_bindable(m)
    return m


# ---- rewrite ---------------------------------------------------------------------------

def _materialise(graph, m: Match, op: Operand) -> Node:
    n = op.node
    if m.unsqueeze_batch:
        n = insert_call(graph, m.anchor, aten.unsqueeze.default, (n, 0))
    if op.transpose:
        n = insert_call(graph, m.anchor, aten.permute.default, (n, [0, 1, 3, 2]))
    if op.expand_batch is not None:
        s = shape(n)
        n = insert_call(graph, m.anchor, aten.expand.default, (n, [op.expand_batch, *s[1:]]), exclude=m.region)
    return n


def rewrite(graph, m: Match) -> None:
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


def describe(m: Match, node: Node) -> str:
    B, Hq, Sq, D, Hkv, Sk, Dv, _, _ = dims(m)
    v = f", v dim {Dv}" if not same(Dv, D) else ""
    return (f"{location(node)}: {m.form} attention -> metainfer.attention "
            f"({Hq} q heads / {Hkv} kv heads x {D}{v}, {Sq} x {Sk} tokens, scale {m.scale:.4g}; {'; '.join(m.notes)})")
