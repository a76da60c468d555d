"""share_act_quant: W8A8 fp8_linears reading one x quantise it once. It fires where two or more
read x in the same groups, per group size; leaves W8A16 linears, a lone reader and readers in
different groups alone (the last a near miss); the graph computes the same outputs bit for
bit; and a whole quantized Llama in W8A8 shares each layer's q/k/v and gate/up inputs."""

import copy

import pytest
import torch
from torch import nn

import metainfer
from metainfer.models.quantized import FP8Linear, quantize_linears
from metainfer.testing import capture_graph, count_calls, run_pass, tiny_hf_model

QUANTIZE = torch.ops.metainfer.fp8_quantize_activations.default
SHARED = torch.ops.metainfer.fp8_linear_quantized.default
LINEAR = torch.ops.metainfer.fp8_linear.default


class Readers(nn.Module):
    """n FP8 linears over one x (blocks: each linear's scale blocks), their outputs summed up."""

    def __init__(self, blocks):
        super().__init__()
        torch.manual_seed(0)
        self.linears = nn.ModuleList(FP8Linear.from_linear(nn.Linear(64, 48), b) for b in blocks)

    def forward(self, x):
        h = torch.relu(x)
        return sum(lin(h) for lin in self.linears)


def _w8a8_graph(blocks, dtype=torch.float32, mode="w8a8"):
    """The graph share_act_quant sees: the module captured, fp8_gemm run in `mode`."""
    m = Readers(blocks).to(dtype)
    x = torch.randn(2, 7, 64, dtype=dtype)
    gm, inputs = capture_graph(m, x)
    gm, rec = run_pass("fp8_gemm", gm, options={"fp8_mode": mode})
    assert rec.matches == len(blocks)
    return gm, inputs


def _same_outputs(before, after, args):
    with torch.no_grad():
        a, b = before(*args), after(*args)
    for u, v in zip(a if isinstance(a, (list, tuple)) else [a], b if isinstance(b, (list, tuple)) else [b]):
        assert torch.equal(u, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_readers_quantise_once(dtype):
    gm, x = _w8a8_graph([(16, 32)] * 3, dtype)
    after, rec = run_pass("share_act_quant", gm)
    assert rec.matches == 1
    assert (count_calls(after, QUANTIZE), count_calls(after, SHARED), count_calls(after, LINEAR)) == (1, 3, 0)
    assert "3 W8A8 linears quantise" in rec.decisions[0] and "2 activation quantisation(s) fewer" in rec.decisions[0]
    _same_outputs(gm, after, x)


def test_each_group_size_shared_by_two_gets_its_own_quantisation():
    gm, x = _w8a8_graph([(16, 32), (16, 32), (16, 16), (16, 16), (16, 64)])
    after, rec = run_pass("share_act_quant", gm)
    assert rec.matches == 1
    assert (count_calls(after, QUANTIZE), count_calls(after, SHARED), count_calls(after, LINEAR)) == (2, 4, 1)
    _same_outputs(gm, after, x)


def test_it_leaves_w8a16_a_lone_reader_and_different_groups_alone():
    for blocks, mode in (([(16, 32)] * 3, "w8a16"), ([(16, 32)], "w8a8")):
        gm, _ = _w8a8_graph(blocks, mode=mode)
        after, rec = run_pass("share_act_quant", gm)
        assert rec.matches == 0 and not rec.near_misses and count_calls(after, QUANTIZE) == 0
    gm, _ = _w8a8_graph([(16, 32), (16, 16)])
    after, rec = run_pass("share_act_quant", gm)
    assert rec.matches == 0 and count_calls(after, LINEAR) == 2
    assert len(rec.near_misses) == 1, rec.near_misses
    assert "activation quantisation not shared: its 2 W8A8 linears quantise in different groups (16, 32" \
        in rec.near_misses[0]


def test_a_quantized_llama_in_w8a8_shares_qkv_and_gate_up():
    """Per layer: q, k, v read the normed hidden state, gate and up the other: two sites a layer,
    three quantisations fewer; the logits equal the unshared pipeline's exactly."""
    model = tiny_hf_model("Llama", "sdpa", layers=2)
    quantize_linears(model, fp8=(32, 32))
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    shared = metainfer.optimize(model, "cpu", example_inputs=(ids,), lowering="aot_eager",
                                pass_options={"fp8_mode": "w8a8"})
    assert shared.report.matches("share_act_quant") == 4
    plain = metainfer.optimize(copy.deepcopy(model), "cpu", example_inputs=(ids,), lowering="aot_eager",
                               pass_options={"fp8_mode": "w8a8"}, disable=("share_act_quant",))
    assert plain.report.matches("fp8_gemm") == shared.report.matches("fp8_gemm") == 14
    assert torch.equal(shared(ids).logits, plain(ids).logits)


def test_readers_of_one_shared_view_are_one_site_reported_once():
    """Where the linears read one reshape of x (not a view each), the site is found from x and
    not again from the view: one match, or one near miss."""
    for blocks, matches, misses in (([(16, 32)] * 2, 1, 0), ([(16, 32), (16, 16)], 0, 1)):
        gm, inputs = _w8a8_graph(blocks)
        linears = [n for n in gm.graph.nodes if n.target is LINEAR]
        view = linears[0].args[0]
        for lin in linears[1:]:
            lin.replace_input_with(lin.args[0], view)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        after, rec = run_pass("share_act_quant", gm)
        assert (rec.matches, len(rec.near_misses)) == (matches, misses), rec.near_misses
        _same_outputs(gm, after, inputs)
