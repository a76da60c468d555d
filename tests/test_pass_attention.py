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
    q, k, v, mask, scale, causal, offset, zero = node.args
    return dict(q=q.meta["val"].shape, k=k.meta["val"].shape, v=v.meta["val"].shape, mask=mask, scale=scale,
                causal=causal, offset=offset, zero=zero)


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


@pytest.mark.parametrize("masked", [False, True])
def test_soft_capped_scores_are_a_named_near_miss(masked):
    """Gemma 2's logit soft-capping, cap * tanh(scores / cap), with and without a mask after it."""
    def f(q, k, v, m):
        s = torch.tanh(q @ k.transpose(-2, -1) * 0.25 / 50.0) * 50.0
        return torch.softmax(s + m if masked else s, dim=-1) @ v

    rec, ops = fuse(f, *qkv(), torch.randn(S, S))
    assert rec.matches == 0 and rec.near_misses[0].endswith("attention not fused: logit soft-capping (cap * "
                                                          "tanh(scores / cap), as in Gemma 2): the fused op has no "
                                                          "soft-cap (tanh)")


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


@pytest.mark.parametrize("form", ["anti_causal", "sliding_window", "negative_offset", "from_input"])
def test_masks_that_are_not_causal_stay_masks(form):
    def f(q, k, v, pad):
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        keep = {"anti_causal": j >= i, "sliding_window": (j <= i) & (j > i - 3), "negative_offset": j <= i - 1,
                "from_input": (j <= i) & pad[:, None, None, :]}[form]
        return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~keep, float("-inf")), dim=-1) @ v

    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, :2] = False
    rec, (op,) = fuse(f, *qkv(), pad)
    a = op_args(op)
    assert not a["causal"] and a["mask"] is not None


def test_gemma2_eager_attention_names_soft_capping():
    """Hugging Face Gemma 2 (eager attention): the near miss names the soft-capping, which is
    what stops the fusion (the same model with attn_logit_softcapping=None fuses)."""
    import metainfer
    from metainfer.testing import tiny_hf_model

    ids = torch.randint(0, 128, (1, 8))
    capped = metainfer.optimize(tiny_hf_model("Gemma2", head_dim=16), "cpu", example_inputs=(ids,),
                                lowering="aot_eager")
    rec = capped.report.record("fuse_attention")
    assert rec.matches == 0 and len(rec.near_misses) == 2
    assert all("logit soft-capping" in m for m in rec.near_misses), rec.near_misses
    plain = metainfer.optimize(tiny_hf_model("Gemma2", head_dim=16, attn_logit_softcapping=None), "cpu",
                               example_inputs=(ids,), lowering="aot_eager")
    assert plain.report.record("fuse_attention").matches == 2
