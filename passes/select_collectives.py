"""select_collectives: each all-reduce rewritten to the algorithm the cost model picks for its
size on the target.

    wait(all_reduce(x, "sum", world))
      -> ring:          unchanged (the library's default)
      -> hierarchical:  wait(all_gather(wait(all_reduce(wait(reduce_scatter(flat(x), island)),
                                                          across)), island))
      -> one_shot / two_shot: metainfer::symm_mem_all_reduce (kernels/symm_mem.py), torch's
                        P2P kernels on CUDA symmetric memory; only where CUDA, P2P and
                        symmetric memory exist, never on CPU. Through the collective library a
                        reduce-scatter + all-gather is two rings, i.e. the ring's own time, so
                        that is never offered as "two-shot".

`flat(x)` is x flattened and zero-padded to a multiple of the group size; the result is cut
back and reshaped. Hierarchical runs on the island sub-groups `metainfer.passes.ranks`
creates for the target (reduce-scatter inside each island, all-reduce of the shard across
islands between the ranks at the same position, all-gather inside the island): only the
shard crosses the slow boundary. Every rank rewrites its graph identically (the decision
depends on sizes and the target only), so collective order stays the same on every rank.

Shared memory (kernels/shm_collectives.py), for CPU ranks of one host where the target declares
the path ([collectives.shm], as `metainfer calibrate` fits it), is a candidate for every
all-reduce, all-gather and reduce-scatter:

    wait(all_reduce(x, "sum", g))            -> metainfer::shm_all_reduce(x, g)
    wait(all_gather_into_tensor(x, n, g))    -> metainfer::shm_all_gather(x, n, g)
    wait(reduce_scatter_tensor(x, "sum", n, g)) -> metainfer::shm_reduce_scatter(x, n, g)

taken where the cost model predicts it faster than the library; its segment is mapped on
every rank of the group when the pass first picks it (`shm_collectives.reserve`, collective:
every rank compiles the same graph), and where any rank cannot, every rank declines the same
way with the reason.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from metainfer.hardware import cost

from . import ranks
from .base import Pass, PassContext, PassResult, register
from .options import Option
from .matching import Node, insert_call, location, shape, tensor_val

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
prims = torch.ops.prims

_LABEL = {"ring": "flat ring", "two_shot": "two-shot", "hierarchical": "hierarchical", "one_shot": "one-shot",
          "shm": "shared memory"}
KINDS = {c10d.all_reduce.default: "all_reduce", c10d.all_gather_into_tensor.default: "all_gather",
         c10d.reduce_scatter_tensor.default: "reduce_scatter"}
# optional low-precision transport (pass option / target [passes] "all_reduce_dtype"): off by
# default, because summing in bf16 rounds; see docs/passes.md for the error bound. bf16 only:
# it keeps float32's range, where fp16 would overflow past 65504 on outlier activations
TRANSPORT = {"bf16": torch.bfloat16}


def transport_dtype(ctx: PassContext) -> torch.dtype | None:
    name = ctx.options["all_reduce_dtype"]
    return None if name is None else TRANSPORT[name]


def _group(name: str):
    try:
        return dist.distributed_c10d._resolve_process_group(name)
    except Exception:
        return None


_AGREED: dict[str, bool] = ranks.job_cache()


def _symmetric_memory_available(target) -> bool:
    """One-shot / two-shot need P2P kernels: CUDA symmetric memory, on a target with P2P, on
    every rank. The ranks agree (an exchange through the job's store, once per job) so that no
    rank picks them while another does not."""
    if target.device.kind != "cuda" or not target.topology.p2p:  # the same answer on every rank
        return False
    from metainfer.kernels import symm_mem

    world = dist.group.WORLD.group_name if dist.is_available() and dist.is_initialized() else ""
    if world not in _AGREED:
        local = symm_mem.available(target.device.kind)
        if world and dist.get_backend() != "fake":
            local = all(ranks.exchange(local, world))
        _AGREED[world] = local
    return _AGREED[world]


def _reserve_symmetric(group_name: str, dtype: torch.dtype, numel: int) -> str | None:
    """Allocate and exchange this all-reduce's symmetric buffer now, on every rank of the group;
    None if all did, else the first failure (every rank then declines the same way)."""
    from metainfer.kernels import symm_mem

    why = symm_mem.reserve(group_name, dtype, numel)
    verdicts = ranks.exchange(why, group_name) if dist.get_backend() != "fake" else [why]
    failed = [(r, w) for r, w in enumerate(verdicts) if w is not None]
    if not failed:
        return None
    r, w = failed[0]
    return f"its symmetric buffer ({numel} x {str(dtype).replace('torch.', '')}) failed on member {r} of the group: {w}"


def allowed_algorithms(target, members: tuple[int, ...]) -> set[str]:
    """The all-reduce algorithms this pass may pick for a group of ranks `members` on `target`:
    the ring always; hierarchical on the whole job's island groups; one-/two-shot where P2P
    kernels exist on every rank."""
    allowed = {"ring"}
    if (dist.is_available() and dist.is_initialized() and len(members) == dist.get_world_size()
            and ranks.island_groups(target) is not None):
        allowed.add("hierarchical")
    if _symmetric_memory_available(target):
        allowed |= {"one_shot", "two_shot"}
    if "all_reduce" in target.shm_links and target.device.kind == "cpu":
        allowed.add("shm")
    return allowed


_SHM_VERDICTS: dict[str, "str | None"] = ranks.job_cache()  # group -> None (attached) or why not


def _reserve_shm(group_name: str) -> str | None:
    """Map the group's shared-memory segment now, on every rank of it (the pass runs in step on
    every rank); None if all did, else why not (the same on every rank)."""
    if dist.get_backend() == "fake":  # one process standing for the job: nothing to map
        return None
    if group_name not in _SHM_VERDICTS:
        from metainfer.kernels import shm_collectives

        _SHM_VERDICTS[group_name] = shm_collectives.reserve(group_name,
                                                            exchange=lambda obj: ranks.exchange(obj, group_name))
    return _SHM_VERDICTS[group_name]


@register
class SelectCollectives(Pass):
    """all_reduce (all_gather, reduce_scatter) -> the algorithm or path the cost model picks for its size on the target"""

    name = "select_collectives"
    options = (Option("all_reduce_dtype", str, None, "send float32 all-reduces in this dtype (halves the bytes; "
                      "rounds the sum, docs/passes.md; unset: as computed)", choices=tuple(TRANSPORT)),)
    needs_collectives = True

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> PassResult:
        res = PassResult(modified=False)
        low = transport_dtype(ctx)
        for node in list(graph.nodes):
            kind = KINDS.get(node.target) if node.op == "call_function" else None
            if kind is None or (kind != "all_reduce" and not _shm_offered(kind, ctx.target)):
                continue
            site = _site(node, kind, ctx.target)
            if isinstance(site, str):
                res.near_misses.append(f"{location(node)}: {kind} kept: {site}")
                continue
            if site is None:
                continue
            val = tensor_val(node.args[0])
            narrow = (kind == "all_reduce" and low is not None and val.dtype.is_floating_point
                      and val.element_size() > low.itemsize)
            chosen, head = _choose(node, kind, site, ctx.target, low if narrow else None, res.near_misses)
            if chosen in ("one_shot", "two_shot"):  # its buffer, reserved in _choose; again on a cache hit
                dtype = (low if narrow else None) or val.dtype
                res.resources.append(("symm_mem", node.args[2], str(dtype).replace("torch.", ""), val.numel()))
            if chosen == "ring" and not narrow:
                res.decisions.append(head + " (kept)")
                continue
            _emit(graph, node, kind, chosen, low if narrow else None, ctx.target)
            res.decisions.append(head)
            res.matches += 1
            res.modified = True
        return res


def _shm_offered(kind: str, target) -> bool:
    return kind in target.shm_links and target.device.kind == "cpu"


def _site(node: Node, kind: str, target) -> "tuple[int, ...] | str | None":
    """The ranks of a sum all-reduce / reduce-scatter or an all-gather this pass may rewrite
    (its one wait, a known group of two or more of the target's ranks, a static size); why
    not (a near miss); or None (not the target's group)."""
    x, group_name = node.args[0], node.args[-1]
    op = node.args[1] if kind != "all_gather" else "sum"
    waits = [u for u in node.users if u.target is c10d.wait_tensor.default]
    val = tensor_val(x)
    pg = _group(group_name)
    if len(waits) != 1 or len(node.users) != 1 or val is None or pg is None:
        return "not a single wait on a known group"
    members = tuple(dist.get_process_group_ranks(pg))
    if len(members) < 2 or max(members) >= target.num_devices:
        return None
    if op != "sum":
        return f"reduce op {op!r} (only sum is rewritten)"
    if not isinstance(val.numel(), int):
        return "symbolic size"
    return members


def _choose(node: Node, kind: str, members, target, low, near_misses: list[str]) -> tuple[str, str]:
    """(the algorithm the cost model picks for this collective, its decision line); an
    all-reduce sent as `low` when given. A path whose buffers cannot be set up (symmetric
    memory, a shared-memory segment) is a near miss and the next best is taken."""
    val = tensor_val(node.args[0])
    numel, n = val.numel(), len(members)
    itemsize = low.itemsize if low is not None else val.element_size()
    # the cost model's message: one rank's buffer; for all-gather the gathered output
    nbytes = numel * itemsize * (n if kind == "all_gather" else 1)
    if kind == "all_reduce":
        allowed = allowed_algorithms(target, members)
    else:
        allowed = {"ring", "shm"}
    if "shm" in allowed and kind != "all_gather" and (low or val.dtype) not in _shm_dtypes():
        allowed.discard("shm")
    options = [c for c in cost.candidates(kind, nbytes, target, ranks=members) if c.algorithm in allowed]
    chosen = min(options, key=lambda c: c.seconds)
    if chosen.algorithm in ("one_shot", "two_shot", "shm"):
        why_not = (_reserve_symmetric(node.args[2], low or val.dtype, numel) if chosen.algorithm != "shm"
                   else _reserve_shm(node.args[-1]))
        if why_not is not None:
            near_misses.append(f"{location(node)}: {kind} not {_LABEL[chosen.algorithm]}: {why_not}")
            dropped = ("shm",) if chosen.algorithm == "shm" else ("one_shot", "two_shot")
            options = [c for c in options if c.algorithm not in dropped]
            chosen = min(options, key=lambda c: c.seconds)
    ring = next(c for c in options if c.algorithm == "ring")
    others = ", ".join(f"{_LABEL[c.algorithm]} {c.seconds * 1e6:.0f} us" for c in options if c is not chosen)
    head = (f"{location(node)}: {kind} {nbytes / 2**10:.1f} KiB over {n} ranks: {_LABEL[chosen.algorithm]}, "
            f"predicted {chosen.seconds * 1e6:.0f} us vs {others}")
    if chosen.algorithm == "shm":
        head += " (through this host's shared memory, not the process group's library)"
    elif kind == "all_reduce":
        head += (f"; bytes across islands {chosen.bytes_inter / 2**10:.1f} KiB (ring {ring.bytes_inter / 2**10:.1f}), "
                 f"inside islands {chosen.bytes_intra / 2**10:.1f} KiB (ring {ring.bytes_intra / 2**10:.1f}), "
                 "all ranks together")
    if low is not None:
        head += f"; sent as {str(low).replace('torch.', '')} (all_reduce_dtype)"
    return chosen.algorithm, head


def _shm_dtypes() -> tuple:
    from metainfer.kernels import shm_collectives

    return shm_collectives.DTYPES


_SHM_OPS = {"all_reduce": "shm_all_reduce", "all_gather": "shm_all_gather", "reduce_scatter": "shm_reduce_scatter"}


def _emit(graph, node: Node, kind: str, algorithm: str, low, target) -> None:
    """Replace the collective and its wait by `algorithm` (an all-reduce sent as `low` when given)."""
    x, group_name = node.args[0], node.args[-1]
    wait = next(iter(node.users))
    val = tensor_val(x)
    src = insert_call(graph, node, prims.convert_element_type.default, (x, low), meta_from=node) if low is not None else x
    if algorithm == "shm":  # this host's shared memory
        from metainfer.kernels import shm_collectives  # noqa: F401  (registers the ops)

        op = getattr(torch.ops.metainfer, _SHM_OPS[kind]).default
        args = (src, group_name) if kind == "all_reduce" else (src, node.args[-2], group_name)
        out = insert_call(graph, node, op, args, meta_from=node)
    elif algorithm in ("one_shot", "two_shot"):  # P2P kernels on symmetric memory
        out = insert_call(graph, node, torch.ops.metainfer.symm_mem_all_reduce.default,
                          (src, algorithm, group_name), meta_from=node)
    elif algorithm == "ring":
        ar = insert_call(graph, node, c10d.all_reduce.default, (src, "sum", group_name), meta_from=node)
        out = insert_call(graph, node, c10d.wait_tensor.default, (ar,), meta_from=node)
    else:
        groups, me = ranks.island_groups(target), dist.get_rank()
        out = _hierarchical(graph, node, src, groups.intra_for(me), groups.cross_for(me),
                            len(groups.islands[0]), val.numel())
    if low is not None:
        out = insert_call(graph, node, prims.convert_element_type.default, (out, val.dtype), meta_from=node)
    wait.replace_all_uses_with(out)
    graph.erase_node(wait)
    graph.erase_node(node)


def _flat_padded(graph, before: Node, x: Node, numel: int, multiple: int) -> Node:
    flat = insert_call(graph, before, aten.reshape.default, (x, [numel]), meta_from=before)
    pad = (-numel) % multiple
    if pad:
        flat = insert_call(graph, before, aten.constant_pad_nd.default, (flat, [0, pad], 0.0), meta_from=before)
    return flat


def _restore(graph, before: Node, y: Node, x: Node, numel: int) -> Node:
    if tensor_val(y).numel() != numel:
        y = insert_call(graph, before, aten.slice.Tensor, (y, 0, 0, numel), meta_from=before)
    return insert_call(graph, before, aten.reshape.default, (y, list(shape(x))), meta_from=before)


def _wait(graph, before, t):
    return insert_call(graph, before, c10d.wait_tensor.default, (t,), meta_from=before)


def _hierarchical(graph, node: Node, x: Node, intra: str, cross: str, k: int, numel: int) -> Node:
    flat = _flat_padded(graph, node, x, numel, k)
    rs = _wait(graph, node, insert_call(graph, node, c10d.reduce_scatter_tensor.default, (flat, "sum", k, intra),
                                        meta_from=node))
    ar = _wait(graph, node, insert_call(graph, node, c10d.all_reduce.default, (rs, "sum", cross), meta_from=node))
    ag = _wait(graph, node, insert_call(graph, node, c10d.all_gather_into_tensor.default, (ar, k, intra),
                                        meta_from=node))
    return _restore(graph, node, ag, x, numel)

