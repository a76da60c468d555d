"""How much KV pool and batch the serving engine gets: the smallest of the target's memory,
the machine's memory as it is now, and what a known workload can ever hold (choose_capacity),
with the report's words for which bound decided. Used by runtime/serving.py, which hands the
result to transformers' continuous batching."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

@dataclass
class Capacity:
    """The engine's pool and batch sizes as metainfer chose them, and why."""

    num_blocks: int
    page_size: int
    max_batch_tokens: int
    why: str
    memory: str = ""  # the memory bound that applied, in words (choose_capacity)

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.page_size


ENGINE_MAX_BATCH_TOKENS = 8192  # transformers' continuous batching default (PagedAttentionMemoryHandler)

# Of the memory the OS reports available on a host, the share the KV pool may take: the host is
# shared with the OS, its page cache and other processes, and the engine zero-fills the pool up
# front (vLLM's CPU backend takes a fixed 4 GiB unless told otherwise). A GPU's free memory is
# the engine's alone: the planner's 90% applies there, as vLLM's gpu_memory_utilization does.
HOST_MEMORY_SHARE = 0.5


def available_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, where the figure came from) the machine has free for a new allocation on
    `device` now: free device memory on a GPU, the OS's MemAvailable on a host."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory on {device}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages (sysconf)"


def choose_capacity(opt, request_tokens: list[int] | None, page_size: int = 256,
                    max_batch_tokens: int = ENGINE_MAX_BATCH_TOKENS,
                    available: tuple[int, str] | None = None) -> Capacity:
    """KV pool: the smallest of three bounds, the report saying which decided:
    - the target's memory after the weights and one step's activations;
    - the machine's memory as it is: what is available now (the weights, already loaded, are
      not in it) after one step's activations, a share of it on a host (HOST_MEMORY_SHARE);
    - when the workload is known (`request_tokens`: each request's prompt plus new tokens), what
      it can ever hold at once (every request whole).
    `available` (bytes, source) stands in for the machine's reading (tests)."""
    from metainfer.hardware import planner, shapes
    from metainfer.parallel import distributed

    model, target = opt.model, opt.target
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    shape = dataclasses.replace(shapes.from_hf(cfg), act_bytes=next(model.parameters()).element_size())
    weights = sum(_local(p).numel() * p.element_size() for p in model.parameters())  # this rank's shard
    mesh = distributed.tp_mesh(model)
    plan = planner.Plan(tp=mesh.size() if mesh is not None else 1, dp=1, pp=1, ep=1)
    kv_per_token = planner.kv_per_token(shape, plan)  # this rank's heads (the MLA latent whole)
    act_per_token = planner.activation_per_token(shape, plan)
    # logits rows of one step (float32): the engine plans for its 1024 requests a step when the
    # workload is not known
    rows = len(request_tokens) if request_tokens else 1024
    activations = max_batch_tokens * act_per_token + rows * (shape.hidden * shape.act_bytes + shape.vocab * 4)
    # each cached token also costs what a step reads back of it at the attention peak (one layer's
    # keys and values gathered; an MLA layer's latents decompressed to heads): the engine refuses a
    # pool whose footprint with these passes what it sees available
    read_per_token = _read_bytes_per_token(shape, plan.tp)
    block_bytes = (kv_per_token + read_per_token) * page_size
    device = next(model.parameters()).device
    free, source = available if available is not None else available_memory(device)
    share = HOST_MEMORY_SHARE if device.type == "cpu" else planner.MEMORY_UTILIZATION
    local = local_ranks() if device.type == "cpu" else 1
    if local > 1:  # the host's memory is every rank's on it
        share /= local
        source += f", shared by {local} ranks of this host"
    bounds = {
        "target": (target.device.memory_bytes * planner.MEMORY_UTILIZATION - weights - activations,
                   f"target {target.name}'s memory ({target.device.memory_bytes / 2**30:.0f} GiB x "
                   f"{planner.MEMORY_UTILIZATION:.0%}) after {weights / 2**20:.1f} MiB of weights and "
                   f"{activations / 2**20:.1f} MiB of activations at {max_batch_tokens} batch tokens"),
        "machine": (free * share - activations,
                    f"the machine's available memory ({free / 2**30:.1f} GiB, {source}; {share:.0%} of it) after "
                    f"{activations / 2**20:.1f} MiB of activations at {max_batch_tokens} batch tokens"),
    }
    bound, (budget, memory) = min(bounds.items(), key=lambda kv: kv[1][0])
    if budget < block_bytes:
        raise ValueError(f"no room for a KV pool of even one block ({block_bytes / 2**20:.1f} MiB): {memory} leaves "
                         f"{max(budget, 0) / 2**20:.1f} MiB; lower max_batch_tokens or free memory")
    by_memory = int(budget // block_bytes)
    other = next(v for k, v in bounds.items() if k != bound)
    allows = f"the {'machine' if bound == 'target' else 'target'} would allow {int(max(other[0], 0) // block_bytes)}"
    if request_tokens:
        need = blocks_to_hold(request_tokens, page_size)
        num_blocks = max(1, min(by_memory, need))
        reason = (f"what the {len(request_tokens)} requests can hold at once ({memory} would allow {by_memory})"
                  if num_blocks == need else f"{memory} ({allows}); the workload could use {need}")
    else:
        num_blocks, reason = by_memory, f"{memory} ({allows})"
    why = (f"KV pool {num_blocks} blocks x {page_size} tokens ({num_blocks * page_size * kv_per_token / 2**20:.1f} MiB, "
           f"{kv_per_token:.0f} B per token, {read_per_token:.0f} B more per token read back in a step): {reason}; "
           f"max_batch_tokens {max_batch_tokens}")
    return Capacity(num_blocks, page_size, max_batch_tokens, why, memory)


def blocks_to_hold(request_tokens: list[int], page_size: int) -> int:
    """KV blocks that hold every request (prompt + new tokens each) whole at once, plus a spare."""
    return sum(math.ceil(n / page_size) for n in request_tokens) + 1


def _read_bytes_per_token(shape, tp: int = 1) -> float:
    """Bytes a step reads back for each cached token at the attention peak, as transformers'
    engine counts it for flash-style attention (cache.py, PagedAttentionMemoryHandler.
    kv_numel_at_peak): one layer's keys and values, or an MLA layer's two latents and the keys and
    values they decompress into (values padded to the key head dim where they differ); on a rank
    of a tensor-parallel group of `tp`, its heads."""
    if not shape.mla:
        return shape.kv_bytes_per_token() / shape.layers / min(tp, shape.kv_heads)
    qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    expanded = shape.qk_nope_head_dim + shape.v_head_dim + qk + (qk if shape.v_head_dim != qk else 0)
    return (shape.kv_lora_rank + shape.qk_rope_head_dim + shape.heads / tp * expanded) * shape.act_bytes


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_ranks() -> int:
    """Ranks of this job on this host (torchrun's LOCAL_WORLD_SIZE; without it, every rank of a
    started job counts as local, as gloo ranks on one machine are)."""
    import os

    import torch.distributed as dist

    if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
