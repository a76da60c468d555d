"""GPU paths checked on CPU (issue 49): what a first GPU lease would trip over, caught here, each
test failing on the code before its fix. Importing metainfer never initialises CUDA (a forkserver
that preloads it forks children that cannot use CUDA once the parent touched the runtime); a
newer GPU takes its own kernel rows and both entries resolve the target alike; the serving
engine's CUDA graphs are off; no autotuning in a capture or after warm-up, which tunes the
expected shapes; a cached graph's symmetric buffers are reserved at load."""

import os
import subprocess
import sys

import pytest

_PROBE = r"""
import importlib.metadata as md, os, sys
real = md.version
md.version = lambda name: "2.13.0" if name == "torch" else real(name)   # not a "+cpu" build
import torch
calls = []
torch.cuda.is_available = lambda: calls.append("is_available") or True
torch.cuda._is_compiled = lambda: True
torch.cuda._device_count_nvml = lambda: int(sys.argv[1])
import metainfer
print(calls, torch.cuda.is_initialized(), os.environ.get("TRITON_INTERPRET"))
"""


@pytest.mark.parametrize("gpus, interpret", [(1, None), (0, "1")])
def test_importing_metainfer_never_initialises_cuda(tmp_path, gpus, interpret):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "METAINFER_TRITON_INTERPRET")}
    out = subprocess.run([sys.executable, "-c", _PROBE, str(gpus)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == f"[] False {interpret}"  # no is_available(), CUDA untouched


def test_a_newer_gpu_with_rows_of_its_own_takes_them():
    """Item 6: an H100 (sm_90) under the sm_89 `cuda` target runs sm_90's rows (which AOT compiles),
    not the Ada rows; a GPU newer than every table keeps the declared rows."""
    from metainfer.api import target_for_device
    from metainfer.hardware import targets
    from metainfer.kernels import configs

    assert "sm_90" in configs.arches() and "sm_89" in configs.arches()
    cuda = targets.get("cuda")
    assert cuda.device.arch == "sm_89"
    hopper, note = target_for_device(cuda, (9, 0))
    assert hopper.device.arch == "sm_90" and "newer, with kernel rows of its own" in note
    blackwell, note = target_for_device(cuda, (10, 0))
    assert blackwell is cuda and note is None


def test_torch_compile_resolves_the_target_against_the_device_as_optimize_does(monkeypatch):
    """Item 7: the Dynamo backend goes through the same target_for_device as optimize() (on an
    A100 an sm_89 target's FP8 decisions would otherwise raise inside the graph). On CPU the
    capability is None: the call is what is checked."""
    import torch

    import metainfer
    from metainfer import api, dynamo_backend

    seen = []
    real = api.target_for_device

    def spy(target, capability):
        seen.append(capability)
        return real(target, capability)

    monkeypatch.setattr(api, "target_for_device", spy)
    model = torch.nn.Linear(8, 8).eval()
    compiled = torch.compile(model, backend="metainfer", options={"target": "cpu", "lowering": "aot_eager"})
    compiled(torch.randn(2, 8))
    assert seen == [None]
    assert metainfer.last_report() is dynamo_backend.last_report()
    assert api.inputs_capability([torch.zeros(1)]) is None


def test_the_engines_cuda_graphs_are_off_by_construction(monkeypatch):
    """Item 2: on a GPU transformers' engine turns its CUDA graphs on for an attention whose name
    says "flash" (metainfer's must, to be admitted), and replayed padded steps never reach
    metainfer. metainfer owns the steps: the config it hands the engine has them off, which the
    engine's own decision keeps on a pretend GPU; asking for them is refused by name."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import initialization

    import metainfer
    from metainfer.runtime import serving
    from metainfer.testing import tiny_hf_model

    opt = metainfer.optimize(tiny_hf_model("Llama", "sdpa"), "cpu", lowering="aot_eager")
    cfg, _ = serving._engine_config(opt, ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64), None)
    assert cfg.use_cuda_graph == (False, False)
    monkeypatch.setattr(initialization, "get_accelerator_graph_name", lambda: "cuda")
    left_open = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64)
    initialization.decide_use_cuda_graphs(left_open, is_attn_mask_needed=False, cuda_graph_requested=False)
    assert left_open.use_cuda_graph == (True, True)  # what the engine would do left to itself
    initialization.decide_use_cuda_graphs(cfg, is_attn_mask_needed=False, cuda_graph_requested=False)
    assert cfg.use_cuda_graph == (False, False)
    with pytest.raises(ValueError, match="replay its padded steps without metainfer"):
        serving._engine_config(opt, ContinuousBatchingConfig(use_cuda_graph=True), None)


def test_a_cached_graphs_symmetric_buffers_are_reserved_at_load(monkeypatch, tmp_path):
    """Item 8: the buffers select_collectives reserved when it compiled a graph are recorded with
    its pass record, kept through metainfer's record cache, and reserved again when Inductor's
    cache serves the graph (in the model's ownership), not allocated lazily inside the op."""
    from metainfer.kernels import symm_mem
    from metainfer.lowering import backend, compile_cache
    from metainfer.passes.manager import PassRecord

    rec = PassRecord(name="select_collectives", ran=True, resources=[["symm_mem", "0", "bfloat16", 4096]])
    key = "k" * 16
    compile_cache.store(tmp_path, key, [rec])
    (loaded,) = compile_cache.load(tmp_path, key)
    assert loaded.resources == [["symm_mem", "0", "bfloat16", 4096]]
    calls = []
    monkeypatch.setattr(symm_mem, "reserve", lambda *a: calls.append(a) or None)
    backend.reserve_resources([loaded])
    import torch

    assert calls == [("0", torch.bfloat16, 4096)]
    monkeypatch.setattr(symm_mem, "reserve", lambda *a: "RuntimeError: CUDA IPC refused")
    with pytest.raises(RuntimeError, match="could not be reserved: RuntimeError: CUDA IPC refused"):
        backend.reserve_resources([loaded])


def test_no_tuning_inside_a_capture_or_after_warm_up(monkeypatch, tmp_path):
    """Item 4: a launcher times candidates only outside a CUDA-graph capture and before a server has
    warmed up (then the table's row runs); timings persist in Triton's cache directory, which
    metainfer puts under its own cache, per GPU name and driver."""
    import torch

    from metainfer.kernels import _common
    from metainfer.lowering import compile_cache

    monkeypatch.setattr(_common, "interpreted", lambda: False)  # as on a GPU
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    gpu = torch.device("cuda")
    assert _common.autotune_enabled(gpu)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not _common.autotune_enabled(gpu)  # inside a capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    _common.freeze_tuning()
    try:
        assert not _common.autotune_enabled(gpu)  # after a server's warm-up
    finally:
        _common.freeze_tuning(False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12080, raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    import triton

    monkeypatch.setattr(triton.knobs.cache, "dir", triton.knobs.cache.dir)  # restored after the test
    d = compile_cache.point_triton_at(tmp_path)
    assert d == tmp_path / "triton" / "NVIDIA_H100_80GB_HBM3-driver12080"
    import os

    assert os.environ["TRITON_CACHE_DIR"] == str(d)
    assert _common._AUTOTUNE_CACHES  # Triton 3.9 keeps autotune timings on disk when asked


def test_a_gpu_server_tunes_its_buckets_at_warm_up_then_freezes(monkeypatch):
    """Item 4: where kernels autotune, the server's warm-up runs the shapes they tune per (prefill
    buckets up to the batch budget, decode batches up to the running cap) before /ready, then
    freezes tuning; on CPU it runs its one request and freezes."""
    import asyncio
    from types import SimpleNamespace

    import torch

    from metainfer.kernels import _common
    from metainfer.server import engine as E

    assert E.tuning_shapes(2048, 8, 4096) == [(16, 1), (64, 1), (256, 1), (1024, 1), (8, 2), (8, 4), (8, 8)]
    assert E.tuning_shapes(2048, 1, 100) == [(16, 1), (64, 1)]  # within the model's positions

    for gpu in (False, True):
        seen = []

        async def generate(req, count=True):
            seen.append((len(req.prompt_ids), req.max_tokens))
            yield [1], "length"

        stub = SimpleNamespace(
            opt=SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=128, max_position_embeddings=512),
                                                      parameters=lambda: iter([torch.zeros(1)]))),
            manager=SimpleNamespace(capacity=SimpleNamespace(max_batch_tokens=256)),
            admission=SimpleNamespace(max_running=4), generate=generate, ready=False)
        monkeypatch.setattr(_common, "autotune_enabled", lambda device: gpu)
        try:
            asyncio.run(E.Engine.warm_up(stub))
            assert stub.ready and _common._TUNING["frozen"]
        finally:
            _common.freeze_tuning(False)
        want = [(8, 3)] + ([(16, 3), (64, 3), (256, 3)] + [(8, 2)] * 2 + [(8, 2)] * 4 if gpu else [])
        assert seen == want
