"""metainfer.load on quantized checkpoint folders: tiny Llama / Qwen3 / DeepSeek-V3 models written by
metainfer.checkpoint_writers in each format's documented layout (FP8 block, compressed-tensors
FP8 per channel and per tensor, compressed-tensors int4, GPTQ v1/v2 with act-order, AWQ) load with
their linears kept quantized, give the logits of the dequantised model (the writer's real weights
in a float copy of the model) and its greedy tokens, reach the kernels through optimize(), and
bad folders fail with errors that name what is wrong."""

import copy
import json

import pytest
import torch
from torch import nn

import metainfer
from metainfer.checkpoint_writers import save_quantized
from metainfer.models.checkpoint import load, weight_bytes
from metainfer.models.quantized import FP8Linear, Int4Linear
from metainfer.testing import tiny_hf_model

IDS = torch.randint(3, 100, (2, 11), generator=torch.Generator().manual_seed(0))
DEEPSEEK = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1,
                topk_group=1, num_key_value_heads=4)
ARCHS = {"Llama": {}, "Qwen3": dict(tie_word_embeddings=True, head_dim=16), "DeepseekV3": DEEPSEEK}


def dequantised_reference(model, real):
    """The model as the checkpoint means it: float32, unquantized parameters rounded through the
    stored bf16 (buffers such as the rotary table computed, as the loader computes them), each
    quantized weight the writer's real one."""
    ref = copy.deepcopy(model).float()
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    for name, w in real.items():
        ref.get_parameter(name).data.copy_(w)
    return ref


CASES = [("Llama", "fp8-block", {}), ("Llama", "ct-fp8-channel", {}), ("Llama", "ct-fp8-tensor", {}),
         ("Llama", "ct-int4", dict(act_order=True)), ("Llama", "gptq", dict(act_order=True, shards=2)),
         ("Llama", "gptq_v2", dict(symmetric=True)), ("Llama", "awq", {}),
         ("Qwen3", "gptq", {}), ("Qwen3", "ct-fp8-channel", {}), ("DeepseekV3", "fp8-block", dict(block=(16, 16)))]


@pytest.mark.parametrize("arch, fmt, options", CASES, ids=[f"{a}-{f}" for a, f, _ in CASES])
def test_loads_kept_quantized_with_the_dequantised_models_logits(tmp_path, arch, fmt, options):
    model = tiny_hf_model(arch, "sdpa", **ARCHS[arch])
    real = save_quantized(model, tmp_path, fmt, **options)
    loaded = load(tmp_path, dtype=torch.float32)
    layers = [m for m in loaded.modules() if isinstance(m, (FP8Linear, Int4Linear))]
    assert len(layers) == len([k for k in real if k.endswith(".weight")]) > 0
    kind = FP8Linear if "fp8" in fmt else Int4Linear
    assert all(isinstance(m, kind) for m in layers)
    stored = {FP8Linear: (torch.float8_e4m3fn,), Int4Linear: (torch.int32,)}[kind]
    assert all((m.weight if kind is FP8Linear else m.qweight).dtype in stored for m in layers)
    # weight bytes by hand: FP8 one byte a weight, int4 half a byte, plus scales (and zero points, perm)
    n_weights = sum(w.numel() for k, w in real.items() if k.endswith(".weight"))  # the linears'; experts below
    assert weight_bytes(loaded)["quantized_linears"] >= n_weights * (1 if kind is FP8Linear else 0.5)
    assert weight_bytes(loaded)["quantized_linears"] < n_weights * (1.2 if kind is FP8Linear else 0.75)
    ref = dequantised_reference(model, real)
    with torch.no_grad():
        out, want = loaded(IDS).logits, ref(IDS).logits
    assert (out - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
    if arch == "Qwen3":
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied, stored once


@pytest.mark.parametrize("fmt, pass_name", [("gptq", "int4_gemm"), ("ct-fp8-channel", "fp8_gemm")])
def test_optimized_load_gives_the_greedy_tokens_of_the_dequantised_model(tmp_path, fmt, pass_name):
    model = tiny_hf_model("Llama", "sdpa")
    real = save_quantized(model, tmp_path, fmt, act_order=fmt == "gptq")
    loaded = load(tmp_path, dtype=torch.float32)
    ref = dequantised_reference(model, real)
    gen = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    want = ref.generate(IDS[:1], **gen)
    opt = metainfer.optimize(loaded, "cpu", lowering="aot_eager")
    assert torch.equal(opt.generate(IDS[:1], **gen), want)
    sections = opt.report.sections  # one graph per prompt / decode shape: every linear in each
    assert [opt.report.record(pass_name, g).matches for g in range(len(sections))] == [len(real)] * len(sections)


def test_deepseek_fp8_experts_load_as_one_module_and_fuse(tmp_path):
    """DeepSeek-V3's "-FP8" layout: every routed expert's gate / up / down stored FP8 with block
    scales under its own name; loaded as one FP8Experts per layer (stacked, still FP8), equal to the
    dequantised model, and fuse_moe turns the expert loop into one moe_experts call on the FP8
    weights while fp8_gemm takes the other linears."""
    from metainfer.models.quantized import FP8Experts

    model = tiny_hf_model("DeepseekV3", "sdpa", **DEEPSEEK)
    real = save_quantized(model, tmp_path, "fp8-block", block=(16, 16))
    assert "model.layers.1.mlp.experts.gate_up_proj" in real
    loaded = load(tmp_path, dtype=torch.float32)
    experts = loaded.model.layers[1].mlp.experts
    assert isinstance(experts, FP8Experts) and experts.gate.dtype == torch.float8_e4m3fn
    assert experts.gate.shape == (4, 32, 64) and experts.down_scale.shape == (4, 4, 2)
    ref = dequantised_reference(model, real)
    with torch.no_grad():
        want = ref(IDS).logits
        assert (loaded(IDS).logits - want).abs().max().item() < 1e-4
    opt = metainfer.optimize(loaded, "cpu", example_inputs=(IDS,), lowering="aot_eager")
    with torch.no_grad():
        assert (opt(IDS).logits - want).abs().max().item() < 1e-4
    assert opt.report.matches("fuse_moe") == 1
    assert "FP8 e4m3 16x16 blocks" in opt.report.record("fuse_moe").decisions[0]
    assert opt.report.matches("fp8_gemm") == len([k for k in real if k.endswith(".weight")])


def test_metainfer_load_places_the_model_by_target(tmp_path):
    save_quantized(tiny_hf_model("Llama", "sdpa"), tmp_path, "awq")
    model = metainfer.load(tmp_path, "cpu", dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.q_proj.scales.dtype == torch.float16  # as stored
    assert "awq int4, group 32" in model.metainfer_scheme.describe()


def _edit_config(folder, **changes):
    path = folder / "config.json"
    data = json.loads(path.read_text())
    qc = data["quantization_config"]
    for k, v in changes.items():
        qc[k] = v
    path.write_text(json.dumps(data))


def test_bad_folders_fail_naming_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load(tmp_path)
    save_quantized(tiny_hf_model("Llama", "sdpa"), tmp_path, "gptq")
    _edit_config(tmp_path, bits=8)
    with pytest.raises(ValueError, match="8-bit weights.*4-bit only"):
        load(tmp_path)
    _edit_config(tmp_path, bits=4, quant_method="bitsandbytes")
    with pytest.raises(ValueError, match="'bitsandbytes' is not loaded"):
        load(tmp_path)
    _edit_config(tmp_path, quant_method="awq", version="gemv")
    with pytest.raises(ValueError, match="only the GEMM packing"):
        load(tmp_path)
    _edit_config(tmp_path, quant_method="fp8", weight_block_size=[16, 16])
    with pytest.raises(ValueError, match="stored as int4.*says fp8"):
        load(tmp_path)
    (tmp_path / "config.json").write_text("{" + " " * (5 * 2**20))
    with pytest.raises(ValueError, match="bytes; a model config is at most"):
        load(tmp_path)


def test_tensor_shapes_and_sets_are_checked_before_use(tmp_path):
    from safetensors.torch import load_file, save_file

    save_quantized(tiny_hf_model("Llama", "sdpa"), tmp_path, "fp8-block")
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    bad = dict(tensors)
    bad["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(3, 3)
    save_file(bad, str(path))
    with pytest.raises(ValueError, match=r"up_proj.weight_scale_inv has shape \[3, 3\].*need \[4, 2\]"):
        load(tmp_path)
    bad = dict(tensors)
    del bad["model.norm.weight"]
    save_file(bad, str(path))
    with pytest.raises(ValueError, match="lacks 1 tensors.*model.norm.weight"):
        load(tmp_path)
    bad = dict(tensors)
    bad["model.layers.9.extra.weight"] = torch.ones(2)
    save_file(bad, str(path))
    with pytest.raises(ValueError, match="does not use.*layers.9.extra"):
        load(tmp_path)


def test_a_library_written_compressed_tensors_checkpoint_loads(tmp_path):
    """compressed-tensors' own compressor writes the FP8 and int4 tensors (its packing, its names,
    its config); the loaded layers compute the weights the library's decompressor gives back."""
    pytest.importorskip("compressed_tensors")
    from metainfer.checkpoint_writers import save_with_compressed_tensors

    for scheme in ("fp8-channel", "int4-group"):
        folder = tmp_path / scheme
        model = tiny_hf_model("Llama", "sdpa")
        want = save_with_compressed_tensors(model, folder, scheme)
        loaded = load(folder, dtype=torch.float32)
        for name, w in want.items():
            layer = loaded.get_submodule(name)
            eye = torch.eye(layer.in_features)
            got = layer(eye).T  # the layer's real weight, column by column
            assert torch.allclose(got, w.float(), rtol=1e-3, atol=1e-6), name
        assert isinstance(loaded.model.layers[0].mlp.down_proj, FP8Linear if "fp8" in scheme else Int4Linear)
        assert isinstance(loaded.lm_head, nn.Linear)


@pytest.mark.parametrize("fmt", ["ct-int4", "ct-fp8-channel", "ct-fp8-tensor"])
def test_our_compressed_tensors_configs_validate_against_the_librarys_schema(fmt):
    """The quantization_config we write for compressed-tensors formats is one the library's own
    pydantic model accepts (act-order's legacy "group" name aside: see checkpoint_writers)."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from metainfer.checkpoint_writers import quantization_config

    qc = quantization_config(fmt, 32, False, False, None, ("lm_head",))
    parsed = ct.QuantizationConfig.model_validate({k: v for k, v in qc.items() if k != "quant_method"})
    assert parsed.format == qc["format"] and parsed.ignore == ["lm_head"]


def test_gptq_groups_with_a_partial_last_group(tmp_path):
    """K = 96 in groups of 64: the last group holds 32 columns (g_idx k // 64, not k // (K / G))."""
    model = tiny_hf_model("Llama", "sdpa", hidden_size=96, intermediate_size=160, num_attention_heads=4,
                          num_key_value_heads=2)
    real = save_quantized(model, tmp_path, "gptq_v2", group=64)
    loaded = load(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        want = dequantised_reference(model, real)(IDS).logits
        assert (loaded(IDS).logits - want).abs().max().item() < 1e-4
