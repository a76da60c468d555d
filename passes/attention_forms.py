"""Attention as models write it, read into one canonical description (`Site`).

Forms read (post-grad ATen):
- eager: bmm(softmax(scale * bmm(q, k^T) [+ mask | where(keep, ., -inf)]), v), with the
  expand/reshape that `matmul` decomposes into, dtype casts around the softmax (HF's
  float32 softmax), the scale as mul or div on the scores (or on q and k, as SDPA's math
  decomposition writes it), masks added or applied with `where`, logit soft-capping before
  the mask (Gemma 2: c * tanh(scores / c); any positive factors inside and outside the tanh,
  read as softcap = the factor outside, scale = softcap x the factors inside), softmax
  decomposed, with SDPA's zero for rows that keep no key, or as Inductor's joint pass
  rewrites a scaled one;
- SDPA: `scaled_dot_product_attention` and its backend ops (flash/efficient/cudnn/CPU),
  with an explicit mask or `is_causal`.

A Site holds q, k, v (4-D, or 3-D batch*heads; a batch or head of 1 broadcast by `matmul`
read as the un-broadcast tensor), one positive scale, the soft-cap, the masks as written
(additive, or a `where` keep/drop predicate) and the nodes the op would replace. GQA's
`repeat_kv` is read back to the un-repeated K/V by `strip_gqa`. What the op can take of the
masks, shapes and sizes is proven by the pass (fuse_attention), not here; what a Site cannot
hold is a NearMiss here: an intermediate used elsewhere, an op on the scores the op lacks,
dropout, a scale that is not a positive number, a mask scaled with the scores, q, k and v
split into (batch, heads) differently.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch.fx.operator_schemas import normalize_function

from . import base
from .matching import (
    CONVERT_OPS, VIEW_OPS, Node, aten, constant_value, dtype, escaping_uses, is_noop_view, is_op, is_reshape,
    is_scalar, ndim, peel, reduces_last_dim, same, same_shape, shape, size_reads_rehomable, skip_noop_views,
    uncast, untransposed,
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
class Site:
    """One attention, canonical: what the op computes and what it replaces. The fields below
    `mask_parts` are the pass's verdict on those parts (`causal` is also set by SDPA's is_causal)."""

    form: str
    anchor: Node  # the op is inserted before this node
    q: Operand
    k: Operand
    v: Operand
    scale: float
    score_dtype: torch.dtype  # the dtype the written masks apply in
    replace: list[Node] = field(default_factory=list)  # nodes whose uses the 4-D output replaces
    replace_3d: list[Node] = field(default_factory=list)  # nodes (bmm outputs) a 3-D view of it replaces
    region: set[Node] = field(default_factory=set)  # nodes the op replaces (size reads rehomed)
    softcap: float = 0.0  # scores -> softcap * tanh(scores / softcap) before the mask (0: none)
    unsqueeze_batch: bool = False  # operands were 3-D (batch*heads, seq, dim)
    zero_empty_rows: bool = False  # SDPA's convention for query rows with no key kept
    # (node, "additive" | "keep" | "drop"): the adds, then the wheres, each in the walk's order
    mask_parts: list[tuple[Node, str]] = field(default_factory=list)
    causal: bool = False
    causal_offset: int = 0
    window: int = 0  # sliding window on top of the causal mask (0: none)
    mask: Node | None = None
    mask_negate: bool = False  # mask is a "drop" predicate: pass logical_not(mask)
    notes: list[str] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)  # a faster form not taken (the op still fires)

    def dims(self):
        """(B, Hq, Sq, D, Hkv, Sk, Dv, k shape, v shape) as the op will see them."""
        qs, ks, vs = shape(self.q.node), shape(self.k.node), shape(self.v.node)
        if self.unsqueeze_batch:
            qs, ks, vs = (1, *qs), (1, *ks), (1, *vs)
        if self.k.transpose:
            ks = (*ks[:2], ks[3], ks[2])
        return qs[0], qs[1], qs[2], qs[3], ks[1], ks[2], vs[3], ks, vs


def read(node: Node) -> Site | None:
    """The attention whose last node is `node` (the p @ v bmm or an SDPA op), None if it is
    not one; NearMiss if its structure rules the op out."""
    if is_op(node, aten.bmm):
        return _read_eager(node)
    if node.target in SDPA_OPS:
        return _read_sdpa(node)
    return None


# ---- eager form ------------------------------------------------------------------------

def _read_eager(pv: Node) -> Site | None:
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

    scale, softcap, mask_parts, chain, qk = _parse_scores(logits)
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
    site = Site(form="eager" if safe is None else "sdpa (math)", anchor=pv, q=q, k=k, v=v, scale=scale,
                score_dtype=dtype(logits), region=set(region) - {pv}, softcap=softcap, unsqueeze_batch=three_d,
                zero_empty_rows=safe is not None, mask_parts=mask_parts)
    if softcap:
        site.notes.append(f"soft-capped at {softcap:.4g}")
    # outputs: a (batch*heads) -> (batch, heads) reshape of pv in q's order takes the 4-D result,
    # anything else a 3-D view of it
    B, Hq, Sq, _, _, _, Dv, _, _ = site.dims()
    site.replace = [u for u in pv.users if not three_d and is_reshape(u) and same_shape(shape(u), (B, Hq, Sq, Dv))]
    if len(site.replace) != len(pv.users):
        site.replace_3d.append(pv)
    return site


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
    scale, softcap, chain = 1.0, 0.0, []
    masks, keeps = [], []  # (node, "additive"); (predicate, "keep" | "drop")
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
            scores, mask = _split_add(x)
            if scaled:
                raise NearMiss("the scores are scaled after an additive mask is added (the mask would be scaled too)")
            masks.append((mask, "additive"))
            chain.append(x)
            x = scores
        elif is_op(x, aten.where):
            scores, cond, kind = _split_where(x)
            keeps.append((cond, kind))
            chain.append(x)
            x = scores
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
            return scale, softcap, masks + keeps, chain, x
        else:
            raise NearMiss(_blocked_by(x))


def _split_add(x: Node) -> tuple[Node, Node]:
    """(scores, mask) of an add on the scores: the side that comes from the q k^T matmul is
    the scores; NearMiss where the two cannot be told apart or the mask is not one."""
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
    return scores, mask


def _split_where(x: Node) -> tuple[Node, Node, str]:
    """(scores, predicate, "keep" | "drop") of where(keep, scores, -inf) or where(drop, -inf, scores)."""
    cond, a, b = x.args
    if _fill_drops(b) and _reaches_bmm(a):
        scores, kind = a, "keep"
    elif _fill_drops(a) and _reaches_bmm(b):
        scores, kind = b, "drop"
    else:
        raise NearMiss("where() on the scores does not fill with -inf (or a value that acts as -inf)")
    if not same_shape(shape(x), shape(scores) or ()):
        raise NearMiss("where() on the scores broadcasts them to a larger shape")
    return scores, cond, kind


def _check_exclusive(region: list[Node], probs: set[Node], allowed_exit: Node) -> None:
    """Nothing outside the site reads its scores or probabilities (size reads aside, which
    can be read elsewhere)."""
    inside = set(region)
    escaped = escaping_uses(region, inside, exits=(allowed_exit,), size_reads=True)
    if escaped:
        n, u = escaped[0]
        what = "probabilities" if n in probs else "scores"
        raise NearMiss(f"the attention {what} ({n.name}) are also used by {u.name}")
    if not size_reads_rehomable(inside - {allowed_exit}):
        raise NearMiss("a size of the scores is read and exists nowhere else in the graph")


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


def strip_gqa(site: Site) -> None:
    """K and V un-repeated where both are `repeat_kv` of the same factor (the op maps heads)."""
    if site.unsqueeze_batch or site.k.transpose:
        return
    rk, rv = _strip_repeat_kv(site.k.node), _strip_repeat_kv(site.v.node)
    if rk and rv and rk[1] == rv[1]:
        site.k = Operand(rk[0], expand_batch=site.k.expand_batch)
        site.v = Operand(rv[0], expand_batch=site.v.expand_batch)
        site.notes.append(f"GQA, {rk[1]} query heads per kv head (repeat_kv removed)")


# ---- SDPA form -------------------------------------------------------------------------

def _read_sdpa(node: Node) -> Site | None:
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
    outs = [node] if node.target is aten.scaled_dot_product_attention.default else _first_outputs(node)
    causal = bool(kw.get("is_causal", False))
    if causal and mask is not None:
        raise NearMiss("both is_causal and a mask")
    site = Site(form=SDPA_OPS[node.target], anchor=node, q=Operand(q), k=Operand(k), v=Operand(v),
                scale=float(scale), score_dtype=dtype(q), replace=outs, zero_empty_rows=True, causal=causal)
    if causal:
        site.notes.append("causal (is_causal)")
    if mask is not None:
        site.mask_parts.append((mask, "keep" if dtype(mask) == torch.bool else "additive"))
    return site


def _first_outputs(node: Node) -> list[Node]:
    """The getitem(node, 0) users of an SDPA backend op, which returns (output, logsumexp, ...);
    NearMiss where anything else of it is used."""
    outs = []
    for u in node.users:
        if u.target is not operator.getitem:
            raise NearMiss(f"output used by {u.name} directly")
        if u.args[1] == 0:
            outs.append(u)
        elif u.users:
            raise NearMiss(f"auxiliary output {u.args[1]} (e.g. logsumexp) is used")
    return outs
