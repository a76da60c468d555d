"""No host read in a decode or serving step: metainfer's own code on a step's path (its custom
ops' GPU launch paths, here under Triton's interpreter, the forward it installs, the serving
glue) never calls item()/tolist()/nonzero()/bool(tensor)/torch.cuda.synchronize, each of which
stalls the host until the GPU has caught up. metainfer.testing.host_reads lists any it makes."""

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import metainfer
from metainfer.runtime import inputs
from metainfer.testing import host_reads, tiny_hf_model

HF_TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
               num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
               n_shared_experts=1, first_k_dense_replace=1, index_n_heads=2, index_head_dim=16, index_topk=4)

# The token check's verdict is read from a pinned host word after the check's own event, queued
# before the graph (inputs.TokenGuard): it waits for the check, not for the step.
ALLOW = ("inputs.py:finish",)


@pytest.fixture
def gpu_token_check(monkeypatch):
    """The token check as a GPU runs it: deferred to finish() (on a CPU it reads at once)."""
    real = inputs.TokenGuard.check
    monkeypatch.setattr(inputs.TokenGuard, "check", lambda self, ids, vocab, what, deferred=None:
                        real(self, ids, vocab, what, deferred=True))


def test_the_detector_sees_metainfer_reads_and_not_others():
    t = torch.ones(3)
    with host_reads() as reads:
        t.sum().item()  # a test's own frame is not metainfer's
        inputs.check_dtype(torch.ones(2, dtype=torch.int64), "ids")  # metainfer code that reads nothing
        from metainfer.kernels import token_ids
        token_ids.reference(torch.tensor([1, 500]), 100)  # metainfer code that calls nonzero
    assert len(reads) == 1 and reads[0].startswith("nonzero at token_ids.py:reference"), reads


def test_deepseek_v32_decode_steps_read_nothing_back(interpret, gpu_token_check):
    """Decode steps of DeepSeek-V3.2 (sparse top-k attention whose unselected keys carry HF's
    finite fill, with a padding row): before sparse attention decided its empty rows on the
    device this caught `__bool__` and `nonzero` in sparse_attention.fix_unselected_rows."""
    m = tiny_hf_model("DeepseekV32", "eager", layers=2, **HF_TINY)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 6, dtype=torch.long)
    am[1, :2] = 0
    opt = metainfer.optimize(m, "cpu", lowering="aot_eager")
    gen = dict(attention_mask=am, max_new_tokens=3, do_sample=False)
    warm = opt.generate(ids, **gen)  # compiles the prefill and decode graphs
    assert any(r.name == "sparse_mla" and r.matches for s in opt.report.sections for r in s.records)
    with host_reads(allow=ALLOW) as reads:
        out = opt.generate(ids, **gen)
    assert reads == []
    assert torch.equal(out, warm)


def test_serving_steps_read_nothing_back(interpret, gpu_token_check):
    """Continuous-batching steps (paged attention over the engine's pool, chunked prefill, decode),
    compiled from the first step: the engine's own bookkeeping reads back, metainfer's part not."""
    m = tiny_hf_model("Llama", "sdpa", layers=2)
    opt = metainfer.optimize(m, "cpu", lowering="aot_eager", serve_compile="always")
    reqs = [list(range(3, 3 + n)) for n in (5, 17, 9)]
    greedy = GenerationConfig(do_sample=False, max_new_tokens=4, eos_token_id=-1, pad_token_id=0)
    cfg = dict(num_blocks=32, page_size=16, max_batch_tokens=32)
    warm = opt.generate_batch(reqs, generation_config=greedy, continuous_batching_config=ContinuousBatchingConfig(**cfg))
    with host_reads(allow=ALLOW) as reads:
        out = opt.generate_batch(reqs, generation_config=greedy,
                                 continuous_batching_config=ContinuousBatchingConfig(**cfg))
    assert reads == []
    assert [r.generated_tokens for r in out.values()] == [r.generated_tokens for r in warm.values()]


class FakeEvent:
    """torch.cuda.Event on a CPU build: 'completes' when the test says so."""
    clock = 0.0
    done = False

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self, stream=None):
        FakeEvent.clock += 0.25
        self.at = FakeEvent.clock

    def query(self):
        return FakeEvent.done

    def synchronize(self):
        FakeEvent.done = True

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


def test_observed_calls_on_a_gpu_are_timed_by_events_read_when_done(monkeypatch):
    """An observed call's seconds come from a CUDA event pair, handed on when the events have
    completed (at a later call, or when the calls end), never by synchronising the device."""
    from metainfer.runtime.optimized import CallTimes

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.done = False
    heard = []
    with host_reads() as reads:
        times = CallTimes(cuda=True)
        t = times.start()
        times.stop(t, heard.append)
        t = times.start()  # the first call's events have not completed: nothing waits
        assert heard == []
        times.stop(t, heard.append)
        FakeEvent.done = True
        times.start()  # both have now: handed on in order
        assert heard == [0.25, 0.25]
        t = times.start()
        times.stop(t, heard.append, host=True)  # a call that compiled: its host time, at once
        assert len(heard) == 3 and heard[-1] >= 0
        times.close()
    assert reads == []
