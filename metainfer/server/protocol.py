"""What a request to the server may say, checked before anything reaches the engine, and the
shapes of what comes back: OpenAI's completions and chat completions, with token ids in
(a prompt may be a list of ids) and out (every choice and streamed chunk carries
`token_ids`, as vLLM's return-token-ids option does), and OpenAI's error shape naming the
field at fault."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

# sampling fields OpenAI defines that this server does not compute: refused unless at their default
_UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
                "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "response_format": (None,)}
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}  # OpenAI's completions default; chat: capped by positions


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


# A prompt's text is refused before it is tokenised past this many characters a position of the
# model: no tokenizer makes fewer tokens than characters / 64 of real text, and the tokenizer's
# work is bounded by the characters it is given.
MAX_CHARS_PER_POSITION = 64
DEFAULT_POSITIONS = 8192  # for a model that does not say how many it has


def max_prompt_chars(model: "ModelInfo") -> int:
    return MAX_CHARS_PER_POSITION * (model.max_positions or DEFAULT_POSITIONS)


def default_max_request_bytes(max_positions: int | None) -> int:
    """A body limit sized to the model's context: its longest prompt text as JSON (characters
    escape to at most 2 bytes on average in real text), at least 1 MiB."""
    return max(2**20, 2 * MAX_CHARS_PER_POSITION * (max_positions or DEFAULT_POSITIONS))


def _check_chars(text_len: int, param: str, model: "ModelInfo") -> None:
    limit = max_prompt_chars(model)
    if text_len > limit:
        raise bad(param, f"{param} has {text_len} characters; at most {limit} are tokenised for a model of "
                         f"{model.max_positions or DEFAULT_POSITIONS} positions")


@dataclass
class GenerationRequest:
    """One request as the engine takes it."""

    kind: str  # "completion" or "chat"
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class ModelInfo:
    """What the protocol needs to know of the served model."""

    name: str
    vocab_size: int
    max_positions: int | None  # None: no limit the config states
    tokenizer: Any = None  # a transformers tokenizer, or None: token ids in and out only
    parallel: dict | None = None  # how it is spread over the job's ranks, and why (/v1/models)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(None, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(None, f"the body must be a JSON object, not {type(body).__name__}")
    return body


def parse(body: dict, kind: str, model: ModelInfo) -> GenerationRequest:
    """The request `body` of a /v1/completions ("completion") or /v1/chat/completions ("chat")
    call, checked; APIError (4xx) naming the field otherwise."""
    name = body.get("model")
    if name is None:
        raise bad("model", "model is required")
    if name != model.name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {model.name!r}", param="model",
                       code="model_not_found")
    for key, defaults in _UNSUPPORTED.items():
        if key in body and not any(body[key] == d and type(body[key]) is type(d) or body[key] is d for d in defaults):
            raise bad(key, f"{key} is not supported by this server")
    if _number(body, "n", 1, lo=1, hi=1, integer=True) != 1:
        raise bad("n", "n must be 1")
    prompt = _chat_prompt(body, model) if kind == "chat" else _completion_prompt(body, model)
    key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    room = None if model.max_positions is None else model.max_positions - len(prompt)
    if room is not None and room < 1:
        raise bad("prompt" if kind == "completion" else "messages",
                  f"the prompt has {len(prompt)} tokens; the model holds {model.max_positions} positions")
    default = DEFAULT_MAX_TOKENS[kind] if room is None else min(DEFAULT_MAX_TOKENS[kind], room)
    max_tokens = _number(body, key, default, lo=1, hi=room, integer=True,
                         why_hi=f"the prompt's {len(prompt)} tokens + {key} must fit the model's "
                                f"{model.max_positions} positions")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise bad("stream_options", "stream_options must be an object with a boolean include_usage")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise bad("seed", "seed must be a non-negative integer")
    return GenerationRequest(
        kind=kind, prompt_ids=prompt, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=_number(body, "top_p", 1.0, lo=0.0, hi=1.0, open_lo=True),
        top_k=_number(body, "top_k", -1, lo=-1, hi=model.vocab_size, integer=True),
        seed=seed, stop_token_ids=_stop_ids(body, model), stream=stream,
        include_usage=options.get("include_usage", False))


def _number(body: dict, key: str, default, *, lo=None, hi=None, integer=False, open_lo=False, why_hi=None):
    value = body.get(key)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise bad(key, f"{key} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if lo is not None and (value <= lo if open_lo else value < lo):
        raise bad(key, f"{key} must be {'>' if open_lo else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise bad(key, why_hi or f"{key} must be <= {hi}, got {value!r}")
    return value


def _check_ids(ids: list, param: str, model: ModelInfo) -> list[int]:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad(param, f"{param}[{i}] is {t!r}, not a token id")
        if not 0 <= t < model.vocab_size:
            raise bad(param, f"{param}[{i}] = {t} is outside the vocabulary [0, {model.vocab_size})")
    return list(ids)


def _completion_prompt(body: dict, model: ModelInfo) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "prompt is empty")
        if model.tokenizer is None:
            raise bad("prompt", "this model has no tokenizer: send the prompt as a list of token ids")
        _check_chars(len(prompt), "prompt", model)
        ids = model.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not ids:
            raise bad("prompt", "prompt encodes to no tokens")
        return list(ids)
    if isinstance(prompt, list):
        if not prompt:
            raise bad("prompt", "prompt is empty")
        if any(isinstance(p, (str, list)) for p in prompt):
            raise bad("prompt", "one prompt per request (a batch of several prompts is not supported)")
        return _check_ids(prompt, "prompt", model)
    if prompt is None:
        raise bad("prompt", "prompt is required")
    raise bad("prompt", f"prompt must be a string or a list of token ids, not {type(prompt).__name__}")


def _chat_prompt(body: dict, model: ModelInfo) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise bad("messages", f"messages[{i}] must be an object with a string role and string content")
    tok = model.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise bad("messages", "this model has no tokenizer with a chat template: use /v1/completions with token ids")
    _check_chars(sum(len(m["content"]) for m in messages), "messages", model)
    try:
        ids = tok.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                      add_generation_prompt=True, tokenize=True)
    except Exception as e:  # the template's own error (an unknown role, say)
        raise bad("messages", f"the chat template cannot render these messages: {e}") from None
    if hasattr(ids, "keys"):  # some tokenizers answer a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _stop_ids(body: dict, model: ModelInfo) -> list[int]:
    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise bad("stop", "stop strings are not supported; pass stop_token_ids")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list):
        raise bad("stop_token_ids", "stop_token_ids must be a list of token ids")
    return _check_ids(ids, "stop_token_ids", model)


# ---- responses ------------------------------------------------------------------------------

def text_of(model: ModelInfo, ids: list[int]) -> str:
    return model.tokenizer.decode(ids, skip_special_tokens=True) if model.tokenizer is not None else ""


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response(req: GenerationRequest, model: ModelInfo, ids: list[int], finish: str) -> dict:
    text = text_of(model, ids)
    choice = {"index": 0, "finish_reason": finish, "logprobs": None, "token_ids": ids}
    if req.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": _id(req), "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": req.created, "model": model.name, "choices": [choice],
            "usage": usage(len(req.prompt_ids), len(ids))}


def chunk(req: GenerationRequest, model: ModelInfo, text: str, ids: list[int], finish: str | None,
          first: bool = False, total: int | None = None) -> dict:
    """One streamed chunk: the new text and token ids; the last (finish set) carries usage."""
    choice = {"index": 0, "finish_reason": finish, "logprobs": None, "token_ids": ids}
    if req.kind == "chat":
        choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
    else:
        choice["text"] = text
    out = {"id": _id(req), "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
           "created": req.created, "model": model.name, "choices": [choice]}
    if finish is not None and total is not None:
        out["usage"] = usage(len(req.prompt_ids), total)
    return out


def usage_chunk(req: GenerationRequest, model: ModelInfo, total: int) -> dict:
    """OpenAI's stream_options.include_usage: a last chunk with no choices and the usage."""
    return {"id": _id(req), "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
            "created": req.created, "model": model.name, "choices": [], "usage": usage(len(req.prompt_ids), total)}


def _id(req: GenerationRequest) -> str:
    return ("chatcmpl-" if req.kind == "chat" else "cmpl-") + req.id


class Detokenizer:
    """The text of a growing token list, handed out as deltas, decoding a window of a few tokens
    per step (not the whole text again): the tokens since the last delta, after the ones before
    it as context (so a tokenizer's word joins come out as in the whole text). A delta that
    would end inside a multi-byte character (decoded as U+FFFD) waits for the next token."""

    def __init__(self, model: ModelInfo):
        self.model = model
        self.context = 0  # ids[context:sent]: decoded with the new ones so their joins are right
        self.sent = 0  # ids handed out as text

    def delta(self, ids: list[int], final: bool = False) -> str:
        if self.model.tokenizer is None or len(ids) <= self.sent:
            return ""
        before = text_of(self.model, ids[self.context:self.sent])
        after = text_of(self.model, ids[self.context:])
        if (after.endswith("\ufffd") and not final) or len(after) <= len(before) or not after.startswith(before):
            return ""
        self.context, self.sent = self.sent, len(ids)
        return after[len(before):]
