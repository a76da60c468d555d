"""The int4_gemm and fp8_gemm passes on quantized layers (models/quantized.py: dequantise the
stored weight through an op of fixed meaning, then F.linear): each becomes one metainfer::
int4_linear / fp8_linear. They fire on every quantized linear of a tiny Hugging Face Llama, with
outputs and greedy tokens equal to the eager quantized model's; they leave float linears and a
dequantised weight used otherwise alone; act-order layers keep reading their inputs through the
permutation; per-channel, per-tensor and block FP8 scales all reach the kernel."""

import pytest
import torch
from torch import nn

import metainfer
from metainfer.models.quantized import FP8Linear, Int4Linear, quantize_linears
from metainfer.testing import tiny_hf_model

# scheme -> (quantize_linears arguments, the pass that folds it, what its decisions say)
SCHEMES = {
    "int4-g32": (dict(group=32, symmetric=False), "int4_gemm", "metainfer.int4_linear"),
    "fp8-channel": (dict(fp8="channel"), "fp8_gemm", "per-channel scales"),
    "fp8-tensor": (dict(fp8="tensor"), "fp8_gemm", "per-tensor scales"),
    "fp8-block32": (dict(fp8=(32, 32)), "fp8_gemm", "32x32 block scales"),
}


def _llama(scheme, dtype=torch.float32):
    m = tiny_hf_model("Llama", "sdpa", layers=2)
    n = quantize_linears(m, **SCHEMES[scheme][0])
    return m.to(dtype), n


IDS = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scheme, dtype, lowering", [
    ("int4-g32", torch.float32, "aot_eager"), ("int4-g32", torch.bfloat16, "aot_eager"),
    ("int4-g32", torch.float32, "inductor"),
    ("fp8-channel", torch.float32, "aot_eager"), ("fp8-channel", torch.bfloat16, "inductor"),
    ("fp8-tensor", torch.float32, "aot_eager"), ("fp8-block32", torch.bfloat16, "aot_eager"),
])
def test_every_quantized_linear_becomes_one_op(scheme, dtype, lowering):
    model, n = _llama(scheme, dtype)
    assert n == 14  # q, k, v, o, gate, up, down in two layers; lm_head stays float
    with torch.no_grad():
        ref = model(IDS).logits.float()
    opt = metainfer.optimize(model, "cpu", example_inputs=(IDS,), lowering=lowering)
    out = opt(IDS).logits.float()
    _, pass_name, says = SCHEMES[scheme]
    assert opt.report.matches(pass_name) == n
    tol = 1e-4 if dtype == torch.float32 else 3e-2 * ref.abs().max().item()
    assert (out - ref).abs().max().item() < tol
    decisions = opt.report.record(pass_name).decisions
    assert says in decisions[0] and "weight bytes instead of writing" in decisions[0]


@pytest.mark.parametrize("scheme", ["int4-g32", "fp8-channel"])
def test_generate_gives_the_eager_quantized_models_tokens(scheme):
    model, _ = _llama(scheme)
    ref = model.generate(IDS[:1], max_new_tokens=12, do_sample=False, pad_token_id=0)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    assert torch.equal(opt.generate(IDS[:1], max_new_tokens=12, do_sample=False, pad_token_id=0), ref)
    assert opt.report.matches(SCHEMES[scheme][1]) > 0


class _Uses(nn.Module):
    """A quantized linear, beside a float one and a dequantised weight used for something else."""

    def __init__(self, kind, act_order=False):
        super().__init__()
        torch.manual_seed(1)
        if kind == "int4":
            self.q = Int4Linear.from_linear(nn.Linear(64, 48), group=32)
            if act_order:
                self.q.perm = torch.randperm(64).to(torch.int32)
        else:
            self.q = FP8Linear.from_linear(nn.Linear(64, 48), "channel")
        self.f = nn.Linear(48, 16)

    def dequantised(self, dtype):
        q = self.q
        if isinstance(q, Int4Linear):
            return torch.ops.metainfer.int4_dequantize(q.qweight, q.scales, q.zeros, 32, dtype)
        return torch.ops.metainfer.fp8_dequantize(q.weight, q.weight_scale, q.block_n, q.block_k, dtype)

    def forward(self, x):
        return self.f(self.q(x)), self.dequantised(x.dtype).sum()


@pytest.mark.parametrize("kind, act_order, pass_name", [("int4", False, "int4_gemm"), ("int4", True, "int4_gemm"),
                                                        ("fp8", False, "fp8_gemm")])
def test_only_the_quantized_linear_is_rewritten(kind, act_order, pass_name):
    m = _Uses(kind, act_order).eval()
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        ref = m(x)
    opt = metainfer.optimize(m, "cpu", example_inputs=(x,), lowering="aot_eager")
    out = opt(x)
    assert opt.report.matches(pass_name) == 1  # not the float linear, not the sum of the weight
    assert torch.allclose(out[0], ref[0], atol=1e-5) and torch.allclose(out[1], ref[1], rtol=1e-5)
    # act-order: the kernel reads x's columns through the permutation; no gathered copy of x is made
    assert ("act-order columns read through perm" in opt.report.record(pass_name).decisions[0]) == act_order


def test_fp8_scales_of_another_dtype_are_left_as_the_graph_has_them():
    m = _Uses("fp8").eval()
    m.q.weight_scale = m.q.weight_scale.to(torch.float64)  # the op dequantises any float scales; the kernel reads fp32
    x = torch.randn(3, 64)
    opt = metainfer.optimize(m, "cpu", example_inputs=(x,), lowering="aot_eager")
    assert opt.report.matches("fp8_gemm") == 0
    assert "float32 scales" in " ".join(opt.report.record("fp8_gemm").near_misses)
    with torch.no_grad():
        assert torch.allclose(opt(x)[0], m(x)[0], atol=1e-5)


def test_the_layers_keep_their_stored_dtypes_and_refuse_what_they_cannot_hold():
    lin = nn.Linear(64, 48, bias=True)
    f, i = FP8Linear.from_linear(lin, (16, 32)).bfloat16(), Int4Linear.from_linear(lin, 32).to(torch.bfloat16)
    assert (f.weight.dtype, f.weight_scale.dtype, f.bias.dtype) == (torch.float8_e4m3fn, torch.float32, torch.bfloat16)
    assert (i.qweight.dtype, i.scales.dtype, i.bias.dtype) == (torch.int32, torch.float16, torch.bfloat16)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        Int4Linear(60, 8, group=32)
    with pytest.raises(Exception, match="block_k must be a power of two"):
        FP8Linear(64, 48, block=(16, 24))


def test_transformers_own_fp8_linear_is_adopted_and_fused():
    """A model a user built with transformers' FP8Linear (its forward wants a hub kernel): optimize()
    swaps each for metainfer's FP8Linear on the same tensors, and fp8_gemm fuses them."""
    from transformers.integrations.finegrained_fp8 import FP8Linear as HFFP8Linear

    from metainfer.kernels import fp8_gemm

    model = tiny_hf_model("Llama", "sdpa", layers=1)
    ref = tiny_hf_model("Llama", "sdpa", layers=1)
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear) and not name.endswith("lm_head"):
            hf = HFFP8Linear(m.in_features, m.out_features, block_size=(32, 32))
            w8, s = fp8_gemm.quantize_weight(m.weight.detach(), 32, 32)
            hf.weight.data.copy_(w8)
            hf.weight_scale_inv.data.copy_(s)
            ref.get_submodule(name).weight.data.copy_(fp8_gemm.dequantize(w8, s, 32, 32, torch.float32))
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, hf.eval())
    opt = metainfer.optimize(model, "cpu", example_inputs=(IDS,), lowering="aot_eager")
    with torch.no_grad():
        assert (opt(IDS).logits - ref(IDS).logits).abs().max().item() < 1e-4
    assert opt.report.matches("fp8_gemm") == 7
    assert any("7 transformers FP8Linear layer(s) replaced" in n for n in opt.report.notes)
    assert isinstance(model.model.layers[0].mlp.up_proj, FP8Linear)
