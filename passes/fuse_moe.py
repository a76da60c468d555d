"""fuse_moe: routed experts computed expert by expert (or per token) -> metainfer::moe_experts.

One op per MoE layer computes out[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
with e = ids[t, k], as a grouped GEMM (tokens sorted by expert, gate/up GEMM with SwiGLU
fused, down GEMM, weighted combine). Forms recognised (post-grad ATen):

- loop: DeepSeek's reference loop (models/deepseek.py): for every expert e,
  `idx, top = torch.where(ids == e)`, the expert's SwiGLU MLP on `x[idx]`, and
  `y.index_add_(0, idx, out * w[idx, top, None])` into zeros; captured as one graph (metainfer
  captures with data-dependent output shapes enabled), it is a chain of E `index_put`s. Expert
  weights are slices `w[e]` of stacked (E, N, K) tensors, FP8 ones dequantised per expert.
- grouped_mm: Hugging Face transformers' `grouped_mm` experts (sort by expert, histc/cumsum
  offsets, two grouped GEMMs, un-permute, sum over k).
- batched_mm: transformers' `batched_mm` experts (each token repeated k times, its experts'
  weights gathered per row, two bmm's, sum over k): it copies k weight matrices per token.

transformers' eager experts loop iterates over the experts that received tokens, a
data-dependent Python loop that breaks the graph once per expert; metainfer captures those
modules through transformers' own `grouped_mm` implementation instead (see
metainfer.runtime.model_capture), where this pass finds them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from metainfer.hardware import targets
from metainfer.kernels.moe import FP8_DTYPES as KERNEL_FP8

from . import base
from .base import MatchPass, register

from .fp8_dequant import NotDequant, find_dequant
from .matching import (
    CONVERT_OPS, FLOAT_DTYPES, Node, aten, dtype, escaping_uses, insert_call, is_op, is_reshape, is_size_read, location, peel, shape,
    silu_input, uncast, untransposed,
)

_GROUPED_MM = {"transformers.grouped_mm_fallback", "aten._grouped_mm", "aten.grouped_mm"}


class NearMiss(base.NearMiss):
    """Experts recognised, but not fused; the message says why."""


@dataclass
class Site:
    form: str
    out: Node  # the node whose uses the op's (T, H) result takes
    x: Node  # (T, H)
    ids: Node  # (T, K) integer
    weights: Node  # (T, K) float
    gate: tuple  # (node, slice) where slice None or (start, end) along dim 1 of node
    up: tuple
    down: Node
    scales: tuple = (None, None, None)  # FP8 block scales for gate, up, down
    block: tuple = (128, 128)
    region: set = field(default_factory=set)  # nodes the op replaces
    extra_dead: list = field(default_factory=list)  # side-effect-only nodes to erase (assertions)


@register
class FuseMoE(MatchPass):
    """per-expert loop / HF grouped_mm / HF batched_mm experts -> metainfer::moe_experts (one grouped GEMM)"""

    name = "fuse_moe"
    cost_gated = True

    missed = "experts not fused"
    misses = (NearMiss, NotDequant)  # its own, or fp8_dequant's (a scale it cannot prove)

    def match(self, node, state):
        return _match(node)

    def refuse(self, node, site, state):
        why_not = _fp8_unsupported(site, state.ctx.target)
        return f"experts not fused: {why_not}" if why_not else None

    def rewrite(self, node, site, state):
        _rewrite(state.graph, site)

    def describe(self, node, site):
        return _describe(site)


def _fp8_unsupported(site: Site, target) -> str | None:
    """Why the kernel cannot take these FP8 experts on the target's GPU (None if it can):
    Triton has no float8_e4m3fn before sm_89, and this kernel does not decode the bytes itself
    (fp8_gemm does). Decided here, so no compiled graph raises it."""
    if site.scales[0] is None or target.device.kind != "cuda":
        return None
    cap = targets.capability(target.device.arch)
    if cap is None or cap >= (8, 9):
        return None
    return (f"FP8 experts need Triton's float8_e4m3fn, sm_89 or newer; target {target.name} is {target.device.arch}: "
            "left as the graph has them (dequantised per expert)")


def _match(node: Node) -> Site | None:
    if is_op(node, aten.full):
        return _match_loop(node)
    if is_op(node, aten.sum):
        return _match_combine(node)
    return None


# ---- shared pieces ----------------------------------------------------------------------

def _target_name(n) -> str:
    return str(getattr(n, "target", ""))


def _swiglu(h) -> tuple[Node, Node, list[Node]] | None:
    """(gate, up, nodes) if h = silu(gate) * up (in any of its decomposed forms)."""
    h = uncast(h)
    if not is_op(h, aten.mul):
        return None
    for s_side, up in ((h.args[0], h.args[1]), (h.args[1], h.args[0])):
        found = silu_input(s_side)
        if found is not None:
            gate, inner = found
            return gate, up, [h, *inner]
    return None


def _halves(gate: Node, up: Node) -> tuple[Node, int] | None:
    """(P, I) if gate, up are P[..., :I] and P[..., I:] (split/chunk/slice of the last dim)."""
    if gate.target is operator.getitem and up.target is operator.getitem and gate.args[0] is up.args[0]:
        sp = gate.args[0]
        if is_op(sp, aten.split, aten.split_with_sizes) and gate.args[1] == 0 and up.args[1] == 1:
            src, size = sp.args[0], sp.args[1]
            dim = sp.args[2] if len(sp.args) > 2 else 0
            I = size if isinstance(size, int) else (size[0] if len(size) == 2 and size[0] == size[1] else None)
            if I is not None and dim in (-1, len(shape(src)) - 1) and shape(src)[-1] == 2 * I:
                return src, I
    return None


def _exclusive(region: set, keep: Node) -> None:
    escaped = escaping_uses(region, region, exits=(keep,), size_reads=True)
    if escaped:
        n, u = escaped[0]
        raise NearMiss(f"{n.name} (inside the experts) is also used by {u.name}")


def _check_kernel_limits(site: Site) -> None:
    T, H = shape(site.x)
    K = shape(site.ids)[1]
    E = shape(site.down)[0]
    if dtype(site.x) not in FLOAT_DTYPES:
        raise NearMiss(f"activations of dtype {dtype(site.x)}")
    if dtype(site.ids) not in (torch.int32, torch.int64):
        raise NearMiss(f"expert ids of dtype {dtype(site.ids)}")
    if not isinstance(K, int) or not isinstance(E, int) or K < 1:
        raise NearMiss(f"top-k {K} of {E} experts: the kernel needs static sizes and k >= 1")
    for wd in {dtype(site.gate[0]), dtype(site.up[0]), dtype(site.down)}:
        if site.scales[0] is not None:
            if wd not in KERNEL_FP8:
                raise NearMiss(f"FP8 format {wd} is not supported by the kernel (supported: "
                               f"{', '.join(map(str, KERNEL_FP8))})")
        elif wd != dtype(site.x):
            raise NearMiss(f"expert weights {wd} and activations {dtype(site.x)} differ in dtype")


# ---- form: DeepSeek's loop over experts ------------------------------------------------

def _match_loop(zeros: Node) -> Site | None:
    s = shape(zeros)
    if s is None or len(s) != 2 or not (len(zeros.args) > 1 and zeros.args[1] == 0):
        return None
    users = list(zeros.users)
    if len(users) != 1 or not _is_accumulate(users[0], zeros):
        return None
    links, cur = [], zeros
    while True:  # each link's only user is the next one
        acc = [u for u in cur.users if _is_accumulate(u, cur)]
        if len(acc) != 1 or len(cur.users) != 1:
            break
        cur = acc[0]
        links.append(cur)
    experts = [_loop_expert(link) for link in links]
    if any(e is None for e in experts):
        if len(links) > 1:
            raise NearMiss("an index_add chain into zeros of which some links are not one expert's SwiGLU MLP")
        return None
    ids, x, wts = experts[0]["ids"], experts[0]["x"], experts[0]["weights"]
    stacks = experts[0]["stacks"]
    E = shape(stacks[2][0])[0]
    if any(e["ids"] is not ids or e["x"] is not x or e["weights"] is not wts or e["stacks"] != stacks for e in experts):
        raise NearMiss("the loop's experts read different routing tensors, inputs or weight stacks")
    found = sorted(e["expert"] for e in experts)
    if found != list(range(E)):
        raise NearMiss(f"the loop covers experts {found}, not each of the {E} experts once")
    if shape(x) != s or not (shape(ids)[0] == s[0] and shape(wts) == shape(ids)):
        raise NearMiss(f"routing {list(shape(ids))} / {list(shape(wts) or [])} does not match tokens {list(s)}")
    region = {zeros, *links}
    for e in experts:
        region |= e["region"]
    _exclusive(region, keep=links[-1])
    (wg, sg), (wu, su), (wdn, sd) = stacks
    blocks = {b for e in experts for b in e["blocks"]}
    if len(blocks) > 1:
        raise NearMiss(f"expert projections use different FP8 block sizes {sorted(blocks)}")
    site = Site(form="loop", out=links[-1], x=x, ids=ids, weights=wts, gate=(wg, None), up=(wu, None), down=wdn,
                scales=(sg, su, sd), block=blocks.pop() if blocks else (128, 128), region=region,
                extra_dead=[n for e in experts for n in e["asserts"]])
    _check_kernel_limits(site)
    return site


def _is_accumulate(n, acc) -> bool:
    """index_put(acc, [idx], val, accumulate=True), or index_add(acc, 0, idx, val) (low precision)."""
    if is_op(n, aten.index_put):
        return n.args[0] is acc and len(n.args) > 3 and n.args[3] is True and len(n.args[1]) == 1
    return (is_op(n, aten.index_add) and n.args[0] is acc and n.args[1] == 0
            and n.kwargs.get("alpha", 1) == 1 and (len(n.args) < 5 or n.args[4] == 1))


def _accumulated(link: Node) -> tuple[Node, Node]:
    """(row indices, values) an accumulate link adds."""
    if is_op(link, aten.index_put):
        return link.args[1][0], link.args[2]
    return link.args[2], link.args[3]


def _expert_weight(w_t: Node, e: int | None):
    """W^T of one expert's projection -> ((stack, scales), expert, block, nodes): W is
    select(stack, 0, e), or the dequantisation of select(fp8 stack, 0, e) with
    select(scales, 0, e)."""
    w = untransposed(w_t, 2)
    if w is None:
        return None
    nodes = [w_t]
    if is_op(w, aten.select) and w.args[1] == 0:
        return (w.args[0], None), w.args[2], None, nodes + [w]
    dq = find_dequant(w)
    if dq is None:
        return None
    ws, ss = dq.weight, dq.scale
    if not (is_op(ws, aten.select) and is_op(ss, aten.select) and ws.args[1] == 0 and ss.args[1] == 0
            and ws.args[2] == ss.args[2]):
        raise NearMiss("an FP8 expert weight is not slice e of a stacked weight with slice e of its scales")
    return (ws.args[0], ss.args[0]), ws.args[2], (dq.block_n, dq.block_k), nodes + [*dq.nodes, ws, ss]


def _expert_rows(idx: Node, top: Node) -> "tuple[Node, int, tuple] | None":
    """(ids, e, the nodes) if idx, top = unbind(nonzero(ids == e), 1): the (token, slot) pairs
    routed to expert e."""
    if not (idx.target is operator.getitem and top.target is operator.getitem and idx.args[0] is top.args[0]
            and idx.args[1] == 0 and top.args[1] == 1):
        return None
    unbind = idx.args[0]
    if not (is_op(unbind, aten.unbind) and unbind.args[1] == 1 and is_op(unbind.args[0], aten.nonzero)):
        return None
    nz = unbind.args[0]
    eq = nz.args[0]
    if not (is_op(eq, aten.eq) and isinstance(eq.args[1], int)):
        return None
    return eq.args[0], eq.args[1], (unbind, nz, eq)


def _loop_expert(link: Node) -> dict | None:
    """One iteration: index_put(acc, [idx], mm(h, Wd^T) * w[idx, top, None], True)."""
    idx, val = _accumulated(link)
    if not is_op(val, aten.mul):
        return None
    for down, rw in ((val.args[0], val.args[1]), (val.args[1], val.args[0])):
        if is_op(down, aten.mm) and is_op(rw, aten.index):
            break
    else:
        return None
    # routing weight: index(unsqueeze(w, 2), [idx, top]) -> (n, 1)
    src, where = rw.args[0], rw.args[1]
    if not (is_op(src, aten.unsqueeze) and src.args[1] in (2, -1) and len(where) == 2 and where[0] is idx):
        return None
    wts, top = src.args[0], where[1]
    selected = _expert_rows(idx, top)
    if selected is None:
        return None
    ids, expert, (unbind, nz, eq) = selected
    # the expert's MLP on x[idx]
    found = _swiglu(down.args[0])
    if found is None:
        return None
    g, u, sw_nodes = found
    if not (is_op(g, aten.mm) and is_op(u, aten.mm) and g.args[0] is u.args[0] and is_op(g.args[0], aten.index)):
        return None
    xi = g.args[0]
    if not (len(xi.args[1]) == 1 and xi.args[1][0] is idx):
        return None
    parts, blocks, region = [], set(), {link, val, down, rw, src, idx, top, unbind, nz, eq, xi, g, u, *sw_nodes}
    for mm in (g, u, down):
        got = _expert_weight(mm.args[1], expert)
        if got is None or got[1] != expert:
            return None
        parts.append(got[0])
        if got[2] is not None:
            blocks.add(got[2])
        region.update(got[3])
    if len({p[1] is None for p in parts}) != 1:
        raise NearMiss("some expert projections are FP8 and others are not")
    asserts = [a for n in (nz,) for a in _assertions_on(n)]
    region.update(_size_nodes_of(nz))
    return dict(ids=ids, x=xi.args[0], weights=wts, expert=expert, stacks=tuple(parts), blocks=blocks,
                region=region, asserts=asserts)


def _size_nodes_of(n: Node) -> set[Node]:
    """The size reads of n and the comparisons/assertions on them (range checks Dynamo adds
    for data-dependent sizes)."""
    out, todo = set(), [u for u in n.users if is_size_read(u)]
    while todo:
        s = todo.pop()
        if s in out:
            continue
        out.add(s)
        todo.extend(s.users)
    return out


def _assertions_on(n: Node) -> list[Node]:
    return [s for s in _size_nodes_of(n) if is_op(s, aten._assert_scalar) or _target_name(s).endswith("_assert_scalar.default")]


# ---- forms: transformers' grouped_mm and batched_mm experts ---------------------------

def _match_combine(total: Node) -> Site | None:
    """sum(view(per_pair_out, (T, K, H)), [1]): the weighted combine both HF forms end with."""
    if len(total.args) < 2 or not isinstance(total.args[1], (list, tuple)) or list(total.args[1]) != [1]:
        return None
    if (len(total.args) > 2 and total.args[2]) or total.kwargs.get("dtype") is not None:
        return None
    v = total.args[0]
    if not is_reshape(v) or shape(v) is None or len(shape(v)) != 3:
        return None
    T, K, H = shape(v)
    per_pair = v.args[0]
    if is_op(per_pair, aten.index):  # grouped_mm: rows back in (token, k) order
        return _match_grouped(total, v, per_pair, (T, K, H))
    if is_op(per_pair, aten.mul):
        return _match_batched(total, v, per_pair, (T, K, H))
    return None


def _weighted(mul: Node, expect) -> tuple[Node, Node] | None:
    """mul(y, unsqueeze(w_rows, -1)) -> (y, w_rows, the unsqueeze) where `expect(y)`."""
    for y, w in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
        if is_op(w, aten.unsqueeze) and w.args[1] in (-1, 1) and expect(y):
            return y, w.args[0], w
    return None


def _flat_of(n: Node, T, K) -> Node | None:
    """X if n is reshape(X, [-1]) with X (T, K)."""
    if is_reshape(n) and shape(n.args[0]) == (T, K):
        return n.args[0]
    return None


def _is_grouped_mm(n) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and any(
        _target_name(n).startswith(p) for p in _GROUPED_MM)


def _match_grouped(total, v, back, tkh) -> Site | None:
    T, K, H = tkh
    if len(back.args[1]) != 1:
        return None
    mul, (inv,) = back.args[0], back.args[1]
    if not is_op(mul, aten.mul):
        return None
    got = _weighted(mul, lambda y: _is_grouped_mm(_unsentinel(y)[0]))
    if got is None:
        return None
    g2, w_rows, w_col = got
    g2, zeroed = _unsentinel(g2)
    # inverse permutation: index_put(empty, [perm], arange(T*K))
    if not (is_op(inv, aten.index_put) and len(inv.args[1]) == 1):
        raise NearMiss("the grouped rows are not put back in token order by the inverse of the sort")
    perm = inv.args[1][0]
    if not (is_op(w_rows, aten.index) and w_rows.args[1][0] is perm and is_op(inv.args[2], torch.ops.prims.iota)):
        raise NearMiss("routing weights are not gathered in the sorted order")
    wts = _flat_of(w_rows.args[0], T, K)
    if not (perm.target is operator.getitem and perm.args[1] == 1 and is_op(perm.args[0], aten.sort)):
        raise NearMiss("the grouping permutation is not a sort of the expert ids")
    srt = perm.args[0]
    if not _ascending(srt):
        raise NearMiss("the expert ids are not sorted ascending (offsets count experts 0..E-1 in order)")
    ids = _flat_of(srt.args[0], T, K)
    if wts is None or ids is None:
        raise NearMiss("routing tensors are not (tokens, k)")
    h, wd_t, offs = g2.args[:3]
    found = _swiglu(h)
    if found is None:
        raise NearMiss("the first grouped GEMM's output is not SwiGLU-gated")
    g, u, sw_nodes = found
    halves = _halves(g, u)
    g1, zeroed1 = _unsentinel(halves[0]) if halves else (None, None)
    if not _is_grouped_mm(g1):
        raise NearMiss("gate and up are not the two halves of one grouped GEMM")
    I = halves[1]
    xs, wgu_t, offs1 = g1.args[:3]
    xs, zeroed_x = _unsentinel(xs)
    zeroed = [w for w in (zeroed, zeroed1, zeroed_x) if w is not None]
    if offs1 is not offs:
        raise NearMiss("the two grouped GEMMs use different offsets")
    wgu, wd = untransposed(wgu_t, 3), untransposed(wd_t, 3)  # (E, N, K) from their transposes
    if wgu is None or wd is None:
        raise NearMiss("expert weights are not (E, N, K) tensors read transposed")
    E = shape(wd)[0]
    _check_offsets(offs, srt, E)
    # xs = x[perm // K]
    if not (is_op(xs, aten.index) and is_op(xs.args[1][0], aten.div) and xs.args[1][0].args[0] is perm
            and xs.args[1][0].args[1] == K and xs.args[1][0].kwargs.get("rounding_mode") == "floor"):
        raise NearMiss("the grouped rows are not the tokens of the sorted (token, k) pairs")
    x = xs.args[0]
    for where in zeroed:
        ge = where.args[0].args[0]
        if not (ge.args[0].target is operator.getitem and ge.args[0].args[0] is srt and ge.args[0].args[1] == 0
                and ge.args[1] == E):  # the sorted values (output 0 of the sort), not the permutation
            raise NearMiss(f"{where.name} zeroes rows by a mask other than the sorted ids >= {E} "
                           "(transformers' expert-parallel sentinel)")
    region = {total, v, back, mul, g2, wd_t, h, *sw_nodes, g1, wgu_t, xs, xs.args[1][0], offs, inv, w_rows, w_col,
              g.args[0] if g.target is operator.getitem else g,
              *(n for w in zeroed for n in (w, w.args[0], w.args[0].args[0], w.args[1]))}
    region |= {g, u}
    site = Site(form="grouped_mm", out=_through_convert(total), x=x, ids=ids, weights=wts,
                gate=(wgu, (0, I)), up=(wgu, (I, 2 * I)), down=wd, region=region)
    _exclusive(region, keep=total)
    _check_kernel_limits(site)
    return site


def _unsentinel(n: Node) -> tuple[Node, Node | None]:
    """(x, the where) for where(unsqueeze(ids >= E, -1), 0, x): under expert parallelism
    transformers points other ranks' experts at the sentinel id E and zeroes their rows; the
    fused op drops ids outside [0, E) itself. (n, None) otherwise; the caller checks that the
    ids are the sorted ones."""
    if (is_op(n, aten.where) and is_op(n.args[0], aten.unsqueeze) and n.args[0].args[1] == -1
            and is_op(n.args[0].args[0], aten.ge) and is_op(n.args[1], aten.full) and n.args[1].args[1] == 0):
        return n.args[2], n
    return n, None


def _ascending(srt: Node) -> bool:
    """sort(x) / sort(x, dim, descending=False) / sort.stable(x, ...) over the only dim."""
    args = list(srt.args) + [None] * 3
    if srt.target is aten.sort.stable:
        desc, dim = srt.kwargs.get("descending", False), srt.kwargs.get("dim", -1)
    else:
        dim = args[1] if args[1] is not None else srt.kwargs.get("dim", -1)
        desc = args[2] if args[2] is not None else srt.kwargs.get("descending", False)
    return not desc and dim in (-1, 0)


def _through_convert(n: Node) -> Node:
    users = list(n.users)
    if len(users) == 1 and is_op(users[0], *CONVERT_OPS) and dtype(users[0]) == dtype(n):
        return users[0]
    return n


def _check_offsets(offs, srt, E) -> None:
    """offs = cumsum(histc(sorted ids, bins=E, min=0, max=E-1)): per-expert row ends."""
    if not is_op(offs, aten.cumsum):
        raise NearMiss("grouped GEMM offsets are not a cumulative sum")
    hist = offs.args[0]
    if not is_op(hist, aten.histc):
        raise NearMiss("grouped GEMM offsets are not counts per expert")
    args = list(hist.args) + [100, 0, 0][len(hist.args) - 1:]
    src, bins, lo, hi = args[:4]
    src = uncast(src)
    if not (src.target is operator.getitem and src.args[0] is srt and src.args[1] == 0):
        raise NearMiss("expert counts are not taken over the sorted ids")
    if (bins, lo, hi) != (E, 0, E - 1):
        raise NearMiss(f"expert counts over bins={bins} [{lo}, {hi}], not one per expert 0..{E - 1}")


def _match_batched(total, v, mul, tkh) -> Site | None:
    T, K, H = tkh

    def per_row_bmm(y):
        return is_op(y, aten.squeeze) and is_op(y.args[0], aten.bmm)

    got = _weighted(mul, per_row_bmm)
    if got is None:
        return None
    sq2, w_flat, w_col = got
    wts = _flat_of(w_flat, T, K)
    b2 = sq2.args[0]
    wd_rows, h_col = b2.args[0], b2.args[1]
    if not (is_op(wd_rows, aten.index) and is_op(h_col, aten.unsqueeze)):
        raise NearMiss("the down projection is not a bmm of per-row gathered expert weights")
    ids_flat = wd_rows.args[1][0]
    ids = _flat_of(ids_flat, T, K)
    if ids is None or wts is None:
        raise NearMiss("routing tensors are not (tokens, k)")
    found = _swiglu(h_col.args[0])
    if found is None:
        raise NearMiss("the up projection's output is not SwiGLU-gated")
    g, u, sw_nodes = found
    halves = _halves(g, u)
    if halves is None or not is_op(halves[0], aten.squeeze):
        raise NearMiss("gate and up are not the two halves of one per-row bmm")
    sq1, I = halves
    b1 = sq1.args[0]
    wgu_rows, x_col = b1.args[0], b1.args[1]
    if not (is_op(b1, aten.bmm) and is_op(wgu_rows, aten.index) and wgu_rows.args[1][0] is ids_flat
            and is_op(x_col, aten.unsqueeze)):
        raise NearMiss("the up projection is not a bmm of the same experts' gathered weights")
    x = _repeated_rows(x_col.args[0], T, K)
    if x is None:
        raise NearMiss("the rows are not each token repeated k times")
    wgu, wd = wgu_rows.args[0], wd_rows.args[0]
    region = {total, v, mul, sq2, b2, wd_rows, h_col, w_col, *sw_nodes, g, u, sq1, b1, wgu_rows, x_col,
              g.args[0] if g.target is operator.getitem else g}
    site = Site(form="batched_mm", out=_through_convert(total), x=x, ids=ids, weights=wts,
                gate=(wgu, (0, I)), up=(wgu, (I, 2 * I)), down=wd, region=region)
    _exclusive(region, keep=total)
    _check_kernel_limits(site)
    return site


def _repeated_rows(n, T, K) -> Node | None:
    """x (T, H) if n is repeat_interleave(x, K, dim=0): reshape(clone(expand(unsqueeze(x, 1))))."""
    if not is_reshape(n):
        return None
    e, _ = peel(n.args[0], (aten.clone,))
    if not (is_op(e, aten.expand) and is_op(e.args[0], aten.unsqueeze) and e.args[0].args[1] == 1):
        return None
    x = e.args[0].args[0]
    if shape(x) is None or len(shape(x)) != 2 or shape(x)[0] != T or shape(e)[1] != K:
        return None
    return x


# ---- rewrite ---------------------------------------------------------------------------

def _weight_arg(graph, before, part):
    node, sl = part
    if sl is None:
        return node
    return insert_call(graph, before, aten.slice.Tensor, (node, 1, sl[0], sl[1]))


def _rewrite(graph, site: Site) -> None:
    before = site.out
    wg, wu = _weight_arg(graph, before, site.gate), _weight_arg(graph, before, site.up)
    sg, su, sd = site.scales  # only the loop form has FP8 experts, never a fused gate_up to slice
    out = insert_call(graph, before, torch.ops.metainfer.moe_experts.default,
                      (site.x, site.ids, site.weights, wg, wu, site.down, sg, su, sd,
                       site.block[0], site.block[1]))
    if dtype(out) != dtype(site.out):
        out = insert_call(graph, before, torch.ops.prims.convert_element_type.default, (out, dtype(site.out)))
    site.out.replace_all_uses_with(out)
    for a in site.extra_dead:
        graph.erase_node(a)


def _describe(site: Site) -> str:
    T, H = shape(site.x)
    K = shape(site.ids)[1]
    E, Hd, I = shape(site.down)
    fp8 = (f", FP8 e4m3 {site.block[0]}x{site.block[1]} blocks (W8A16)" if site.scales[0] is not None else "")
    return (f"{location(site.out)}: {site.form} experts -> metainfer.moe_experts ({E} experts, top-{K}, "
            f"hidden {H}, expert width {I}, {T} tokens{fp8})")
