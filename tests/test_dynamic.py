"""Symbolic shapes: passes fire on graphs whose sizes are symbols, the optimized callable is
right at every batch and length, recompilations are few and the report says why, and bad
shapes are refused."""

import pytest
import torch
import torch.nn.functional as F

import metainfer
from metainfer import models
from metainfer.testing import capture_graph, graph_inputs, run_pass, tiny_hf_model
from metainfer.verify import mismatch

ALL = ["fuse_attention", "fuse_rope", "fuse_rmsnorm", "fuse_swiglu"]


def repeat_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def cached_attention(q, k_new, v_new, k_cache, v_cache):
    """One step of attention over a KV cache: queries at positions past..past+s-1."""
    s, past = q.shape[2], k_cache.shape[2]
    k = repeat_kv(torch.cat([k_cache, k_new], dim=2), 2)
    v = repeat_kv(torch.cat([v_cache, v_new], dim=2), 2)
    scores = (q @ k.transpose(-2, -1)) * 0.25
    keep = torch.ones(s, past + s, dtype=torch.bool).tril(diagonal=past)
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).type_as(q) @ v


def step_inputs(b, s, past, d=16):
    return (torch.randn(b, 4, s, d), torch.randn(b, 2, s, d), torch.randn(b, 2, s, d),
            torch.randn(b, 2, past, d), torch.randn(b, 2, past, d))


def capture_symbolic(fn, inputs, dims=((0, 2),)):
    """A graph whose batch and sequence sizes are symbols (head counts and dims stay static, as
    in models, where they come from weight shapes), and a function giving its argument list
    for new inputs. `dims[i]` lists the symbolic dims of input i (the last entry repeats)."""
    for i, t in enumerate(inputs):
        for d in dims[min(i, len(dims) - 1)]:
            if t.shape[d] > 1:
                torch._dynamo.mark_dynamic(t, d)
    gm, args = capture_graph(fn, *inputs, dynamic=None)
    assert any(isinstance(n.meta.get("val"), torch.SymInt) for n in gm.graph.nodes if n.op == "placeholder"), \
        "the graph has symbolic sizes"
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    # each graph tensor is one of the inputs (by position) or a module's parameter (kept)
    where = [next((i for i, x in enumerate(inputs) if x is t), t) for t in tensors]
    return gm, lambda new: graph_inputs(gm, [new[w] if isinstance(w, int) else w for w in where])


def test_attention_over_a_cache_fuses_with_a_symbolic_causal_offset():
    gm, bind = capture_symbolic(cached_attention, step_inputs(2, 5, 7))
    after, rec = run_pass("fuse_attention", gm)
    assert rec.matches == 1, rec.near_misses
    (op,) = [n for n in after.graph.nodes if n.target is torch.ops.metainfer.attention.default]
    q, k, v, mask, scale, causal, offset, zero = op.args
    assert causal and mask is None, "the cache-length mask is proven causal and dropped"
    assert isinstance(offset, torch.fx.Node), "the offset is the cache length, a size of the graph"
    assert "GQA" in rec.decisions[0] and "offset s" in rec.decisions[0]
    for b, s, past in [(2, 5, 7), (3, 2, 30), (2, 9, 2)]:
        new = step_inputs(b, s, past)
        with torch.no_grad():
            assert mismatch(cached_attention(*new), after(*bind(new))[0]) is None, (b, s, past)


def test_one_query_token_over_a_cache():
    """Decode: one new token attends to every cached one (the mask is all True, and proven)."""
    gm, bind = capture_symbolic(cached_attention, step_inputs(2, 1, 9))
    after, rec = run_pass("fuse_attention", gm)
    assert rec.matches == 1 and "1 x s" in rec.decisions[0], rec.decisions + rec.near_misses
    (op,) = [n for n in after.graph.nodes if n.target is torch.ops.metainfer.attention.default]
    assert op.args[3] is None and "keeps every key" in rec.decisions[0], "the all-True mask is proven and dropped"
    for b, past in [(2, 9), (4, 3), (2, 40)]:
        new = step_inputs(b, 1, past)
        with torch.no_grad():
            assert mismatch(cached_attention(*new), after(*bind(new))[0]) is None


def test_k_and_v_lengths_that_are_separate_symbols_are_checked_by_the_op():
    """K and V caches are separate inputs whose lengths Dynamo gives separate symbols; the
    op fuses them and checks equality when it runs, as eager code would fail too."""

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 4, 6, 16), torch.randn(2, 4, 6, 16)
    gm, bind = capture_symbolic(f, (q, k, v))
    after, rec = run_pass("fuse_attention", gm)
    assert rec.matches == 1 and "checked by the op" in rec.decisions[0], rec.decisions + rec.near_misses
    with torch.no_grad():
        assert mismatch(f(q, k, v), after(*bind((q, k, v)))[0]) is None
        with pytest.raises(Exception, match="does not match k shape"):
            after(*bind((q, k, torch.randn(2, 4, 5, 16))))


@pytest.mark.parametrize("p", ALL[1:])
def test_pointwise_passes_fire_on_symbolic_graphs(p):
    model = models.build("llama-tiny", n_layers=1)
    (ids,) = models.example_inputs("llama-tiny", batch=2, seq=9)
    gm, bind = capture_symbolic(model, (ids,), dims=((0, 1),))
    after, rec = run_pass(p, gm)
    assert rec.matches >= 1
    with torch.no_grad():
        for b, s in [(2, 9), (3, 17)]:
            other = torch.randint(0, 256, (b, s))
            assert mismatch(model(other), after(*bind((other,)))[0]) is None


def test_any_batch_and_length_with_few_recompilations():
    model = models.build("llama-tiny")
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    shapes = [(1, 16), (2, 24), (1, 1), (3, 7), (2, 1), (1, 100), (4, 33), (1, 256), (2, 2), (5, 255)]
    for b, s in shapes:
        ids = torch.randint(0, 256, (b, s))
        with torch.no_grad():
            assert mismatch(model(ids), opt(ids)) is None, (b, s)
    r = opt.report
    # the first shapes compile static; then batch and length go symbolic, and sizes of 1 stay
    # specialised: (1, S), (B, S), (1, 1), (B, 1) and the first static graph
    assert len(r.sections) <= 5, [s.why for s in r.sections]
    assert r.recompilations == len(r.sections) - 1
    assert all("size mismatch" in s.why or "<=" in s.why for s in r.sections[1:]), [s.why for s in r.sections]
    # graphs of symbolic length fuse every layer's attention (a length-1 sequence has a single
    # key: Inductor's decompositions turn its matmuls into mul/sum and there is nothing to fuse)
    token_length = [next(i for i in s.inputs if i.startswith("int64["))[:-1].split(", ")[-1] for s in r.sections]
    symbolic = [s for s, n in zip(r.sections, token_length) if not n.isdigit()]
    assert symbolic and all(rec.matches == 2 for s in symbolic for rec in s.records if rec.name == "fuse_attention")
    assert "recompilation" in str(r) and "recompiled:" in str(r)


def test_dynamic_true_compiles_symbolic_from_the_start():
    model = models.build("llama-tiny", n_layers=1)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager", dynamic=True)
    for s in (5, 9, 31):
        ids = torch.randint(0, 256, (2, s))
        with torch.no_grad():
            assert mismatch(model(ids), opt(ids)) is None
    assert len(opt.report.sections) == 1 and "Sym(" in " ".join(opt.report.sections[0].inputs)
    with pytest.raises(ValueError, match="dynamic must be"):
        metainfer.optimize(model, "cpu", dynamic="yes")


def test_too_long_gets_the_models_own_error():
    model = models.build("llama-tiny", n_layers=1)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    opt(torch.randint(0, 256, (1, 8)))
    with pytest.raises(ValueError, match="exceeds max_seq_len 256"):
        opt(torch.randint(0, 256, (1, 257)))


def test_empty_batch_is_refused():
    model = models.build("llama-tiny", n_layers=1)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    with pytest.raises(ValueError, match="empty input"):
        opt(torch.zeros(0, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="empty input"):
        opt(torch.zeros(2, 0, dtype=torch.long))


def test_hugging_face_past_max_positions_is_refused():
    pytest.importorskip("transformers")
    model = tiny_hf_model("Llama", layers=1, max_position_embeddings=32)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    opt(torch.randint(3, 128, (1, 32)))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        opt(torch.randint(3, 128, (1, 33)))
    # generate() is refused before its first step: 30 + 5 passes 32
    with pytest.raises(ValueError, match=r"generating to position 35 \(30 prompt tokens \+ 5 new\) passes the "
                                         r"model's max_position_embeddings \(32\); lower max_new_tokens to 2"):
        opt.generate(torch.randint(3, 128, (1, 30)), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    # a step's cache counts: 3 tokens after 30 cached reach position 33
    with torch.no_grad():
        cache = model(torch.randint(3, 128, (1, 30)), use_cache=True).past_key_values
    with pytest.raises(ValueError, match="reaches position 33"):
        opt(torch.randint(3, 128, (1, 3)), past_key_values=cache)
