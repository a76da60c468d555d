"""mla_decode: MLA decompress-then-attend over the latent cache -> the absorbed form.

The fallback keeps MLA's compressed cache (latent c (B, T, R) and shared rope key (B, T, P))
but decompresses all of it on every step: K_nope, V = c @ W_kv_b^T, an (B, T, H, nope + v)
tensor, O(T x R x H x (nope + v)) work and memory per token generated. Since
q_nope . k_nope[t] = (q_nope W_UK) . c[t] and sum_t p_t v[t] = (sum_t p_t c[t]) W_UV^T, the
same attention is

    q_lat = q_nope @ W_UK          (B, H, S, R), W_UK = W_kv_b[h, :nope, :]
    o_lat = softmax(scale * (q_lat . c + q_pe . k_pe) + mask) @ c     metainfer::mla_decode
    out   = o_lat @ W_UV^T         (B, H, S, v), W_UV = W_kv_b[h, nope:, :]

which reads the cache once as both key and value. The pass rewrites a fused attention (from
mla_prefill / sparse_mla) whose K is [c W_UK^T, broadcast k_pe] and V is c W_UV^T, where the
cost model predicts the graph faster with the absorbed form (each site rewritten on a copy
and priced by the simulator): decode steps (few queries over a long cache), not prefill.
`pass_options={"mla_decode": True}` absorbs every site (to measure the alternative).
"""

from __future__ import annotations

import math
import operator
from types import SimpleNamespace

import torch


from . import base
from .base import MatchPass, register
from .options import Option
from .matching import (
    VIEW_OPS, Node, aten, arg, dtype, insert_call, is_op, linear_operands, location, peel, same, shape, untransposed, escaping_uses,
    sizes_available,
)

_ATTENTION = torch.ops.metainfer.attention.default
_SPARSE = torch.ops.metainfer.sparse_attention.default


class NearMiss(base.NearMiss):
    """MLA decode recognised, but not rewritten; the message says why."""


@register
class MLADecode(MatchPass):
    """MLA attention over a decompressed latent cache -> absorbed form + metainfer::mla_decode"""

    name = "mla_decode"
    options = (Option("mla_decode", bool, False, "absorb every MLA decode site, paying or not (to measure the "
                      "alternative)"),)

    missed = "MLA decode not absorbed"
    misses = (NearMiss,)

    def start(self, graph, ctx):
        return SimpleNamespace(graph=graph, ctx=ctx, decided={})  # sites of the same sizes decide alike

    def match(self, node, state):
        if node.target not in (_ATTENTION, _SPARSE):
            return None
        site = _match(node)
        if site is None:
            return None
        if node.target is _ATTENTION and (arg(node, 8, "softcap", 0.0), arg(node, 9, "window", 0)) != (0.0, 0):
            raise NearMiss("the attention is soft-capped or windowed, which metainfer.mla_decode does not compute")
        if not sizes_available(state.graph, node, [shape(site["q_nope"]), shape(node)], site["region"]):
            raise NearMiss("a symbolic size the absorbed form needs is not available")
        return site

    def refuse(self, node, site, state):
        key = _signature(node, site)
        if key not in state.decided:
            state.decided[key] = ((True, "forced (pass option mla_decode)") if state.ctx.options["mla_decode"]
                                  else _pays(state.graph, node, site, state.ctx.target))
        pays, site["why"] = state.decided[key]
        return None if pays else f"MLA kept decompressed: {site['why']}"

    def rewrite(self, node, site, state):
        _rewrite(state.graph, node, site)

    def describe(self, node, site):
        return (f"{location(node)}: MLA over the latent cache -> absorbed form + "
                f"metainfer.mla_decode{' (sparse)' if node.target is _SPARSE else ''}; {site['why']}")


# ---- matching -------------------------------------------------------------------------------

def _bhsd(n) -> tuple[Node, bool]:
    """(x, swapped): n is x, or permute(x, [0, 2, 1, 3]) (x in (B, S, H, D) layout)."""
    if is_op(n, aten.permute) and list(n.args[1]) == [0, 2, 1, 3]:
        return n.args[0], True
    return n, False


def _last_dim_parts(n) -> tuple[list[Node], list[Node]] | None:
    """([a, b], the nodes joining them) if n = cat([a, b], -1), or a and b written into the two
    halves of the last dim of a new tensor (slice_scatter / copy: transformers' expand_kv)."""
    last = len(shape(n)) - 1
    if is_op(n, aten.cat) and len(n.args[0]) == 2 and (n.args[1] if len(n.args) > 1 else 0) in (-1, last):
        return list(n.args[0]), [n]
    if not is_op(n, aten.slice_scatter) or not is_op(n.args[0], aten.slice_scatter):
        return None
    inner = n.args[0]
    if not is_op(inner.args[0], aten.empty, aten.new_empty):
        return None
    a, a_nodes = _written(inner.args[1])
    b, b_nodes = _written(n.args[1])
    width = shape(a)[-1]
    if not (n.args[2] in (-1, last) and inner.args[2] in (-1, last) and inner.args[3] == 0
            and inner.args[4] == width and n.args[3] == width and n.args[4] >= shape(n)[-1]):
        return None
    return [a, b], [n, inner, inner.args[0], *a_nodes, *b_nodes]


def _written(v) -> tuple[Node, list[Node]]:
    """What a functionalised `dst[...].copy_(src)` writes: src (copy(dst_slice, src))."""
    if is_op(v, aten.copy):
        return v.args[1], [v, v.args[0]]
    return v, []


def _split_of(n) -> tuple[Node, int] | None:
    """(source, part) if n is part `part` of a split of the last dim."""
    if n.target is operator.getitem and is_op(n.args[0], aten.split, aten.split_with_sizes):
        sp = n.args[0]
        dim = sp.args[2] if len(sp.args) > 2 else 0
        if dim in (-1, len(shape(sp.args[0])) - 1):
            return sp.args[0], n.args[1]
    return None


def _match(att: Node):
    q, k, v = att.args[:3]
    if att.target is _SPARSE:
        fill = att.args[9]
        if fill != -math.inf:
            raise NearMiss("the sparse selection has a finite fill (dense recomputation of masked rows)")
    q4, q_sw = _bhsd(q)
    k4, k_sw = _bhsd(k)
    v4, v_sw = _bhsd(v)
    if not (q_sw == k_sw == v_sw):
        return None
    qparts, kparts = _last_dim_parts(q4), _last_dim_parts(k4)
    vs = _split_of(v4)
    if qparts is None or kparts is None or vs is None:
        return None
    (k_nope, k_pe_b), k_nodes = kparts
    qparts = qparts[0]
    ks = _split_of(k_nope)
    if ks is None or ks[0] is not vs[0] or (ks[1], vs[1]) != (0, 1):
        return None
    kv = vs[0]  # (B, T, H, nope + v) [or (B, H, T, .) when the layout was swapped before the split]
    # kv = view(c @ W^T), possibly transposed to heads-major
    kv_src, kv_sw = _bhsd(kv)
    dec, views = peel(kv_src, VIEW_OPS)
    found = linear_operands(dec)
    if found is None or found[2] is not None:
        return None
    lat_flat, wt, _ = found
    W = untransposed(wt, 2)
    if W is None:
        return None
    latent, lat_views = peel(lat_flat, (*VIEW_OPS, aten.expand))
    if shape(latent) is None or len(shape(latent)) not in (3, 4) or (len(shape(latent)) == 4 and shape(latent)[1] != 1):
        return None  # (B, T, R), or (B, 1, T, R) as transformers keeps it; not a paged layout
    R = shape(W)[1]
    H = shape(q)[1]
    nope, dv = shape(k_nope)[-1], shape(v)[-1]
    if not (isinstance(R, int) and shape(W)[0] == H * (nope + dv) and same(shape(latent)[-1], R)):
        raise NearMiss(f"W_kv_b {list(shape(W))} does not decompress a latent of {R} into {H} x ({nope} + {dv})")
    # the rope key, shared by every head: an expand of (B, T, 1, P) ((B, 1, T, P) in heads-major layout)
    kpe_src, _ = peel(k_pe_b, (aten.expand,))
    head_axis = 2 if k_sw else 1
    if shape(kpe_src) is None or len(shape(kpe_src)) != 4 or shape(kpe_src)[head_axis] != 1:
        return None
    q_nope, q_pe = qparts
    if not (same(shape(q_nope)[-1], nope) and same(shape(q_pe)[-1], shape(kpe_src)[-1])):
        return None
    if dtype(W) != dtype(q) or dtype(latent) != dtype(q):
        raise NearMiss(f"weights {dtype(W)} / latent {dtype(latent)} differ from queries {dtype(q)}")
    # everything from the decompression GEMM to the attention goes with the rewrite
    inner = {k, v, k4, v4, k_nope, k_pe_b, kv, kv_src, dec, wt, *views, k_nope.args[0], *k_nodes}
    if is_op(dec, aten.bmm):  # the broadcast weight and the batched views of the latent go too
        inner |= {dec.args[1], *peel(dec.args[1], (*VIEW_OPS, aten.expand))[1], *lat_views}
    escaped = escaping_uses(inner, inner | {att}, size_reads=True)
    if escaped:
        n, u = escaped[0]
        raise NearMiss(f"the decompressed keys/values ({n.name}) are also used by {u.name}")
    region = inner
    return dict(q_nope=q_nope, q_pe=q_pe, q_swapped=q_sw, latent=latent, kpe=kpe_src, head_axis=head_axis,
                W=W, R=R, H=H, nope=nope, dv=dv, region=region)


def _signature(att: Node, site) -> tuple:
    return (att.target, str(shape(site["q_nope"])), str(shape(site["q_pe"])), str(shape(site["latent"])),
            str(shape(att)), site["H"], site["R"], site["nope"], site["dv"], site["q_swapped"])


def _pays(graph, att: Node, site, target) -> tuple[bool, str]:
    """Whether the simulator predicts the graph faster with this site absorbed (rewritten on
    a copy), and the figures."""
    from metainfer.hardware.simulate import simulate

    from .lookahead import trial

    def absorb(g, node_map):
        copy = node_map[att]
        _rewrite(g, copy, _match(copy))

    before = simulate(graph, target).step_seconds
    after = simulate(trial(graph, absorb), target).step_seconds
    tokens, rank = shape(site["latent"])[-2:]
    figures = (f"{tokens} cached tokens, latent {rank}: predicted step {after * 1e6:.1f} us absorbed, "
               f"{before * 1e6:.1f} us decompressed")
    return after < before, figures


# ---- rewrite --------------------------------------------------------------------------------

def _call(graph, before, op, *args):
    return insert_call(graph, before, op, args)


def _rewrite(graph, att: Node, site) -> None:
    g = lambda op, *a: _call(graph, att, op, *a)  # noqa: E731
    H, R, nope, dv = site["H"], site["R"], site["nope"], site["dv"]
    q_nope, q_pe = site["q_nope"], site["q_pe"]
    if site["q_swapped"]:  # (B, S, H, d) -> (B, H, S, d)
        q_nope = g(aten.permute.default, q_nope, [0, 2, 1, 3])
        q_pe = g(aten.permute.default, q_pe, [0, 2, 1, 3])
    B, _, S, _ = shape(q_nope)
    w3 = g(aten.reshape.default, site["W"], [H, nope + dv, R])
    w_uk = g(aten.slice.Tensor, w3, 1, 0, nope)  # (H, nope, R)
    w_uv_t = g(aten.permute.default, g(aten.slice.Tensor, w3, 1, nope, nope + dv), [0, 2, 1])  # (H, R, dv)
    # q_lat = q_nope @ W_UK per head: (H, B*S, nope) @ (H, nope, R)
    qh = g(aten.reshape.default, g(aten.permute.default, q_nope, [1, 0, 2, 3]), [H, -1, nope])
    q_lat = g(aten.bmm.default, qh, w_uk)
    q_lat = g(aten.permute.default, g(aten.reshape.default, q_lat, [H, B, S, R]), [1, 0, 2, 3])
    latent = site["latent"]
    if len(shape(latent)) == 4:  # (B, 1, T, R)
        latent = g(aten.squeeze.dim, latent, 1)
    kpe = site["kpe"]  # (B, T, 1, P) or (B, 1, T, P)
    kpe = g(aten.squeeze.dim, kpe, site["head_axis"])
    scale, causal, offset, zero = att.args[4:8] if att.target is _ATTENTION else att.args[5:9]
    mask = att.args[3] if att.target is _ATTENTION else att.args[4]
    indices = None if att.target is _ATTENTION else att.args[3]
    o_lat = g(torch.ops.metainfer.mla_decode.default, q_lat, q_pe, latent, kpe, indices, mask, scale, causal,
              offset, zero)
    oh = g(aten.reshape.default, g(aten.permute.default, o_lat, [1, 0, 2, 3]), [H, -1, R])
    out = g(aten.bmm.default, oh, w_uv_t)  # (H, B*S, dv)
    out = g(aten.permute.default, g(aten.reshape.default, out, [H, B, S, dv]), [1, 0, 2, 3])
    if dtype(out) != dtype(att):
        out = g(torch.ops.prims.convert_element_type.default, out, dtype(att))
    att.replace_all_uses_with(out)
