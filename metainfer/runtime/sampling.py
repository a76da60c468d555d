"""Per-request sampling for the serving engine, at the cost of what each request asks for.

The engine's per-request processors (transformers' continuous batching) sort the whole
vocabulary for top-k and again for top-p on every row of every step, greedy rows included, then
draw with `torch.multinomial`: measured on this machine, 32 rows x 32,000 tokens, each sort 33 ms
and the draw 23 ms, against 0.8 ms for an argmax. Sampler replaces that processor list (it is the
engine's own extension point: a ContinuousBatchingLogitsProcessorList, which the engine's step
calls on the logits rows and whose per-request arguments it stores) and draws the token itself:

- a greedy row (temperature 0) is left as it is: the engine, run with do_sample=False, takes its
  argmax;
- a row with neither top-k nor top-p draws from the full softmax;
- a filtered row keeps its top candidates (`torch.topk` of the batch's largest k; for top-p
  alone the top 1,024, a full sort only where those hold less than p), applies top-k then top-p
  (transformers' order) and draws;
- a draw inverts the cumulative sum (as multinomial does, at a tenth of its time here); the
  drawn row becomes 0 at its token and -inf elsewhere, so the engine's argmax reads the draw.

On CPU the rows are split by kind on the host (the arguments are host tensors: no device sync);
on a GPU, or while compiling, every row takes the one filtered path (one sort, no
data-dependent shapes) and greedy rows are selected with `torch.where`.

Per request, and only for the rows that ask (other rows cost nothing):
- penalties on the raw logits, before temperature and the greedy argmax: `repetition_penalty`
  over the prompt and the generated tokens (transformers' RepetitionPenaltyLogitsProcessor),
  then OpenAI's `frequency_penalty` x count and `presence_penalty` over the generated tokens
  (vLLM's order and scope). They travel in the request's kwargs, so every rank of a
  tensor-parallel group applies them alike;
- log-probabilities of the model's raw distribution (before penalties and temperature, as
  vLLM's default) for the chosen token and the k most likely, recorded for the request ids a
  consumer watches (`watch_logprobs`; the server on rank 0) and taken by position.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from metainfer.models import transformers_adapter as hf
from metainfer.models.transformers_adapter import CLASSIC_TO_CB_PROCESSORS_MAP, ContinuousBatchingLogitsProcessorList

_KEYS = {"temperature": float, "top_k": int, "top_p": float}
PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}  # key: its "off" value
LOGPROB_FLOOR = -9999.0  # a -inf log-probability is reported as this (JSON has no infinity)


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the `k` most likely tokens' (id, log-probability)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def history(state) -> tuple[list[int], list[int]]:
    """(prompt, generated tokens) of an engine request state; a request the engine preempted and
    re-queued carries its generated tokens at the end of its initial tokens."""
    true_prompt = hf.true_prompt_length(state)
    return state.initial_tokens[:true_prompt], state.initial_tokens[true_prompt:] + state.generated_tokens


def penalise(scores: torch.Tensor, rows: list[int], penalties: list[dict], prompts: list[list[int]],
             generated: list[list[int]]) -> torch.Tensor:
    """`scores` with rows[i] penalised by penalties[i] (repetition over prompt + generated, then
    frequency x count and presence over generated); other rows untouched."""
    vocab = scores.size(-1)
    sub = scores[rows]
    counts = torch.zeros_like(sub)
    seen = torch.zeros(sub.shape, dtype=torch.bool, device=sub.device)
    for i, (prompt, gen) in enumerate(zip(prompts, generated)):
        if gen:
            ids = torch.tensor(gen, device=sub.device)
            counts[i].index_add_(0, ids, torch.ones(len(gen), device=sub.device, dtype=sub.dtype))
        if penalties[i]["repetition_penalty"] != 1.0 and (prompt or gen):
            seen[i, torch.tensor(prompt + gen, device=sub.device).clamp_(0, vocab - 1)] = True
    value = lambda key: torch.tensor([p[key] for p in penalties], device=sub.device, dtype=sub.dtype)[:, None]  # noqa: E731
    rep = value("repetition_penalty")
    sub = torch.where(seen, torch.where(sub < 0, sub * rep, sub / rep), sub)
    sub = sub - counts * value("frequency_penalty") - (counts > 0).to(sub.dtype) * value("presence_penalty")
    out = scores.clone()
    out[rows] = sub.clamp(-torch.finfo(sub.dtype).max, torch.finfo(sub.dtype).max)  # a tiny penalty divides to inf
    return out


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of `probs` (>= 0, rows need not sum to 1), drawn as torch.multinomial(probs, 1)
    draws, by inverting the cumulative sum (a tenth of multinomial's time on CPU at 32 x 32,000)."""
    cumulative = probs.cumsum(-1)
    # u in [0, total): never an index past the last one with mass (the factor keeps u < total in fp32)
    u = torch.rand(probs.size(0), 1, device=probs.device, generator=generator) * cumulative[:, -1:] * (1 - 2.0 ** -20)
    return torch.searchsorted(cumulative, u, right=True).squeeze(1).clamp_max_(probs.size(-1) - 1)


TOP_P_CANDIDATES = 1024  # a top-p row first tries this many candidates; a full sort only if they hold < p


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           generator: torch.Generator | None = None, *, dense: bool = False) -> torch.Tensor:
    """Token ids drawn for rows of `logits` [rows, vocab] with per-row temperature > 0, top_k
    (<= 0 or >= vocab: off) and top_p (>= 1: off), top-k applied before top-p. `dense`: one
    sorted path for every row (no host reads of the arguments: a GPU's path)."""
    vocab = logits.size(-1)
    scaled = logits.float() / temperature[:, None]
    top_k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    if dense:
        probs, index = _candidates(scaled, top_k, top_p, vocab)
        return index.gather(-1, draw(probs, generator)[:, None]).squeeze(-1)
    filtered = ((top_k < vocab) | (top_p < 1)).tolist()
    out = torch.empty(len(filtered), dtype=torch.long, device=logits.device)
    plain = [i for i, f in enumerate(filtered) if not f]
    if plain:
        out[plain] = draw(scaled[plain].softmax(-1), generator)
    rows = [i for i, f in enumerate(filtered) if f]
    if rows:
        k, p = top_k[rows], top_p[rows]
        top_p_alone = k == vocab
        width = min(vocab, max(int(k[~top_p_alone].max()) if bool((~top_p_alone).any()) else 1,
                               TOP_P_CANDIDATES if bool(top_p_alone.any()) else 1))
        sub = scaled[rows]
        probs, index = _candidates(sub, k, p, width)
        tokens = index.gather(-1, draw(probs, generator)[:, None]).squeeze(-1)
        short = (top_p_alone & (probs.sum(-1) < p)).nonzero().squeeze(1)  # the nucleus reaches past the candidates
        if short.numel():
            probs, index = _candidates(sub[short], k[short], p[short], vocab)
            tokens[short] = index.gather(-1, draw(probs, generator)[:, None]).squeeze(-1)
        out[rows] = tokens
    return out


def _candidates(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int):
    """The `width` most likely tokens of each row (ids, and their probabilities where top-k and
    top-p keep them, else 0). Top-p's probabilities are over what top-k kept: the candidates when
    the row has top-k (width >= its k), else the whole row."""
    vocab = scaled.size(-1)
    values, index = scaled.topk(width, dim=-1) if width < vocab else scaled.sort(dim=-1, descending=True)
    rank = torch.arange(width, device=scaled.device)
    values = values.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    norm = torch.where(top_k < vocab, values.logsumexp(-1), scaled.logsumexp(-1))
    probs = (values - norm[:, None]).exp()
    before = probs.cumsum(-1) - probs  # mass of the candidates ranked above: top-p keeps those with < p
    # and always the most likely (a top_p that rounds to 0 in fp32 keeps one, as transformers does)
    return probs.masked_fill((before >= top_p[:, None]) & (rank[None, :] > 0), 0.0), index


class Sampler(ContinuousBatchingLogitsProcessorList):
    """The engine's logits-processor list, drawing tokens itself (see the module docstring).
    Defaults for a request that sets none come from the engine's generation config."""

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"Sampler: temperature {temperature} must be >= 0 and top_p {top_p} in (0, 1]")
        super().__init__(LogitsProcessorList())
        self.defaults = {"temperature": float(temperature), "top_k": int(top_k or 0), "top_p": float(top_p)}
        self.tensors_required = 3  # rows of the engine's argument storage: temperature, top_k, top_p
        self.supported_keys = {**_KEYS, "seed": int, **{key: float for key in PENALTIES}}
        self.ignored_keys = set()
        self.do_processing = True
        self.generator = None  # torch's default generator (a request's "seed" seeds it)
        # host-side extras of each prepared step (penalised rows, rows whose log-probabilities are
        # watched), taken by the step's call in order; the engine prepares a step ahead only in
        # its async mode (2 in flight); an entry older than that is dropped (a step prepared whose
        # forward never ran: transformers 5.25 ends its loop then, a later version may not)
        self.steps_in_flight = 1
        self._steps: collections.deque = collections.deque()
        self._lock = threading.Lock()  # the watches are read on the engine's thread, taken on another
        self._watched: dict[str, int] = {}  # request id -> top log-probabilities wanted
        self._logprobs: dict[str, dict[int, TokenLogprob]] = {}  # request id -> position -> record

    @classmethod
    def replacing(cls, generation_config, processors) -> "Sampler | None":
        """A Sampler standing for the engine's processor list, when that list only has
        temperature, top-k and top-p (per request or not) and the config samples; else None."""
        if not getattr(generation_config, "do_sample", False):
            return None
        ours = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, *CLASSIC_TO_CB_PROCESSORS_MAP.values())
        if any(not isinstance(p, ours) for p in processors.logits_processor):
            return None
        g = generation_config
        return cls(1.0 if g.temperature is None else g.temperature, g.top_k or 0, 1.0 if g.top_p is None else g.top_p)

    def __repr__(self) -> str:
        return f"Sampler(defaults={self.defaults})"

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        d = self.defaults
        int32_tensor.copy_(self._encode([d["temperature"]], [d["top_k"]], [d["top_p"]]))

    @staticmethod
    def _encode(temperature, top_k, top_p) -> torch.Tensor:
        return torch.stack([torch.tensor(temperature, dtype=torch.float32).view(torch.int32),
                            torch.tensor(top_k, dtype=torch.int32),
                            torch.tensor(top_p, dtype=torch.float32).view(torch.int32)])

    def prepare_tensor_args(self, requests_in_batch, arg_storage: torch.Tensor) -> torch.Tensor:
        rows = [r.state.logit_processor_kwargs for r in requests_in_batch if r.has_new_token]
        # a request's seed seeds the generator before its first draw (the batch shares it: best
        # effort, as in OpenAI's API); taken here, on the engine's thread, so the ranks of a
        # tensor-parallel group, each running this step, seed theirs at the same draw
        seeds = [kw.pop("seed") for kw in rows if "seed" in kw]
        if seeds:
            if self.generator is not None:
                self.generator.manual_seed(seeds[-1])
            else:
                torch.manual_seed(seeds[-1])  # every device's default generator
        if rows:
            values = {key: [kw.get(key, self.defaults[key]) for kw in rows] for key in _KEYS}
            arg_storage[:3, :len(rows)] = self._encode(values["temperature"], values["top_k"],
                                                       values["top_p"]).to(arg_storage.device)
        while len(self._steps) >= self.steps_in_flight:
            self._steps.popleft()  # a step prepared whose forward never ran (it failed)
        self._steps.append(self._extras([r.state for r in requests_in_batch if r.has_new_token]))
        return arg_storage

    def _extras(self, states) -> dict:
        penalised, watched = [], []
        with self._lock:
            for row, state in enumerate(states):
                kw = state.logit_processor_kwargs
                if any(kw.get(key, off) != off for key, off in PENALTIES.items()):
                    penalised.append((row, {key: float(kw.get(key, off)) for key, off in PENALTIES.items()},
                                      *history(state)))
                k = self._watched.get(state.request_id)
                if k is not None:
                    watched.append((row, state.request_id, len(history(state)[1]), k))
        return {"penalised": penalised, "watched": watched}

    # ---- log-probabilities, for a consumer on another thread
    def watch_logprobs(self, request_ids: list[str], top: int) -> None:
        """Record the chosen token's log-probability and the `top` most likely for these requests."""
        with self._lock:
            for rid in request_ids:
                self._watched[rid] = top
                self._logprobs[rid] = {}

    def watches(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._watched

    def take_logprobs(self, request_id: str, start: int, end: int) -> list[TokenLogprob]:
        """The records of generated positions [start, end) of a watched request (handed out once)."""
        with self._lock:
            records = self._logprobs.get(request_id, {})
            missing = [i for i in range(start, end) if i not in records]
            if missing:
                raise RuntimeError(f"no log-probabilities recorded for {request_id} at positions {missing}")
            return [records.pop(i) for i in range(start, end)]

    def unwatch(self, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._watched.pop(rid, None)
                self._logprobs.pop(rid, None)

    def _record(self, watched, raw: torch.Tensor, out: torch.Tensor) -> None:
        rows = [w[0] for w in watched]
        logprobs = raw[rows].float().log_softmax(-1)
        chosen = out[rows].argmax(-1)  # what the engine's argmax takes from the returned rows
        picked = logprobs.gather(-1, chosen[:, None]).squeeze(-1)
        width = max(w[3] for w in watched)
        top_values, top_ids = logprobs.topk(width, -1) if width else (logprobs[:, :0], chosen[:, None][:, :0])
        chosen, picked = chosen.tolist(), picked.clamp(min=LOGPROB_FLOOR).tolist()
        top_values, top_ids = top_values.clamp(min=LOGPROB_FLOOR).tolist(), top_ids.tolist()
        with self._lock:
            for i, (_row, rid, position, k) in enumerate(watched):
                records = self._logprobs.get(rid)
                if records is not None:  # still watched
                    records[position] = TokenLogprob(chosen[i], picked[i], list(zip(top_ids[i][:k], top_values[i][:k])))

    def __call__(self, input_ids, scores: torch.Tensor, logits_processor_args: torch.Tensor) -> torch.Tensor:
        extras = self._steps.popleft() if self._steps else {"penalised": [], "watched": []}
        raw = scores
        if extras["penalised"]:
            rows, penalties, prompts, generated = zip(*extras["penalised"])
            scores = penalise(scores, list(rows), list(penalties), list(prompts), list(generated))
        out = self._sample(scores, logits_processor_args)
        if extras["watched"]:
            self._record(extras["watched"], raw, out)
        return out

    def _sample(self, scores: torch.Tensor, logits_processor_args: torch.Tensor) -> torch.Tensor:
        n = scores.size(0)
        temperature = logits_processor_args[0, :n].view(torch.float32)
        top_k = logits_processor_args[1, :n]
        top_p = logits_processor_args[2, :n].view(torch.float32)
        if scores.device.type == "cpu" and not torch.compiler.is_compiling():
            rows = (temperature > 0).nonzero().squeeze(1)
            if rows.numel() == 0:
                return scores  # all greedy: the engine's argmax
            tokens = sample(scores[rows], temperature[rows], top_k[rows], top_p[rows], self.generator)
            return scores.index_fill(0, rows, float("-inf")).index_put_((rows, tokens), scores.new_zeros(()))
        sampling = temperature > 0
        tokens = sample(scores, torch.where(sampling, temperature, 1.0), top_k, top_p, self.generator, dense=True)
        drawn = torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)
        return torch.where(sampling[:, None], drawn, scores)
