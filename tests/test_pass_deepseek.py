"""The DeepSeek passes (fp8_gemm, fuse_moe, mla_prefill, sparse_mla, mla_decode) on the
graphs of models/deepseek.py and of Hugging Face's DeepSeek-V3 / V3.2: each fires where it
should (counts), stays away where it must not (with the reason in the report), and the
rewritten graph computes the same function."""

import copy
import functools
import operator
import math

import pytest
import torch
import torch.nn.functional as F

from metainfer import models
from metainfer.hardware import targets
from metainfer.kernels import fp8_gemm as F8
from metainfer.kernels import ops
from metainfer.passes import PassManager, get_pass
from metainfer.testing import capture_graph, count_calls, run_pass, tiny_hf_model
from metainfer.verify import mismatch

M = torch.ops.metainfer
HF_TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
               num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
               n_shared_experts=1, first_k_dense_replace=1)
HF_DSA = dict(index_n_heads=2, index_head_dim=16, index_topk=4)


def run(gm, *names, options=None):
    after = copy.deepcopy(gm)
    mgr = PassManager([get_pass(n) for n in names], targets.get("cpu"), explicit=True, options=options)
    mgr(after.graph)
    after.recompile()
    return after, {r.name: r for r in mgr.records}


def outputs(gm, args):
    with torch.no_grad():
        return gm(*args)


def assert_same(gm, after, args, tol=None):
    why = mismatch(outputs(gm, args), outputs(after, args))
    assert why is None, why


@functools.lru_cache(maxsize=None)
def ds_graph(name, dtype=torch.float32, seq=8, decode=False, **cfg):
    """(graph, inputs) of models/deepseek `name`: a prefill over `seq` tokens, or one decode
    step after it through the latent cache."""
    m = models.build(name, dtype=dtype, **cfg)
    (ids,) = models.example_inputs(name, batch=2, seq=seq)
    if not decode:
        return capture_graph(lambda x: m(x), ids)
    m.setup_cache(2, seq + 1)
    m(ids, start_pos=0)
    return capture_graph(lambda x: m(x, start_pos=seq), ids[:, -1:])


@functools.lru_cache(maxsize=None)
def hf_graph(arch, attn="eager", experts="grouped_mm", padded=True):
    m = tiny_hf_model(arch, attn, layers=2, **HF_TINY, **(HF_DSA if arch == "DeepseekV32" else {}))
    m.set_experts_implementation(experts)
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 10, dtype=torch.long)
    if padded:
        am[1, :3] = 0  # left padding: fully masked query rows
    return capture_graph(lambda x, a: m(x, attention_mask=a).logits, ids, am)


# ---- fp8_gemm ---------------------------------------------------------------------------

def test_fp8_gemm_fires_on_every_fp8_linear():
    gm, args = ds_graph("deepseek-v32-tiny-fp8")
    after, rec = run(gm, "fp8_gemm")
    # per layer: wq_a, wq_b, wkv_a, wkv_b, wo, indexer wq_b/wk; dense MLP (3) + shared experts (3);
    # + 8 experts x 3 in the loop (fuse_moe, which runs first in the pipeline, would take those)
    assert rec["fp8_gemm"].matches == 2 * 7 + 3 + 3 + 8 * 3, rec["fp8_gemm"].near_misses
    assert count_calls(after, M.fp8_linear) == 44
    assert "W8A16" in rec["fp8_gemm"].decisions[0] and "32x32 block scales" in rec["fp8_gemm"].decisions[0]
    assert_same(gm, after, args)
    assert not any(n.target is torch.ops.prims.convert_element_type.default and
                   n.args[0].meta["val"].dtype == torch.float8_e4m3fn for n in after.graph.nodes if n.op == "call_function"
                   and n.users), "the FP8 weights are still dequantised"


def test_fp8_gemm_bf16_within_bf16_tolerance_of_the_fallback():
    # dense layers only: bf16 rounding differences would flip MoE routing and DSA top-k choices
    # (the eager model is that sensitive itself); routing is tested in fp32 and pinned in bf16
    gm, args = ds_graph("deepseek-tiny", torch.bfloat16, fp8=True, quant_block=32, n_dense_layers=2)
    after, rec = run(gm, "fp8_gemm")
    assert rec["fp8_gemm"].matches == 2 * 5 + 2 * 3
    assert_same(gm, after, args)


def test_fp8_gemm_w8a8_by_option_and_by_target(tmp_path):
    gm, args = ds_graph("deepseek-tiny", fp8=True, quant_block=32, n_layers=1)
    after, rec = run(gm, "fp8_gemm", options={"fp8_mode": "w8a8"})
    assert all("W8A8" in d for d in rec["fp8_gemm"].decisions)
    ref, out = outputs(gm, args)[-1], outputs(after, args)[-1]
    err = (out - ref).norm() / ref.norm()
    assert 0 < err < 0.05  # activation quantisation: ~2^-5 per product, averaged (kernels/fp8_gemm.py)
    t = targets.from_dict({**_toml("cpu"), "passes": {"fp8_mode": "w8a8"}})
    mgr = PassManager([get_pass("fp8_gemm")], t, explicit=True)
    g2 = copy.deepcopy(gm)
    mgr(g2.graph)
    assert all("W8A8" in d for d in mgr.records[0].decisions)
    with pytest.raises(Exception, match="fp8_mode"):
        run(gm, "fp8_gemm", options={"fp8_mode": "w4a4"})


def _toml(name):
    import tomllib
    from pathlib import Path

    import metainfer.hardware.targets as T
    return tomllib.loads((Path(T.__file__).parent / f"{name}.toml").read_text())


def _dequant_linear(x, w, s, block):
    return F.linear(x, models.deepseek.weight_dequant(w, s, block, x.dtype))


def test_fp8_gemm_does_not_fire_on_unsupported_formats_or_scales():
    x = torch.randn(5, 64)
    w, s = F8.quantize_weight(torch.randn(96, 64), 32, 32)
    # e5m2 weights: recognised, refused with the reason
    gm, args = capture_graph(lambda x, w, s: _dequant_linear(x, w, s, 32), x, w.float().to(torch.float8_e5m2), s)
    after, rec = run_pass("fp8_gemm", gm)
    assert rec.matches == 0 and "not supported" in rec.near_misses[0]
    # scales expanded with a block size that is not a power of two: not a block map we can prove
    gm, args = capture_graph(lambda x, w, s: _dequant_linear(x, w, s, 24), x, w, torch.rand(4, 3))
    after, rec = run_pass("fp8_gemm", gm)
    assert rec.matches == 0 and "blocks" in rec.near_misses[0]
    # a plain bf16 linear is not FP8
    gm, args = capture_graph(lambda x, w: F.linear(x, w), x, torch.randn(96, 64))
    assert run_pass("fp8_gemm", gm)[1].matches == 0


# ---- fuse_moe ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,dtype", [("deepseek-tiny", torch.float32), ("deepseek-v32-tiny-fp8", torch.float32),
                                        ("deepseek-tiny", torch.bfloat16)])
def test_fuse_moe_on_the_reference_loop(name, dtype):
    gm, args = ds_graph(name, dtype)
    after, rec = run(gm, "fuse_moe")
    r = rec["fuse_moe"]
    assert r.matches == 1 and "loop experts" in r.decisions[0], r.near_misses  # one MoE layer
    assert count_calls(after, M.moe_experts) == 1
    assert count_calls(after, torch.ops.aten.nonzero) == 0  # no per-expert work left
    if "fp8" in name:
        assert "FP8 e4m3 32x32" in r.decisions[0]
    assert_same(gm, after, args)


def test_fuse_moe_leaves_fp8_experts_on_a_gpu_without_fp8():
    """Triton has no float8_e4m3fn before sm_89: on an sm_80 target the pass declines (a near
    miss naming the architecture) instead of a graph that raises inside the op; sm_89 fuses."""
    import dataclasses

    gm, _ = ds_graph("deepseek-v32-tiny-fp8")
    cuda = targets.get("cuda")
    for arch, fused in (("sm_80", 0), ("sm_89", 1)):
        t = dataclasses.replace(cuda, device=dataclasses.replace(cuda.device, arch=arch))
        mgr = PassManager([get_pass("fuse_moe")], t, explicit=True)
        after = copy.deepcopy(gm)
        mgr(after.graph)
        rec = mgr.records[0]
        assert rec.matches == fused, rec.near_misses
        if not fused:
            assert any("FP8 experts need Triton's float8_e4m3fn, sm_89 or newer; target cuda is sm_80" in n
                       for n in rec.near_misses)


def test_a_gpu_older_than_the_target_decides_for_itself():
    assert targets.capability("sm_89") == (8, 9) and targets.capability("sm_100") == (10, 0)
    assert targets.capability("") is None and targets.capability("gfx942") is None
    pcie8 = targets.get("pcie8")  # L40S, sm_89
    same, note = targets.for_device(pcie8, (8, 9))
    assert same is pcie8 and note is None
    newer, note = targets.for_device(pcie8, (10, 0), ("sm_89", "sm_90"))
    assert newer is pcie8 and note is None, "a newer GPU without rows of its own runs what sm_89 was tuned for"
    a100, note = targets.for_device(pcie8, (8, 0))
    assert a100.device.arch == "sm_80" and note == ("target pcie8 declares sm_89; this GPU is sm_80: kernels and "
                                                    "passes decide for sm_80")
    assert targets.for_device(targets.get("cpu"), None) == (targets.get("cpu"), None)


@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("arch", ["DeepseekV3", "DeepseekV32"])
def test_fuse_moe_on_transformers_experts(arch, experts):
    gm, args = hf_graph(arch, experts=experts)
    after, rec = run(gm, "fuse_moe")
    assert rec["fuse_moe"].matches == 1 and experts in rec["fuse_moe"].decisions[0]
    assert count_calls(after, torch.ops.aten.bmm) <= count_calls(gm, torch.ops.aten.bmm)
    assert_same(gm, after, args)


@pytest.fixture
def expert_parallel_graph():
    """Rank 0 of 2 with Mixtral's experts spread (sharding.expert_parallel on torch's fake
    process group, held for the test: its all-reduce returns the input, so the graph runs in
    one process)."""
    import torch.distributed as dist

    from metainfer.runtime import model_capture as capture
    from metainfer.parallel import distributed, sharding

    with distributed.fake_job(2):
        m = tiny_hf_model("Mixtral", "eager", layers=2, num_local_experts=4, num_experts_per_tok=2)
        assert sharding.expert_parallel(m, dist.group.WORLD) == 2
        ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
        with capture.capturable(m):
            yield capture_graph(lambda x: m(x).logits, ids)


def test_fuse_moe_on_transformers_expert_parallel_experts(expert_parallel_graph):
    gm, args = expert_parallel_graph
    after, rec = run(gm, "fuse_moe")
    assert rec["fuse_moe"].matches == 2, rec["fuse_moe"].near_misses  # both layers (2 local experts each)
    assert count_calls(after, torch.ops.aten.where) < count_calls(gm, torch.ops.aten.where)  # sentinel rows gone
    assert_same(gm, after, args)


def test_fuse_moe_does_not_take_rows_zeroed_by_another_mask(expert_parallel_graph):
    gm, args = expert_parallel_graph
    for n in gm.graph.nodes:  # the sentinel test moved off by one: rows of a real expert zeroed too
        if n.target is torch.ops.aten.ge.Scalar and n.args[1] == 2 and n.args[0].target is operator.getitem:
            n.args = (n.args[0], 1)
    gm.recompile()
    after, rec = run(gm, "fuse_moe")
    assert rec["fuse_moe"].matches == 0
    assert all("mask other than the sorted ids >= 2" in m for m in rec["fuse_moe"].near_misses), rec["fuse_moe"].near_misses


def test_fuse_moe_does_not_take_rows_zeroed_by_the_permutation(expert_parallel_graph):
    gm, args = expert_parallel_graph
    for n in gm.graph.nodes:  # the sentinel test read off the sort's permutation instead of its values
        if n.target is torch.ops.aten.ge.Scalar and n.args[1] == 2 and n.args[0].target is operator.getitem:
            n.args = (next(u for u in n.args[0].args[0].users if u.args[1] == 1), 2)
    gm.recompile()
    after, rec = run(gm, "fuse_moe")
    assert rec["fuse_moe"].matches == 0, rec["fuse_moe"].decisions


def test_fuse_moe_does_not_fire_on_a_partial_loop():
    E, T, H, I = 4, 6, 16, 8
    w1, w3, w2 = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)

    def some_experts(x, ids, wts):  # experts 0..2 only: not the MoE function
        y = torch.zeros_like(x)
        for i in range(E - 1):
            idx, top = torch.where(ids == i)
            h = x[idx]
            h = F.silu(F.linear(h, w1[i])) * F.linear(h, w3[i])
            y.index_add_(0, idx, F.linear(h, w2[i]) * wts[idx, top, None])
        return y

    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    gm, args = capture_graph(some_experts, torch.randn(T, H), ids, torch.rand(T, 2))
    after, rec = run_pass("fuse_moe", gm)
    assert rec.matches == 0 and "not each of the 4 experts" in rec.near_misses[0]


def test_moe_op_refuses_what_the_kernel_cannot_do():
    from metainfer.kernels import KernelInputError
    x, w = torch.randn(3, 8), torch.randn(2, 4, 8)
    with pytest.raises(KernelInputError):  # routing weights of another shape than the ids
        ops.moe_experts(x, torch.zeros(3, 3, dtype=torch.long), torch.rand(3, 2), w, w, torch.randn(2, 8, 4),
                        None, None, None, 128, 128)


# ---- mla_prefill ------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_mla_prefill_on_the_reference_model(attention):
    gm, args = ds_graph("deepseek-tiny", attention=attention)
    after, rec = run(gm, "mla_prefill", "fuse_attention")
    r = rec["mla_prefill"]
    assert r.matches == 2 and rec["fuse_attention"].matches == 0
    assert all("q/k head 24, v head 12" in d for d in r.decisions)
    if attention == "sdpa":
        assert all("V zero-padding 24 -> 12 dropped" in d for d in r.decisions)
        assert count_calls(after, torch.ops.aten.constant_pad_nd) == 0
    (op, *_) = [n for n in after.graph.nodes if n.target is M.attention.default]
    assert op.args[2].meta["val"].shape[-1] == 12  # V read at its own width
    assert_same(gm, after, args)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_mla_prefill_on_transformers_deepseek_v3(attn):
    gm, args = hf_graph("DeepseekV3", attn)
    after, rec = run(gm, "mla_prefill")
    assert rec["mla_prefill"].matches == 2, rec["mla_prefill"].near_misses
    assert_same(gm, after, args)


def test_mla_prefill_leaves_ordinary_attention_to_fuse_attention():
    llama = models.build("llama-tiny")
    gm, args = capture_graph(lambda x: llama(x), *models.example_inputs("llama-tiny", seq=8))
    after, rec = run(gm, "mla_prefill", "fuse_attention")
    assert rec["mla_prefill"].matches == 0 and rec["fuse_attention"].matches == 2


# ---- sparse_mla -------------------------------------------------------------------------

@pytest.mark.parametrize("decode", [False, True])
def test_sparse_mla_on_the_reference_model(decode):
    gm, args = ds_graph("deepseek-v32-tiny", seq=12, decode=decode)  # top-8 of 12 (13) keys
    after, rec = run(gm, "mla_prefill", "sparse_mla")
    r = rec["sparse_mla"]
    assert r.matches == 2 and all("top-8 selection" in d for d in r.decisions), r.near_misses
    assert count_calls(after, M.sparse_attention) == 2 and count_calls(after, M.attention) == 0
    assert count_calls(after, torch.ops.aten.scatter) == count_calls(gm, torch.ops.aten.scatter) - 2  # router's stays
    assert_same(gm, after, args)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sparse_mla_on_transformers_deepseek_v32(attn):
    gm, args = hf_graph("DeepseekV32", attn)  # left-padded: fully masked rows
    after, rec = run(gm, "mla_prefill", "sparse_mla")
    assert rec["sparse_mla"].matches == 2, rec["sparse_mla"].near_misses
    assert_same(gm, after, args)


def _dense_with(mask_fn):
    def f(q, k, v, sel):
        s = (q @ k.transpose(-1, -2)) * 0.25 + mask_fn(sel, q)
        return torch.softmax(s, -1) @ v
    return f


def test_sparse_mla_needs_a_pure_top_k_selection():
    B, H, S, D = 1, 2, 6, 16
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    idx = torch.randint(0, S, (B, S, 3))  # user indices: may repeat, not a top-k
    scores = torch.randn(B, S, S)
    cases = {
        "not topk": (lambda sel, q: torch.full((B, S, S), -math.inf).scatter(-1, sel, 0.0).unsqueeze(1), idx),
        "finite mask": (lambda sel, q: torch.full((B, S, S), -1.0).scatter(-1, sel.topk(3)[1], 0.0).unsqueeze(1),
                        scores),
    }
    for what, (mask_fn, sel) in cases.items():
        gm, args = capture_graph(_dense_with(mask_fn), q, k, v, sel)
        after, rec = run(gm, "fuse_attention", "sparse_mla")
        assert rec["fuse_attention"].matches == 1 and rec["sparse_mla"].matches == 0, what
        if what == "not topk":
            assert "topk" in rec["sparse_mla"].near_misses[0]
    # the same with topk indices fires
    gm, args = capture_graph(_dense_with(lambda sel, q: torch.full((B, S, S), -math.inf).scatter(
        -1, sel.topk(3)[1], 0.0).unsqueeze(1)), q, k, v, scores)
    after, rec = run(gm, "fuse_attention", "sparse_mla")
    assert rec["sparse_mla"].matches == 1
    assert_same(gm, after, args)


def test_sparse_op_with_a_finite_fill_equals_dense_even_on_fully_masked_rows():
    B, H, S, D, K = 2, 3, 9, 8, 3
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, 5)
    idx = torch.randn(B, S, S).topk(K, dim=-1)[1]
    base = torch.randn(B, 1, S, S).masked_fill(torch.rand(B, 1, S, S) < 0.6, torch.finfo(torch.float32).min)
    base[0, 0, 2] = torch.finfo(torch.float32).min  # a row with every key masked
    fill = torch.finfo(torch.float32).min
    drop = torch.ones(B, S, S, dtype=torch.bool).scatter(-1, idx, False).unsqueeze(1)
    dense = ops.attention(q, k, v, torch.where(drop, torch.tensor(fill), base), 0.3, False, 0, False)
    sparse = ops.sparse_attention(q, k, v, idx, base, 0.3, False, 0, False, fill)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)


# ---- mla_decode -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["deepseek-tiny", "deepseek-v32-tiny"])
def test_mla_decode_absorbs_on_decode_steps(name):
    """One query over 256 cached tokens: decompressing the cache is 256 rows of a GEMM per
    step, the absorbed form two small per-head GEMMs."""
    gm, args = ds_graph(name, seq=256, decode=True)
    after, rec = run(gm, "mla_prefill", "sparse_mla", "mla_decode")
    r = rec["mla_decode"]
    assert r.matches == 2 and all("absorbed" in d for d in r.decisions), r.near_misses
    assert count_calls(after, M.mla_decode) == 2
    assert count_calls(after, M.attention) + count_calls(after, M.sparse_attention) == 0
    assert ("(sparse)" in r.decisions[0]) == ("v32" in name)
    assert_same(gm, after, args)


def test_mla_decode_keeps_prefill_decompressed():
    gm, args = ds_graph("deepseek-tiny", seq=12)
    after, rec = run(gm, "mla_prefill", "mla_decode")
    assert rec["mla_decode"].matches == 0
    assert all("kept decompressed" in n for n in rec["mla_decode"].near_misses)


def test_mla_decode_on_transformers_deepseek_v3_decode():
    from transformers import DynamicCache

    m = tiny_hf_model("DeepseekV3", "eager", layers=2, **HF_TINY)
    ids = torch.randint(3, 128, (2, 257), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=m.config)
    m(ids[:, :256], cache=cache)  # enough cached tokens for the absorbed form to pay
    gm, args = capture_graph(lambda x, c: m(x, cache=c).logits, ids[:, 256:], cache)
    after, rec = run(gm, "mla_prefill", "mla_decode")
    assert rec["mla_decode"].matches == 2, rec["mla_decode"].near_misses
    assert_same(gm, after, args)


# ---- regressions from a soundness review: each of these once fired (or crashed) wrongly --------

def _att(q, k, v, mask):
    return ops.attention(q, k, v, mask, 0.35, False, 0, True)


@pytest.mark.parametrize("case", ["3-D selection", "scatter reduce", "key dim broadcast", "add alpha",
                                  "finite fill + base"])
def test_sparse_mla_refuses_look_alikes(case):
    B, H, S, D, K = 2, 2, 5, 8, 2
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    fill = torch.finfo(torch.float32).min if case == "finite fill + base" else -math.inf

    def f(q, k, v, score, base):
        keys = 1 if case == "key dim broadcast" else S
        idx = score[..., :keys].topk(min(K, keys), dim=-1).indices
        full = torch.full((B, S, keys), -1e30 if case == "scatter reduce" else fill)
        sel = full.scatter(-1, idx, 0.0, reduce="add") if case == "scatter reduce" else full.scatter(-1, idx, 0.0)
        if case == "3-D selection":
            return _att(q, k, v, sel)  # (B, S, T) lines B up with the heads
        m = torch.add(sel, base, alpha=3.0) if case == "add alpha" else sel + base
        return _att(q, k, v, m.unsqueeze(1))

    base = torch.full((S, S), torch.finfo(torch.float32).min).triu(1)
    gm, args = capture_graph(f, q, k, v, torch.randn(B, S, S), base)
    after, rec = run_pass("sparse_mla", gm)
    assert rec.matches == 0, case
    assert_same(gm, after, args)


def test_fuse_moe_ignores_reductions_and_descending_sorts():
    gm, _ = capture_graph(lambda x: (x * 2).sum(), torch.randn(4, 6))  # aten.sum.default: one argument
    assert run_pass("fuse_moe", gm)[1].matches == 0
    E, T, K, H, I = 4, 6, 2, 16, 8
    gate_up, down = torch.randn(E, 2 * I, H, dtype=torch.bfloat16), torch.randn(E, H, I, dtype=torch.bfloat16)

    def grouped_descending(x, ids, w):
        flat, wf = ids.reshape(-1), w.reshape(-1)
        ids_g, perm = torch.sort(flat, descending=True)
        xs = x[perm // K]
        offs = torch.cumsum(torch.histc(ids_g.float(), bins=E, min=0, max=E - 1), 0, dtype=torch.int32)
        g, u = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offs) * wf[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return out[inv].view(T, K, H).sum(dim=1)

    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    gm, args = capture_graph(grouped_descending, torch.randn(T, H, dtype=torch.bfloat16), ids,
                             torch.rand(T, K, dtype=torch.bfloat16))  # aten._grouped_mm takes bf16
    after, rec = run_pass("fuse_moe", gm)
    assert rec.matches == 0 and "ascending" in rec.near_misses[0]


def test_fp8_dequant_refuses_casts_that_round_or_truncate():
    x = torch.randn(4, 64)
    w, s = F8.quantize_weight(torch.randn(32, 64) * 30, 32, 32)

    def s_full(s):
        return s.repeat_interleave(32, 0).repeat_interleave(32, 1)

    forms = {
        "int weight": lambda x, w, s: F.linear(x, w.to(torch.int32) * s_full(s)),
        "fp16 detour": lambda x, w, s: F.linear(x, (w.float() * s_full(s)).half().float()),
    }
    for what, fn in forms.items():
        gm, args = capture_graph(fn, x, w, s)
        assert run_pass("fp8_gemm", gm)[1].matches == 0, what
