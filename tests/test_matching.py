"""The helpers every matcher shares, on small captured graphs: what they accept and what they
must not (expected values written out by hand)."""

import torch

from metainfer.passes import matching as M
from metainfer.testing import capture_graph


def _nodes(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target)]


def test_a_bit_reinterpretation_is_not_a_reshape():
    gm, _ = capture_graph(lambda x: (x.view(torch.int32) + 1, x.view(4, 16) * 2), torch.randn(8, 8))
    (bits,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.view.dtype]
    aten = torch.ops.aten
    (shaped,) = [n for n in gm.graph.nodes if n.target in (aten.view.default, aten.reshape.default)]
    assert not M.is_reshape(bits) and M.is_reshape(shaped)


def test_peel_walks_back_through_what_it_is_told_and_no_further():
    x0 = torch.randn(4, 8)
    gm, _ = capture_graph(lambda x: (x.to(torch.float64).reshape(8, 4) * 2).sum(), x0)
    (mul,) = _nodes(gm, "aten.mul")
    view, chain = M.peel(mul.args[0], M.is_reshape)
    assert len(chain) == 1 and M.is_reshape(chain[0])
    source, casts = M.peel(view, M.CONVERT_OPS)
    assert source.op == "placeholder" and len(casts) == 1 and casts[0].meta["val"].dtype == torch.float64
    # single_use stops before a node with two users
    gm2, _ = capture_graph(lambda x: (lambda y: y.reshape(32) + y.sum())(x.reshape(8, 4)), x0)
    (add,) = _nodes(gm2, "aten.add")
    src, walked = M.peel(add.args[0], M.is_reshape, single_use=True)
    assert len(walked) == 1 and M.is_reshape(src)  # the (8, 4) view feeds the sum too


def test_untransposed_by_rank():
    gm, _ = capture_graph(lambda w2, w3: (w2.t() * 1, w2.permute(1, 0) * 1, w3.permute(0, 2, 1) * 1,
                                          w3.permute(1, 0, 2) * 1), torch.randn(3, 5), torch.randn(2, 3, 5))
    muls = _nodes(gm, "aten.mul")
    t2, p2, p3, other = (m.args[0] for m in muls)
    assert M.untransposed(t2, 2) is not None and M.untransposed(p2, 2) is not None
    assert M.untransposed(p3, 3) is not None and M.untransposed(p3, 2) is None  # a 3-D permute is not a 2-D one
    assert M.untransposed(other) is None  # swaps the first two dims, not the last two


def test_escaping_uses_names_each_use_outside_the_region():
    gm, _ = capture_graph(lambda x: (lambda e: (e / e.sum(-1, keepdim=True), e.max()))(x.exp()), torch.randn(4, 8))
    (exp,) = _nodes(gm, "aten.exp")
    (s,) = _nodes(gm, "aten.sum")
    (div,) = _nodes(gm, "aten.div")
    region = {exp, s, div}
    escaped = M.escaping_uses([exp, s, div], region, exits=(div,))
    assert [(n.name, u.target) for n, u in escaped] == [(exp.name, torch.ops.aten.max.default)]
    assert M.escaping_uses([exp, s, div], region | {escaped[0][1]}, exits=(div,)) == []
