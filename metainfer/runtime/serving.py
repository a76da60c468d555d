"""Serving many requests: transformers' continuous batching engine running metainfer's graphs.

    opt = metainfer.optimize(model, "cpu")
    outputs = opt.generate_batch(inputs=[[1, 2, 3], [4, 5]], max_new_tokens=32)
    manager = opt.init_continuous_batching(); manager.start(); manager.add_request([1, 2, 3]); ...

The engine (scheduler, paged KV pool, prefix blocks, chunked prefill) is transformers'. metainfer
is its compiler and kernels:

- every forward the engine runs goes through metainfer: eagerly (the model's forward with the
  attention and cache update below) until compiling pays (metainfer.runtime.serve_compile), then the
  OptimizedModel's compiled graphs (one for steps of several tokens, one for steps of one),
  labelled in the report by the step they first served (prefill, decode or mixed);
- attention is metainfer's paged kernel (metainfer::paged_attention), reached through the
  engine's documented extension point, its attention-function registry: each request's keys
  and values are read in place from the pool, causal per request, and no dense
  [tokens x keys] mask is built (the engine builds one only for its eager and SDPA paths);
- the engine's per-layer cache update is compiler-disabled (a graph break in every layer);
  while metainfer serves, each engine cache's `update` only hands the layer's read and write
  indices to the attention op, which writes the new keys and values into the pool itself, so
  a step is one graph. The pool is reached through kernels/kv_pool.py, not as a graph input;
- the KV pool is sized by metainfer where the engine's config leaves it open: the smallest of
  the target's memory, the machine's available memory and the workload's need (choose_capacity);
- a request that cannot be served (empty, not token ids, ids outside the vocabulary, longer
  than the model's positions, or more tokens than the pool can ever hold) fails alone, with
  the reason in its output's `error`; the others are served.

Sliding-window layers (Mistral, Gemma 2/3) and soft-capped scores (Gemma 2) run in the paged
kernel too; layers of other kinds (chunked, linear attention) run the engine's own attention
(the report says so).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from typing import Any

import torch

from metainfer.models import transformers_adapter as hf
from metainfer.runtime import exchange as step_exchange
from metainfer.runtime import inputs
from metainfer.runtime.capacity import ENGINE_MAX_BATCH_TOKENS, Capacity, choose_capacity

ATTENTION_NAME = "metainfer_paged_flash"  # the engine admits custom attention names containing "flash"
_STEP_KEY = "metainfer_kv"  # what the cache update hands the attention: (layer, read, write, sentinel)
_STEP_ATTR = "_metainfer_step"  # on the engine's cache while a step runs: the step's keyword arguments


# ---- the engine's extension points ---------------------------------------------------------

def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: query (1, Hq, T, D) of the packed step, key/value
    (1, Hkv, T, D) its new keys and values; returns (1, T, Hq, Dv)."""
    step = kwargs.get(_STEP_KEY)
    if step is None and isinstance(kwargs.get("read_index"), (list, tuple)):
        # the model called the cache's update without its keyword arguments (GPT-NeoX): this layer's
        # indices from the step's, which the attention still receives
        if len(kwargs["read_index"]) != 1:
            raise RuntimeError(f"{type(module).__name__} updates the cache without the step's arguments and the "
                               "model has several kinds of attention layers: which indices are this layer's is unknown")
        layer_type = next(iter(kwargs["cu_seq_lens_k"]))
        if layer_type != "full_attention":
            raise RuntimeError(f"{type(module).__name__} updates the cache without the step's arguments and its "
                               f"layers are {layer_type}: the ring buffer's sentinel is unknown here")
        kwargs = dict(kwargs, **_layer_indices(kwargs, 0, layer_type))
        step = (module.layer_idx, kwargs["read_index"], kwargs["write_index"], -1)
    if step is None:
        raise RuntimeError(f"attention {ATTENTION_NAME!r} runs only inside metainfer's serving steps "
                           "(OptimizedModel.generate_batch or init_continuous_batching)")
    if kwargs.get("s_aux") is not None:
        raise RuntimeError(f"{type(module).__name__} has attention sinks (s_aux), which metainfer's paged attention "
                           "does not compute")
    layer, read_index, write_index, sentinel = step
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # a sliding-window layer (Mistral, Gemma 2/3) passes its window, Gemma 2 its logit soft-cap
    window, softcap = kwargs.get("sliding_window") or 0, kwargs.get("softcap") or 0.0
    out = torch.ops.metainfer.paged_attention(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), write_index, read_index,
        kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs["max_length_q"], kwargs["max_length_k"], layer,
        scale, int(window), float(softcap), sentinel)
    return out.unsqueeze(0), None


def _layer_indices(step: dict, group: int, layer_type: str) -> dict:
    """One layer's share of a packed step's arguments: its group's read and write indices and key
    lengths, and the step's query lengths."""
    return {"read_index": step["read_index"][group], "write_index": step["write_index"][group],
            "cu_seq_lens_k": step["cu_seq_lens_k"][layer_type], "max_length_k": step["max_length_k"][layer_type],
            "cu_seq_lens_q": step["cu_seq_lens_q"], "max_length_q": step["max_length_q"]}


def _update(self, key_states, value_states, layer_idx, kwargs=None):
    """PagedAttentionCache.update while metainfer serves, traceable (no graph break): this
    layer's indices selected as the engine's update selects them, and handed to the attention
    in `kwargs`; keys and values are left to the attention op, which writes them into the pool;
    an MLA layer's latents are written and read back by metainfer::paged_latents (the model
    decompresses them into keys after). A model whose layers do not pass the step's arguments
    down (StableLM) gets them from the step (_STEP_ATTR); one that calls update without
    `kwargs` (GPT-NeoX) leaves the choice to the attention function."""
    if kwargs is None:
        return key_states, value_states
    step = kwargs if "read_index" in kwargs else getattr(self, _STEP_ATTR)
    allocator = self.layer_to_allocator[layer_idx]
    layer = _layer_indices(step, allocator.index, allocator.layer_type)
    read, write = layer.pop("read_index"), layer.pop("write_index")
    kwargs.update(layer)
    if hf.is_latent_allocator(allocator):  # (1, 1, T, R) and (1, 1, T, P) latents
        latent, rotated = torch.ops.metainfer.paged_latents(key_states[0, 0], value_states[0, 0], write, read,
                                                             layer_idx)
        kwargs[_STEP_KEY] = (layer_idx, None, None, -1)
        return latent[None, None], rotated[None, None]
    kwargs[_STEP_KEY] = (layer_idx, read, write, _sentinel(allocator))
    return key_states, value_states


def _sentinel(allocator) -> int:
    """The read index's marker for a new token in a ring-buffer (sliding-window) layer group, -1
    for a group whose rows are read after they are written."""
    return allocator.sentinel_index if allocator.layer_type == "sliding_attention" else -1


def paged_attention_unsupported(model) -> str | None:
    """Why metainfer's paged attention cannot serve this model (None if it can)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    other = set(getattr(cfg, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if other:
        return f"it has {', '.join(sorted(other))} layers (the paged kernel has full and sliding-window attention)"
    return None


class _Step:
    """Per engine forward: the cache's update made traceable, the pool active for the op; counts
    the steps and the query tokens they computed. `total`: the query tokens the engine is known
    to compute in all (a batch's), which tells the compile policy what work is left."""

    def __init__(self, paged: bool, total: int | None = None):
        self.paged = paged
        self.total = total
        self.steps = 0
        self.tokens = 0

    def use_compiled(self, policy, tokens: int) -> bool:
        """Whether this step, of `tokens` query tokens, runs a compiled graph (metainfer.runtime.serve_compile
        decides)."""
        return policy.use_compiled(tokens, max(0, self.total - self.tokens) if self.total is not None else 0)

    def __call__(self, kwargs):
        ids = kwargs.get("input_ids")
        self.steps += 1
        self.tokens += ids.shape[-1] if ids is not None else 0
        cache = kwargs.get("cache")
        if not self.paged or cache is None:
            return contextlib.nullcontext()
        # nothing cached yet: the engine reads no key (the new ones are used as they are); ours
        # read them back from the rows just written (the same values; in a ring buffer, the new
        # tokens' marker), so no step has an empty index
        if any(r.numel() == 0 for r in kwargs.get("read_index", ())):
            sentinels = {a.index: _sentinel(a) for a in cache.cache_allocators.values()}
            kwargs["read_index"] = [
                r if r.numel() else w.clone() if sentinels[g] < 0 else torch.full_like(w, sentinels[g])
                for g, (r, w) in enumerate(zip(kwargs["read_index"], kwargs["write_index"]))]
        hf.replace_method(cache, "update", _update)  # this cache instance only
        setattr(cache, _STEP_ATTR, kwargs)

        def views(layer: int):
            return hf.token_views(cache.layer_to_allocator[layer], layer)

        from metainfer.kernels import kv_pool

        return kv_pool.active(views)


def step_label(kwargs) -> str:
    """prefill, decode or mixed: what the requests of a packed step are doing (read only when
    the step compiles a graph: it reads the batch's lengths on the host)."""
    cu_q = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_q is None:
        return "forward"
    q = cu_q.diff().tolist()
    k = next(iter(cu_k.values())).diff().tolist() if isinstance(cu_k, dict) else cu_k.diff().tolist()
    decode = [lq == 1 and lk > 1 for lq, lk in zip(q, k)]
    return "decode" if all(decode) else "prefill" if not any(decode) else "mixed"


# ---- requests ------------------------------------------------------------------------------

def request_problem(opt, tokens, max_new_tokens: int, pool_tokens: int | None, page_size: int) -> str | None:
    """Why one request cannot be served (None if it can)."""
    vocab = inputs.vocab_size(opt.model)
    err = inputs.request_error(tokens, vocab)
    if err is not None:
        return err
    limit = getattr(opt.model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and len(tokens) > limit:
        return f"prompt of {len(tokens)} tokens is longer than the model's {limit} positions"
    if isinstance(limit, int) and len(tokens) + max_new_tokens > limit:
        return (f"prompt of {len(tokens)} tokens + {max_new_tokens} new reaches position {len(tokens) + max_new_tokens}, "
                f"past the model's {limit} positions")
    if pool_tokens is not None:
        need = math.ceil((len(tokens) + max_new_tokens) / page_size) * page_size
        if need > pool_tokens:
            return (f"prompt of {len(tokens)} tokens + {max_new_tokens} new needs {need} tokens of KV pool "
                    f"({need // page_size} blocks of {page_size}); the pool holds {pool_tokens}")
    return None


def _failed(request_id: str, tokens, why: str):
    return hf.GenerationOutput(request_id=request_id,
                               prompt_ids=list(tokens) if isinstance(tokens, (list, tuple)) else [],
                               error=why, status=hf.RequestStatus.FAILED)


# ---- entry points --------------------------------------------------------------------------

def _engine_config(opt, cb_config, request_tokens: list[int] | None):
    """The engine's config with metainfer's capacity where the user left it open, and that
    capacity: a pool size the user gave is the one planned with, admitted against and reported
    (refused if the machine cannot hold it); max_batch_tokens is the engine's default unless given."""
    from transformers import ContinuousBatchingConfig

    cfg = ContinuousBatchingConfig() if cb_config is None else cb_config
    if any(cfg.cuda_graph_booleans):
        raise ValueError(f"continuous_batching_config.use_cuda_graph={cfg.use_cuda_graph!r}: the engine's CUDA graphs "
                         "replay its padded steps without metainfer (no pass, no paged kernel's decode split); "
                         "metainfer runs every step itself, leave use_cuda_graph unset or False")
    # metainfer owns the steps: the engine's CUDA graphs off by construction (its heuristic turns
    # them on for attention whose name says "flash", as metainfer's must to be admitted)
    cfg = dataclasses.replace(cfg, use_cuda_graph=(False, False))
    page = cfg.page_size
    batch_tokens = cfg.max_batch_tokens or ENGINE_MAX_BATCH_TOKENS
    given = "given" if cfg.max_batch_tokens else "the engine's default"
    cap, error = None, None
    try:
        if cfg.num_blocks is not None:
            fits = choose_capacity(opt, None, page, batch_tokens)
            if cfg.num_blocks > fits.num_blocks:
                raise ValueError(f"a KV pool of {cfg.num_blocks} blocks x {page} tokens does not fit: {fits.memory} "
                                 f"allows {fits.num_blocks}")
            cap = Capacity(cfg.num_blocks, page, batch_tokens,
                           f"KV pool {cfg.num_blocks} blocks x {page} tokens, as given; max_batch_tokens {batch_tokens} "
                           f"({given})")
        else:
            cap = choose_capacity(opt, request_tokens, page, batch_tokens)
            cap.why += f" ({given})"
    except ValueError as e:
        error = str(e)
    cap = _agreed(opt, cap, error)
    return dataclasses.replace(cfg, num_blocks=cap.num_blocks, max_batch_tokens=batch_tokens), cap


def _agreed(opt, cap: Capacity | None, error: str | None) -> Capacity:
    """In a tensor-parallel job every rank's engine runs the same pool: the smallest any rank can
    hold (the engine would take the minimum too, after metainfer admitted requests against its
    own), and a pool one rank cannot hold is refused on every rank, naming it. Agreed through
    the job's store (metainfer.passes.ranks.exchange), before the engine exists."""
    import torch.distributed as dist

    from metainfer.parallel import distributed
    from metainfer.passes import ranks

    mesh = distributed.tp_mesh(opt.model)
    if mesh is None:
        if error is not None:
            raise ValueError(error)
        return cap
    group = mesh.get_group()
    verdicts = ranks.exchange((None if cap is None else cap.num_blocks, error), group.group_name)
    members = dist.get_process_group_ranks(group)
    for rank, (_, why) in zip(members, verdicts):
        if why is not None:
            raise ValueError(f"rank {rank}: {why}")
    smallest = min(blocks for blocks, _ in verdicts)
    if smallest < cap.num_blocks:
        cap = dataclasses.replace(cap, num_blocks=smallest,
                                  why=f"{cap.why}; {smallest} blocks on every rank, the smallest of the ranks' pools")
    return cap


@contextlib.contextmanager
def attention(opt):
    """metainfer's paged attention as the model's attention, where it can serve the model: set
    before the engine starts (which then keeps it), the model's own restored after. Yields
    whether it is in use."""
    import torch.distributed as dist

    from metainfer.parallel import distributed

    model = opt.model
    why_not = paged_attention_unsupported(model)
    original = hf.attention_implementation(model.config)
    if why_not is None:
        hf.register_attention(ATTENTION_NAME, paged_attention_forward)
        hf.set_attention_implementation(model.config, ATTENTION_NAME)
    # sharded by metainfer inside a job: the engine runs its tensor-parallel mode over the same
    # mesh (rank 0 of each group schedules, the others follow its broadcasts)
    mesh, own_mesh = distributed.tp_mesh(model), getattr(model, "_device_mesh", None)
    if mesh is not None and own_mesh is None:
        model._device_mesh = mesh
    note = (f"serving: attention is metainfer.paged_attention over the engine's KV pool (was {original!r})"
            if why_not is None else
            f"serving: the engine's own {original!r} attention (with its dense mask and a graph break per layer), "
            f"since {why_not}")
    if mesh is not None and own_mesh is None:
        ranks = dist.get_process_group_ranks(mesh.get_group())
        note += (f"; the engine schedules in tensor-parallel mode over ranks {ranks} (rank {ranks[0]} schedules, the "
                 "others follow its broadcasts)")
    if note not in opt.report.notes:
        opt.report.notes.append(note)
    try:
        yield why_not is None
    finally:
        hf.set_attention_implementation(model.config, original)
        if mesh is not None and own_mesh is None:
            model._device_mesh = None


@contextlib.contextmanager
def forwards(opt, paged: bool, total: int | None = None):
    """While the engine runs: its forwards through metainfer (the compiled graph once compiling
    pays). Yields the step counter."""
    step = _Step(paged, total)
    from metainfer.parallel import distributed

    if distributed.tp_mesh(opt.model) is not None:
        opt.serving_compile.in_a_job()
    with opt.installed(lambda kw, n: (lambda: step_label(kw)), step=step):
        yield step


@contextlib.contextmanager
def _engine(opt, generation_config, cfg, hints, warmup: bool, exchange: str):
    """transformers' continuous_batching_context_manager, with the engine prepared for this
    rank's shard and its per-step exchange installed before the batch processor is made."""
    manager = opt.model.init_continuous_batching(generation_config=generation_config, continuous_batching_config=cfg,
                                                 workload_hints=hints)
    _engine_kv_heads(opt, manager.distributed_helper)
    installed = step_exchange.install(manager, exchange)
    if installed is not None:
        _note(opt, _exchange_note(installed))
    try:
        if warmup and not manager.warmed_up:
            manager.warmup()
        manager.start()
        try:
            yield manager
        finally:
            manager.stop(block=True, timeout=60)
    finally:
        manager.destroy()
        if installed is not None:
            installed.close()


def generate_batch(opt, prompts, generation_config=None, continuous_batching_config=None, record_timestamps=False,
                   progress_bar=False, warmup=True, exchange: str = "auto", **kwargs) -> dict:
    """OptimizedModel.generate_batch: results in input order, keyed by request id; a request
    that cannot be served is FAILED with the reason and the others are served."""
    from tqdm.auto import tqdm

    if not prompts:
        return {}
    model = opt.model
    gen = model.generation_config if generation_config is None else generation_config
    max_new = kwargs.pop("max_new_tokens", None)
    max_new = gen.max_new_tokens if max_new is None else max_new
    if max_new is None:
        max_new = 20  # transformers' GenerationConfig default max_length budget
    if kwargs:
        raise TypeError(f"generate_batch got unexpected arguments {sorted(kwargs)}")
    valid = [p for p in prompts if inputs.request_error(p, None) is None]
    cfg, cap = _engine_config(opt, continuous_batching_config, [len(p) + max_new for p in valid] or None)
    _note(opt, f"serving capacity: {cap.why}")
    problems = [request_problem(opt, p, max_new, cap.tokens, cap.page_size) for p in prompts]
    good = [i for i, why in enumerate(problems) if why is None]
    results: dict[int, list] = {}
    if good:
        hints = hf.WorkloadHints(max_prompt_length=max(len(prompts[i]) for i in good), max_generated_length=max_new,
                              num_requests=len(good))
        # query tokens the batch computes: every prompt, and every new token but the last fed back
        total = sum(len(prompts[i]) for i in good) + len(good) * max(0, max_new - 1)
        with attention(opt) as paged, forwards(opt, paged, total) as steps, _engine(
                opt, generation_config, cfg, hints, warmup, exchange) as manager:
            ids = manager.add_requests(inputs=[prompts[i] for i in good], max_new_tokens=max_new,
                                       record_timestamps=record_timestamps)
            owner = {rid: i for rid, i in zip(ids, good)}
            pending = {one for rid in ids for one in hf.child_request_ids(rid, manager.num_return_sequences)}
            bar = tqdm(total=len(pending), desc=f"Solving {len(pending)} requests", unit="request",
                       disable=not progress_bar)
            while pending:
                out = manager.get_result(timeout=1)
                if out is None:
                    if not manager.is_running():
                        break
                    continue
                if out.is_finished() and out.request_id in pending:
                    pending.discard(out.request_id)
                    bar.update(1)
                    results.setdefault(owner[out.request_id.split("__child#")[0]], []).append(out)
            bar.close()
            for rid in pending:  # the engine stopped before finishing them
                results.setdefault(owner[rid.split("__child#")[0]], []).append(
                    _failed(rid, prompts[owner[rid.split("__child#")[0]]], "the engine stopped before finishing it"))
        prompt_tokens = sum(len(prompts[i]) for i in good)
        fed_back = sum(max(0, len(o.generated_tokens) - 1) for outs in results.values() for o in outs)
        reused = prompt_tokens + fed_back - steps.tokens  # prompt tokens the engine did not compute
        opt.report.notes.append(f"serving run: {len(good)} requests, {steps.steps} steps, {steps.tokens} query tokens "
                                f"computed; {max(0, reused)} of {prompt_tokens} prompt tokens "
                                f"({max(0, reused) / max(1, prompt_tokens):.0%}) reused from cached prefix blocks")
        opt.report.notes.append(opt.serving_compile.note())
    ordered = {}
    for i, p in enumerate(prompts):
        if problems[i] is not None:
            ordered[f"rejected_{i}"] = _failed(f"rejected_{i}", p, problems[i])
            continue
        for out in sorted(results.get(i, []), key=lambda o: ("__child#" not in o.request_id, o.request_id)):
            ordered[out.request_id] = out
    return ordered


class Manager:
    """The engine's ContinuousBatchingManager with its forwards through metainfer between start()
    and stop() (call both from the same thread). Every request is checked on admission
    (add_request, add_requests: ValueError before anything is queued); a cancelled request ends
    with a result whose error is "cancelled" (its blocks freed by the engine); the report gets
    the capacity, compile and run notes generate_batch writes."""

    def __init__(self, opt, generation_config=None, continuous_batching_config=None, workload_hints=None,
                 exchange: str = "auto", speculation=None):
        self._opt = opt
        hints = workload_hints
        tokens = ([hints.max_prompt_length + hints.max_generated_length] * hints.num_requests
                  if hints and hints.num_requests else None)
        cfg, self.capacity = _engine_config(opt, continuous_batching_config, tokens)
        _note(opt, f"serving capacity: {self.capacity.why}")
        # what the manager holds from here to stop(): metainfer's attention, entered before the
        # engine starts (it keeps the attention it finds); start() adds the forwards on `_running`
        self._held, self._running = contextlib.ExitStack(), contextlib.ExitStack()
        self._paged = self._held.enter_context(attention(opt))
        self.admitted_tokens = 0  # prompt tokens admitted so far (the server's prefix-hit gauge reads it)
        try:
            self._manager = opt.model.init_continuous_batching(generation_config=generation_config,
                                                              continuous_batching_config=cfg, workload_hints=hints)
            _engine_kv_heads(opt, self._manager.distributed_helper)
            self.exchange = step_exchange.install(self._manager, exchange)
        except BaseException:
            self._held.close()
            raise
        if self.exchange is not None:
            _note(opt, _exchange_note(self.exchange))
        self._sample_in_metainfer(cfg)
        self._deliver_cancellations()
        self.speculation = None
        if speculation is not None:
            if cfg.use_async_batching:
                raise ValueError("speculative decoding needs the engine's synchronous batching (use_async_batching "
                                 "prepares a step before the last one's drafts are verified)")
            self._speculate(*speculation)

    def start(self) -> None:
        self.steps = self._running.enter_context(forwards(self._opt, self._paged))
        try:
            self._manager.start()
        except BaseException:
            self._running.close()
            raise

    def stop(self, *args, **kwargs) -> None:
        """Stops the engine; the model's own attention is back afterwards."""
        try:
            self._manager.stop(*args, **kwargs)
        finally:
            steps = getattr(self, "steps", None)
            self._running.close()  # the forwards first, then the attention they ran on
            self._held.close()
            if self.exchange is not None and not self._manager.is_running():
                self.exchange.close()
            if self.speculation is not None:
                self.speculation.close()
            if steps is not None and steps.steps:
                _note(self._opt, f"serving run: {steps.steps} steps, {steps.tokens} query tokens computed for "
                                 f"{self.admitted_tokens} prompt tokens admitted (streaming)")
                _note(self._opt, self._opt.serving_compile.note())

    def _problem(self, input_ids, max_new_tokens) -> str | None:
        max_new = self._manager.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        return request_problem(self._opt, input_ids, max_new or 0, self.capacity.tokens, self.capacity.page_size)

    def add_request(self, input_ids, request_id=None, max_new_tokens=None, n: int = 1, **kwargs):
        """The engine's add_request, checked first; `n` > 1 asks for n sequences of one prompt (the
        engine's num_return_sequences: the prompt prefilled once, its cache forked before the last
        token), delivered under `request_ids(request_id, n)`."""
        why = self._problem(input_ids, max_new_tokens)
        if why is not None:
            raise ValueError(f"request refused: {why}")
        self.admitted_tokens += len(input_ids)
        manager = self._manager
        if n > 1 and request_id is None:
            raise ValueError("a request of several sequences needs its request_id (its sequences' ids derive from it)")
        if n > 1 and (len(input_ids) - 1) % self.capacity.page_size == 0:
            # the engine forks a request after prefilling all but its last prompt token; where none
            # is left to prefill before it (a one-token prompt, or all the others in cached prefix
            # pages) it schedules an empty step, which fails (transformers 5.25): n requests instead
            for one in self.request_ids(request_id, n):
                manager.add_request(input_ids, request_id=one, max_new_tokens=max_new_tokens, **kwargs)
            self.admitted_tokens += (n - 1) * len(input_ids)
            return request_id
        self.admitted_tokens += n - 1  # each child computes the held-back last prompt token itself
        with hf.children_per_request(manager, n):  # requests are added from one thread (the server's loop)
            return manager.add_request(input_ids, request_id=request_id, max_new_tokens=max_new_tokens, **kwargs)

    @staticmethod
    def request_ids(request_id: str, n: int) -> list[str]:
        """The ids the engine delivers a request of `n` sequences under (its children's naming)."""
        return hf.child_request_ids(request_id, n)

    @property
    def sampler(self):
        """metainfer's Sampler, which the engine samples with (None when the engine kept its own
        processors); it applies per-request penalties and records watched log-probabilities."""
        from metainfer.runtime import sampling

        processor = self._manager.logit_processor
        return processor if isinstance(processor, sampling.Sampler) else None

    def add_requests(self, inputs, max_new_tokens=None, **kwargs) -> list[str]:
        """The engine's add_requests, every request checked first: one that cannot be served is a
        ValueError naming it, and none of them is queued."""
        bad = [(i, why) for i, p in enumerate(inputs) if (why := self._problem(p, max_new_tokens)) is not None]
        if bad:
            raise ValueError("requests refused, none queued: " + "; ".join(f"input {i}: {why}" for i, why in bad))
        self.admitted_tokens += sum(len(p) for p in inputs)
        return self._manager.add_requests(inputs, max_new_tokens=max_new_tokens, **kwargs)

    def _sample_in_metainfer(self, cfg) -> None:
        """A sampling engine whose processors are only temperature, top-k and top-p samples with
        metainfer.runtime.sampling.Sampler (greedy rows an argmax, no vocabulary sort unless a
        row asks for top-p alone), the engine then taking the argmax of what it drew."""
        from metainfer.runtime import sampling  # transformers' processor classes: loaded when an engine is made

        manager = self._manager
        sampler = sampling.Sampler.replacing(manager.generation_config, manager.logit_processor)
        if sampler is None or cfg.return_logprobs:  # the engine's log-probabilities would read the drawn rows
            return
        manager.logit_processor = sampler
        sampler.steps_in_flight = 2 if cfg.use_async_batching else 1
        manager.generation_config = copy.copy(manager.generation_config)
        manager.generation_config.do_sample = False
        _note(self._opt, f"serving: sampling by metainfer's sampler, {sampler.defaults} unless a request sets its own "
                         "(greedy rows an argmax; the engine's processors sort the vocabulary twice per row)")

    def _deliver_cancellations(self) -> None:
        """The engine drops a cancelled request without a word (transformers 5.25: the scheduler frees
        its blocks and no result is delivered); its scheduler, made when the engine starts, is
        wrapped so each one dropped delivers a final result with error "cancelled" and the tokens
        generated so far."""
        manager = self._manager

        def install(processor):
            scheduler = processor.scheduler
            clear = scheduler.clear_cancelled_requests

            def clear_and_deliver():
                states = clear()
                for state in states:
                    state.status, state.error = hf.RequestStatus.FAILED, "cancelled"
                    manager.output_router.deliver(state.to_generation_output())
                return states

            scheduler.clear_cancelled_requests = clear_and_deliver

        hf.wrap_batch_processor(manager, install, "cancellations")

    def drop_unclaimed_outputs(self) -> None:
        """For a manager whose every result goes to a registered handler (the server's, on every
        rank): the engine puts an output no handler claims (one delivered after its request was
        cancelled and its handler removed; every output on a rank that only follows) on a queue
        that only get_result reads. Nothing reads it here, so those outputs are dropped."""
        hf.discard_unclaimed_outputs(self._manager)

    def _speculate(self, drafter, max_draft: int) -> None:
        """Greedy requests decode speculatively (metainfer.runtime.serve_speculation): each batch
        processor the engine makes gets the hooks."""
        from metainfer.parallel import distributed
        from metainfer.runtime import serve_speculation

        if distributed.tp_mesh(self._opt.model) is not None:
            raise ValueError("speculative decoding in a tensor-parallel job is not built: every rank would draft "
                             "and choose its draft length on its own, and their steps must be the same")
        self.speculation = serve_speculation.EngineSpeculation(self, self._opt.model, drafter, max_draft,
                                                               graphs=lambda: len(self._opt.report.sections))
        hf.wrap_batch_processor(self._manager, self.speculation.install, "speculation")
        _note(self._opt, f"serving: speculative decoding of greedy requests, {drafter.name}, at most {max_draft} "
                         "draft tokens a step (each step's length from measured acceptance and step times)")

    def kv_blocks(self) -> tuple[float, float, float]:
        """The KV pool's blocks (of every layer group) held by requests, kept after their request
        ended for prefix reuse (taken back when the pool needs them), and free; read while the
        engine thread runs, so a reading may be a step old."""
        cache = getattr(getattr(self._manager, "batch_processor", None), "cache", None)
        if cache is None:  # not started
            return 0.0, 0.0, float(self.capacity.num_blocks)
        total = cache.num_blocks
        pool = cache.num_sectors * cache.bytes_per_sector
        cached = sum(len(a.ledger.cached_blocks) * a.bytes_per_block for a in cache.cache_allocators.values())
        free = cache.compute_free_capacity(relative=False)
        return tuple(float(round(b / pool * total)) for b in (pool - free - cached, cached, free))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


def _exchange_note(exchange) -> str:
    how = ("a shared-memory segment of this host (metainfer.runtime.exchange)" if exchange.transport == "shm" else
           "the engine's gloo group")
    return f"serving: the engine's per-step exchange between ranks (statuses, new requests) goes through {how}"


def _engine_kv_heads(opt, helper) -> None:
    """Make the engine's KV pool hold the heads this rank computes. transformers' cache splits
    the config's K/V heads by the group's size where the plan it reads names k_proj and v_proj,
    else keeps them all; metainfer's sharding replicates whole heads where the degree exceeds
    them (each rank one head). The helper's copy of the plan is set to say which."""
    from metainfer.parallel import sharding

    if helper.tp_size <= 1:
        return
    mine = sharding.local_kv_heads(opt.model)
    if mine is None:
        return
    cfg = opt.model.config.get_text_config() if hasattr(opt.model.config, "get_text_config") else opt.model.config
    total = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    kv = {f"layers.*.self_attn.{n}": "colwise" for n in ("k_proj", "v_proj")}
    others = {k: v for k, v in helper.tp_plan.items() if not k.endswith(tuple(kv))}
    if mine == total:
        helper.tp_plan = others
    elif mine * helper.tp_size == total:
        helper.tp_plan = {**others, **kv}
    else:
        raise ValueError(f"this rank holds {mine} of {total} key-value heads over {helper.tp_size} ranks; the "
                         "engine's KV pool holds either every head or an even share of them per rank (a degree "
                         f"that divides {total}, or a model with one key-value head)")


def _note(opt, note: str) -> None:
    if note not in opt.report.notes:
        opt.report.notes.append(note)
