"""Speculative decoding with metainfer's graphs for the verify and draft steps and the draft
length chosen by metainfer. Two engines run the steps:
- Hugging Face's assisted generation (candidates from a draft model or from prompt lookup, one
  verify forward of the target over them): metainfer hands it a candidate generator's length;
- a models/ model's own loop (models/ DeepSeek with MTP layers: `generate(..., speculate=)`),
  which asks a policy for each draft length and tells it what was accepted.

    opt.generate(ids, assistant_model=draft, max_new_tokens=64)           # draft length: auto
    opt.generate(ids, prompt_lookup_num_tokens=8, max_new_tokens=64)      # auto, at most 8
    opt.generate(ids, assistant_model=draft, draft_length=3, ...)         # fixed at 3
    opt.generate(prompt, 64)                # models/ DeepSeek with MTP layers: auto, the MTP drafts

The draft length k maximises expected accepted tokens per second (planner.best_draft_length):
    tokens per step = (1 - a^(k+1)) / (1 - a)        a: acceptance per drafted token
    step seconds    = verify(k + 1) + draft(k) + rest
- a is measured: a Beta(1, 1) prior updated after every verify with the tokens accepted and
  whether a drafted token was rejected; kept per drafter across calls (batch 1: the only
  batch either engine speculates at).
- verify(n) is measured: a least-squares line through the target's measured forwards by new
  tokens. Until two lengths are measured the first steps probe (a draft model or MTP: k = 1, 2;
  prompt lookup: its maximum and half of it); before any
  measurement the cost model's prediction (planner.step_time) stands in. draft(k) is k times
  the measured drafting time per token (prompt lookup: none; its n-gram search is part of the
  rest), a draft model's (or MTP layer's) predicted from its shape until measured; the rest of
  a step (the engine's bookkeeping) is measured. Steps that compiled a graph, and a call's
  first step (it holds the drafter's pass over the prompt), are not measured.
The length is re-chosen after every verify; k = 0 switches speculation off for the rest of
the call (plain decode steps). Every change, with its reason, goes into the report's
`speculation` list.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field

import torch

from metainfer.hardware import planner
from metainfer.runtime.optimized import OptimizedModel

# OptimizedModel -> (draft model -> stats, weakly; prompt lookup or the target itself -> stats)
_STATS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# draft lengths tried first, in turn, so that two verify lengths get measured: a draft model's
# tokens cost time, so short; prompt lookup's are free, so long and half that
PROBE = {"assistant": lambda cap: (1, 2), "mtp": lambda cap: (1, 2),
         "prompt lookup": lambda cap: (cap, max(1, cap // 2))}
_DRAFTER_ATTR = "_metainfer_drafter"  # a plain draft model's optimized copy, on the model
CONTEXT = 1024  # tokens in the cache the cost model prices a step at (small effect at batch 1)
PROBE_STEPS = 8  # steps probing may take (steps that compile measure nothing) before deciding anyway


@dataclass
class Acceptance:
    """Drafted tokens accepted and drafts rejected: a Beta posterior of the per-token rate."""

    accepted: int = 0
    rejected: int = 0

    @property
    def rate(self) -> float:
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)

    def observe(self, drafted: int, matched: int) -> None:
        self.accepted += matched
        self.rejected += int(matched < drafted)


@dataclass
class _Mean:
    total: float = 0.0
    count: int = 0

    def add(self, x: float, n: int = 1) -> None:
        self.total, self.count = self.total + x, self.count + n

    @property
    def value(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class Measured:
    """Seconds measured over the steps (steps that compiled a graph left out): the target's
    forwards by new tokens, drafting per drafted token, and the rest of each step."""

    verify: dict = field(default_factory=dict)  # new tokens -> _Mean seconds of the target's forward
    draft_per_token: _Mean = field(default_factory=_Mean)
    rest: _Mean = field(default_factory=_Mean)

    def verify_seconds(self, n: int) -> float | None:
        """The target's forward over n new tokens: a least-squares line through the measured
        lengths (flat through one), None before any."""
        pts = [(k, m.value, m.count) for k, m in self.verify.items() if m.count]
        if not pts:
            return None
        if len(pts) == 1:
            return pts[0][1]
        w = sum(c for *_, c in pts)
        mx, my = sum(k * c for k, _, c in pts) / w, sum(t * c for _, t, c in pts) / w
        slope = sum(c * (k - mx) * (t - my) for k, t, c in pts) / sum(c * (k - mx) ** 2 for k, _, c in pts)
        return max(my + max(slope, 0.0) * (n - mx), 0.0)


def _shape(model):
    from metainfer.hardware import shapes

    try:
        return shapes.resolve(model.config)
    except Exception:
        return None


class Speculation:
    """One speculative generate() of an OptimizedModel: labels its forwards (prefill, verify,
    decode, draft), measures them, and sets the draft length: the candidate generator's
    (Hugging Face), or as the policy a models/ loop asks (`draft_length()`, `verified()`)."""

    def __init__(self, opt, kind: str, fixed: int | None, max_draft: int, drafter=None):
        self.opt, self.kind, self.fixed, self.max_draft = opt, kind, fixed, max_draft
        self.drafter = drafter  # the draft OptimizedModel (assistant, MTP), or None
        self.drafts_cost = kind != "prompt lookup"  # drafted tokens take forwards of a drafter
        # kept per drafter (its model; prompt lookup or the target itself: by name) across
        # calls, dropped with the drafter; every speculative call runs at batch 1
        by_model, by_name = _STATS.setdefault(opt, (weakref.WeakKeyDictionary(), {}))
        per_drafter = by_model if drafter is not None else by_name
        key = drafter.model if drafter is not None else kind
        self.acceptance, self.measured = per_drafter.setdefault(key, (Acceptance(), Measured()))
        self.generator = None
        self.k = None
        self.steps = 0
        self.in_draft = False
        self.calls = 0
        self._step_start = None
        self._step_forwards = 0.0  # seconds of forwards inside the current step
        self._draft_seconds = 0.0
        self._verify = None  # (tokens, seconds) of this step's verify forward
        self._drafted = 0  # tokens the current step drafted
        self._candidates = None  # and which (Hugging Face's candidate ids)
        self.drafted: dict[int, int] = {}  # drafted length -> steps, over this call
        self._compiled = False  # a graph was compiled during the current step: its times are not kept
        self._target_shape = _shape(opt.model)
        if kind == "mtp":  # one decoder layer and the shared head: the cost model's drafter
            self._drafter_shape = self._target_shape and planner.one_layer_drafter(self._target_shape)
        else:
            self._drafter_shape = _shape(drafter.model) if drafter is not None else None
        self._predicted: dict = {}  # the cost model's times, by what they are of (fixed for the call)

    # -- labels for the target's forwards ------------------------------------------------
    def phase(self, kwargs, tokens: int) -> str:
        if self.in_draft:
            return "draft"
        self.calls += 1
        if self.calls == 1:
            return "prefill"
        return "verify" if tokens > 1 else "decode"

    def symbolic(self, kwargs, tokens: int) -> bool:
        """Verify steps (and drafts) compile once with symbolic lengths: k + 1 changes."""
        return self.in_draft or (self.calls > 1 and tokens > 1)

    def observe(self, phase: str, tokens: int, seconds: float, compiled: bool) -> None:
        """A forward of the target (drafting forwards are inside the drafting time)."""
        self._compiled |= compiled
        if phase != "draft":
            self._step_forwards += seconds
        if phase in ("verify", "decode"):
            self._verify = (tokens, seconds)

    def observe_draft(self, phase: str, tokens: int, seconds: float, compiled: bool) -> None:
        """A forward of a separate drafter. Hugging Face's drafting is timed around its whole
        candidate search; a models/ loop's drafting is the sum of these forwards."""
        self._compiled |= compiled
        if self.kind == "mtp":
            self._draft_seconds += seconds

    # -- a models/ loop's policy (generate(..., speculate=self)) -------------------------
    def draft_length(self) -> int:
        """The length to draft now: a step starts (drafting, verify, the loop's bookkeeping)."""
        if self.k is None:
            self._choose("before the first step")
        self._begin_step()
        return self.k

    def verified(self, drafted: int, accepted: int) -> None:
        """The step's verify kept `accepted` of `drafted` tokens: the step ends."""
        self._drafted = drafted
        self._after_verify(accepted)

    def _begin_step(self) -> None:
        self._step_start = time.perf_counter()
        self._step_forwards, self._verify, self._compiled, self._draft_seconds = 0.0, None, False, 0.0

    # -- the candidate generator -----------------------------------------------------------
    @contextlib.contextmanager
    def installed(self):
        """For the generate() call: Hugging Face's candidate generator set and watched (a
        models/ loop asks this object itself); the call's summary into the report after."""
        try:
            if self.kind == "mtp":
                yield self
            else:
                with self._candidate_generator():
                    yield self
        finally:
            if self.steps:
                self._record("end of call", self.k, f"{self.steps} verify steps; drafted lengths (length: steps) "
                             f"{dict(sorted(self.drafted.items()))}", drafted=dict(self.drafted))

    def _record(self, when: str, k: int, why: str, **more) -> None:
        a = self.acceptance
        self.opt.report.speculation.append({
            "when": when, "drafter": self.kind, "batch": 1, "draft_length": k, "acceptance": round(a.rate, 3),
            "observed": f"{a.accepted} accepted, {a.rejected} rejected", "why": why, **more})

    @contextlib.contextmanager
    def _candidate_generator(self):
        """Hand Hugging Face's assisted decoding a candidate generator whose draft length is
        this object's, and watch it. Wraps the model's `_get_candidate_generator` for the
        call (the instance attribute, as the forward is installed)."""
        from metainfer.models import transformers_adapter as hf

        with hf.candidate_generator_wrapped(self.opt.model, self._attach):
            yield

    def _attach(self, gen) -> None:
        if not hasattr(gen, self._length_attr(gen)):
            raise RuntimeError(f"{type(gen).__name__}: metainfer sets the draft length of assistant and prompt-lookup "
                               "candidate generators only")
        self.generator = gen
        for cfg in (getattr(gen, "generation_config", None), getattr(gen, "assistant_generation_config", None)):
            if cfg is not None:  # the draft length is exactly this object's: no stopping on low
                cfg.assistant_confidence_threshold = 0.0  # confidence (_after_verify resets the length)
        get_candidates, update = gen.get_candidates, gen.update_candidate_strategy

        def timed_get_candidates(input_ids, *args, **kwargs):
            self._begin_step()
            self.in_draft = True
            try:
                out = get_candidates(input_ids, *args, **kwargs)
            finally:
                self.in_draft = False
            self._draft_seconds = time.perf_counter() - self._step_start
            self._drafted = out[0].shape[-1] - input_ids.shape[-1]
            self._candidates = out[0][:, input_ids.shape[-1]:]
            return out

        def observed_update(input_ids, scores, num_matches):
            update(input_ids, scores, num_matches)
            self._after_verify(_greedy_matches(self._candidates, scores, int(num_matches)))

        gen.get_candidates, gen.update_candidate_strategy = timed_get_candidates, observed_update
        self._set(self._choose("before the first step"))

    @staticmethod
    def _length_attr(gen) -> str:
        return "num_output_tokens" if hasattr(gen, "num_output_tokens") else "num_assistant_tokens"

    def _set(self, k: int) -> None:
        if self.generator is not None:  # Hugging Face's; a models/ loop asks draft_length()
            setattr(self.generator, self._length_attr(self.generator), k)

    # -- measuring and choosing --------------------------------------------------------------
    def _after_verify(self, matched: int) -> None:
        self.steps += 1
        drafted = self._drafted
        self.drafted[drafted] = self.drafted.get(drafted, 0) + 1
        if drafted:
            self.acceptance.observe(drafted, min(matched, drafted))
        wall = time.perf_counter() - self._step_start
        m = self.measured
        # a step that compiled a graph says nothing about the next ones; nor does a call's first
        # step, whose drafting holds the drafter's pass over the prompt (with Hugging Face the
        # target's forward is the prompt's prefill too, not a verify)
        if not self._compiled and self._verify is not None and self.steps > 1:
            m.verify.setdefault(self._verify[0], _Mean()).add(self._verify[1])
            if self.drafts_cost:
                if drafted:
                    m.draft_per_token.add(self._draft_seconds, drafted)
                m.rest.add(max(0.0, wall - self._draft_seconds - self._step_forwards))
            else:  # the n-gram search counts as the rest: per step, whatever the length
                m.rest.add(max(0.0, wall - self._step_forwards))
        if self.fixed is None and self.k != 0:
            self._choose(f"after step {self.steps}")
        self._set(self.k)  # also over whatever the engine's own update did

    def _predicted_step(self, shape, tokens: int) -> float | None:
        """The cost model's decode step of `shape` (the target's or the drafter's) over `tokens`
        new tokens (batch 1, one device)."""
        if shape is None:
            return None
        key = (shape is self._target_shape, tokens)
        if key not in self._predicted:
            self._predicted[key] = planner.step_time(shape, planner.Plan(1, 1, 1, 1), self.opt.target, "decode", 1,
                                                     CONTEXT, tokens_per_seq=tokens)[0]
        return self._predicted[key]

    def _verify_seconds(self, n: int) -> float:
        measured = self.measured.verify_seconds(n)
        if measured is not None:
            return measured
        predicted = self._predicted_step(self._target_shape, n)
        return predicted if predicted is not None else 1.0

    def _draft_seconds_per_token(self) -> float:
        measured = self.measured.draft_per_token.value
        if measured is not None or not self.drafts_cost:
            return measured or 0.0
        if self._drafter_shape is None:
            return self._verify_seconds(1)  # no shape: as costly as the target's step
        return self._predicted_step(self._drafter_shape, 1)

    def _hopeless(self, rate: float, rest: float, per_token: float) -> bool:
        """Whether no draft length pays even with the verify as cheap as one decode step (the
        best case for speculation), by what is measured so far: probing can stop."""
        if not (self.measured.draft_per_token.count or not self.drafts_cost) or not self.steps:
            return False
        flat = self._verify_seconds(1) + rest
        return planner.best_draft_length(rate, lambda n: flat, lambda k: k * per_token, self.max_draft)[0] == 0

    def _choose(self, when: str) -> int:
        a = self.acceptance
        rest = self.measured.rest.value or 0.0
        per_token = self._draft_seconds_per_token()
        lengths = sorted(n for n, m in self.measured.verify.items() if m.count)
        if self.fixed is not None:
            k, why = self.fixed, "fixed by the caller"
        elif len(lengths) < 2 and self.steps < PROBE_STEPS and not self._hopeless(a.rate, rest, per_token):
            # the cost model's verify time at these sizes is not checked against this machine yet:
            # measure two verify lengths (and the acceptance) before deciding
            probe = PROBE[self.kind](self.max_draft)
            k = min(self.max_draft, probe[self.steps % len(probe)])
            why = f"probing: verify lengths measured so far {lengths or 'none'}"
        elif len(lengths) < 2 and self.steps < PROBE_STEPS:
            k, why = 0, (f"speculation off: at acceptance {a.rate:.2f} and drafting {per_token * 1e3:.2f} ms/token "
                         "(measured) no draft pays even if a verify cost no more than a decode step")
        else:
            k, acc, step = planner.best_draft_length(a.rate, lambda n: self._verify_seconds(n) + rest,
                                                     lambda k: k * per_token, self.max_draft)
            base = self._verify_seconds(1) + rest
            src = (f"measured at {lengths} new tokens" if lengths else "predicted by the cost model, not measured")
            why = (f"{acc:.2f} tokens per {step * 1e3:.2f} ms step vs 1 per {base * 1e3:.2f} ms without a draft "
                   f"(verify {src}; drafting {per_token * 1e3:.2f} ms/token "
                   f"{'measured' if self.measured.draft_per_token.count or not self.drafts_cost else 'predicted'}"
                   f"; the rest of a step {rest * 1e3:.2f} ms measured)")
            if k == 0:
                why = "speculation off: " + why
        if k != self.k:
            self._record(when, k, why)
            self.k = k
        return k


def _greedy_matches(candidates, scores, reported: int) -> int:
    """Drafted tokens the verify agreed with: the leading candidates equal to the argmax of its
    scores. Hugging Face reports fewer where it cut the step at an EOS or the length limit,
    which is not a rejection of the drafts."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3 or scores.shape[1] != candidates.shape[-1] + 1:
        return reported
    agree = (candidates == scores[:, :-1].argmax(-1)).long().cumprod(-1)
    return int(agree.sum(-1).min())


def statistics(opt) -> list[tuple[Acceptance, Measured]]:
    """What `opt`'s speculative calls measured so far, one (acceptance, times) per drafter."""
    by_model, by_name = _STATS.get(opt, ({}, {}))
    return list(by_model.values()) + list(by_name.values())


def forget(opt) -> None:
    """Drop what `opt`'s speculative calls measured: the next call decides from its prior."""
    _STATS.pop(opt, None)


def _mtp(model, args, kwargs):
    """(a models/ model's MTP drafter module, where its generate() takes `speculate=`, or None;
    whether this call passes speculate= itself)."""
    import inspect

    mtp = getattr(model, "mtp", None)
    if not isinstance(mtp, torch.nn.Module):
        return None, False
    try:
        bound = inspect.signature(type(model).generate).bind(model, *args, **kwargs)
    except (AttributeError, TypeError, ValueError):
        return None, False
    return (mtp if "speculate" in bound.signature.parameters else None), "speculate" in bound.arguments


def _optimized_drafter(opt, model):
    """`model` optimized the way `opt` was (target, passes, lowering), kept on the model itself
    (a weak map's value would keep its key alive) while it lives."""
    how = opt.how_optimized()
    drafter = model.__dict__.get(_DRAFTER_ATTR)
    if drafter is None or drafter.target != opt.target or drafter.how_optimized() != how:
        drafter = opt.optimize_like(model)
        model.__dict__[_DRAFTER_ATTR] = drafter
    return drafter


def prepare(opt, args: tuple, kwargs: dict, draft_length, batch: int = 1) -> Speculation | None:
    """The Speculation for a generate() call that speculates, None otherwise: Hugging Face's
    assisted generation (`assistant_model`, or `prompt_lookup_num_tokens` in the kwargs), or a
    models/ model with MTP layers (unless draft_length is 0). A drafter that is a plain model
    (an assistant, the MTP layers) is optimized as the target was first (kept while it
    lives); the kwargs are edited for the engine (Hugging Face: the assistant's model, not its
    wrapper; a models/ loop: `speculate=` this object). `batch`: the prompt's rows; the MTP loop
    takes one, so a batch runs the plain loop unless a draft length was asked for."""
    configs = [c for c in (kwargs.get("generation_config"), getattr(opt.model, "generation_config", None)) if c is not None]
    assistant = kwargs.get("assistant_model")
    lookup = kwargs.get("prompt_lookup_num_tokens",
                        next((c.prompt_lookup_num_tokens for c in configs
                              if getattr(c, "prompt_lookup_num_tokens", None) is not None), None))
    if draft_length is not None and (isinstance(draft_length, bool) or not isinstance(draft_length, int)
                                     or draft_length < 0):
        raise ValueError(f"draft_length must be a non-negative integer (or None: metainfer chooses), "
                         f"got {draft_length!r}")
    mtp, own = _mtp(opt.model, args, kwargs)
    if assistant is None and lookup is None and mtp is not None:
        if own:
            raise ValueError("metainfer drives the MTP drafts itself: fix their length with draft_length= "
                             "(0: no speculation), not speculate=")
        if draft_length == 0:
            return None
        if batch > 1:
            if draft_length is not None:
                raise ValueError(f"MTP speculative decoding takes one sequence, the prompt has {batch}: pass "
                                 "draft_length=0 (or leave it out) for the plain loop")
            note = "generate: a batch of prompts runs without MTP speculation (its loop takes one sequence)"
            if note not in opt.report.notes:
                opt.report.notes.append(note)
            return None
        spec = Speculation(opt, "mtp", draft_length, planner.MAX_DRAFT, drafter=_optimized_drafter(opt, mtp))
        kwargs["speculate"] = spec
        return spec
    if assistant is None and lookup is None:
        if draft_length is not None:
            raise ValueError("draft_length= applies to speculative decoding: pass assistant_model= or "
                             "prompt_lookup_num_tokens= too (or use a model with MTP layers)")
        return None
    if assistant is not None and lookup is not None:
        raise ValueError("pass either assistant_model= or prompt_lookup_num_tokens=, not both")
    if kwargs.get("do_sample", next((c.do_sample for c in configs if getattr(c, "do_sample", None) is not None),
                                    False)):
        raise ValueError("metainfer's speculative decoding is greedy (do_sample=False): sampled assisted "
                         "generation is not supported yet")
    drafter = None
    if assistant is not None:
        model = assistant.model if isinstance(assistant, OptimizedModel) else assistant
        if model is opt.model:  # the target drafts for itself, through its own graphs
            drafter = opt
        elif isinstance(assistant, OptimizedModel):
            drafter = assistant
        else:
            drafter = _optimized_drafter(opt, assistant)
        kwargs["assistant_model"] = drafter.model
        kind, cap = "assistant", planner.MAX_DRAFT
    else:
        if isinstance(lookup, bool) or not isinstance(lookup, int) or lookup < 1:
            raise ValueError(f"prompt_lookup_num_tokens must be a positive integer, got {lookup!r}")
        if draft_length is not None and draft_length > lookup:
            raise ValueError(f"draft_length={draft_length} exceeds prompt_lookup_num_tokens={lookup}, the most "
                             "prompt lookup drafts")
        kind, cap = "prompt lookup", lookup
    return Speculation(opt, kind, draft_length, cap, drafter=None if drafter is opt else drafter)
