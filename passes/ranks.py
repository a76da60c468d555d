"""What the passes need from the torch.distributed job they compile in: this rank's place,
the sub-groups of the target's islands, and agreement across ranks without a collective.
Below the runtime (metainfer.parallel.distributed starts jobs and shards models; passes never import it).

- `island_groups(target)`: the sub-groups the hierarchical all-reduce runs on (this rank's
  island, and the ranks with this rank's position in the other islands), created on every
  rank in the same order.
- `exchange(obj, group)`: every member's `obj`, through the job's rendezvous store.
- `collective_order_mismatch(...)`: whether every member would issue the same collectives.
- `job_cache()`: a dict of decisions about the current job, emptied when the job ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from metainfer.hardware import targets as _targets


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_JOB_CACHES: list[dict] = []


def job_cache() -> dict:
    """A dict for what was decided about the current job (agreed choices, created groups)."""
    cache: dict = {}
    _JOB_CACHES.append(cache)
    return cache


def forget_job() -> None:
    """The job ended (a fake one, say): nothing decided about it holds for the next."""
    for cache in _JOB_CACHES:
        cache.clear()


# ---- the topology's sub-groups ------------------------------------------------------------

@dataclass(frozen=True)
class IslandGroups:
    islands: tuple[tuple[int, ...], ...]
    intra: dict  # island index -> group name (ranks of one island); None where this rank is not in it
    cross: dict  # local index -> group name (the ranks at that position in every island)

    def intra_for(self, r: int) -> str:
        return self.intra[next(i for i, isl in enumerate(self.islands) if r in isl)]

    def cross_for(self, r: int) -> str:
        isl = next(isl for isl in self.islands if r in isl)
        return self.cross[isl.index(r)]


_GROUPS: dict[tuple, IslandGroups] = job_cache()


def island_groups(target: _targets.Target) -> IslandGroups | None:
    """Sub-groups for the target's islands over the job's ranks (None: one island or no job).
    Every rank creates every group in the same order, as torch.distributed requires."""
    if world_size() <= 1 or len(target.topology.islands) <= 1:
        return None
    islands = target.topology.islands
    if sum(len(i) for i in islands) != world_size():
        raise ValueError(f"target {target.name!r} has {sum(len(i) for i in islands)} devices, the job "
                         f"{world_size()} ranks")
    key = (islands, world_size())
    if key not in _GROUPS:
        def name(ranks):  # only members learn a group's name; others get None
            g = dist.new_group(list(ranks))
            return g.group_name if isinstance(g, dist.ProcessGroup) else None

        intra = {i: name(isl) for i, isl in enumerate(islands)}
        k = len(islands[0])
        cross = {j: name([isl[j] for isl in islands]) for j in range(k)}
        _GROUPS[key] = IslandGroups(islands, intra, cross)
    return _GROUPS[key]


# ---- agreement across ranks -------------------------------------------------------------

_EXCHANGES: dict[str, int] = {}  # per group: exchanges so far


def exchange(obj, group_name: str) -> list:
    """`obj` from every member of the process group `group_name`, in member order, passed
    through the job's rendezvous store rather than as a collective. Passes agree this way
    because they run inside the compiler with the Python dispatcher on: a collective issued
    there holds the GIL while it waits for the backend's work queue, whose worker thread may
    need the GIL to free the previous collective's tensors, and the rank deadlocks (seen with
    gloo). Every member must call this the same number of times per group, like a collective.
    Raises TimeoutError naming the absent ranks after the store's timeout."""
    import pickle

    pg = dist.distributed_c10d._resolve_process_group(group_name)
    members = dist.get_process_group_ranks(pg)
    n = _EXCHANGES.get(group_name, 0)
    _EXCHANGES[group_name] = n + 1
    store = dist.distributed_c10d._get_default_store()
    prefix = f"metainfer/exchange/{group_name}/{n}/"
    store.set(prefix + str(rank()), pickle.dumps(obj))
    keys = [prefix + str(r) for r in members]
    try:
        store.wait(keys, store.timeout)
    except Exception as e:  # the store's own error names no rank: say who did not come
        absent = [r for r, k in zip(members, keys) if not store.check([k])]
        raise TimeoutError(
            f"metainfer: rank {rank()} waited {store.timeout.total_seconds():g} s for rank(s) {absent} of group "
            f"{members} to agree in exchange {n} of that group; they did not take part (a rank that served "
            f"this graph from a compile cache another rank lacks skips the passes: `metainfer cache clear`)"
        ) from e
    return [pickle.loads(store.get(k)) for k in keys]


def collective_order_mismatch(signature: list, groups: list[str], proposing: bool = True) -> str | None:
    """Agree with every other member of each group the graph's collectives run on: None when
    every member proposes to issue the same collective sequence (`signature`, the same form
    on every rank), else why not (a member keeps its old order, or the sequences differ).
    Every rank calls this for such a graph, proposing or not, so all of them exchange and
    all of them learn the answer. `groups` come in name order, the same on every rank: a rank
    waits in one group's exchange before it offers in the next, so ranks taking groups in
    different orders could wait on each other in a cycle. Outside a job, or on the fake
    process group: None."""
    if world_size() <= 1:
        return None if proposing else "not proposed"
    import hashlib

    digest = hashlib.sha256(repr(signature).encode()).hexdigest()[:16]
    why = None
    for name in groups:
        try:
            pg = dist.distributed_c10d._resolve_process_group(name)
        except Exception:
            continue
        if dist.get_backend(pg) == "fake":  # one process standing for all ranks: nothing to compare
            continue
        got = exchange((rank(), digest, proposing), name)
        members = dist.get_process_group_ranks(pg)
        keep = [r for r, _, p in got if not p]
        differ = [r for r, d, _ in got if d != digest]
        if why is None and keep:
            why = f"rank(s) {keep} of group {members} keep their order"
        elif why is None and differ:
            why = (f"rank(s) {differ} of group {members} would issue a different sequence of collectives than "
                   f"rank {rank()} ({len(signature)} here)")
    if why is None and not proposing:
        why = "not proposed"
    return why


def job_identity() -> dict:
    """This process's place in the job, for keys of what it compiles: ranks of one job may
    compile the same graph to different decisions (or take part in an agreement), so a rank
    must not be served another rank's compiled artifact. Empty outside a job."""
    if world_size() <= 1:
        return {}
    return {"rank": rank(), "world": world_size()}
