"""metainfer.runtime.sampling against transformers' own warpers: the distribution each row draws
from is the one TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper -> softmax
gives (the engine's processors, per row); greedy rows are the argmax."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from metainfer.runtime import sampling


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    scores = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    if 0 < top_k < logits.numel():
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)[0]


def drawn_frequencies(logits, temperature, top_k, top_p, draws, dense, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = logits[None].expand(draws, -1)
    tokens = sampling.sample(rows, torch.full((draws,), temperature), torch.full((draws,), top_k, dtype=torch.int32),
                             torch.full((draws,), top_p), g, dense=dense)
    return torch.bincount(tokens, minlength=logits.numel()).double() / draws


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(2, 48), temperature=st.floats(0.3, 2.0), top_k=st.integers(-1, 60),
       top_p=st.sampled_from([0.3, 0.75, 0.95, 1.0]), dense=st.booleans(), seed=st.integers(0, 2**16))
def test_draws_follow_the_engines_warpers(vocab, temperature, top_k, top_p, dense, seed):
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2
    want = reference_probs(logits, temperature, top_k, top_p).double()
    got = drawn_frequencies(logits, temperature, top_k, top_p, draws=20_000, dense=dense, seed=seed)
    assert not (got[want == 0] > 0).any(), "drew a token the warpers remove"
    # 20,000 draws: the expected total-variation distance is <= 0.4 * sqrt(vocab / draws) ~ 0.02
    assert 0.5 * (got - want).abs().sum() < 0.06


def test_top_p_past_the_first_candidates_sorts_the_row():
    # a nucleus of ~1,300 tokens: more than the 1,024 candidates tried first
    logits = torch.cat([torch.linspace(0.0, 0.05, 1400), torch.full((600,), -30.0)])
    want = reference_probs(logits, 1.0, 0, 0.93).double()
    assert int((want > 0).sum()) > sampling.TOP_P_CANDIDATES
    for dense in (False, True):
        got = drawn_frequencies(logits, 1.0, 0, 0.93, draws=40_000, dense=dense)
        assert not (got[want == 0] > 0).any()
        # compared in 10 groups of tokens (single-token frequencies are too thin here)
        groups = torch.arange(logits.numel()) * 10 // logits.numel()
        g_got = torch.zeros(10, dtype=torch.float64).index_add_(0, groups, got)
        g_want = torch.zeros(10, dtype=torch.float64).index_add_(0, groups, want)
        assert 0.5 * (g_got - g_want).abs().sum() < 0.02


def test_draw_never_picks_a_token_without_mass():
    probs = torch.zeros(4096, 7)
    probs[:, 3] = 1.0
    probs[::2, 6] = 1e-30
    tokens = sampling.draw(probs, torch.Generator().manual_seed(1))
    assert set(tokens.tolist()) <= {3, 6}


class _Row:  # what the engine hands prepare_tensor_args: a request state with its kwargs
    _ids = iter(range(10**9))

    def __init__(self, **kwargs):
        from transformers.generation.continuous_batching.requests import RequestState

        self.has_new_token = True
        self.state = RequestState(request_id=f"r{next(self._ids)}", initial_tokens=[1], logit_processor_kwargs=kwargs)


@pytest.mark.parametrize("device_path", [False, True], ids=["host-split", "dense"])
def test_the_sampler_marks_its_draws_for_the_engines_argmax(device_path, monkeypatch):
    sampler = sampling.Sampler(temperature=1.0, top_k=0, top_p=1.0)
    rows = [_Row(temperature=0.0), _Row(temperature=0.8, top_k=5, top_p=0.9), _Row(), _Row(temperature=0.0, top_k=3)]
    storage = torch.zeros(3, 8, dtype=torch.int32)
    sampler.prepare_tensor_args(rows, storage)
    assert storage[1, :4].tolist() == [0, 5, 0, 3]
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    if device_path:  # the path a GPU or a compiled step takes
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = sampler(None, logits.clone(), storage)
    picked = out.argmax(-1)
    assert picked[0] == logits[0].argmax() and picked[3] == logits[3].argmax()  # greedy rows: the argmax
    assert torch.equal(out[[0, 3]], logits[[0, 3]])
    for r in (1, 2):  # sampled rows: one token at 0, the rest -inf
        assert (out[r] == 0).sum() == 1 and torch.isinf(out[r]).sum() == 49
    assert int(picked[1]) in logits[1].topk(5).indices.tolist()


def test_a_requests_seed_seeds_the_draw_once_before_its_first_token():
    """The seed travels with the request (every rank of a tensor-parallel group gets it in the
    request's state) and is applied in the step, before the request's first draw, then dropped."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(5))

    def first_draw(seed):
        sampler = sampling.Sampler()
        rows = [_Row(temperature=1.0, seed=seed), _Row(temperature=1.0)]
        storage = torch.zeros(3, 8, dtype=torch.int32)
        torch.manual_seed(seed + 1000)  # whatever the generator held before
        sampler.prepare_tensor_args(rows, storage)
        assert all("seed" not in r.state.logit_processor_kwargs for r in rows)  # applied once
        return sampler(None, logits.clone(), storage).argmax(-1).tolist()

    assert first_draw(7) == first_draw(7)
    assert len({tuple(first_draw(s)) for s in range(8)}) > 1  # the seed decides the draw
    assert sampling.Sampler().supported_keys["seed"] is int  # the engine admits it per request


def test_the_sampler_stands_only_for_temperature_top_k_top_p():
    from transformers import GenerationConfig, LogitsProcessorList
    from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessorList
    from transformers.generation.logits_process import MinPLogitsWarper

    def processors(*items):
        return ContinuousBatchingLogitsProcessorList(LogitsProcessorList(items), per_request_processors=True)

    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    sampler = sampling.Sampler.replacing(config, processors(TemperatureLogitsWarper(0.7), TopKLogitsWarper(20)))
    assert sampler.defaults == {"temperature": 0.7, "top_k": 20, "top_p": 0.9}
    assert sampling.Sampler.replacing(config, processors(TopKLogitsWarper(20), MinPLogitsWarper(0.1))) is None
    assert sampling.Sampler.replacing(GenerationConfig(do_sample=False), processors()) is None
    with pytest.raises(ValueError, match="top_p"):
        sampling.Sampler(top_p=0.0)


def test_extreme_parameters_still_draw_the_most_likely_token():
    """Found by fuzzing the server: a top_p that rounds to 0 in fp32 (5e-324) kept no candidate,
    and a repetition penalty that small divides logits to inf; both must still draw the argmax."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    for dense in (False, True):
        tokens = sampling.sample(logits, torch.ones(3), torch.zeros(3, dtype=torch.long),
                                 torch.full((3,), 5e-324), dense=dense)
        assert torch.equal(tokens, logits.argmax(-1))
    out = sampling.penalise(logits, [0], [{"repetition_penalty": 5e-324, "presence_penalty": 0.0,
                                           "frequency_penalty": 0.0}], [[1, 2, 3]], [[]])
    assert torch.isfinite(out).all()
    assert int(out[0].argmax()) in {1, 2, 3} or float(logits[0, [1, 2, 3]].max()) <= 0
