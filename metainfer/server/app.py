"""The FastAPI application and `run`, which serves it with uvicorn.

Endpoints: POST /v1/completions and /v1/chat/completions (streamed as server-sent events when
"stream": true), GET /v1/models; GET /health (the process answers), /ready (the engine's graphs
are compiled and warmed) and /metrics (Prometheus). With an API key, /v1/* asks for
"Authorization: Bearer <key>"; health, readiness and metrics stay open, as a load balancer
and a scraper need them.

Errors are OpenAI's shape with the status that fits (400 naming the field, 401, 404 for an
unknown model, 429 with Retry-After at capacity, 504 past the request timeout); an unexpected
error in one request is a 500 whose id is in the log, and the server goes on serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol, schema
from .engine import Engine
from .metrics import Metrics
from .protocol import APIError, ModelInfo

log = logging.getLogger("metainfer.server")


# Parsing and tokenising a request run here, off the event loop (which keeps answering /health
# and other requests meanwhile); a request whose parse takes longer is answered 400.
PARSE_THREADS, PARSE_TIMEOUT_S = 2, 30.0


def build_app(engine: Engine, model: ModelInfo, metrics: Metrics, api_key: str | None = None,
              on_serving=None, on_stopping=None, on_failed=None, max_request_bytes: int | None = None) -> FastAPI:
    """The app around `engine`. `on_serving(loop)` runs once the engine has started,
    `on_stopping()` before it stops; `on_failed()` once the engine has failed (its loop died, or
    `engine.fail` was called), after the requests in flight were answered. A request body past
    `max_request_bytes` (default: protocol.default_max_request_bytes of the model's context) is a
    413, read no further than the limit."""
    import concurrent.futures

    limit = max_request_bytes or protocol.default_max_request_bytes(model.max_positions)
    parser = concurrent.futures.ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="metainfer-parse")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        if on_serving is not None:
            on_serving(asyncio.get_running_loop())
        tasks = [asyncio.create_task(_warm(engine)), asyncio.create_task(_watch_engine(engine, on_failed))]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            if on_stopping is not None:
                on_stopping()
            engine.stop()  # on the thread that started it (the runtime's Manager asks for that)
            parser.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="metainfer", lifespan=lifespan)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/") and \
                request.headers.get("authorization", "") != f"Bearer {api_key}":
            return _error(APIError(401, "a valid API key is required (Authorization: Bearer <key>)",
                                   kind="authentication_error", code="invalid_api_key"))
        try:
            response = await call_next(request)
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > TRIM_AFTER_BYTES:
                # a large body's buffers are freed by now; hand the pages back to the system
                asyncio.get_running_loop().run_in_executor(parser, _release_memory)
            return response
        except Exception:  # one request's failure, never the server's
            ref = uuid.uuid4().hex[:12]
            log.exception("internal error %s on %s %s", ref, request.method, request.url.path)
            return _error(APIError(500, f"internal error (id {ref} in the server's log)", code="internal_error"))

    @app.get("/health", openapi_extra=schema.plain("the process answers"))
    async def health():
        return {"status": "ok"}

    @app.get("/ready", openapi_extra=schema.plain("the engine's graphs are compiled and warm",
                                                  _503="warming up, or failing"))
    async def ready():
        if engine.ready:
            return {"status": "ready"}
        return JSONResponse({"status": "warming up"}, status_code=503)

    @app.get("/metrics", openapi_extra=schema.plain("Prometheus' text format", {"type": "string"},
                                                    media="text/plain"))
    async def metrics_():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", openapi_extra=schema.plain("the served model", _401="a valid API key is required"))
    async def models():
        entry = {"id": model.name, "object": "model", "created": 0, "owned_by": "metainfer",
                 "max_model_len": model.max_positions}
        if model.parallel is not None:
            entry["parallel"] = model.parallel
        return {"object": "list", "data": [entry]}

    async def generate(request: Request, kind: str):
        endpoint = request.url.path
        try:
            raw = await _read_body(request, limit)
            try:
                req = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                    parser, lambda: protocol.parse(protocol.parse_json(raw), kind, model)), PARSE_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise APIError(400, f"the request took more than {PARSE_TIMEOUT_S:g} s to parse and tokenise",
                               code="request_too_complex") from None
            if not req.stream:
                body = await _complete(engine, req, model, request)
                metrics.requests.labels(endpoint, "ok").inc()
                return body
            first = _stream(engine, req, model, metrics, endpoint)
            head = await anext(first)  # admission and the first tokens: errors before the 200
        except APIError as e:
            metrics.requests.labels(endpoint, str(e.code or e.status)).inc()
            return _error(e)
        except _Disconnected:
            metrics.requests.labels(endpoint, "cancelled").inc()
            return Response(status_code=499)
        return StreamingResponse(_chain(head, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions", openapi_extra=schema.generation("completion", model))
    async def completions(request: Request):
        return await generate(request, "completion")

    @app.post("/v1/chat/completions", openapi_extra=schema.generation("chat", model))
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        """The router's own answers (no such route, a method a route does not take) in OpenAI's shape."""
        if e.status_code == 404:
            return _error(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))
        if e.status_code == 405:
            return _error(APIError(405, f"{request.url.path} does not take {request.method}", code="method_not_allowed",
                                   headers=dict(e.headers or {})))
        return _error(APIError(e.status_code, str(e.detail), headers=dict(e.headers or {})))

    return app


class _Disconnected(Exception):
    pass


TRIM_AFTER_BYTES = 8 * 2**20


def _release_memory() -> None:
    """Return freed heap pages to the system after a large request (glibc keeps them otherwise:
    a 50 MB body left the server 100 MB larger)."""
    import ctypes
    import gc

    gc.collect(1)  # the young generations: a refused request's exception cycles hold its parsed body
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 once it passes `limit` bytes (by its Content-Length, or as it arrives:
    never more than the limit is held)."""
    declared = request.headers.get("content-length", "")
    too_large = APIError(413, f"the request body is larger than the server's limit of {limit} bytes "
                              "(--max-request-bytes)", code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _warm(engine: Engine) -> None:
    try:
        await engine.warm_up()
    except Exception:
        log.exception("warm-up failed: /ready stays false")


async def _watch_engine(engine: Engine, on_failed, poll_s: float = 0.25) -> None:
    """Fail the server when the engine's loop dies (its requests fail with it) or someone failed
    it (a rank of the job); then, once the requests in flight are answered, `on_failed()`."""
    while engine.failed is None:
        why = engine.fatal_error() or engine.stopped_by_itself()
        if why is not None:
            log.error("the engine's loop ended: %s", why)
            if await engine.diagnosed(None) is None:  # no other rank named at fault
                engine.fail(f"rank 0's engine: {why}")
            break
        await asyncio.sleep(poll_s)
    deadline = time.monotonic() + 2.0
    while engine.admission.running and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if on_failed is not None:
        on_failed()


async def _complete(engine: Engine, req, model: ModelInfo, request: Request) -> dict:
    """A non-streamed request: the whole completion; the request is cancelled if the client
    goes away while it runs."""
    choices = [protocol.Choice(i, req, model) for i in range(req.n)]

    async def run():
        async for update in engine.generate(req):
            choice = choices[update.index]
            choice.add(update.ids, update.finish, update.logprobs)
            if choice.finish is not None and update.finish is None:
                engine.end_choice(req, update.index)  # a stop string matched

    task = asyncio.create_task(run())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise _Disconnected()
        task.result()  # its error, if any
    finally:
        if not task.done():
            task.cancel()
    return protocol.response(req, model, choices)


async def _stream(engine: Engine, req, model: ModelInfo, metrics: Metrics, endpoint: str):
    """Server-sent events: a chunk per step's new tokens of a choice, a choice's last with its
    finish reason, the last of all with the usage, then [DONE]. The first item is yielded once
    the first tokens exist (so admission and request errors are still an HTTP status); a client
    that goes away cancels the request."""
    choices = [protocol.Choice(i, req, model) for i in range(req.n)]
    started, first, status = [False] * req.n, True, "cancelled"
    try:
        async for update in engine.generate(req):
            choice = choices[update.index]
            text, new, records = choice.add(update.ids, update.finish, update.logprobs)
            if choice.finish is not None and update.finish is None:
                engine.end_choice(req, update.index)  # a stop string matched
            if not new and not text and choice.finish is None:
                continue
            done = all(c.finish is not None for c in choices)
            yield _sse(protocol.chunk(req, model, choice, text, new, records, first=not started[update.index],
                                      total=sum(len(c.ids) for c in choices) if done else None))
            started[update.index], first = True, False
            if done:
                if req.include_usage:
                    yield _sse(protocol.usage_chunk(req, model, sum(len(c.ids) for c in choices)))
                status = "ok"
        yield "data: [DONE]\n\n"
    except APIError as e:
        status = None if first else str(e.code or e.status)
        if first:
            raise  # answered (and counted) as an HTTP error
        yield _sse(e.body())  # mid-stream: the error as the last event
        yield "data: [DONE]\n\n"
    finally:
        if status is not None:
            metrics.requests.labels(endpoint, status).inc()


async def _chain(head: str, rest):
    yield head
    async for item in rest:
        yield item


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def run(opt, model: ModelInfo, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
        max_running: int = 64, max_queue: int = 256, request_timeout: float = 600.0, grace: float = 30.0,
        cb_config=None, log_level: str = "info", rank0=None, max_request_bytes: int | None = None,
        speculation=None) -> int:
    """Serve `opt` (an OptimizedModel of a transformers causal LM) until SIGTERM or SIGINT: then
    stop accepting, give in-flight requests `grace` seconds to finish, cancel the rest, stop the
    engine; returns the exit status: 0 after a drain, 1 when the engine failed. `rank0`
    (metainfer.server.ranks.Rank0): this is rank 0 of a job whose other ranks follow its engine;
    a fault of any rank fails the server (and the process exits from rank0.finish). `speculation`:
    (drafter, max draft tokens) of metainfer.runtime.serve_speculation."""
    import dataclasses

    import uvicorn

    from . import ranks

    metrics = Metrics()
    engine = Engine(opt, max_running=max_running, max_queue=max_queue, request_timeout=request_timeout,
                    metrics=metrics, cb_config=cb_config, speculation=speculation)
    if rank0 is not None:  # the watch names a rank at fault within its beat timeout (at once for an exit)
        engine.diagnose_s = rank0.watch.rank_timeout_s + 1.0
    parallel = ranks.parallel_of(opt, engine, rank0.job if rank0 is not None else None)
    model = dataclasses.replace(model, parallel=parallel.as_dict())
    metrics.show_parallel(parallel)
    log.info("parallel: %s", parallel.as_dict())
    server: list = []

    def failed():
        server[0].should_exit = True

    app = build_app(engine, model, metrics, api_key=api_key, on_failed=failed, max_request_bytes=max_request_bytes,
                    on_serving=(lambda loop: rank0.serving(engine, loop)) if rank0 is not None else None,
                    on_stopping=rank0.expect_exit if rank0 is not None else None)
    # uvicorn's own bounds: a request head (line and headers) of at most 64 KiB, idle keep-alive
    # connections closed after 5 s; a slow sender holds a socket and a coroutine, not a thread
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace,
                            access_log=False, h11_max_incomplete_event_size=64 * 2**10, timeout_keep_alive=5)
    server.append(uvicorn.Server(config))
    started = time.perf_counter()
    log.info("serving %s on http://%s:%d", model.name, host, port)
    # uvicorn drains on SIGTERM/SIGINT, then raises the signal again for the handler it found:
    # a handler that only notes it makes a drained stop exit 0
    stopped_by: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _f: stopped_by.append(s)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server[0].run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    status = 1 if engine.failed is not None else 0
    log.info("stopped after %.0f s%s", time.perf_counter() - started,
             f": {engine.failed.message}" if engine.failed is not None else
             f" ({signal.Signals(stopped_by[0]).name}, drained)" if stopped_by else "")
    if rank0 is not None:
        status = max(status, rank0.finish(failed=engine.failed))
    return status
