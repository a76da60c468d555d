"""Soundness of the causal-mask proof: on randomly built index-arithmetic masks, whenever
the analysis says "causal with offset o", the mask must equal tril(ones, o) exactly."""

import os

import torch
from hypothesis import given, settings, strategies as st

from metainfer.passes import mask_analysis as ma
from metainfer.testing import capture_graph

OPS = ["le", "lt", "ge", "gt"]


def _cmp(x, op, y):
    return {"le": x <= y, "lt": x < y, "ge": x >= y, "gt": x > y}[op]


@st.composite
def mask_programs(draw):
    atoms = draw(st.lists(st.tuples(st.integers(-2, 2), st.integers(-2, 2), st.integers(-3, 3), st.sampled_from(OPS)),
                          min_size=1, max_size=2))
    combine = draw(st.sampled_from(["and", "or"]))
    negate = draw(st.booleans())
    q_start = draw(st.integers(0, 3))
    form = draw(st.sampled_from(["bool", "additive", "tril"]))
    broadcast_q = draw(st.booleans())  # one query position broadcast over all rows
    diag = draw(st.integers(-2, 3))
    sq, sk = draw(st.integers(1, 6)), draw(st.integers(1, 9))
    return dict(atoms=atoms, combine=combine, negate=negate, q_start=q_start, form=form, diag=diag, sq=sq, sk=sk,
                broadcast_q=broadcast_q)


def build(p):
    def f(x):
        if p["form"] == "tril":
            keep = torch.tril(torch.ones(p["sq"], p["sk"], dtype=torch.bool), diagonal=p["diag"])
        else:
            if p.get("broadcast_q"):
                i = torch.arange(p["q_start"], p["q_start"] + 1).view(1, 1) + torch.zeros(p["sq"], 1, dtype=torch.long)
            else:
                i = torch.arange(p["q_start"], p["q_start"] + p["sq"]).view(p["sq"], 1)
            j = torch.arange(p["sk"]).view(1, p["sk"])
            keep = None
            for a, b, c, op in p["atoms"]:
                t = _cmp(a * j + c, op, b * i)
                keep = t if keep is None else (keep & t if p["combine"] == "and" else keep | t)
            if p["negate"]:
                keep = ~keep
        if p["form"] == "additive":
            return torch.where(keep, 0.0, float("-inf")), x + 1
        return keep, x + 1

    return f


@settings(max_examples=int(os.environ.get("MASK_EXAMPLES", 40)), deadline=None)
@given(p=mask_programs())
def test_proof_is_sound(p):
    f = build(p)
    expected, _ = f(torch.zeros(1))
    gm, _ = capture_graph(f, torch.zeros(1))
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    kind = "additive" if p["form"] == "additive" else "keep"
    offset = ma.causal_offset(out, ma.MaskInterpreter(), kind=kind, score_dtype=torch.float32)
    if offset is None:
        return  # unknown is always allowed
    keep = expected == 0 if kind == "additive" else expected
    assert torch.equal(keep, torch.tril(torch.ones(p["sq"], p["sk"], dtype=torch.bool), diagonal=offset)), (p, offset)


def test_recognises_the_common_forms():
    for p, want in [
        (dict(atoms=[(1, 1, 0, "le")], combine="and", negate=False, q_start=0, form="bool", diag=0, sq=4, sk=4), 0),
        (dict(atoms=[(1, 1, 0, "gt")], combine="and", negate=True, q_start=2, form="additive", diag=0, sq=3, sk=5), 2),
        (dict(atoms=[], combine="and", negate=False, q_start=0, form="tril", diag=1, sq=4, sk=6), 1),
    ]:
        f = build(p)
        gm, _ = capture_graph(f, torch.zeros(1))
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
        kind = "additive" if p["form"] == "additive" else "keep"
        assert ma.causal_offset(out, ma.MaskInterpreter(), kind=kind, score_dtype=torch.float32) == want
