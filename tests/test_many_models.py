"""One process optimizing many models (found by bench/fuzz.py, case 24 of seed 0: after ~24
Hugging Face models, each with its forward and generate() graphs, the next optimize() raised
"torch.compile did not hand any graph to metainfer": every model's forward shares one code
object behind transformers' decorators, and Dynamo's recompile limit counts per code object)."""

import torch

import metainfer
from metainfer.testing import tiny_hf_model


def test_each_optimized_model_has_a_dynamo_cache_of_its_own(monkeypatch):
    # the limit low enough that eight models sharing one cache would exceed it
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 4)
    monkeypatch.setattr(metainfer.api, "RECOMPILE_LIMIT", 4)
    ids = torch.randint(3, 100, (1, 5))
    for seed, arch in enumerate(["Llama", "Qwen2", "Mistral", "Llama", "Qwen2", "Mistral", "Llama", "Qwen2"]):
        model = tiny_hf_model(arch, "sdpa", layers=1, seed=seed)
        opt = metainfer.optimize(model, "cpu", example_inputs=(ids,), lowering="aot_eager")
        assert opt.report.sections, f"model {seed} ({arch}) was never handed to metainfer"
        with torch.no_grad():
            torch.testing.assert_close(opt(ids).logits, model(ids).logits)


def test_models_whose_forward_breaks_the_graph_do_not_share_a_recompile_budget(monkeypatch):
    """Dynamic rope scaling branches on the positions (a graph break inside the model): Dynamo
    then compiles the frames around the break on their own, among them transformers' decorator
    frame (`deprecation.wrapped_func`), one code object for every model class. Each optimize()
    added entries to its cache until the limit was hit and the next model was never handed to
    metainfer (bench/fuzz.py seed 1, cases 207, 213, 214 and 227, after ~40 models)."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 4)
    monkeypatch.setattr(metainfer.api, "RECOMPILE_LIMIT", 4)
    ids = torch.randint(3, 100, (1, 5))
    for seed, arch in enumerate(["Llama", "Qwen2", "Mistral", "Llama", "Qwen2", "Mistral"]):
        model = tiny_hf_model(arch, "sdpa", layers=1, seed=seed,
                              rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=64)
        opt = metainfer.optimize(model, "cpu", example_inputs=(ids,), lowering="aot_eager")
        assert opt.report.sections, f"model {seed} ({arch}) was never handed to metainfer"
        with torch.no_grad():
            torch.testing.assert_close(opt(ids).logits, model(ids).logits)
