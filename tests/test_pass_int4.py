"""The int4_gemm pass: a quantized linear (models/quantized.py: dequantise the packed weight,
then F.linear) becomes one metainfer::int4_linear. It fires on every quantized linear of a tiny
Hugging Face Llama, with outputs and greedy tokens equal to the eager quantized model's; it
leaves float linears and a dequantised weight used otherwise alone; act-order layers keep
reading their inputs through the permutation."""

import pytest
import torch
from torch import nn

import metainfer
from metainfer.models.quantized import Int4Linear, quantize_linears
from metainfer.testing import tiny_hf_model


def _llama(dtype=torch.float32, group=32, symmetric=False):
    m = tiny_hf_model("Llama", "sdpa", layers=2)
    n = quantize_linears(m, group=group, symmetric=symmetric)
    return m.to(dtype), n


IDS = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype, lowering", [(torch.float32, "aot_eager"), (torch.bfloat16, "aot_eager"),
                                             (torch.float32, "inductor")])
def test_every_quantized_linear_becomes_one_op(dtype, lowering):
    model, n = _llama(dtype)
    assert n == 14  # q, k, v, o, gate, up, down in two layers; lm_head stays float
    with torch.no_grad():
        ref = model(IDS).logits.float()
    opt = metainfer.optimize(model, "cpu", example_inputs=(IDS,), lowering=lowering)
    out = opt(IDS).logits.float()
    assert opt.report.matches("int4_gemm") == n
    tol = 1e-4 if dtype == torch.float32 else 3e-2 * ref.abs().max().item()
    assert (out - ref).abs().max().item() < tol
    decisions = opt.report.record("int4_gemm").decisions
    assert "int4 dequant + linear -> metainfer.int4_linear" in decisions[0] and "packed weight bytes" in decisions[0]


def test_generate_gives_the_eager_quantized_models_tokens():
    model, _ = _llama(symmetric=True)
    ref = model.generate(IDS[:1], max_new_tokens=12, do_sample=False, pad_token_id=0)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    assert torch.equal(opt.generate(IDS[:1], max_new_tokens=12, do_sample=False, pad_token_id=0), ref)
    assert opt.report.matches("int4_gemm") > 0


class _Uses(nn.Module):
    """A quantized linear, beside a float one and a dequantised weight used for something else."""

    def __init__(self, act_order=False):
        super().__init__()
        torch.manual_seed(1)
        self.q = Int4Linear.from_linear(nn.Linear(64, 48), group=32)
        if act_order:
            self.q.perm = torch.randperm(64).to(torch.int32)
        self.f = nn.Linear(48, 16)

    def forward(self, x):
        w = torch.ops.metainfer.int4_dequantize(self.q.qweight, self.q.scales, self.q.zeros, 32, x.dtype)
        return self.f(self.q(x)), w.sum()


@pytest.mark.parametrize("act_order", [False, True])
def test_only_the_quantized_linear_is_rewritten(act_order):
    m = _Uses(act_order).eval()
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        ref = m(x)
    opt = metainfer.optimize(m, "cpu", example_inputs=(x,), lowering="aot_eager")
    out = opt(x)
    assert opt.report.matches("int4_gemm") == 1  # not the float linear, not the sum of the weight
    assert torch.allclose(out[0], ref[0], atol=1e-5) and torch.allclose(out[1], ref[1], rtol=1e-5)


def test_the_layer_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="not a multiple of 8"):
        Int4Linear(60, 8, group=32)
