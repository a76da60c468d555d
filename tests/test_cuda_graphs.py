"""CUDA graphs for decode, decided and made safe on a CPU: which graphs Inductor compiles to
replay (lowering.backend.uses_cuda_graphs), that a decode step over a static cache compiles one
graph per batch bucket and never one per context length, and that a step the serving engine
captures into its own CUDA graph neither times itself nor switches path between the engine's
warm-up call and its capture."""

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import metainfer
from metainfer.runtime import optimized
from metainfer.runtime import inputs
from metainfer.hardware import targets
from metainfer.lowering import backend as B
from metainfer.testing import tiny_hf_model


def test_only_replayable_calls_on_a_cuda_target_through_inductor_use_cuda_graphs():
    cuda, cpu = targets.get("cuda"), targets.get("cpu")
    assert B.uses_cuda_graphs(cuda, "inductor", True, True)
    assert not B.uses_cuda_graphs(cuda, "inductor", True, False)  # a cache that grows
    assert not B.uses_cuda_graphs(cuda, "inductor", False, True)  # optimize(cuda_graphs=False)
    assert not B.uses_cuda_graphs(cuda, "aot_eager", True, True)
    assert not B.uses_cuda_graphs(cpu, "inductor", True, True)


def _compiles(monkeypatch):
    """(phase, replayable) of every graph the backend compiles."""
    seen = []
    real = B.MetainferBackend.__call__

    def spy(self, gm, example_inputs):
        call = self.current_call()
        seen.append((call.phase_name(), call.replayable))
        return real(self, gm, example_inputs)

    monkeypatch.setattr(B.MetainferBackend, "__call__", spy)
    return seen


# 14 new tokens alone would show one graph per length; 6 too (the slow tier)
@pytest.mark.parametrize("new_tokens", [pytest.param(6, marks=pytest.mark.slow), 14])
def test_static_cache_decode_compiles_per_batch_bucket_not_per_length(monkeypatch, new_tokens):
    """Batches of 1, 2 and 3 over a static cache: the decode graphs are replayable and there are
    two of them (batch 1, then one with a symbolic batch) however long the decode runs; a growing
    (dynamic) cache's decode graphs are not replayable."""
    seen = _compiles(monkeypatch)
    m = tiny_hf_model("Llama", "sdpa", layers=2)
    opt = metainfer.optimize(m, "cpu", lowering="aot_eager")
    for batch in (1, 2, 3):
        ids = torch.randint(3, 128, (batch, 5), generator=torch.Generator().manual_seed(batch))
        gen = dict(max_new_tokens=new_tokens, do_sample=False, cache_implementation="static")
        assert torch.equal(opt.generate(ids, **gen), m.generate(ids, **gen))
    decode = [r for p, r in seen if p == "decode"]
    assert decode == [True, True], seen
    assert all(not r for p, r in seen if p == "prefill")
    seen.clear()
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(9))
    opt2 = metainfer.optimize(m, "cpu", lowering="aot_eager")
    opt2.generate(ids, max_new_tokens=4, do_sample=False)  # DynamicCache
    assert seen and not any(r for _, r in seen)


def test_a_captured_serving_step_keeps_its_warm_up_path_and_is_not_timed(monkeypatch):
    """The engine warms a step up, then captures it: the capture must run the function the warm-up
    ran (compiling inside a capture fails), record no event and wait on nothing."""
    m = tiny_hf_model("Llama", "sdpa", layers=2)
    opt = metainfer.optimize(m, "cpu", lowering="aot_eager", serve_compile="auto")
    ran, decisions, calls = [], iter([False, True] * 50), {"n": 0}
    eager, compiled = opt._forward, opt._compiled_packed
    opt._forward = lambda *a, **k: ran.append("eager") or eager(*a, **k)
    opt._compiled_packed = lambda *a, **k: ran.append("compiled") or compiled(*a, **k)
    monkeypatch.setattr(type(opt.serving_compile), "use_compiled", lambda self, tokens, rest=0: next(decisions))

    def capturing():  # every second step is the engine's capture of the one before
        calls["n"] += 1
        return calls["n"] % 2 == 0

    monkeypatch.setattr(inputs, "capturing", capturing)
    timed = []
    real_start = optimized.CallTimes.start
    monkeypatch.setattr(optimized.CallTimes, "start", lambda self: timed.append(1) or real_start(self))
    greedy = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=-1, pad_token_id=0)
    out = opt.generate_batch([[3, 4, 5, 6], [7, 8, 9]], generation_config=greedy,
                             continuous_batching_config=ContinuousBatchingConfig(num_blocks=16, page_size=16))
    assert all(r.status.name == "FINISHED" for r in out.values())
    assert len(ran) >= 4
    for i in range(1, len(ran), 2):  # each capture ran what its warm-up ran, though the policy flipped
        assert ran[i] == ran[i - 1], ran
    assert len(timed) == (len(ran) + 1) // 2  # only the warm-ups were timed


def test_symmetric_buffers_are_freed_with_the_models_that_reserved_them(monkeypatch):
    """lowering.symm_mem.reserve allocates (here a stand-in for CUDA symmetric memory) under its
    owner; the buffer lives while any owner does."""
    import gc

    from metainfer.kernels import symm_mem

    made = []
    monkeypatch.setattr(symm_mem, "_allocate", lambda n, dt, dev, group: made.append(group) or torch.empty(n, dtype=dt))
    cpu = torch.device("cpu")

    class Owner:
        pass

    a, b = Owner(), Owner()
    with symm_mem.owned_by(a):
        assert symm_mem.reserve("g0", torch.bfloat16, 64, cpu) is None
    with symm_mem.owned_by(b):
        assert symm_mem.reserve("g0", torch.bfloat16, 64, cpu) is None  # shared, not allocated twice
    assert made == ["g0"] and ("g0", torch.bfloat16, 64, None) in symm_mem.reserved()
    del a
    gc.collect()
    assert ("g0", torch.bfloat16, 64, None) in symm_mem.reserved()
    del b
    gc.collect()
    assert ("g0", torch.bfloat16, 64, None) not in symm_mem.reserved()
    monkeypatch.setattr(symm_mem, "_allocate", lambda *a: (_ for _ in ()).throw(RuntimeError("IPC refused\nmore")))
    assert symm_mem.reserve("g1", torch.float32, 8, cpu) == "RuntimeError: IPC refused"


def test_static_cache_is_metainfers_own_marked_and_kept_across_calls():
    """Issue 49 item 5: transformers marks a static cache's tensors as static addresses only outside
    a Dynamo trace, and metainfer's compiled prefill is where they are allocated; unmarked, Inductor
    skips CUDA graphs for the decode ("mutated inputs"). And a new cache per generate() would
    re-record the graphs every call. So generate() keeps one cache per batch size and length
    bucket, resets it per call, and marks its tensors before the compiled calls."""
    m = tiny_hf_model("Llama", "sdpa", layers=2)
    opt = metainfer.optimize(m, "cpu", lowering="aot_eager")
    gen = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    first = opt.generate(ids, **gen)
    (cache,) = opt._static_caches.values()
    addresses = [layer.keys.data_ptr() for layer in cache.layers]
    assert all(getattr(t, "_dynamo_static_input_type", None) is not None
               for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length))
    again = opt.generate(ids, **gen)
    assert list(opt._static_caches.values()) == [cache]  # the same cache, reset
    assert [layer.keys.data_ptr() for layer in cache.layers] == addresses
    assert torch.equal(first, again) and torch.equal(first, m.generate(ids, **gen))
    opt.generate(ids[:1], **gen)  # another batch size: a cache of its own
    assert len(opt._static_caches) == 2
