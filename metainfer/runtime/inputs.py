"""What a call to an optimized model may be given, checked before any compiled graph runs.

A compiled graph meets bad input worse than eager does: an out-of-range token id fails a
bounds check inside generated code (on a GPU, a device-side assert that poisons the CUDA
context for every request in flight), and a float tensor where token ids belong fails deep
inside Dynamo. So every call is checked here first, and a bad one is a ValueError that names
the input, the position and the value.

On a CPU the range check is one `aminmax` before the graph runs. On a GPU it would cost a
host stall per step, so the graph runs on a copy whose bad ids are replaced by 0 (one kernel,
kernels/token_ids.py) while the first bad position travels to the host behind it; the caller
raises once it arrives (`TokenGuard.finish`), having waited only for that small copy.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch

TOKEN_PARAMS = ("input_ids", "tokens")  # what Hugging Face and models/ call their token input
ID_DTYPES = (torch.int64, torch.int32)  # what an embedding lookup accepts


def vocab_size(model: torch.nn.Module) -> int | None:
    """Rows of the model's input embedding (Hugging Face's and models/' get_input_embeddings)."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    return emb.num_embeddings if isinstance(emb, torch.nn.Embedding) else None


def check_dtype(ids: torch.Tensor, what: str) -> None:
    if ids.dtype not in ID_DTYPES:
        raise ValueError(f"{what} must hold integer token ids (torch.int64 or torch.int32), got a {ids.dtype} "
                         f"tensor of shape {tuple(ids.shape)}")


def out_of_range(ids: torch.Tensor, vocab: int, what: str) -> ValueError | None:
    """The error for token ids outside [0, vocab), or None (reads every id: for the error path
    and for host-side lists)."""
    bad = ((ids < 0) | (ids >= vocab)).nonzero()
    if bad.shape[0] == 0:
        return None
    where = tuple(bad[0].tolist())
    value = int(ids[where])
    place = f"{what}[{', '.join(map(str, where))}]" if where else what
    more = f"; {bad.shape[0]} ids in all are out of range" if bad.shape[0] > 1 else ""
    return ValueError(f"{place} = {value} is not a token id: the model's vocabulary is {vocab} ids "
                      f"(0..{vocab - 1}){more}")


def request_error(tokens, vocab: int | None, what: str = "prompt") -> str | None:
    """Why one request's token list cannot be served (None if it can): for serving paths, where
    only the bad request should fail."""
    if not isinstance(tokens, (list, tuple)):
        return f"{what} must be a list of integer token ids, got a {type(tokens).__name__}"
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or isinstance(t, bool):
            return f"{what}[{i}] is {t!r} ({type(t).__name__}), not an integer token id"
    if not tokens:
        return f"{what} is empty"
    if vocab is not None and (min(tokens) < 0 or max(tokens) >= vocab):
        return str(out_of_range(torch.tensor(tokens, dtype=torch.int64), vocab, what))
    return None


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (a serving engine
    capturing its step): nothing may wait on the device, or record events, until it ends."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class TokenGuard:
    """Range checks of one model's token ids; holds the pinned host word a GPU check reports
    through (allocating pinned memory per call costs more than the check)."""

    def __init__(self):
        self._host: dict[torch.device, torch.Tensor] = {}

    def check(self, ids: torch.Tensor, vocab: int, what: str, *,
              deferred: bool | None = None) -> tuple[torch.Tensor, Callable[[], None]]:
        """(the ids to run the graph on, finish); finish() raises the ValueError for an id
        outside [0, vocab). Immediate on CPU (the ids are returned as they are); deferred on
        a GPU (`deferred` forces either, for tests)."""
        check_dtype(ids, what)
        if deferred is None:
            deferred = ids.is_cuda
        if not deferred:
            if ids.numel():
                lo, hi = torch.aminmax(ids)
                if int(lo) < 0 or int(hi) >= vocab:
                    raise out_of_range(ids, vocab, what)
            return ids, _nothing
        safe, first = _safe_copy(ids, vocab)
        if ids.is_cuda and capturing():
            # inside a CUDA graph's capture (the engine's; its ids were checked when admitted):
            # the graph keeps the safe copy, nothing is read back
            return safe, _nothing
        if ids.is_cuda:
            host = self._host.get(ids.device)
            if host is None:
                host = self._host[ids.device] = torch.empty(1, dtype=torch.int64, pin_memory=True)
            host.copy_(first, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record()
        else:
            host, arrived = first, None

        def finish() -> None:
            if arrived is not None:
                arrived.synchronize()  # the copy was queued before the graph: no wait for the graph
            if int(host[0]) < ids.numel():
                raise out_of_range(ids, vocab, what)

        return safe, finish


def _safe_copy(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    from metainfer import kernels
    from metainfer.kernels import token_ids
    from metainfer.kernels.configs import config_for

    if kernels.use_triton(ids):
        return token_ids.launch(ids, vocab, config=config_for("token_ids", ids.device))
    return token_ids.reference(ids, vocab)


def _nothing() -> None:
    return None


class ModelInputs:
    """How one model takes its inputs: which argument holds the token ids, its vocabulary and
    position limit. `check(args, kwargs)` validates a call; see the module docstring."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.token_param, self._token_index = None, None
        try:
            params = list(inspect.signature(model.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        for i, p in enumerate(params):
            if p.name in TOKEN_PARAMS:
                self.token_param = p.name
                positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                self._token_index = i if positional else None
                break
        self.guard = TokenGuard()

    def token_ids(self, args: tuple, kwargs: Mapping) -> torch.Tensor | None:
        if self.token_param is None:
            return None
        if self.token_param in kwargs:
            ids = kwargs[self.token_param]
        elif self._token_index is not None and self._token_index < len(args):
            ids = args[self._token_index]
        else:
            return None
        return ids if isinstance(ids, torch.Tensor) else None

    def check_prompt(self, ids: torch.Tensor) -> None:
        """A whole prompt checked at once, before a generate() loop starts (one host read)."""
        check_dtype(ids, self.token_param)
        vocab = vocab_size(self.model)
        if vocab is not None:
            self.guard.check(ids, vocab, self.token_param, deferred=False)

    def _with_ids(self, args: tuple, kwargs: dict, ids: torch.Tensor) -> tuple[tuple, dict]:
        if self.token_param in kwargs:
            return args, {**kwargs, self.token_param: ids}
        return args[:self._token_index] + (ids,) + args[self._token_index + 1:], kwargs

    def check(self, args: tuple, kwargs: dict, positions: bool = True) -> tuple[tuple, dict, Callable[[], None]]:
        """(args, kwargs) to run the graph on and a finish() to call after it: raises the
        ValueError of a bad call now, or from finish() where the check is deferred (GPU).
        `positions=False`: the ids are many requests packed in one row, whose lengths were
        checked when they were admitted."""
        ids = self.token_ids(args, kwargs)
        if ids is None:
            return args, kwargs, _nothing
        what = self.token_param
        check_dtype(ids, what)
        if positions:
            check_positions(self.model, ids, kwargs)
        vocab = vocab_size(self.model)
        if vocab is None:
            return args, kwargs, _nothing
        safe, finish = self.guard.check(ids, vocab, what)
        if safe is not ids:
            args, kwargs = self._with_ids(args, kwargs, safe)
        return args, kwargs, finish


def _past_length(kwargs, limit: int) -> int:
    """Tokens already in the cache, where they could matter: a cache whose capacity is within
    `limit` cannot hold a position past it (and asking a static cache its length costs a
    device sync per step)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5 calls it `cache`
    if cache is None or not hasattr(cache, "get_seq_length"):
        return 0
    try:
        capacity = cache.get_max_length() if hasattr(cache, "get_max_length") else -1  # -1: grows
    except Exception:
        capacity = -1
    if isinstance(capacity, int) and 0 <= capacity <= limit:
        return 0
    return int(cache.get_seq_length())


def check_positions(model: torch.nn.Module, ids: torch.Tensor, kwargs: Mapping) -> None:
    """Inputs no graph may be asked to compute: empty, or past the model's positions."""
    if ids.numel() == 0:
        raise ValueError(f"empty input: tokens of shape {tuple(ids.shape)} (a batch or sequence of 0)")
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and ids.dim() >= 1:
        end = _past_length(kwargs, limit) + ids.shape[-1]
        if end > limit:
            raise ValueError(f"input reaches position {end}, past the model's max_position_embeddings ({limit}); "
                             "its position embeddings are not defined there")


def _tensors(obj, path: str):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]")


def check_devices(target, args, kwargs, what: str) -> None:
    kind = target.device.kind
    for path, t in _tensors((args, kwargs), what):
        if t.device.type != kind:
            raise ValueError(f"{what} {path} is on {t.device}, but target {target.name!r} drives {kind} "
                             f"devices; move it with .to({kind!r}) or pick a {t.device.type} target")


def describe(model: torch.nn.Module, args: tuple, kwargs: Mapping) -> str:
    """The call's inputs by parameter name, e.g. "input_ids: int64[1, 8], use_cache: True"."""
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    return ", ".join(f"{k}: {_describe(v)}" for k, v in bound.items()) or "(none)"


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}" + ("" if v.device.type == "cpu" else f" on {v.device}")
    if isinstance(v, (list, tuple)) and len(v) > 4:
        return f"{type(v).__name__} of {len(v)}"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{k}: {_describe(x)}" for k, x in v.items()) + "}"
    text = repr(v) if isinstance(v, (int, float, bool, str, type(None))) else type(v).__name__
    return text if len(text) <= 40 else text[:37] + "..."
