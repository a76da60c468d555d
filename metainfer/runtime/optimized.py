"""The optimized model: what `metainfer.optimize()` returns and what runs when it is called.

It routes the model's own forward through the compiled graphs of a MetainferBackend for the
length of a call (`installed`), labels each call for the report (prefill, decode, a serving
step), and hands generate(), continuous batching and speculative decoding the same graphs.
The API (metainfer.api) builds it; the runtime's serving and speculation drive it through the
public methods below; nothing here calls back up into the API: a drafter is made by the
`remake` factory the API hands in."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from metainfer.hardware import targets as _targets
from metainfer.lowering.backend import CallContext, MetainferBackend
from metainfer.runtime import inputs as _inputs
from metainfer.runtime import model_capture as capture
from metainfer.runtime.inputs import ModelInputs, check_devices
from metainfer.runtime.serve_compile import ServingCompile


def _static_cache(kwargs) -> bool:
    """Whether the call's KV cache keeps its shapes from step to step (Hugging Face's static
    caches say so with `is_compileable`): its decode graph can be replayed."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.25 renamed it "cache"
    return bool(getattr(cache, "is_compileable", False))


def _mark_static_addresses(kwargs) -> None:
    """A static cache's tensors as fixed addresses for the graphs that mutate them. transformers
    marks them when it allocates them, except inside a Dynamo trace, which is where metainfer's
    compiled prefill allocates them: unmarked, Inductor would skip CUDA graphs for the decode
    ("mutated inputs"). Marked here before each compiled call (a no-op once marked)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    for layer in getattr(cache, "layers", ()):
        for name in ("keys", "values", "cumulative_length"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and getattr(t, "_dynamo_static_input_type", None) is None:
                torch._dynamo.mark_static_address(t)


STATIC_CACHE_MIN = 256  # the smallest static cache metainfer keeps; longer ones by powers of two


class CallTimes:
    """The seconds each observed call took, handed to its callback without stalling the host.

    On a CPU the call's wall time is known when it returns. On a GPU the call returns once its
    kernels are queued: a CUDA event pair brackets them and is read when it has completed (at a
    later call's start, or when the calls end), never by synchronising the device in the step."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.pending: list = []

    def start(self):
        self.deliver(wait=False)
        begin = time.perf_counter()
        if not self.cuda:
            return begin, None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return begin, event

    def stop(self, timing, callback, host: bool = False) -> None:
        begin, event = timing
        if event is None or host:
            callback(time.perf_counter() - begin)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((event, end, callback))

    def deliver(self, wait: bool) -> None:
        """Hand on the pending calls' times whose events have completed (`wait`: all of them)."""
        while self.pending:
            begin, end, callback = self.pending[0]
            if not wait and not end.query():
                return
            end.synchronize()  # a no-op once query() said done; the wait at close otherwise
            self.pending.pop(0)
            callback(begin.elapsed_time(end) / 1e3)

    def close(self) -> None:
        self.deliver(wait=True)


RECOMPILE_LIMIT = 64  # Dynamo's per-code-object limit optimize() raises torch's to, at least


def _own_entry(forward):
    """`forward` called from a function whose code object is new, so its compiled graphs have a
    Dynamo cache of their own. Dynamo keeps graphs, and counts recompiles against its limit, per
    code object; a model's forward shares its code with every instance of its class (and, behind
    Hugging Face's decorators, with every model class), so each optimize() of another model
    added entries to one cache: a process that optimized a few dozen models hit the limit and
    its next model was never handed to metainfer (found by bench/fuzz.py)."""

    def entry(*args, **kwargs):
        return forward(*args, **kwargs)

    entry.__code__ = entry.__code__.replace()  # an equal but distinct code object
    return entry


# torch 2.13's torch.compile(isolate_recompiles=True): every frame one call compiles (its entry,
# and the frames around a graph break, such as transformers' decorator frames shared by every
# model class) keeps its cache entries and recompile count in a region of that call's own; the
# GPU machine's torch 2.11 has no such argument
_ISOLATES = "isolate_recompiles" in inspect.signature(torch.compile).parameters
ACCUMULATED_LIMIT = 4096  # Dynamo's cap on one code object's entries across all regions


def _compile(fn, backend, dynamic):
    return torch.compile(fn, backend=backend, dynamic=dynamic, **({"isolate_recompiles": True} if _ISOLATES else {}))


class OptimizedModel:
    """The optimized callable: same call signature and outputs as the model; `.report` says
    what metainfer did. `generate()` runs the model's own generate() (Hugging Face, or a
    models/ model's loop) with every forward call going through the optimized graphs.
    Attributes it does not have are read from the model."""

    def __init__(self, model: torch.nn.Module, backend: MetainferBackend, *, dynamic: bool | None,
                 dump_dir: str | None, serve_compile: str = "auto",
                 remake: "Callable[..., OptimizedModel] | None" = None):
        self.model = model
        self._backend = backend
        self._remake = remake  # optimize(model, **settings) for this target: the API's factory
        self._forward = model.forward  # bound; what the compiled graphs compute
        self._compiled = _compile(_own_entry(self._forward), backend, dynamic)
        # a serving engine's packed steps change size every step: symbolic from the first one
        self._compiled_packed = _compile(_own_entry(self._forward), backend, True)
        self.serving_compile = ServingCompile(self, serve_compile)
        self._dump_dir = dump_dir
        self._dumped_sections = 0
        self._inputs = ModelInputs(model)
        self._serving_fn = None  # the function the last serving step ran
        self._modules = list(model.modules())  # read on every call: is any in training mode?

    @property
    def report(self):
        """The metainfer.report.Report of every graph compiled for this model."""
        return self._backend.report

    @property
    def target(self) -> _targets.Target:
        return self._backend.target

    @property
    def lowering(self) -> str:
        return self._backend.lowering

    @property
    def pass_names(self) -> list[str]:
        """The passes each graph runs through, in order."""
        return [p.name for p in self._backend.passes]

    @property
    def cache_dir(self):
        """Where compiled artifacts are kept (metainfer.lowering.compile_cache)."""
        return self._backend.cache_dir

    def record_call_times(self) -> None:
        """Record each graph's wall time per call in its report section (the cost model's
        validation compares them with predictions); takes effect for graphs compiled after."""
        self._backend.time_calls = True

    def __call__(self, *args, **kwargs):
        check_devices(self.target, args, kwargs, what="input")
        with self.installed(lambda kw, n: "forward"):
            return self.model(*args, **kwargs)

    def generate(self, *args, draft_length: int | None = None, **kwargs):
        """The model's generate(), its prefill and decode steps running the optimized graphs
        (the report labels each graph with its phase). With Hugging Face's assisted generation
        (`assistant_model=`, an OptimizedModel or a model, which is then optimized for the
        same target; or `prompt_lookup_num_tokens=`) the verify and draft steps run metainfer's
        graphs too, and the draft length is metainfer's (metainfer.runtime.speculative), re-chosen as
        acceptance is measured, unless `draft_length=` fixes it. A models/ model with MTP
        layers (DeepSeek) speculates the same way with them as the drafter, on one prompt at a
        time; `draft_length=0` runs its plain loop."""
        from metainfer.runtime import speculative

        if not callable(getattr(type(self.model), "generate", None)):
            raise AttributeError(f"{type(self.model).__name__} has no generate() method")
        check_devices(self.target, args, kwargs, what="input")
        ids = self._inputs.token_ids(args, kwargs)
        if ids is not None:  # the prompt, checked once before generate() builds anything around it
            self._inputs.check_prompt(ids)
            if getattr(self.model, "generation_config", None) is not None:
                _check_generation_length(self.model, ids, kwargs)
        if getattr(self.model, "generation_config", None) is not None:
            # Hugging Face would wrap the forward in its own torch.compile on GPUs
            kwargs.setdefault("disable_compile", True)
        spec = speculative.prepare(self, args, kwargs, draft_length,
                                   batch=ids.shape[0] if ids is not None and ids.dim() > 1 else 1)
        if spec is None and ids is not None and self._wants_static_cache(kwargs):
            kwargs = {**kwargs, "past_key_values": self._static_cache_for(ids, kwargs)}
            kwargs.pop("cache_implementation", None)
        if spec is None:
            steps = itertools.count()
            with self.installed(lambda kw, n: "prefill" if next(steps) == 0 else "decode"):
                return self.model.generate(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            stack.enter_context(spec.installed())
            stack.enter_context(self.installed(spec.phase, observe=spec.observe, symbolic=spec.symbolic))
            if spec.drafter is not None:
                stack.enter_context(spec.drafter.installed(lambda kw, n: "draft", observe=spec.observe_draft,
                                                            symbolic=lambda kw, n: True))
            return self.model.generate(*args, **kwargs)

    def _wants_static_cache(self, kwargs) -> bool:
        if "past_key_values" in kwargs or "cache" in kwargs:
            return False  # the caller's own cache
        config = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        return kwargs.get("cache_implementation", getattr(config, "cache_implementation", None)) == "static"

    def _static_cache_for(self, ids: torch.Tensor, kwargs):
        """One StaticCache per batch size, dtype and length bucket, kept by this OptimizedModel and
        reset per call: its tensors keep their addresses, so the decode graph's CUDA graphs are
        replayed by every later generate() instead of re-recorded for a new cache each call.
        Lengths are bucketed by powers of two from STATIC_CACHE_MIN (capped at the model's
        positions): longer masked keys do not change the tokens."""
        from transformers import StaticCache

        config = kwargs.get("generation_config") or self.model.generation_config
        new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
        need = ids.shape[-1] + new if new is not None else kwargs.get("max_length", config.max_length)
        bucket = max(STATIC_CACHE_MIN, 1 << (int(need) - 1).bit_length())
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if isinstance(limit, int) and need <= limit:
            bucket = min(bucket, limit)
        batch = ids.shape[0] if ids.dim() > 1 else 1
        key = (batch, bucket, self.model.dtype, ids.device)
        caches = self.__dict__.setdefault("_static_caches", {})
        cache = caches.get(key)
        if cache is None:
            cache = caches[key] = StaticCache(config=self.model.config, max_cache_len=bucket)
        else:
            cache.reset()
        return cache

    def generate_batch(self, inputs, generation_config=None, continuous_batching_config=None, **kwargs):
        """transformers' continuous batching `generate_batch`, every forward of the engine running
        metainfer's graphs (see metainfer.runtime.serving); a request that cannot be served fails alone."""
        from metainfer.runtime import serving

        return serving.generate_batch(self, inputs, generation_config, continuous_batching_config, **kwargs)

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None,
                                 workload_hints=None, exchange: str = "auto", speculation=None):
        """The engine's streaming manager (add_request / get_result / start / stop), its forwards
        running metainfer's graphs between start() and stop() (see metainfer.runtime.serving).
        In a tensor-parallel job, `exchange` is how the ranks exchange each step's requests:
        "auto" (shared memory where the group shares this host), "shm" or "gloo" (the
        engine's own; metainfer.runtime.exchange). `speculation`: (drafter, max draft tokens) of
        metainfer.runtime.serve_speculation, for greedy requests."""
        from metainfer.runtime import serving

        return serving.Manager(self, generation_config, continuous_batching_config, workload_hints, exchange=exchange,
                               speculation=speculation)

    @contextlib.contextmanager
    def installed(self, phase, step=None, observe=None, symbolic=None):
        """Route the model's forward through the compiled graphs: the model's own __call__
        (hooks included) and generate() loop stay as they are. `phase(kwargs, tokens)` labels each
        call (tokens: the length of its token ids, 1 if it has none);
        `step`, if given, is a serving engine's: step(kwargs) is a context for the call, and the
        call's token ids are packed requests (positions are checked per request, not here).
        `symbolic(kwargs, tokens)`: whether the call takes the graphs compiled with symbolic sizes from
        the first call on (as a serving step does); `observe(phase, tokens, seconds, compiled)`
        hears of every call."""

        @functools.wraps(self._forward)
        def forward(*args, **kwargs):
            self._refuse_training()
            args, kwargs, finish = self._inputs.check(args, kwargs, positions=step is None)
            ids = self._inputs.token_ids(args, kwargs)
            tokens = ids.shape[-1] if ids is not None and ids.dim() else 1
            name = phase(kwargs, tokens)
            call = CallContext(phase=name, replayable=name == "decode" and step is None and _static_cache(kwargs))
            if step is None and _static_cache(kwargs):
                _mark_static_addresses(kwargs)
            packed = step is not None or (symbolic is not None and symbolic(kwargs, tokens))
            fn = self._compiled_packed if packed else self._compiled
            shapes = contextlib.nullcontext()
            captured = _inputs.capturing()
            if step is not None:  # a serving step: compiled once compiling pays (metainfer.runtime.serve_compile)
                if captured and self._serving_fn is not None:
                    fn = self._serving_fn  # the engine captures the path its warm-up call just ran
                else:
                    fn = self._compiled_packed if step.use_compiled(self.serving_compile, tokens) else self._forward
                self._serving_fn = fn
                shapes = _serving_shapes()
            graphs = len(self.report.sections)
            # a captured call is not timed (its replays never reach here)
            timing = times.start() if (observe is not None or step is not None) and not captured else None
            with (self._backend.calling(call), torch.no_grad(), capture.capturable(self.model) as notes,
                  step(kwargs) if step is not None else contextlib.nullcontext(), shapes):
                try:
                    out = fn(*args, **kwargs)
                except torch._dynamo.exc.TorchDynamoException as e:
                    if step is None or fn is self._forward:
                        raise capture.translate(e, self.model, args, kwargs, self.target.name) from e
                    # a serving step whose graph cannot be captured: the engine keeps serving, eagerly
                    self.serving_compile.failed(capture.translate(e, self.model, args, kwargs, self.target.name))
                    fn = self._forward
                    out = fn(*args, **kwargs)
            if timing is not None:
                new = self.report.sections[graphs:]
                compiled, ran_compiled = bool(new), fn is not self._forward

                def heard(seconds, name=name, tokens=tokens, new=new, compiled=compiled, ran_compiled=ran_compiled):
                    if observe is not None:
                        observe(name, tokens, seconds, compiled)
                    if step is not None:
                        self.serving_compile.ran(seconds, tokens, ran_compiled, compiled,
                                                warm=any(s.from_cache for s in new))
                # a call that compiled is timed on the host (compiling dwarfs its launches)
                times.stop(timing, heard, host=compiled)
            finish()
            for note in notes:
                if note not in self.report.notes:
                    self.report.notes.append(note)
            self._dump_new_sections()
            return out

        times = CallTimes(self.target.device.kind == "cuda")
        # one call at a time per model: the installed forward is visible to every caller
        with _model_lock(self.model), contextlib.closing(times):
            d = self.model.__dict__
            previous = d.get("forward", _MISSING)
            d["forward"] = forward
            try:
                yield
            finally:
                if previous is _MISSING:
                    d.pop("forward", None)
                else:
                    d["forward"] = previous

    def optimize_like(self, model: torch.nn.Module) -> "OptimizedModel":
        """`model` optimized the way this one was (target, passes, lowering, pass options):
        how a drafter for speculative decoding is built."""
        if self._remake is None:
            raise RuntimeError("this OptimizedModel was built without a factory for other models "
                               "(metainfer.optimize passes one)")
        return self._remake(model, **self.how_optimized())

    def how_optimized(self) -> dict:
        """The optimize() settings this model was built with, beside the target."""
        b = self._backend
        return dict(passes=[p.name for p in b.passes] if b.explicit else None, disable=tuple(sorted(b.disabled)),
                    lowering=b.lowering, pass_options=b.options or None)

    def _refuse_training(self) -> None:
        """The graphs were compiled for inference; a module switched to training mode since
        would need dropout (and batch statistics) they do not compute."""
        for m in self._modules:
            if m.training:
                name = next((n for n, x in self.model.named_modules() if x is m), "") or type(self.model).__name__
                raise ValueError(f"the model is in training mode ({name} and perhaps others were switched with "
                                 ".train() after metainfer.optimize); its compiled graphs are for inference: call "
                                 "model.eval() to use them, or call the model itself to train")

    def _dump_new_sections(self) -> None:
        if self._dump_dir and len(self.report.sections) != self._dumped_sections:
            self.report.save(self._dump_dir)
            self._dumped_sections = len(self.report.sections)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("model",):
            raise AttributeError(name)
        return getattr(self.model, name)

    def __repr__(self) -> str:
        return f"<metainfer.OptimizedModel of {type(self.model).__name__} for {self.target.name}>"


def _check_generation_length(model, ids: torch.Tensor, kwargs: dict) -> None:
    """A Hugging Face generate() that would run past the model's positions is refused before it
    starts (not at the step that gets there)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(limit, int) or ids.dim() == 0:
        return
    config = kwargs.get("generation_config") or model.generation_config
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    end = ids.shape[-1] + new if new is not None else kwargs.get("max_length", getattr(config, "max_length", None))
    if isinstance(end, int) and end > limit:
        raise ValueError(f"generating to position {end} ({ids.shape[-1]} prompt tokens"
                         f"{f' + {new} new' if new is not None else ''}) passes the model's max_position_embeddings "
                         f"({limit}); lower max_new_tokens to {max(0, limit - ids.shape[-1])} or less")


def _serving_shapes():
    """Dynamo's shape settings for a serving step (thread-local in torch 2.13, so set around each
    call on the engine's thread): equal sizes not assumed equal (a chunk of 512 tokens over a
    512-row index would otherwise compile a graph of its own). With no step reading an empty
    index (metainfer.runtime.serving), the steps of several tokens take one graph, and steps of one
    token another (Dynamo specialises sizes of 1; size-oblivious sizes break models' views)."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(use_duck_shape=False)


_MISSING = object()
_LOCKS: "weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _model_lock(model: torch.nn.Module) -> threading.RLock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


