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

# fields OpenAI defines that this server does not compute: refused unless at their default
_UNSUPPORTED = {"best_of": (None, 1), "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []),
                "functions": (None, []), "tool_choice": (None, "none")}
MAX_STOPS, MAX_STOP_CHARS = 4, 512  # OpenAI takes up to 4 stop sequences; each is matched per token
MAX_LOGPROBS = 20  # top log-probabilities a token may carry (OpenAI's chat bound; vLLM's default)
MAX_N = 16  # choices a request may ask for (each holds a running slot)
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
    stop: list[str] = field(default_factory=list)  # stop strings, matched on the detokenised text
    n: int = 1  # choices (the engine's sequences of one prompt)
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely tokens'
    echo: bool = False  # completions: the prompt's text before the completion's
    penalties: dict = field(default_factory=dict)  # repetition/presence/frequency_penalty set off their default
    prompt_text: str | None = None  # a completion's prompt as sent, when it was text (echo)
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
    _response_format(body)
    n = _number(body, "n", 1, lo=1, hi=MAX_N, integer=True)
    logprobs = _logprobs(body, kind)
    echo = _echo(body, kind, logprobs)
    penalties = _penalties(body)
    stop = _stop_strings(body, model)
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
    if key == "max_completion_tokens":  # it wins over max_tokens, which must still be one (found by fuzzing)
        _number(body, "max_tokens", None, lo=1, integer=True)
    stream = False if body.get("stream") is None else body["stream"]  # 0 or "" are not false
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be true or false")
    options = {} if body.get("stream_options") is None else body["stream_options"]
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
        seed=seed, stop_token_ids=_stop_ids(body, model), stop=stop, n=n, logprobs=logprobs, echo=echo,
        penalties=penalties, prompt_text=_prompt_text(body) if echo else None, stream=stream,
        include_usage=options.get("include_usage", False))


def _prompt_text(body: dict) -> str | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def _response_format(body: dict) -> None:
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return
    if isinstance(kind, str):
        raise bad("response_format", f"response_format {kind!r} is not supported: this server does not constrain "
                                     "decoding to a format (only {\"type\": \"text\"})")
    raise bad("response_format", "response_format must be an object with a string type")


def _logprobs(body: dict, kind: str) -> int | None:
    """How many top log-probabilities each token carries (0: the chosen token's alone), or None.
    Completions: logprobs is that number; chat: logprobs is a boolean and top_logprobs the number."""
    if kind == "completion":
        if body.get("top_logprobs") is not None:
            raise bad("top_logprobs", "top_logprobs is a chat completions field; completions take logprobs: <k>")
        if body.get("logprobs") is None:
            return None
        return _number(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS, integer=True)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad("logprobs", "logprobs must be true or false (top_logprobs says how many alternatives)")
    top = _number(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS, integer=True)
    if top is not None and not wanted:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if wanted else None


def _echo(body: dict, kind: str, logprobs: int | None) -> bool:
    echo = body.get("echo")
    if echo is None or echo is False:
        return False
    if kind == "chat":
        raise bad("echo", "echo is a completions field")
    if echo is not True:
        raise bad("echo", "echo must be true or false")
    if logprobs is not None:
        raise bad("echo", "echo with logprobs asks for the prompt's log-probabilities, which this server does not "
                          "compute (the engine keeps only each sequence's last logits)")
    return True


def _penalties(body: dict) -> dict:
    out = {key: _number(body, key, 0.0, lo=-2.0, hi=2.0) for key in ("presence_penalty", "frequency_penalty")}
    out["repetition_penalty"] = _number(body, "repetition_penalty", 1.0, lo=0.0, open_lo=True, hi=100.0)
    off = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    return {key: float(v) for key, v in out.items() if v != off[key]}


def _stop_strings(body: dict, model: ModelInfo) -> list[str]:
    stop = body.get("stop")
    if stop is None or (isinstance(stop, (str, list)) and len(stop) == 0):
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        raise bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"stop has {len(stops)} strings; at most {MAX_STOPS}")
    if any(len(x) > MAX_STOP_CHARS for x in stops):
        raise bad("stop", f"a stop string is longer than {MAX_STOP_CHARS} characters")
    if model.tokenizer is None:
        raise bad("stop", "this model has no tokenizer to match stop strings on: pass stop_token_ids")
    return list(dict.fromkeys(stops))


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
    ids = [] if body.get("stop_token_ids") is None else body["stop_token_ids"]
    if not isinstance(ids, list):
        raise bad("stop_token_ids", "stop_token_ids must be a list of token ids")
    return _check_ids(ids, "stop_token_ids", model)


# ---- responses ------------------------------------------------------------------------------

def text_of(model: ModelInfo, ids: list[int]) -> str:
    return model.tokenizer.decode(ids, skip_special_tokens=True) if model.tokenizer is not None else ""


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Choice:
    """One choice of a request as its tokens arrive: the text to hand out (deltas that add up to
    the whole text), the tokens kept, the finish reason and the log-probability records. A stop
    string ends the choice: its text ends before the first stop string found (which is not part
    of it, as in OpenAI's API) and its tokens at the one that completed it. Text that could be
    the start of a stop string is held back until the next tokens tell."""

    def __init__(self, index: int, req: GenerationRequest, model: ModelInfo):
        self.index, self.req, self.model = index, req, model
        self.detok = Detokenizer(model)
        self.ids: list[int] = []
        self.finish: str | None = None
        self.logprobs: list = []
        self.text = ""  # all handed out so far
        self.offset = 0  # characters of the tokens' own texts so far (completions' text_offset)
        self._held = ""  # text that may begin a stop string
        self._fed = 0  # tokens whose text was taken
        self._stopped = False  # a stop string matched
        self._prefix = (req.prompt_text if req.prompt_text is not None else text_of(model, req.prompt_ids)) \
            if req.echo else ""
        self.offset = len(self._prefix)

    def add(self, ids: list[int], finish: str | None, logprobs: list | None = None) -> tuple[str, list[int], list]:
        """Takes the choice's tokens so far (and the records of the new ones); returns the new text,
        the new tokens and their records. Sets `finish` once finished (a stop string: "stop")."""
        if self.finish is not None:
            return "", [], []
        text = self._prefix + (self._feed(ids, finish is not None) if self.req.stop else
                               self.detok.delta(ids, final=finish is not None))
        self._prefix = ""
        keep = self._fed if self.req.stop and self._stopped else len(ids)
        new, records = ids[len(self.ids):keep], (logprobs or [])[:max(0, keep - len(self.ids))]
        self.ids = ids[:keep]
        self.logprobs += records
        self.finish = "stop" if self.req.stop and self._stopped else finish
        self.text += text
        return text, new, records

    def _feed(self, ids: list[int], final: bool) -> str:
        out = []
        for end in range(self._fed + 1, len(ids) + 1):  # a token at a time: the stop's token is known
            window = self._held + self.detok.delta(ids[:end], final=final and end == len(ids))
            self._fed = end
            found = [at for at in (window.find(s) for s in self.req.stop) if at >= 0]
            if found:
                out.append(window[:min(found)])
                self._held, self._stopped = "", True
                return "".join(out)
            hold = _open_stop(window, self.req.stop)
            out.append(window[:len(window) - hold])
            self._held = window[len(window) - hold:]
        if final:
            out.append(self._held)
            self._held = ""
        return "".join(out)

    def logprobs_block(self, records: list) -> dict | None:
        """OpenAI's logprobs of a choice (or of a chunk's tokens): chat's {"content": [...]},
        completions' {"tokens", "token_logprobs", "top_logprobs", "text_offset"}."""
        if self.req.logprobs is None:
            return None
        token = lambda t: self.model.tokenizer.decode([t]) if self.model.tokenizer is not None else f"token_id:{t}"  # noqa: E731
        if self.req.kind == "chat":
            entry = lambda t, lp: {"token": token(t), "logprob": lp, "bytes": list(token(t).encode())}  # noqa: E731
            return {"content": [entry(r.token, r.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in r.top]}
                                for r in records], "refusal": None}
        strings = [token(r.token) for r in records]
        offsets = []
        for s in strings:
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": strings, "token_logprobs": [r.logprob for r in records],
                "top_logprobs": [{token(t): lp for t, lp in r.top} for r in records], "text_offset": offsets}


def _open_stop(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that begin some stop string (the longest such run)."""
    for k in range(min(max(map(len, stops)) - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


def response(req: GenerationRequest, model: ModelInfo, choices: list[Choice]) -> dict:
    out = []
    for c in choices:
        entry = {"index": c.index, "finish_reason": c.finish, "logprobs": c.logprobs_block(c.logprobs),
                 "token_ids": c.ids}
        if req.kind == "chat":
            entry["message"] = {"role": "assistant", "content": c.text}
        else:
            entry["text"] = c.text
        out.append(entry)
    return {"id": _id(req), "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": req.created, "model": model.name, "choices": out,
            "usage": usage(len(req.prompt_ids), sum(len(c.ids) for c in choices))}


def chunk(req: GenerationRequest, model: ModelInfo, choice: Choice, text: str, ids: list[int], records: list,
          first: bool = False, total: int | None = None) -> dict:
    """One streamed chunk of a choice: its new text, token ids and their log-probabilities, and
    its finish reason once finished; `total` (completion tokens of every choice) on the last."""
    entry = {"index": choice.index, "finish_reason": choice.finish, "logprobs": choice.logprobs_block(records),
             "token_ids": ids}
    if req.kind == "chat":
        entry["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
    else:
        entry["text"] = text
    out = {"id": _id(req), "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
           "created": req.created, "model": model.name, "choices": [entry]}
    if total is not None:
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
    it as context (so a tokenizer's word joins come out as in the whole text). A multi-byte
    character split over tokens (decoded as U+FFFD) waits for the token that completes it; the
    text before it goes out now."""

    def __init__(self, model: ModelInfo):
        self.model = model
        self.context = 0  # ids[context:sent]: decoded with the new ones so their joins are right
        self.sent = 0  # ids whose text is all handed out
        self.partial = 0  # characters handed out of the tokens after `sent` (before a split character)

    def delta(self, ids: list[int], final: bool = False) -> str:
        if self.model.tokenizer is None or len(ids) <= self.sent:
            return ""
        before = text_of(self.model, ids[self.context:self.sent])
        after = text_of(self.model, ids[self.context:])
        complete = after if final else after.rstrip("\ufffd")
        shown = len(before) + self.partial
        if len(complete) <= shown or not after.startswith(before):
            return ""
        if complete == after:
            self.context, self.sent, self.partial = self.sent, len(ids), 0
        else:
            self.partial = len(complete) - len(before)
        return complete[shown:]
