"""The server's OpenAPI description of what it takes and answers: JSON Schemas of the request
bodies (the bounds protocol.parse enforces, for the served model) and of the answers, errors in
OpenAI's shape included. FastAPI does not validate with them (parsing runs off the event loop,
in protocol.parse); they document the API and drive API fuzzing (tests/test_server_fuzz.py)."""

from __future__ import annotations

from . import protocol

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}

# a server-sent event: its data a JSON chunk (or an error in OpenAI's shape), the last "[DONE]"
EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}

# the statuses a generation request may be answered with, besides 200 (app.py's module docstring)
ERROR_STATUSES = {"400": "a field is wrong (named in param)", "401": "a valid API key is required",
                  "404": "the model is not served", "413": "the body is past --max-request-bytes",
                  "429": "at capacity: retry after Retry-After seconds", "500": "an internal error (its id is logged)",
                  "503": "the server is failing and shutting down", "504": "past --request-timeout"}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _number(lo=None, hi=None, integer=False, exclusive_lo=False) -> dict:
    out = {"type": ["integer" if integer else "number", "null"]}
    if lo is not None:
        out["exclusiveMinimum" if exclusive_lo else "minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    return out


def request_body(kind: str, model: protocol.ModelInfo) -> dict:
    """The JSON Schema of a /v1/completions ("completion") or /v1/chat/completions ("chat") body."""
    positions = model.max_positions or protocol.DEFAULT_POSITIONS
    token = {"type": "integer", "minimum": 0, "maximum": model.vocab_size - 1}
    chars = protocol.max_prompt_chars(model)
    stop = {"type": "string", "minLength": 1, "maxLength": protocol.MAX_STOP_CHARS}
    props = {
        "model": {"type": "string", "enum": [model.name]},
        "temperature": _number(0.0, 2.0), "top_p": _number(0.0, 1.0, exclusive_lo=True),
        "top_k": _number(-1, model.vocab_size, integer=True), "n": _number(1, protocol.MAX_N, integer=True),
        "seed": _number(0, 2**63 - 1, integer=True),
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
        # "" and [] are no stop strings
        "stop": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": protocol.MAX_STOP_CHARS},
                           {"type": "array", "items": stop, "maxItems": protocol.MAX_STOPS}]},
        "stop_token_ids": {"type": ["array", "null"], "items": token},
        "presence_penalty": _number(-2.0, 2.0), "frequency_penalty": _number(-2.0, 2.0),
        "repetition_penalty": _number(0.0, 100.0, exclusive_lo=True),
        "response_format": {"anyOf": [{"type": "null"}, {"type": "object", "required": ["type"],
                                                         "properties": {"type": {"enum": ["text"]}}}]},
    }
    if kind == "completion":
        text = {"type": "string", "minLength": 1, "maxLength": chars}
        ids = {"type": "array", "items": token, "minItems": 1, "maxItems": positions - 1}
        props |= {
            # text, token ids, or OpenAI's batch form holding one of them (one prompt per request)
            "prompt": {"anyOf": [text, ids, {"type": "array", "items": {"anyOf": [text, ids]}, "minItems": 1,
                                             "maxItems": 1}]},
            "max_tokens": _number(1, positions - 1, integer=True),
            "logprobs": _number(0, protocol.MAX_LOGPROBS, integer=True),
            "echo": {"type": ["boolean", "null"]},
        }
        required = ["model", "prompt"]
    else:
        message = {"type": "object", "required": ["role", "content"],
                   "properties": {"role": {"type": "string"},  # which roles: the chat template's say
                                  "content": {"type": "string", "maxLength": chars}}}
        props |= {
            "messages": {"type": "array", "items": message, "minItems": 1},
            "max_tokens": _number(1, positions - 1, integer=True),
            "max_completion_tokens": _number(1, positions - 1, integer=True),
            "logprobs": {"type": ["boolean", "null"]},
            "top_logprobs": _number(0, protocol.MAX_LOGPROBS, integer=True),
        }
        required = ["model", "messages"]
    return {"type": "object", "required": required, "properties": props}


def _answer(kind: str) -> dict:
    choice = {"type": "object", "required": ["index", "finish_reason", "token_ids"],
              "properties": {"index": {"type": "integer"}, "finish_reason": {"type": ["string", "null"]},
                             "token_ids": {"type": "array", "items": {"type": "integer"}},
                             "logprobs": {"type": ["object", "null"]},
                             **({"message": {"type": "object"}} if kind == "chat" else {"text": {"type": "string"}})}}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                           "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                           "usage": usage}}


def generation(kind: str, model: protocol.ModelInfo) -> dict:
    """The OpenAPI operation fields of a generation endpoint (FastAPI's openapi_extra)."""
    errors = {status: {"description": why, "content": _json(ERROR)} for status, why in ERROR_STATUSES.items()}
    return {
        "requestBody": {"required": True, "content": _json(request_body(kind, model))},
        "responses": {"200": {"description": "the completion, or with \"stream\": true its chunks as server-sent "
                                             "events", "content": _json(_answer(kind)) | {
                                                 "text/event-stream": {"schema": EVENT}}},
                      **errors},
    }


def plain(description: str, schema: dict | None = None, media: str = "application/json", **statuses) -> dict:
    """The responses of a GET endpoint: 200 (`schema`), and each of `statuses` (code: why)."""
    ok = {"200": {"description": description, "content": {media: {"schema": schema or {"type": "object"}}}}}
    return {"responses": ok | {code.lstrip("_"): {"description": why, "content": _json({"type": "object"})}
                               for code, why in statuses.items()}}
