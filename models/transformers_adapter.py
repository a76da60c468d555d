"""Every touch of Hugging Face transformers' private API, in one place, for the versions tested.

metainfer drives transformers through its public API where one exists (models, configs,
generate, continuous batching's manager). What has no public form is here: a private config
field, an engine method wrapped so its batch processor gets metainfer's hooks, a request
state's private fields. Each function names the private thing it reaches, so a new
transformers release is checked against this file alone (tests/test_transformers_adapter.py
fails on a private name reached anywhere else).

Importing this module checks the installed version against TESTED_VERSIONS and refuses an
untested one, naming both; METAINFER_UNTESTED_TRANSFORMERS=1 lets it run with a warning.
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import transformers
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator  # re-exported
from transformers.generation.continuous_batching.cb_logits_processors import (  # re-exported
    CLASSIC_TO_CB_PROCESSORS_MAP,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.continuous_batching.requests import (  # re-exported
    GenerationOutput,
    RequestState,
    RequestStatus,
)
from transformers.generation.continuous_batching.utils import WorkloadHints  # re-exported

__all__ = ["CLASSIC_TO_CB_PROCESSORS_MAP", "ContinuousBatchingLogitsProcessorList", "GenerationOutput",
           "PromptLookupCandidateGenerator", "RequestState", "RequestStatus", "WorkloadHints", "TESTED_VERSIONS",
           "TransformersVersionError", "check_version", "attention_implementation", "set_attention_implementation",
           "experts_implementation", "init_weights", "keys_to_ignore_on_load", "register_attention",
           "candidate_generator_wrapped", "is_latent_allocator", "token_views", "replace_method",
           "wrap_batch_processor", "wrap_candidate_pass", "children_per_request", "child_request_ids",
           "discard_unclaimed_outputs", "never_idle_sleep", "new_tokens_limit", "eos_token_ids", "true_prompt_length"]

# major.minor releases whose private API this module was read against and the suite ran on
TESTED_VERSIONS = ("5.24", "5.25")
UNTESTED_ENV = "METAINFER_UNTESTED_TRANSFORMERS"


class TransformersVersionError(ImportError):
    """The installed transformers is not one this adapter was tested with."""


def check_version(version: str, allow_untested: bool = False) -> None:
    """Refuse (or, with `allow_untested`, warn about) a transformers outside TESTED_VERSIONS."""
    release = ".".join(version.split(".")[:2])
    if release in TESTED_VERSIONS:
        return
    message = (f"transformers {version} is installed; metainfer reaches private parts of transformers (its "
               f"continuous-batching engine's hooks, config fields) tested with {', '.join(TESTED_VERSIONS)} only "
               f"(metainfer/models/transformers_adapter.py). Install one of those (pip install "
               f"'transformers>={TESTED_VERSIONS[0]},<{_next(TESTED_VERSIONS[-1])}'), or set {UNTESTED_ENV}=1 to try")
    if not allow_untested:
        raise TransformersVersionError(message)
    warnings.warn(message + " (running anyway: " + UNTESTED_ENV + " is set)", stacklevel=2)


def _next(release: str) -> str:
    major, minor = release.split(".")
    return f"{major}.{int(minor) + 1}"


check_version(transformers.__version__, allow_untested=os.environ.get(UNTESTED_ENV) == "1")


# ---- configs and models ------------------------------------------------------------------------

def attention_implementation(config) -> str | None:
    """The attention form a config selects (`config._attn_implementation`)."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config, name: str | None) -> None:
    """Select the attention form on a config before or after the model is built (the field
    every layer reads at call time; `model.set_attn_implementation` also checks the form
    against the hub, which a registered custom form is not in)."""
    config._attn_implementation = name


def experts_implementation(config) -> str | None:
    """The MoE experts form a config selects (`config._experts_implementation`)."""
    return getattr(config, "_experts_implementation", None)


def init_weights(model, module) -> None:
    """transformers' own initialisation of one module (`model._init_weights`): rotary tables
    and other buffers computed from the config."""
    model._init_weights(module)


def keys_to_ignore_on_load(model) -> tuple[str, ...]:
    """The checkpoint key patterns a model class drops on load (`_keys_to_ignore_on_load_unexpected`)."""
    return tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())


def register_attention(name: str, fn: Callable) -> None:
    """Add an attention function under `name` to transformers' attention registry."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ALL_ATTENTION_FUNCTIONS.get(name) is not fn:
        ALL_ATTENTION_FUNCTIONS[name] = fn


@contextlib.contextmanager
def candidate_generator_wrapped(model, wrap: Callable[[Any], None]) -> Iterator[None]:
    """For the duration: every candidate generator assisted generation makes for `model` is
    handed to `wrap` first (`_get_candidate_generator`, replaced on this instance only)."""
    original = getattr(type(model), "_get_candidate_generator", None)
    if original is None:
        raise RuntimeError(f"{type(model).__name__} has no _get_candidate_generator (transformers' assisted "
                           "generation): metainfer cannot set its draft length")

    def get_candidate_generator(*args, **kwargs):
        gen = original(model, *args, **kwargs)
        wrap(gen)
        return gen

    model.__dict__["_get_candidate_generator"] = get_candidate_generator
    try:
        yield
    finally:
        model.__dict__.pop("_get_candidate_generator", None)


# ---- the continuous-batching engine ------------------------------------------------------------

def is_latent_allocator(allocator) -> bool:
    """Whether a cache allocator holds MLA latents (one tensor a token) rather than keys and values."""
    return hasattr(allocator, "_latent_token_views")


def token_views(allocator, layer: int):
    """A layer's per-token views of the pool: (keys, values), or the latents of an MLA layer."""
    return (allocator._latent_token_views if is_latent_allocator(allocator) else allocator._kv_token_views)[layer]


def replace_method(obj, name: str, fn: Callable) -> None:
    """Bind `fn` as `obj.<name>` on this instance only (the class keeps its own), once."""
    if getattr(getattr(obj, name), "__func__", None) is not fn:
        setattr(obj, name, types.MethodType(fn, obj))


def wrap_batch_processor(manager, install: Callable[[Any], None], marker: str) -> None:
    """Each batch processor the manager makes from now on (`_create_batch_processor`, made when
    the engine starts) is handed to `install` once; `marker` names the hook, so wrapping twice
    installs once."""
    make = manager._create_batch_processor

    def create():
        processor = make()
        done = processor.__dict__.setdefault("_metainfer_hooks", set())
        if marker not in done:
            install(processor)
            done.add(marker)
        return processor

    manager._create_batch_processor = create


def wrap_candidate_pass(scheduler, wrap: Callable[[Callable], Callable]) -> None:
    """The scheduler's pass over the requests it may schedule (`_process_candidates`), replaced
    by `wrap(original)`."""
    scheduler._process_candidates = wrap(scheduler._process_candidates)


@contextlib.contextmanager
def children_per_request(manager, n: int) -> Iterator[None]:
    """Requests added meanwhile produce `n` sequences each: the engine reads
    `num_return_sequences` only when a request is added (from one thread)."""
    manager.num_return_sequences = n
    try:
        yield
    finally:
        manager.num_return_sequences = 1


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The ids the engine delivers a request of `n` sequences under (its children's naming)."""
    return [request_id] + [f"{request_id}__child#{i}" for i in range(n - 1)]


def discard_unclaimed_outputs(manager) -> None:
    """Outputs no handler claims go nowhere, instead of onto the queue only get_result reads."""
    manager.output_router.output_queue = _Nowhere()


class _Nowhere:
    """An output queue that drops what is put on it."""

    def put(self, item, block=True, timeout=None) -> None:
        pass

    put_nowait = put

    def empty(self) -> bool:
        return True

    def qsize(self) -> int:
        return 0

    def get(self, block=True, timeout=None):
        import queue

        raise queue.Empty


def never_idle_sleep(manager) -> None:
    """The engine's idle loop sleeps 0.1 s on an event (`_wake_up_loop`) that only add_request and
    cancel_request set: a rank that only follows the driver never gets one, so it must not sleep."""
    manager._wake_up_loop = _NeverSleep()


class _NeverSleep(threading.Event):
    def wait(self, timeout=None) -> bool:
        return True


def new_tokens_limit(state) -> int:
    """The most tokens a request may still reach in all (`RequestState._new_tokens_limit`)."""
    return state._new_tokens_limit


def eos_token_ids(state):
    """The tokens that end a request (`RequestState._eos_token_ids`)."""
    return state._eos_token_ids


def true_prompt_length(state) -> int:
    """The prompt's own length: a request the engine preempted and re-queued carries its
    generated tokens at the end of its initial tokens (`_true_initial_tokens`)."""
    return state._true_initial_tokens or len(state.initial_tokens)
