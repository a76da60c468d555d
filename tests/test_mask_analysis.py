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


def test_recognises_the_common_forms():
    for p, want in [
        (dict(atoms=[(1, 1, 0, "le")], combine="and", negate=False, q_start=0, form="bool", diag=0, sq=4, sk=4), 0),
        (dict(atoms=[(1, 1, 0, "gt")], combine="and", negate=True, q_start=2, form="additive", diag=0, sq=3, sk=5), 2),
        (dict(atoms=[], combine="and", negate=False, q_start=0, form="tril", diag=1, sq=4, sk=6), 1),
    ]:
        assert _causal_window(build(p)) == (want, 0)  # causal with that offset, no window


def _band(sq, sk, offset, window):
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    keep = j <= i + offset
    return keep & (j > i + offset - window) if window else keep


def _causal_window(f):
    gm, _ = capture_graph(f, torch.zeros(1))
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    kind = "additive" if out.meta["val"].dtype.is_floating_point else "keep"
    return ma.causal_window(out, ma.MaskInterpreter(), kind=kind, score_dtype=torch.float32)


@settings(max_examples=int(os.environ.get("MASK_EXAMPLES", 40)), deadline=None)
@given(p=mask_programs())
def test_window_proof_is_sound_on_any_program(p):
    """Whenever the analysis says "causal with offset o and window w", the mask is that band."""
    _assert_window_sound(p)


def _assert_window_sound(p):
    f = build(p)
    expected, _ = f(torch.zeros(1))
    found = _causal_window(f)
    if found is None:
        return
    keep = expected == 0 if p["form"] == "additive" else expected
    assert torch.equal(keep, _band(p["sq"], p["sk"], *found)), (p, found)


_FLIP = {"le": "gt", "lt": "ge", "ge": "lt", "gt": "le"}


@st.composite
def band_programs(draw):
    """Near-bands: j <= i + u and j >= i + u - w + 1 (each written with < or <=, > or >=), now and
    then with a slope of 2 on one side, a third bound, a width below 1, or an or for an and; half
    of them written as the drop mask (the flipped bounds or-ed, then negated)."""
    u, w = draw(st.integers(-2, 5)), draw(st.sampled_from([-1, 0] + list(range(1, 8)) * 3))
    lo = u - w + 1

    def slope():
        return draw(st.sampled_from([(1, 1)] * 8 + [(2, 1), (1, 2)]))

    atoms = [(*slope(), *draw(st.sampled_from([(-u, "le"), (-u - 1, "lt")]))),
             (*slope(), *draw(st.sampled_from([(-lo, "ge"), (-lo + 1, "gt")])))]
    if draw(st.integers(0, 3)) == 0:
        atoms.append((*slope(), draw(st.integers(-6, 6)), draw(st.sampled_from(OPS))))
    combine = draw(st.sampled_from(["and"] * 7 + ["or"]))
    negate = draw(st.booleans())
    if negate:  # De Morgan: not (flipped or flipped) is the same band
        atoms = [(a, b, c, _FLIP[op]) for a, b, c, op in atoms]
        combine = {"and": "or", "or": "and"}[combine]
    return dict(atoms=draw(st.permutations(atoms)), combine=combine, negate=negate, q_start=draw(st.integers(0, 4)),
                form=draw(st.sampled_from(["bool", "additive"])), diag=0, sq=draw(st.integers(1, 8)),
                sk=draw(st.sampled_from([1, 2] + list(range(6, 14)) * 2)), broadcast_q=False)


@settings(max_examples=int(os.environ.get("MASK_EXAMPLES", 60)), deadline=None)
@given(p=band_programs())
def test_window_proof_is_sound_on_bands(p):
    _assert_window_sound(p)


def test_recognises_hugging_face_sliding_window():
    """transformers' sliding_window_causal_mask_function as its eager mask writes it (kv > q - W
    and kv <= q, queries at cache positions q_start..): offset q_start, window W; a window wider
    than every distance folds away to plain causal; a lower bound alone is no causal mask."""
    def hf(q_start, sq, sk, window, fill=torch.finfo(torch.float32).min):
        def f(x):
            q = torch.arange(q_start, q_start + sq)[:, None]
            kv = torch.arange(sk)[None, :]
            return torch.where((kv > q - window) & (kv <= q), 0.0, fill), x + 1
        return f

    assert _causal_window(hf(0, 16, 16, 4)) == (0, 4)
    assert _causal_window(hf(7, 3, 10, 5, float("-inf"))) == (7, 5)
    assert _causal_window(hf(0, 8, 8, 40)) == (0, 0)
    assert _causal_window(lambda x: (torch.arange(6)[None, :] > torch.arange(6)[:, None] - 3, x + 1)) is None
