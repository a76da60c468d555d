"""fuse_attention on the forms real model code writes: fires, does not fire where it must not,
and the rewritten graph computes the same function (on fresh random inputs)."""

import math

import pytest
import torch
import torch.nn.functional as F

from metainfer.testing import assert_graphs_equivalent, capture_graph, fresh_like, run_pass

B, H, HKV, S, D = 2, 4, 2, 8, 16


def qkv(h=H, hkv=H, s=S, sk=None, d=D, dv=None, dtype=torch.float32):
    sk = s if sk is None else sk
    return (torch.randn(B, h, s, d, dtype=dtype), torch.randn(B, hkv, sk, d, dtype=dtype),
            torch.randn(B, hkv, sk, dv or d, dtype=dtype))


def repeat_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def fuse(fn, *inputs):
    gm, args = capture_graph(fn, *inputs)
    after, rec = run_pass("fuse_attention", gm)
    assert_graphs_equivalent(gm, after, fresh_like(args))
    ops = [n for n in after.graph.nodes if n.target is torch.ops.metainfer.attention.default]
    assert len(ops) == rec.matches
    return rec, ops


def op_args(node):
    q, k, v, mask, scale, causal, offset, zero, softcap, window = (*node.args, 0.0, 0)[:10]
    return dict(q=q.meta["val"].shape, k=k.meta["val"].shape, v=v.meta["val"].shape, mask=mask, scale=scale,
                causal=causal, offset=offset, zero=zero, softcap=softcap, window=window)


# ---- fires -----------------------------------------------------------------------------

def test_plain_softmax_qk_v():
    def f(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v

    rec, (op,) = fuse(f, *qkv())
    a = op_args(op)
    assert rec.matches == 1 and a["mask"] is None and not a["causal"] and a["scale"] == pytest.approx(0.25)
    assert "no mask" in rec.decisions[0]


def test_additive_mask_input_is_passed_through():
    def f(q, k, v, m):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + m, dim=-1) @ v

    rec, (op,) = fuse(f, *qkv(), torch.randn(B, 1, S, S))
    a = op_args(op)
    assert a["mask"] is not None and not a["causal"]


@pytest.mark.parametrize("form", ["triu_additive", "tril_masked_fill", "arange_where_min", "bool_and_where"])
def test_causal_mask_built_in_graph_is_proven_causal(form):
    def f(q, k, v):
        s = q.shape[-2]
        scores = q @ k.transpose(-2, -1) * 0.25
        if form == "triu_additive":
            scores = scores + torch.triu(torch.full((s, s), float("-inf")), diagonal=1)
        elif form == "tril_masked_fill":
            keep = torch.tril(torch.ones(s, s, dtype=torch.bool))
            scores = scores.masked_fill(~keep, float("-inf"))
        elif form == "arange_where_min":
            i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
            scores = scores + torch.where(j <= i, 0.0, torch.finfo(torch.float32).min)[None, None]
        else:
            i, j = torch.arange(s).view(1, 1, s, 1), torch.arange(s).view(1, 1, 1, s)
            keep = (j <= i) & (i >= 0)
            scores = torch.where(keep, scores, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    rec, (op,) = fuse(f, *qkv())
    a = op_args(op)
    assert a["causal"] and a["offset"] == 0 and a["mask"] is None
    assert "proven" in rec.decisions[0]


def test_bottom_right_causal_with_cache_offset():
    past = 5

    def f(q, k, v):  # HF style: query positions are cache_position = arange(past, past + s)
        s, sk = q.shape[-2], k.shape[-2]
        cache_position = torch.arange(past, past + s)
        kv_idx = torch.arange(sk)
        keep = kv_idx[None, None, None, :] <= cache_position[None, None, :, None]
        mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
        w = torch.softmax((q @ k.transpose(2, 3)) * 0.25 + mask, dim=-1, dtype=torch.float32)
        return w @ v

    rec, (op,) = fuse(f, *qkv(s=3, sk=3 + past))
    a = op_args(op)
    assert a["causal"] and a["offset"] == past and a["mask"] is None


@pytest.mark.parametrize("fill", ["-inf", "finfo.min"])
@pytest.mark.parametrize("form", ["hf", "negated_drop", "two_masks", "tight_of_two"])
def test_sliding_window_mask_is_proven(form, fill):
    """Hugging Face's sliding window (key j kept iff i - W < j <= i) and equivalent spellings
    become the op's causal flag and window W = 3, with no mask tensor."""
    def f(q, k, v):
        s = q.shape[-2]
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        lo = float("-inf") if fill == "-inf" else torch.finfo(torch.float32).min
        scores = q @ k.transpose(-2, -1) * 0.25
        if form == "hf":
            keep = (j > i - 3) & (j <= i)
        elif form == "negated_drop":
            keep = ~((j <= i - 3) | (j > i))
        elif form == "two_masks":  # a causal mask, then a window one
            scores = scores + torch.where(j <= i, 0.0, lo)
            keep = (j >= i - 2) & (j <= i + 4)
        else:
            keep = (j > i - 5) & (j <= i) & (j >= i - 2)
        return torch.softmax(scores + torch.where(keep, 0.0, lo), dim=-1) @ v

    rec, (op,) = fuse(f, *qkv())
    a = op_args(op)
    assert a["causal"] and a["offset"] == 0 and a["window"] == 3 and a["mask"] is None, a
    assert "sliding window 3" in rec.decisions[0] and not rec.near_misses


def test_sliding_window_with_cache_offset():
    """Queries at positions past .. past + s - 1 over the whole cache: offset past, window 5."""
    past = 9

    def f(q, k, v):
        s, sk = q.shape[-2], k.shape[-2]
        pos = torch.arange(past, past + s)[:, None]
        kv = torch.arange(sk)[None, :]
        mask = torch.where((kv > pos - 5) & (kv <= pos), 0.0, torch.finfo(torch.float32).min)
        return torch.softmax((q @ k.transpose(2, 3)) * 0.25 + mask, dim=-1) @ v

    rec, (op,) = fuse(f, *qkv(s=4, sk=4 + past))
    a = op_args(op)
    assert a["causal"] and a["offset"] == past and a["window"] == 5 and a["mask"] is None


def test_sliding_window_with_symbolic_sizes():
    """Captured with symbolic lengths: the window is still a constant and every row provably
    keeps a key (offset 0 + s queries <= s keys + 2); equivalent at another length."""
    from metainfer.testing import graph_inputs

    def f(q, k, v):
        s = q.shape[-2]
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        mask = torch.where((j > i - 3) & (j <= i), 0.0, torch.finfo(torch.float32).min)
        return torch.softmax(torch.tanh(q @ k.transpose(-2, -1) * 0.25 / 5.0) * 5.0 + mask, dim=-1) @ v

    q, k, v = qkv()
    for t in (q, k, v):
        torch._dynamo.mark_dynamic(t, 2)
    gm, _ = capture_graph(f, q, k, v, dynamic=None)
    after, rec = run_pass("fuse_attention", gm)
    (op,) = [n for n in after.graph.nodes if n.target is torch.ops.metainfer.attention.default]
    a = op_args(op)
    assert a["causal"] and a["window"] == 3 and a["softcap"] == 5.0 and a["mask"] is None
    assert isinstance(a["q"][2], torch.SymInt)
    assert_graphs_equivalent(gm, after, graph_inputs(gm, qkv(s=13)))


@pytest.mark.parametrize("form", ["gemma2", "reciprocal", "other_factors", "tanh_alone", "bf16"])
def test_soft_capped_scores_fuse(form):
    """Gemma 2's c * tanh(scores / c) before the mask: softcap = the factor outside the tanh,
    scale = softcap x the factors inside (any positive pair is that form exactly)."""
    def f(q, k, v):
        s = q @ k.transpose(-2, -1) * 0.25
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        if form in ("gemma2", "bf16"):
            s = torch.tanh(s / 50.0) * 50.0
        elif form == "reciprocal":
            s = 20.0 * torch.tanh(s * (1 / 20.0))
        elif form == "other_factors":
            s = torch.tanh(s / 4.0) * 3.0
        else:
            s = torch.tanh(s)
        mask = torch.where(j <= i, 0.0, torch.finfo(s.dtype).min)
        return torch.softmax((s + mask).float(), dim=-1).to(q.dtype) @ v

    want = {"gemma2": (50.0, 0.25), "bf16": (50.0, 0.25), "reciprocal": (20.0, 0.25),
            "other_factors": (3.0, 0.25 * 3.0 / 4.0), "tanh_alone": (1.0, 0.25)}[form]
    rec, (op,) = fuse(f, *qkv(dtype=torch.bfloat16 if form == "bf16" else torch.float32))
    a = op_args(op)
    assert (a["softcap"], a["scale"]) == pytest.approx(want) and a["causal"] and a["mask"] is None
    assert f"soft-capped at {want[0]:.4g}" in rec.decisions[0]


def test_hf_eager_gqa_fp32_softmax_bf16():
    def f(q, k, v):  # transformers' eager_attention_forward, dropout p=0 in eval
        k, v = repeat_kv(k, H // HKV), repeat_kv(v, H // HKV)
        w = torch.matmul(q, k.transpose(2, 3)) * (D ** -0.5)
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        w = F.dropout(w, p=0.0, training=False)
        return torch.matmul(w, v).transpose(1, 2).contiguous()

    rec, (op,) = fuse(f, *qkv(hkv=HKV, dtype=torch.bfloat16))
    a = op_args(op)
    assert a["k"][1] == HKV and a["v"][1] == HKV, "K/V are passed un-repeated"
    assert "GQA" in rec.decisions[0]


def test_mqa_by_broadcasting():
    def f(q, k, v):  # single kv head broadcast by matmul
        return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v

    rec, (op,) = fuse(f, *qkv(hkv=1))
    assert op_args(op)["k"][1] == 1


def test_scale_on_q_and_value_dim_differs():
    def f(q, k, v):
        return torch.softmax((q * 0.125) @ k.transpose(-2, -1), dim=-1) @ v

    rec, (op,) = fuse(f, *qkv(dv=24))
    a = op_args(op)
    assert a["scale"] == 0.125 and a["v"][-1] == 24  # the q scaling folded into the op


def test_three_d_batched_attention():
    def f(q, k, v):
        return torch.softmax(torch.bmm(q, k.transpose(1, 2)) / 4.0, dim=-1).bmm(v)

    rec, (op,) = fuse(f, torch.randn(6, S, D), torch.randn(6, S, D), torch.randn(6, S, D))
    assert rec.matches == 1


@pytest.mark.parametrize("form", ["is_causal", "explicit_causal_bool", "explicit_float_mask", "gqa_repeat"])
def test_sdpa_forms(form):
    def f(q, k, v):
        s = q.shape[-2]
        if form == "is_causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if form == "explicit_causal_bool":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.tril(torch.ones(s, s, dtype=torch.bool)))
        if form == "explicit_float_mask":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(s, s) * 0.5)
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)

    rec, (op,) = fuse(f, *qkv(hkv=HKV if form == "gqa_repeat" else H))
    a = op_args(op)
    assert a["zero"], "SDPA's convention for rows with no key"
    if form in ("is_causal", "explicit_causal_bool", "gqa_repeat"):
        assert a["causal"] and a["offset"] == 0 and a["mask"] is None
    else:
        assert a["mask"] is not None and not a["causal"]
    if form == "gqa_repeat":
        assert a["k"][1] == HKV


# ---- must not fire, or must not call it causal -------------------------------------------

def test_not_fused_when_probabilities_are_used_elsewhere():
    def f(q, k, v):
        p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
        return p @ v, p  # output_attentions=True

    rec, ops = fuse(f, *qkv())
    assert rec.matches == 0 and "probabilities" in rec.near_misses[0]


def test_not_fused_when_scores_are_used_elsewhere():
    def f(q, k, v):
        s = q @ k.transpose(-2, -1) * 0.25
        return torch.softmax(s, dim=-1) @ v, s.sum()

    rec, ops = fuse(f, *qkv())
    assert rec.matches == 0 and "scores" in rec.near_misses[0]


def test_not_fused_with_dropout():
    def f(q, k, v):
        p = F.dropout(torch.softmax(q @ k.transpose(-2, -1), dim=-1), p=0.5, training=True)
        return p @ v

    gm, _ = capture_graph(f, *qkv())
    _, rec = run_pass("fuse_attention", gm)
    assert rec.matches == 0


def test_not_fused_when_the_mask_is_scaled():
    def f(q, k, v, m):
        return torch.softmax((q @ k.transpose(-2, -1) + m) * 0.25, dim=-1) @ v

    rec, ops = fuse(f, *qkv(), torch.randn(S, S))
    assert rec.matches == 0 and "scaled" in rec.near_misses[0]


@pytest.mark.parametrize("form, why", [
    ("mask_inside", "inside the soft-cap"),
    ("two_tanh", "two tanh soft-caps"),
    ("negative_cap", "score scale -50.0 is not positive"),
    ("scaled_after_mask", "scaled after an additive mask"),
    ("tensor_cap", "unsupported op aten.mul.Tensor"),
])
def test_soft_caps_the_op_cannot_compute_are_named(form, why):
    """What is not softcap * tanh(scale * q k^T / softcap) followed by the mask does not fuse."""
    def f(q, k, v, m):
        s = q @ k.transpose(-2, -1) * 0.25
        if form == "mask_inside":
            s = torch.tanh((s + m) / 50.0) * 50.0
        elif form == "two_tanh":
            s = torch.tanh(torch.tanh(s / 50.0) * 2.0) * 50.0 + m
        elif form == "negative_cap":
            s = torch.tanh(s / 50.0) * -50.0 + m
        elif form == "scaled_after_mask":
            s = (torch.tanh(s / 50.0) * 50.0 + m) * 0.5
        else:  # a per-key cap: not one number
            s = torch.tanh(s / 50.0) * m.abs() + m
        return torch.softmax(s, dim=-1) @ v

    rec, ops = fuse(f, *qkv(), torch.randn(S, S))
    assert rec.matches == 0 and why in rec.near_misses[0], rec.near_misses


def test_an_unknown_op_on_the_scores_is_named():
    def f(q, k, v, m):
        return torch.softmax(torch.sin(q @ k.transpose(-2, -1)) + m, dim=-1) @ v

    rec, ops = fuse(f, *qkv(), torch.randn(S, S))
    assert rec.matches == 0 and "unsupported op aten.sin.default between the q k^T matmul and the softmax" in \
        rec.near_misses[0]


def test_not_fused_when_fill_value_is_not_minus_infinity():
    def f(q, k, v):
        keep = torch.tril(torch.ones(S, S, dtype=torch.bool))
        return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~keep, -1e4), dim=-1) @ v

    rec, ops = fuse(f, *qkv())
    assert rec.matches == 0 and "-inf" in rec.near_misses[0]


def test_not_fused_over_head_dim_limit():
    def f(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v

    rec, ops = fuse(f, *qkv(d=320))
    assert rec.matches == 0 and "head dims" in rec.near_misses[0]


def test_softmax_over_other_dim_is_not_attention():
    def f(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v

    rec, ops = fuse(f, *qkv())
    assert rec.matches == 0 and not rec.near_misses


@pytest.mark.parametrize("form", ["anti_causal", "window_without_causal", "negative_offset", "from_input",
                                  "window_from_input", "window_negative_offset", "window_keeps_nothing",
                                  "window_slope_2"])
def test_masks_that_are_not_causal_stay_masks(form):
    def f(q, k, v, pad):
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        keep = {"anti_causal": j >= i, "window_without_causal": j > i - 3, "negative_offset": j <= i - 1,
                "from_input": (j <= i) & pad[:, None, None, :],
                "window_from_input": (j <= i) & (j > i - 3) & pad[:, None, None, :],
                "window_negative_offset": (j <= i - 1) & (j > i - 3),  # row 0 keeps nothing
                "window_keeps_nothing": (j <= i) & (j > i), "window_slope_2": (j <= i) & (2 * j > i - 3)}[form]
        return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~keep, float("-inf")), dim=-1) @ v

    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, :2] = False
    rec, (op,) = fuse(f, *qkv(), pad)
    a = op_args(op)
    assert not a["causal"] and not a["window"] and a["mask"] is not None


def test_window_with_rows_that_may_keep_no_key_stays_a_mask():
    """Offset 5, window 2 over 8 x 8: the last rows' windows (keys 11, 12) lie past the keys.
    With a finfo.min fill eager code gives those rows a uniform average, the op would give NaN,
    so the window is not used; the mask goes as a tensor and the near miss says why."""
    def f(q, k, v):
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        keep = (j <= i + 5) & (j > i + 3)
        return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + torch.where(keep, 0.0, -3.0e38), dim=-1) @ v

    rec, (op,) = fuse(f, *qkv())
    a = op_args(op)
    assert not a["causal"] and not a["window"] and a["mask"] is not None
    assert "passed as a tensor: cannot prove every query row keeps a key" in rec.near_misses[0]


# ---- Hugging Face models ------------------------------------------------------------------

def _hf_attention_ops(arch, seq=16, **config):
    """optimize() a tiny HF model with verify=True (eager vs optimized on the example): the
    fuse_attention record and the softcap / window each layer's op got."""
    import metainfer
    from metainfer.testing import tiny_hf_model

    ids = torch.randint(3, 128, (1, seq))
    opt = metainfer.optimize(tiny_hf_model(arch, "eager", **config), "cpu", example_inputs=(ids,),
                             lowering="aot_eager", verify=True)
    rec = opt.report.record("fuse_attention")
    found = [(float(d.split("soft-capped at ")[1].split(";")[0]) if "soft-capped" in d else 0.0,
              int(d.split("sliding window ")[1].split(" ")[0]) if "sliding window" in d else 0)
             for d in rec.decisions]
    return opt, rec, found


def test_gemma2_eager_soft_capped_sliding_window_fuses():
    """Gemma 2 (tiny, head_dim 256, sliding and full layers alternating) with a window of 4
    over 16 tokens: both layers fused, the soft-cap and the window proven, equivalent to eager
    (verify=True) and, on fresh token ids, through the optimized model."""
    opt, rec, found = _hf_attention_ops("Gemma2", sliding_window=4)
    assert rec.matches == 2 and not rec.near_misses, rec.near_misses
    assert found == [(50.0, 4), (50.0, 0)], rec.decisions
    ids = torch.randint(3, 128, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(opt(ids).logits, opt.model(ids).logits, atol=1e-4, rtol=1e-4)


def test_gemma2_through_the_triton_kernel(interpret):
    """The same model with the op running the Triton kernel (interpreted): equivalent to eager."""
    from unittest import mock

    from metainfer.kernels import attention as A

    launched = []
    real = A.launch
    with mock.patch.object(A, "launch", lambda *a, **k: launched.append(a[8:10]) or real(*a, **k)):
        opt, rec, found = _hf_attention_ops("Gemma2", seq=20, sliding_window=5)
    assert rec.matches == 2 and found == [(50.0, 5), (50.0, 0)], rec.decisions
    assert (50.0, 5) in launched and (50.0, 0) in launched, launched


def test_mistral_eager_sliding_window_fuses():
    """Mistral with sliding_window 4 over 16 tokens: its eager mask is the band, proven."""
    opt, rec, found = _hf_attention_ops("Mistral", sliding_window=4)
    assert rec.matches == 2 and found == [(0.0, 4), (0.0, 4)], rec.decisions
