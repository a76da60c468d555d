"""Speculative decoding inside the serving engine (transformers' continuous batching), for
greedy requests: each step, a decoding request's query is its last token plus up to k drafted
tokens; one forward verifies them; the tokens the target's argmax agrees with are accepted
with one more (the argmax after the last accepted), and the rest are taken back.

Three hooks on the engine, nothing else of its scheduling changes:
- the scheduler's candidate pass: before it budgets a step, each eligible decoding request's
  `tokens_to_process` becomes [last token, drafts...] (drafts take only the step's token budget
  that prefills leave, and must fit the request's pool; a request the step does not take gets
  its one token back);
- the model's forward (a forward hook): reads the logits at every query position, counts the
  accepted drafts, and moves the row after the last accepted one to the request's last position,
  which is the row the engine samples its token from (the argmax there is the next token);
- the batch update: appends the accepted drafts before the engine appends its token, takes the
  position back by the rejected drafts (their KV rows are overwritten by later steps), and
  counts only the verified tokens' blocks as complete (prefix sharing never hashes a rejected
  row).

Eligible: greedy (temperature 0), no penalties, no watched log-probabilities, room for one more
token after the drafts (drafts never finish a request: the engine's own token does, so EOS and
max_tokens are checked where they always are). Models with sliding-window layers are refused:
their ring buffer cannot take rejected rows back. Greedy tokens are those of the same request
without speculation (tests/test_serve_speculation.py).

The draft length of a step is chosen, as generate()'s is (metainfer.runtime.speculative), by
`planner.best_draft_length` from measured figures: the acceptance rate (a Beta posterior over
the drafts verified so far), the engine's decode steps' seconds as a line in the step's query tokens
(least squares over the last STEP_WINDOW such steps: a drafted token costs a decoded token's
work, its LM head row included, which a prefill token does not), and a draft model's seconds per drafted token.
A step of R drafting requests and T other query tokens yields R x expected_accepted(a, k)
tokens in step(T + R k) + R k x draft seconds; k = 0 (no drafts) wins where verifying costs
more than acceptance returns (a compute-bound batch). Until MIN_STEPS steps are measured the
flag's maximum is drafted, and while k = 0 is chosen every PROBE_EVERY-th step drafts it
again (so the rate and the line stay measured); steps that compiled a graph are not measured.

Drafters: prompt lookup (transformers' PromptLookupCandidateGenerator: the continuation of the
longest recent n-gram seen before in the request's tokens; free), or a draft model (greedy,
batch 1 per request, its own DynamicCache per request cropped back on rejection).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import torch

from metainfer.models import transformers_adapter as hf
from metainfer.models.transformers_adapter import RequestStatus

log = logging.getLogger("metainfer.speculation")


STEP_WINDOW = 256  # engine steps the step-time line is fitted over
MIN_STEPS = 8  # steps measured before the draft length is chosen from them
PROBE_EVERY = 16  # while no drafting pays, every this many drafting-eligible steps draft anyway


class StepTimes:
    """The engine's step seconds by the step's query tokens, over the last STEP_WINDOW steps."""

    def __init__(self):
        self.steps: collections.deque = collections.deque(maxlen=STEP_WINDOW)

    def add(self, tokens: int, seconds: float) -> None:
        self.steps.append((tokens, seconds))

    def seconds(self, tokens: float) -> float | None:
        """A least-squares line's seconds at `tokens` (its slope at least 0); None before MIN_STEPS."""
        if len(self.steps) < MIN_STEPS:
            return None
        n = len(self.steps)
        mx = sum(t for t, _ in self.steps) / n
        my = sum(s for _, s in self.steps) / n
        var = sum((t - mx) ** 2 for t, _ in self.steps)
        slope = sum((t - mx) * (s - my) for t, s in self.steps) / var if var > 0 else my / max(mx, 1.0)
        return max(my + max(slope, 0.0) * (tokens - mx), 1e-9)


@dataclass
class SpeculationStats:
    """Counted on the engine's thread, read by /metrics."""

    drafted: int = 0  # drafted tokens verified
    accepted: int = 0  # of them, accepted
    steps: int = 0  # request-steps that verified drafts
    lengths: dict = field(default_factory=dict)  # draft length chosen -> engine steps it was chosen for

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class PromptLookup:
    """Drafts the tokens that followed the longest n-gram (up to `max_ngram`) that ends the
    request's tokens and appeared earlier in them."""

    name = "prompt lookup"

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        from metainfer.models.transformers_adapter import PromptLookupCandidateGenerator

        if k < 1 or len(tokens) < 2:
            return []
        lookup = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=self.max_ngram,
                                                max_length=len(tokens) + k + 1)
        out, _ = lookup.get_candidates(torch.tensor([tokens]))
        return out[0, len(tokens):].tolist()

    def forget(self, keep) -> None:
        pass


class DraftModel:
    """Drafts greedily with a small model of the same vocabulary, one request at a time, each
    request's KV in a DynamicCache of its own (cropped to the tokens the target accepted)."""

    name = "draft model"

    def __init__(self, model):
        import inspect

        self.model = model.eval()
        self.device = next(model.parameters()).device
        # transformers renames past_key_values to cache (5.25 warns on the old name)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._caches: dict[str, tuple[object, list[int]]] = {}  # request id -> (cache, the tokens it holds)

    @torch.no_grad()
    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        from transformers import DynamicCache

        if k < 1:
            return []
        cache, held = self._caches.get(request_id, (None, []))
        common = 0
        for a, b in zip(held, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # at least one token fed: its logits draft the first
        if cache is None or common == 0:
            cache, common = DynamicCache(), 0
        elif cache.get_seq_length() > common:
            cache.crop(common - cache.get_seq_length())  # transformers 5.25 crops by a negative count
        feed, out = tokens[common:], []
        for _ in range(k):
            ids = torch.tensor([feed], device=self.device)
            logits = self.model(input_ids=ids, use_cache=True, **{self._cache_kw: cache}).logits
            feed = [int(logits[0, -1].argmax())]
            out.append(feed[0])
        # the cache holds every token fed: the sequence and all drafts but the last
        self._caches[request_id] = (cache, tokens + out[:-1])
        return out

    def forget(self, keep) -> None:
        for rid in [r for r in self._caches if r not in keep]:
            del self._caches[rid]


def drafter(kind: str, model=None):
    if kind == "prompt-lookup":
        return PromptLookup()
    if kind == "draft":
        if model is None:
            raise ValueError("speculative 'draft' needs a draft model")
        return DraftModel(model)
    raise ValueError(f"unknown speculative drafter {kind!r}: prompt-lookup or draft")


class EngineSpeculation:
    """Speculation installed on one engine manager (see the module docstring)."""

    def __init__(self, manager, model, drafter, max_draft: int = 4, graphs=lambda: 0):
        """`graphs()`: graphs compiled so far (a step that compiled one is not timed)."""
        if max_draft < 1:
            raise ValueError(f"speculation needs at least one draft token, not {max_draft}")
        layer_types = getattr(model.config, "layer_types", None)
        sliding = "sliding_attention" in layer_types if layer_types else bool(getattr(model.config, "sliding_window", None))
        if sliding:
            raise ValueError("speculative decoding in the engine needs full-attention layers: a sliding window's "
                             "ring buffer cannot take back the rows of rejected drafts")
        draft_vocab = getattr(getattr(getattr(drafter, "model", None), "config", None), "vocab_size", None)
        if draft_vocab is not None and draft_vocab != model.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_vocab}) is not the model's "
                             f"({model.config.vocab_size})")
        self.manager, self.model, self.drafter, self.max_draft = manager, model, drafter, max_draft
        self.stats = SpeculationStats()
        self.failed = False  # the drafter raised: no more drafts
        from metainfer.runtime.speculative import Acceptance, _Mean

        self.acceptance = Acceptance()
        self.step_times = StepTimes()
        self.draft_seconds = _Mean()  # per drafted token (prompt lookup's counted too: its search)
        self._step_started: float | None = None
        self._graphs, self._graphs_before = graphs, 0
        self._since_probe = 0  # eligible steps since drafts were last verified
        self._pending: dict[str, list[int]] = {}  # this step's drafts by request id
        self._verified: dict[str, tuple[list[int], int]] = {}  # accepted drafts, drafted count
        self._step = None  # this forward's drafted spans (set by the pre-hook)
        self._drafting = 0.0  # seconds this step spent drafting
        self._hooks = [model.register_forward_pre_hook(self._ask_every_drafted_row, with_kwargs=True),
                       model.register_forward_hook(self._verify, with_kwargs=True)]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    # ---- the hooks
    def install(self, processor) -> None:
        """Wraps a new batch processor's scheduler candidate pass and its batch update."""
        def with_drafts(process):
            def process_with_drafts(candidates, token_budget, *args, **kwargs):
                self._step_started, self._graphs_before = time.perf_counter(), self._graphs()
                drafted = self._draft(candidates, token_budget, processor)
                result = process(candidates, token_budget, *args, **kwargs)
                scheduled = {f.state.request_id for f in result[0]}
                for state in drafted:
                    if state.request_id not in scheduled:  # not in this step: its one token back
                        state.tokens_to_process = state.tokens_to_process[:1]
                        self._pending.pop(state.request_id, None)
                return result

            return process_with_drafts

        hf.wrap_candidate_pass(processor.scheduler, with_drafts)
        update = processor.update_batch

        def update_with_accepted():
            batch = processor.inputs_and_outputs.requests_in_batch
            tokens = sum(f.query_length for f in batch)
            # a step of decoding requests only (drafts or not): the steps the draft length is for
            decode = all(f.query_length == 1 or f.state.request_id in self._verified for f in batch)
            self._accept(processor)
            out = update()  # the engine reads the step's tokens back: the step's work is done
            if decode and self._step_started is not None and self._graphs() == self._graphs_before:
                self.step_times.add(tokens, time.perf_counter() - self._step_started - self._drafting)
            self._step_started = None
            return out

        processor.update_batch = update_with_accepted

    def _eligible_room(self, state, sampler) -> int:
        """Drafts this request may take now (0: not eligible)."""

        from metainfer.runtime import sampling

        if state.status != RequestStatus.DECODING or len(state.tokens_to_process) != 1 or \
                state.remaining_prefill_tokens:
            return 0
        kw = state.logit_processor_kwargs
        defaults = sampler.defaults if sampler is not None else {"temperature": 0.0}
        if float(kw.get("temperature", defaults["temperature"])) != 0.0 or "seed" in kw:
            return 0
        if any(kw.get(key, off) != off for key, off in sampling.PENALTIES.items()):
            return 0
        if sampler is not None and sampler.watches(state.request_id):
            return 0
        return min(self.max_draft, hf.new_tokens_limit(state) - state.generated_len() - 1)

    def _draft(self, candidates, token_budget: int, processor) -> list:

        self._drafting = 0.0
        if candidates:  # a draft model's caches of requests that are gone (all of them once it failed)
            self.drafter.forget(set(processor.scheduler.active_requests) if not self.failed else set())
        if self.failed:
            return []
        sampler = getattr(self.manager, "sampler", None)
        decoding = [s for s in candidates if s.status == RequestStatus.DECODING]
        drafted = []
        rooms = [(state, room) for state in decoding if (room := self._eligible_room(state, sampler)) > 0]
        if not rooms:
            return drafted
        others = sum(len(s.remaining_prefill_tokens or s.tokens_to_process) for s in candidates
                     if s.status != RequestStatus.DECODING)
        # drafts take only the budget prefills leave: a prompt waiting for its first token goes first
        spare = token_budget - min(token_budget, len(decoding) + others)
        if spare < 1:
            return drafted
        k = self.draft_length(len(rooms), min(token_budget, len(decoding) + others))
        self.stats.lengths[k] = self.stats.lengths.get(k, 0) + 1
        started = time.perf_counter()
        for state, room in rooms:
            room = min(room, k, spare)
            if room < 1:
                continue
            try:
                drafts = self.drafter.propose(state.request_id, state.initial_tokens + state.generated_tokens, room)
            except Exception:  # a drafter's failure costs its speed, never a request
                log.exception("the %s failed to draft: speculation is off for the rest of this engine",
                              self.drafter.name)
                self.failed = True
                return drafted
            # dry run: the scheduler allocates a scheduled request's pages itself (a real check would
            # take pages another request's next token may need)
            if not drafts or not processor.cache.can_store_request_tokens(state, 1 + len(drafts), dry_run=True):
                continue
            state.tokens_to_process = state.tokens_to_process[:1] + drafts
            self._pending[state.request_id] = drafts
            spare -= len(drafts)
            drafted.append(state)
        self._drafting = time.perf_counter() - started
        if drafted:
            self.draft_seconds.add(self._drafting, sum(len(d) for d in self._pending.values()))
        return drafted

    def draft_length(self, requests: int, other_tokens: int) -> int:
        """The draft length for a step of `requests` drafting requests and `other_tokens` query
        tokens besides theirs: best_draft_length over measured acceptance and step time."""
        from metainfer.hardware import planner

        if self.step_times.seconds(other_tokens) is None:
            return self.max_draft  # probing: the rate and the step line get measured
        per_token = self.draft_seconds.value or 0.0
        k, _, _ = planner.best_draft_length(
            self.acceptance.rate, lambda n: self.step_times.seconds(other_tokens + requests * (n - 1)),
            lambda k: requests * k * per_token, max_draft=self.max_draft)
        self._since_probe = 0 if k else self._since_probe + 1
        if self._since_probe >= PROBE_EVERY:
            self._since_probe = 0
            return self.max_draft
        return k

    def _ask_every_drafted_row(self, module, args, kwargs):
        """Forward pre-hook: the engine asks the model for the logits of each request's last
        position (`logits_to_keep`); a speculating request needs every position's."""
        self._step = None
        if not self._pending:
            return None
        processor = getattr(self.manager, "batch_processor", None)
        pending, self._pending = self._pending, {}
        if processor is None:
            return None
        spans, rows, start, sampled = [], [], 0, 0  # rows: positions whose logits the forward returns
        for future in processor.inputs_and_outputs.requests_in_batch:
            n, drafts = future.query_length, pending.get(future.state.request_id)
            if future.has_new_token:
                if drafts is not None and n == 1 + len(drafts):
                    spans.append((future.state, len(rows), start, drafts))
                    rows.extend(range(start, start + n))
                else:
                    rows.append(start + n - 1)
                sampled += 1
            start += n
        if not spans:
            return None
        keep = kwargs.get("logits_to_keep")
        sliced = isinstance(keep, torch.Tensor)
        if sliced:  # the padded rows the engine may have added stay at the end
            kwargs["logits_to_keep"] = torch.cat([torch.tensor(rows, dtype=keep.dtype).to(keep.device), keep[sampled:]])
        self._step = (spans, rows, sampled, sliced)
        return args, kwargs

    def _verify(self, module, args, kwargs, output):
        """Forward hook: the argmax at every drafted position, the accepted prefix, and the row
        after it handed to the engine as the request's row (the one it samples its token from)."""
        step, self._step = getattr(self, "_step", None), None
        logits = getattr(output, "logits", None)
        if step is None or logits is None:
            return None
        spans, rows, sampled, sliced = step
        at = lambda first, start: first if sliced else start  # noqa: E731 - a span's first row in the output
        drafted = torch.cat([torch.arange(at(first, start), at(first, start) + len(d) + 1) for _, first, start, d in spans])
        greedy = logits[0, drafted.to(logits.device)].argmax(-1).tolist()  # one read back for the step
        chosen, i = {}, 0
        for state, first, start, drafts in spans:
            k = len(drafts)
            g = greedy[i:i + k + 1]
            i += k + 1
            m = 0
            while m < k and g[m] == drafts[m] and drafts[m] not in hf.eos_token_ids(state):
                m += 1
            chosen[first] = at(first, start) + m  # the argmax after the accepted drafts
            self._verified[state.request_id] = (drafts[:m], k)
            self.acceptance.observe(k, m)
            self.stats.drafted += k
            self.stats.accepted += m
            self.stats.steps += 1
        if sliced:  # one row per sampled request again, as the engine asked
            span_of = {first: len(d) for _, first, _, d in spans}
            select, r = [], 0
            while r < len(rows):
                select.append(chosen.get(r, r))
                r += span_of.get(r, 0) + 1
            select += range(len(rows), logits.size(1))  # padded rows
            output.logits = logits[:, torch.tensor(select, device=logits.device)]
        else:  # every position's logits: the engine reads each request's last one
            for state, first, start, drafts in spans:
                logits[0, start + len(drafts)] = logits[0, chosen[first]]
        return output

    def _accept(self, processor) -> None:
        if not self._verified:
            return
        cache = processor.cache
        for future in processor.inputs_and_outputs.requests_in_batch:
            verified = self._verified.pop(future.state.request_id, None)
            if verified is None:
                continue
            accepted, k = verified
            state = future.state
            before = state.position_offset - (k + 1)  # the step's first position
            for token in accepted:  # never the request's last (the room kept one for the engine's)
                state.update_and_check_completion(token, None)
            state.position_offset -= k - len(accepted)
            if future.complete_blocks:  # only rows the target verified may be hashed for sharing
                future.complete_blocks = {
                    name: n for name, allocator in cache.cache_allocators.items()
                    if (n := (before % allocator.tokens_per_page + len(accepted) + 1) // allocator.tokens_per_page)}
        self._verified.clear()
