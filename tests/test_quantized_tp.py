"""Tensor parallelism over quantized checkpoints: the loaded model's FP8 / int4 linears cut by
their own rows (colwise) and columns (rowwise: partial sums all-reduced, the bias added once),
each rank's shard still on metainfer's kernels, every rank's logits equal to the unsharded
loaded model's; cuts that would split a scale block or an act-order group are refused by name
before any collective."""

import os

import pytest
import torch

import metainfer
from metainfer.checkpoint_writers import save_quantized
from metainfer.parallel import multirank
from metainfer.testing import tiny_hf_model

TIMEOUT_S = int(os.environ.get("METAINFER_TEST_RANK_TIMEOUT", 240))
IDS = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))


def tp_run(rank, world, folder, pass_name):
    model = metainfer.load(folder, dtype=torch.float32)
    with torch.no_grad():
        ref = model(IDS).logits
    opt = metainfer.optimize(model, "pcie8", example_inputs=(IDS,), emulate=True, lowering="aot_eager",
                             tensor_parallel=world)
    with torch.no_grad():
        out = opt(IDS).logits
    return (out - ref).abs().max().item(), opt.report.matches(pass_name), opt.report.notes


@pytest.mark.parametrize("fmt, options, pass_name, kv_heads", [
    ("gptq", dict(group=16), "int4_gemm", 2),
    ("fp8-block", dict(block=(16, 16)), "fp8_gemm", 1),  # one KV head: each rank keeps it whole
    ("ct-fp8-channel", {}, "fp8_gemm", 2),
])
def test_two_ranks_equal_the_unsharded_quantized_model(tmp_path, fmt, options, pass_name, kv_heads):
    save_quantized(tiny_hf_model("Llama", "sdpa", num_key_value_heads=kv_heads), tmp_path, fmt, **options)
    for diff, matches, notes in multirank.run(tp_run, 2, args=(str(tmp_path), pass_name), timeout_s=TIMEOUT_S):
        assert diff < 1e-4, diff
        assert matches == 14  # every linear's shard on the kernel
        assert any("tensor parallel over ranks [0, 1]" in n for n in notes)


def test_cuts_that_split_a_block_or_an_act_order_group_are_refused(tmp_path):
    from metainfer.parallel.sharding import check_shardable

    save_quantized(tiny_hf_model("Llama", "sdpa"), tmp_path / "act", "gptq", group=32, act_order=True)
    with pytest.raises(ValueError, match="o_proj: tensor parallelism over 2 ranks: an act-order int4 weight"):
        check_shardable(metainfer.load(tmp_path / "act"), 2)
    save_quantized(tiny_hf_model("Llama", "sdpa"), tmp_path / "blocks", "fp8-block", block=(64, 64))
    with pytest.raises(ValueError, match=r"gate_proj.*rows \[0, 32\) of an FP8 weight \[128, 64\] would split its "
                                         r"64-row scale blocks"):
        check_shardable(metainfer.load(tmp_path / "blocks"), 4)
    save_quantized(tiny_hf_model("Llama", "sdpa"), tmp_path / "groups", "awq", group=64)
    with pytest.raises(ValueError, match=r"o_proj.*columns \[0, 16\) of an int4 weight with groups of 64 would split"):
        check_shardable(metainfer.load(tmp_path / "groups"), 4)
