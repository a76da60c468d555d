"""mla_prefill: MLA's decompress-then-attend attention -> metainfer::attention with distinct
query/key and value head dims.

MLA (DeepSeek-V2/V3) attends with query/key heads of qk_nope + qk_rope dims (e.g. 192) and
value heads of v_head_dim (e.g. 128). Kernels that take one head dim force ports to pad V with
zeros up to the query's head dim and slice the output back (`F.pad(v, [0, 64])`, then
`out[..., :128]`): a third more V reads and output writes. This pass fuses the attention
(every form `fuse_attention` recognises) where the value head dim differs from the query's,
or where V is zero-padded and the output sliced back to V's real width; the padding is
dropped and the op reads V at its own width. It runs before `fuse_attention`, which fuses
every other attention.
"""

from __future__ import annotations

from . import attention_forms as forms
from . import fuse_attention as fa
from . import base
from .base import register
from .matching import Node, aten, constant_value, is_op, ndim, same, shape


class NearMiss(base.NearMiss):
    """MLA attention recognised, but not fused; the message says why."""


@register
class MLAPrefill(fa.FuseAttention):
    """MLA attention (v head dim != q head dim, or V zero-padded) -> metainfer::attention, unpadded"""

    name = "mla_prefill"
    missed = "MLA attention not fused"
    misses = (NearMiss,)

    def match(self, node, interp):
        if not (is_op(node, aten.bmm) or node.target in forms.SDPA_OPS):
            return None
        try:
            m = fa.match_site(node, interp)
        except forms.NearMiss as e:
            if _looks_mla(node):
                raise NearMiss(str(e)) from None
            return None  # not MLA: fuse_attention reports it
        if m is None:
            return None
        unpadded = _drop_v_padding(m)
        _, _, _, D, _, _, Dv, _, _ = m.dims()
        if not unpadded and same(D, Dv):
            return None  # ordinary attention: fuse_attention's
        return m, unpadded, D, Dv

    def rewrite(self, node, site, interp):
        fa.rewrite(node.graph, site[0])

    def notes(self, site):
        return []

    def describe(self, node, site):
        m, unpadded, D, Dv = site
        how = f"V zero-padding {unpadded} -> {Dv} dropped" if unpadded else "V read at its own width"
        return f"{fa.describe(m, node)}; MLA: q/k head {D}, v head {Dv}, {how}"


def _zero_pad_last(n) -> tuple[Node, int] | None:
    """(x, padded width) if n is constant_pad_nd(x, [0, p], 0): zeros appended to the last dim."""
    if not is_op(n, aten.constant_pad_nd):
        return None
    pad = list(n.args[1])
    value = n.args[2] if len(n.args) > 2 else n.kwargs.get("value", 0.0)
    if len(pad) != 2 or pad[0] != 0 or not isinstance(pad[1], int) or pad[1] <= 0 or constant_value(value) != 0:
        return None
    return n.args[0], shape(n)[-1]


def _slice_to(u, width) -> bool:
    """u is x[..., :width] (a slice of the last dim from 0, step 1)."""
    if not is_op(u, aten.slice) or ndim(u) is None:
        return False
    args = list(u.args) + [None] * (5 - len(u.args))
    _, dim, start, end, step = args[:5]
    last = dim in (-1, ndim(u) - 1)
    return last and start in (0, None) and (step in (1, None)) and end is not None and same(shape(u)[-1], width)


def _drop_v_padding(m: forms.Site) -> int | None:
    """If V is zero-padded and every use of the output slices the padding off, read V unpadded
    and let the slices take the op's output; returns the padded width, else None."""
    found = _zero_pad_last(m.v.node)
    if found is None or m.unsqueeze_batch or m.v.transpose or m.replace_3d or not m.replace:
        return None
    v, padded = found
    width = shape(v)[-1]
    slices = [u for r in m.replace for u in r.users]
    if not slices or not all(_slice_to(u, width) for u in slices):
        return None
    m.v = forms.Operand(v, expand_batch=m.v.expand_batch)
    m.replace = slices
    return padded


def _looks_mla(node: Node) -> bool:
    """An SDPA whose V is zero-padded or narrower than Q (for near-miss reports only)."""
    if node.target not in forms.SDPA_OPS or len(node.args) < 3:
        return False
    q, v = node.args[0], node.args[2]
    if _zero_pad_last(v) is not None:
        return True
    return shape(q) is not None and shape(v) is not None and not same(shape(q)[-1], shape(v)[-1])

