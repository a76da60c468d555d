"""The batching engine seen from the server's event loop.

The engine (transformers' continuous batching, through metainfer.runtime.serving.Manager) runs
in its own thread. Here each request is admitted (at most `max_running` in the engine, at most
`max_queue` waiting for a slot, beyond that Overloaded: a 429), its outputs are routed to an
asyncio queue of its own (the engine's result handlers, delivered on the loop), and a request
whose consumer goes away (a client disconnect, a timeout, shutdown) is cancelled in the engine,
which frees its KV blocks.

Sampling: the engine draws with metainfer's Sampler (metainfer.runtime.sampling), each request
with its own temperature (0: greedy, an argmax), top-k and top-p. A request's seed seeds
torch's generator before its first draw, in the engine's step (on every rank of a tensor-
parallel group alike): the engine shares one generator across the batch, so a seed is best
effort, as in OpenAI's API.

When the engine cannot serve any more (`fail`: a rank of the job died, hung or raised, or the
engine's own loop died), every request in flight ends at once with a 503 naming the cause and
new ones are refused the same way, while the server shuts down.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterator

from .metrics import Metrics
from .protocol import APIError, GenerationRequest


class Overloaded(APIError):
    def __init__(self, running: int, queued: int, retry_after: int = 1):
        super().__init__(429, f"the server is at capacity ({running} running, {queued} queued); retry later",
                         kind="rate_limit_error", code="overloaded", headers={"Retry-After": str(retry_after)})


class RequestTimeout(APIError):
    def __init__(self, seconds: float):
        super().__init__(504, f"the request did not finish within {seconds:g} s", kind="timeout", code="timeout")


class EngineFailed(APIError):
    def __init__(self, why: str):
        super().__init__(500, f"the engine failed this request: {why}", code="engine_error")


class ServerFailed(APIError):
    """The engine cannot serve any more (a rank died, hung or raised): every request in flight
    ends with this, and new ones get it at once, while the server shuts down."""

    def __init__(self, why: str):
        super().__init__(503, f"the server is failing: {why}; it is shutting down", kind="server_error",
                         code="server_failed")


@dataclass
class Update:
    """A choice's tokens so far, its finish reason once finished, and the log-probability
    records of the tokens new since its last update (None when the request asked for none)."""

    index: int
    ids: list[int]
    finish: str | None
    logprobs: list | None = None


_CHOICE_ENDED = object()  # queued by end_choice to wake a request's generate()


class Admission:
    """At most `max_running` sequences hold a slot (a request of n choices takes n) and at most
    `max_queue` requests wait (in arrival order: the first waiter is served before any later
    one); past that, Overloaded. A waiter that goes away leaves the queue, and slots handed to
    one that is going away pass on."""

    def __init__(self, max_running: int, max_queue: int):
        self.max_running, self.max_queue = max_running, max_queue
        self.running = 0
        self.waiting: collections.deque[tuple[asyncio.Future, int]] = collections.deque()

    async def acquire(self, slots: int = 1) -> None:
        if not 1 <= slots <= self.max_running:
            raise ValueError(f"a request takes 1 to {self.max_running} slots, not {slots}")
        if not self.waiting and self.running + slots <= self.max_running:
            self.running += slots
            return
        if len(self.waiting) >= self.max_queue:
            raise Overloaded(self.running, len(self.waiting))
        entry = (asyncio.get_running_loop().create_future(), slots)
        self.waiting.append(entry)
        try:
            await entry[0]  # _hand_out counted its slots in `running`
        except asyncio.CancelledError:
            if entry[0].done() and not entry[0].cancelled() and entry[0].exception() is None:
                self.release(slots)  # handed slots while going away: pass them on (not when failed)
            elif entry in self.waiting:
                self.waiting.remove(entry)
                self._hand_out()  # the ones behind it may fit now
            raise

    def release(self, slots: int = 1) -> None:
        self.running -= slots
        self._hand_out()

    def _hand_out(self) -> None:
        while self.waiting:
            future, slots = self.waiting[0]
            if future.done():  # failed by the engine, or cancelled
                self.waiting.popleft()
                continue
            if self.running + slots > self.max_running:
                return
            self.waiting.popleft()
            self.running += slots
            future.set_result(None)


def engine_manager(opt, cb_config=None, max_running: int | None = None, speculation=None, get_results: bool = False):
    """The continuous-batching manager the server drives, made alike on every rank of a job (the
    others follow rank 0's): a sampling config with no processors of its own, so the engine
    samples with metainfer's Sampler, each request passing its own temperature (0: greedy),
    top-k, top-p and seed. Its KV pool holds what admission allows, `max_running` requests of the
    model's whole context (or less where memory bounds it; the capacity note says which).
    `speculation`: (drafter, max draft tokens): greedy requests decode speculatively. The server
    takes every result through handlers; `get_results`: keep the engine's queue for get_result
    (otherwise outputs no handler claims are dropped, not kept forever)."""
    from transformers import GenerationConfig

    from metainfer.models.transformers_adapter import WorkloadHints
    from metainfer.runtime.sampling import Sampler

    model = opt.model
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16, eos_token_id=eos,
                           pad_token_id=getattr(model.config, "pad_token_id", None))
    positions = getattr(model.config, "max_position_embeddings", None)
    hints = (WorkloadHints(max_prompt_length=positions, max_generated_length=0, num_requests=max_running)
             if max_running and isinstance(positions, int) else None)
    manager = opt.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config,
                                           workload_hints=hints, speculation=speculation)
    if not isinstance(manager.logit_processor, Sampler):
        raise RuntimeError(f"the engine did not take metainfer's sampler (it has {manager.logit_processor!r})")
    if not get_results:
        manager.drop_unclaimed_outputs()
    return manager


def tuning_shapes(max_batch_tokens: int, max_running: int, max_positions: int) -> list[tuple[int, int]]:
    """(prompt tokens, concurrent requests) a GPU server warms up with so its kernels tune before
    traffic: prefills of 16, 64, 256, ... tokens up to the engine's batch budget (the GEMMs' and
    attention's M buckets), then decode steps of 2, 4, 8, ... requests up to the running cap."""
    out, n = [], 16
    while n <= min(max_batch_tokens, max_positions - 4):
        out.append((n, 1))
        n *= 4
    b = 2
    while b <= max_running:
        out.append((8, b))
        b *= 2
    return out


class Engine:
    def __init__(self, opt, *, max_running: int, max_queue: int, request_timeout: float, metrics: Metrics,
                 cb_config=None, speculation=None):
        self.opt, self.metrics, self.request_timeout = opt, metrics, request_timeout
        self.manager = engine_manager(opt, cb_config, max_running, speculation)
        eos = opt.model.generation_config.eos_token_id if opt.model.generation_config is not None else None
        self.eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.admission = Admission(max_running, max_queue)
        self._fed_back = 0  # generated tokens fed back as inputs (all but each request's last)
        self._inflight: dict[str, asyncio.Queue] = {}  # each admitted request's output queue
        self._ended: dict[str, set[int]] = {}  # each admitted request's finished choices
        self.failed: ServerFailed | None = None
        self.diagnose_s = 0.0  # how long an engine error waits for the job's watch to name a rank (diagnosed)
        self.ready = False
        self.started = False
        self._watch()

    # ---- lifecycle
    def start(self) -> None:
        self.manager.start()
        self.started = True

    def fatal_error(self) -> str | None:
        """Why the engine's loop died (None while it lives or has stopped cleanly)."""
        error = self.manager.background_thread_status.fatal_error
        return None if error is None else f"{type(error).__name__}: {error}"

    async def diagnosed(self, error: APIError | None) -> APIError | None:
        """What to answer for an error the engine delivered: in a job of several ranks the engine
        fails when another rank does (a collective with a dead peer), so the job's watch is given
        `diagnose_s` to name the rank at fault (ServerFailed) before the engine's own error is."""
        deadline = time.monotonic() + self.diagnose_s
        while self.failed is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.failed or error

    def stopped_by_itself(self) -> str | None:
        """Why the engine's loop ended though this server did not stop it (a rank of its group
        hard-stopped it), or None."""
        if self.started and not self.manager.is_running():  # stop() clears `started` first
            return "its loop ended without being stopped (a rank of its group ended it)"
        return None

    def fail(self, why: str) -> None:
        """On the event loop: the engine cannot serve any more. Every request in flight ends now
        with ServerFailed, new ones get it at admission, /ready says 503."""
        if self.failed is not None:
            return
        self.failed = ServerFailed(why)
        self.ready = False
        for outputs in list(self._inflight.values()):
            outputs.put_nowait(self.failed)
        for waiter, _slots in list(self.admission.waiting):
            if not waiter.done():
                waiter.set_exception(self.failed)
        self.admission.waiting.clear()

    async def warm_up(self) -> None:
        """One request through the engine (a prefill step of several tokens, then decode steps of
        one): its graphs compiled and run before /ready says so. Where kernels autotune (a GPU),
        then the shapes they tune per (tuning_shapes), and tuning is frozen: no kernel is timed
        inside a serving step after this."""
        from metainfer.kernels import _common

        vocab = self.opt.model.config.vocab_size

        async def run(n_prompt: int, concurrent: int) -> None:
            prompt = [1 + t % (vocab - 1) for t in range(n_prompt)]
            reqs = [GenerationRequest(kind="completion", prompt_ids=prompt, max_tokens=2 if concurrent > 1 else 3,
                                      temperature=0.0) for _ in range(concurrent)]

            async def one(req):
                async for _ in self.generate(req, count=False):
                    pass

            await asyncio.gather(*(one(r) for r in reqs))

        await run(8, 1)
        device = next(self.opt.model.parameters()).device
        if _common.autotune_enabled(device):
            limit = getattr(self.opt.model.config, "max_position_embeddings", None) or 2**31
            for n_prompt, concurrent in tuning_shapes(self.manager.capacity.max_batch_tokens,
                                                      self.admission.max_running, limit):
                await run(n_prompt, concurrent)
        _common.freeze_tuning()
        self.ready = True

    def stop(self) -> None:
        """Stops the engine: drains it (the engine finishes what it holds, every rank of a job
        with it), or, once it has failed, leaves its loop behind (it may be waiting on a rank
        that is gone)."""
        if self.started:
            self.started = False
            if self.failed is None:
                self.manager.stop(block=True, timeout=30)
            else:
                self.manager.stop(block=False, hard_stop=True)

    # ---- one request
    async def generate(self, req: GenerationRequest, count: bool = True) -> AsyncIterator[Update]:
        """Yields an Update per choice as the engine makes its tokens (a request of n choices holds
        n running slots); cancels what is left in the engine if the consumer stops early, and a
        choice that `end_choice` ended. Raises Overloaded, RequestTimeout, EngineFailed, and a
        400 for more choices than running slots."""
        arrived = time.perf_counter()
        if self.failed is not None:
            raise self.failed
        if req.n > self.admission.max_running:
            raise APIError(400, f"n = {req.n} asks for more sequences than the server runs at once "
                                f"({self.admission.max_running}, --max-running)", param="n")
        await self.admission.acquire(req.n)
        rid = f"{req.kind}-{req.id}"
        ids_of = self.manager.request_ids(rid, req.n)
        index_of = {engine_id: i for i, engine_id in enumerate(ids_of)}
        outputs: asyncio.Queue = asyncio.Queue()
        ended: set[int] = set()  # choices finished (by the engine, or ended by the consumer)
        self._inflight[rid] = outputs
        self._ended[rid] = ended
        sampler = self.manager.sampler
        try:
            if self.failed is not None:
                raise self.failed
            for engine_id in ids_of:
                self.manager.register_result_handler(engine_id, outputs.put_nowait)
            sampling = {"temperature": float(req.temperature), "top_p": float(req.top_p), "top_k": int(req.top_k),
                        **req.penalties}
            if req.seed is not None:  # applied by the sampler before the request's first draw
                sampling["seed"] = int(req.seed)
            if req.logprobs is not None:
                sampler.watch_logprobs(ids_of, req.logprobs)
            stops = sorted(set(self.eos) | set(req.stop_token_ids)) or [-1]
            try:
                self.manager.add_request(req.prompt_ids, request_id=rid, max_new_tokens=req.max_tokens, streaming=True,
                                         eos_token_id=stops, n=req.n, **sampling)
            except ValueError as e:  # the pool cannot hold it (metainfer.runtime.serving.request_problem)
                ended.update(range(req.n))
                raise APIError(400, str(e), param="max_tokens") from None
            if count:
                self.metrics.prompt_tokens.inc(len(req.prompt_ids))
            deadline = arrived + self.request_timeout
            last, sent = [arrived] * req.n, [0] * req.n
            while len(ended) < req.n:
                try:
                    out = await asyncio.wait_for(outputs.get(), timeout=max(0.0, deadline - time.perf_counter()))
                except asyncio.TimeoutError:
                    raise RequestTimeout(self.request_timeout) from None
                if out is _CHOICE_ENDED:
                    continue
                if isinstance(out, ServerFailed):
                    ended.update(range(req.n))  # nothing left to cancel: the engine is gone
                    raise out
                i = index_of[out.request_id]
                if i in ended:
                    continue  # a choice the consumer ended: its cancellation's result
                if out.error is not None:
                    ended.add(i)
                    raise await self.diagnosed(EngineFailed(out.error))
                ids = list(out.generated_tokens)
                now = time.perf_counter()
                if count and len(ids) > sent[i]:
                    (self.metrics.ttft if sent[i] == 0 else self.metrics.tpot).observe(now - last[i])
                    self.metrics.generation_tokens.inc(len(ids) - sent[i])
                logprobs = sampler.take_logprobs(out.request_id, sent[i], len(ids)) if req.logprobs is not None else None
                last[i], sent[i] = now, len(ids)
                if out.is_finished():
                    ended.add(i)
                    self._fed_back += max(0, len(ids) - 1)
                    yield Update(i, ids, "stop" if ids and ids[-1] in stops else "length", logprobs)
                else:
                    yield Update(i, ids, None, logprobs)
        finally:
            self._inflight.pop(rid, None)
            self._ended.pop(rid, None)
            left = [engine_id for engine_id, i in index_of.items() if i not in ended]
            for engine_id in left:
                self.manager.cancel_request(engine_id)
            with self.manager.output_router._lock:
                for engine_id in ids_of:
                    self.manager.output_router.result_handlers.pop(engine_id, None)
            if req.logprobs is not None:
                sampler.unwatch(ids_of)
            self.admission.release(req.n)

    def end_choice(self, req: GenerationRequest, index: int) -> None:
        """The consumer has what it wants of choice `index` (a stop string matched): the engine
        stops it now, and generate() stops waiting for it."""
        rid = f"{req.kind}-{req.id}"
        ended = self._ended.get(rid)
        if ended is None or index in ended:
            return
        ended.add(index)
        self.manager.cancel_request(self.manager.request_ids(rid, req.n)[index])
        self._inflight[rid].put_nowait(_CHOICE_ENDED)  # wakes generate() to see what is left

    # ---- metrics read at each scrape
    def _watch(self) -> None:
        m = self.metrics
        m.running.set_function(lambda: self.admission.running)
        m.queued.set_function(lambda: len(self.admission.waiting))
        m.graphs.set_function(lambda: len(self.opt.report.sections))
        from metainfer.passes.pipeline import DEFAULT_ORDER

        for name in DEFAULT_ORDER:
            m.pass_matches.labels(name).set_function(lambda name=name: self.opt.report.matches(name))
        for i, state in enumerate(("used", "cached", "free")):
            m.kv_blocks.labels(state).set_function(lambda i=i: self._blocks()[i])
        m.prefix_hit.set_function(self._prefix_hit)
        spec = getattr(self.manager, "speculation", None)
        if spec is not None:
            m.spec_drafted.set_function(lambda: spec.stats.drafted)
            m.spec_accepted.set_function(lambda: spec.stats.accepted)
            m.spec_acceptance.set_function(lambda: spec.stats.acceptance)
            for k in range(spec.max_draft + 1):
                m.spec_lengths.labels(str(k)).set_function(lambda k=k: spec.stats.lengths.get(k, 0))
        stats = lambda: getattr(getattr(self.manager, "exchange", None), "stats", None)  # noqa: E731 - None: one rank
        m.exchange_seconds.set_function(lambda: stats().status_s + stats().payload_s if stats() else 0.0)
        m.exchange_steps.set_function(lambda: stats().status_calls if stats() else 0)

    def _blocks(self) -> tuple[float, float, float]:
        with contextlib.suppress(Exception):  # read while the engine thread changes the pool: a scrape may miss
            return self.manager.kv_blocks()
        return 0.0, 0.0, float(self.manager.capacity.num_blocks)

    def _prefix_hit(self) -> float:
        steps = getattr(self.manager, "steps", None)
        admitted = self.manager.admitted_tokens
        if steps is None or not admitted:
            return 0.0
        spec = getattr(self.manager, "speculation", None)
        computed = steps.tokens - (spec.stats.drafted if spec is not None else 0)  # drafted rows are not prompt work
        return max(0.0, admitted + self._fed_back - computed) / admitted
