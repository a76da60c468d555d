"""Cost model: collectives on a target's topology (alpha-beta), and compute ops from the fake
tensors of a graph's nodes (roofline).

Every algorithm is priced as a sequence of steps; a step costs the latency of the slowest
link it uses plus the bytes its busiest link carries over that link's bandwidth. Links come
from the target: `intra_island` between devices of one island (PCIe switch / NUMA domain),
`inter_island` between islands (the slow boundary on a 2 x 4 PCIe box). Devices are taken
in rank order, islands as the target lists them. Bytes sent inside islands and across the
boundary are counted separately (summed over all ranks), so passes and reports can show what
crosses the slow link.

Algorithms (message size `nbytes` is one rank's buffer; for all-gather the gathered output,
for reduce-scatter the unreduced input):
- all_reduce: `ring` (flat ring over all ranks, NCCL's default: 2(n-1) steps of nbytes/n),
  `two_shot` (reduce-scatter then all-gather, each as one direct exchange with every peer:
  2 steps), `one_shot` (every rank reads every peer's whole buffer and reduces: 1 step,
  needs P2P); these two are the algorithms of P2P all-reduce kernels (symmetric memory),
  not of the library, whose reduce-scatter + all-gather are two rings; `hierarchical` (ring reduce-scatter inside each island, ring all-reduce of the
  shard across islands (the island's k rings share the boundary link), ring all-gather inside);
- a group over part of each island (one rank per island, say) shares the boundary with its
  sibling groups, which run the same collective at the same time (every rank runs the same
  program): the boundary's bandwidth is divided among them;
- all_gather, reduce_scatter: `ring`;
- all_to_all: `direct` (each rank sends nbytes/n to every peer in one step);
- `shm` (all_reduce, all_gather, reduce_scatter): ranks of one host through a shared-memory
  segment (kernels/shm_collectives.py), priced latency + nbytes / bandwidth from the target's
  [collectives.shm] fit of that kind (`metainfer calibrate` measures it); offered only where
  the target declares it. It runs on the rank's own core, beside nothing.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from metainfer.hardware.fxops import VIEW_NAMES, op_name, spec_of
from metainfer.hardware.targets import Target
from metainfer.kernels import spec as op_specs
from metainfer.kernels.spec import numel, size_hint, tensor_bytes  # noqa: F401  (this module's, too)

ALGORITHMS = {
    "all_reduce": ("ring", "two_shot", "one_shot", "hierarchical", "shm"),
    "all_gather": ("ring", "shm"),
    "reduce_scatter": ("ring", "shm"),
    "all_to_all": ("direct",),
}


@dataclass(frozen=True)
class CollectiveCost:
    kind: str
    algorithm: str
    nbytes: float
    ranks: int
    seconds: float
    bytes_intra: float  # bytes sent over links inside islands, all ranks together
    bytes_inter: float  # bytes sent across island boundaries, all ranks together
    steps: int

    def __str__(self) -> str:
        return (f"{self.kind} {self.algorithm}: {self.seconds * 1e6:.1f} us, {self.bytes_inter / 2**20:.2f} MiB "
                f"across islands, {self.bytes_intra / 2**20:.2f} MiB inside")


class _Topo:
    """The group's shape: n ranks in m islands of k each, and the two link classes."""

    def __init__(self, target: Target, ranks: "int | tuple[int, ...] | list[int] | None"):
        islands = target.topology.islands
        if ranks is None:
            members = list(range(target.num_devices))
        elif isinstance(ranks, int):
            members = list(range(ranks))  # a sub-group of the first `ranks` devices
        else:
            members = sorted(set(ranks))  # exactly these devices
        n = len(members)
        if n < 1 or n > target.num_devices or not all(0 <= d < target.num_devices for d in members):
            raise ValueError(f"ranks must be 1..{target.num_devices} devices of target {target.name!r}, got {ranks!r}")
        if n != target.num_devices:  # the islands the group touches
            keep = set(members)
            islands = tuple(tuple(d for d in isl if d in keep) for isl in islands)
            islands = tuple(isl for isl in islands if isl)
        sizes = {len(i) for i in islands}
        if len(sizes) != 1:
            raise ValueError(f"islands of different sizes {sorted(sizes)}: the model assumes equal islands")
        self.n, self.m, self.k = n, len(islands), sizes.pop()
        intra = target.topology.intra_island
        inter = target.topology.inter_island or intra
        self.bw_i, self.lat_i = intra.bandwidth, intra.latency_s
        self.bw_x, self.lat_x = (inter.bandwidth, inter.latency_s) if self.m > 1 else (intra.bandwidth, intra.latency_s)
        if self.m > 1:
            # every rank runs the same program: a group with j of an island's K devices has
            # K / j sibling groups issuing the same collective at once, sharing the boundary
            full = len(target.topology.islands[0])
            self.bw_x /= max(1.0, full / self.k)
        self.p2p = target.topology.p2p

    @property
    def slowest(self) -> tuple[float, float]:
        """(bandwidth, latency) of the slowest link a flat ring crosses."""
        return min(self.bw_i, self.bw_x), max(self.lat_i, self.lat_x)


def _ring(kind, algorithm, nbytes, t: _Topo, steps: int) -> CollectiveCost:
    """`steps` ring steps of nbytes/n per rank; the ring crosses the boundary m times (m > 1)."""
    n = t.n
    chunk = nbytes / n
    bw, lat = t.slowest
    crossing = t.m if t.m > 1 else 0
    return CollectiveCost(kind, algorithm, nbytes, n, steps * (lat + chunk / bw),
                          bytes_intra=(n - crossing) * steps * chunk, bytes_inter=crossing * steps * chunk, steps=steps)


def _exchange(t: _Topo, per_peer: float) -> tuple[float, float, float]:
    """One step where every rank sends `per_peer` bytes to each other rank: (seconds, bytes
    inside islands, bytes across). A rank's own link carries its n-1 messages; the boundary
    link between two islands carries k x k of them each way."""
    n, k, m = t.n, t.k, t.m
    inside, across = n * (k - 1) * per_peer, n * (n - k) * per_peer
    own = (n - 1) * per_peer / t.bw_i
    boundary = (k * k * per_peer / t.bw_x) if m > 1 else 0.0
    lat = t.lat_x if m > 1 else t.lat_i
    return lat + max(own, boundary), inside, across


def collective_cost(kind: str, nbytes: float, target: Target, algorithm: str | None = None,
                    ranks: "int | tuple[int, ...] | None" = None) -> CollectiveCost:
    """Predicted time and traffic of one collective of `nbytes` (see the module docstring).
    `ranks`: the group: None for every device, n for the first n, or the device ids."""
    if kind not in ALGORITHMS:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(ALGORITHMS)}")
    algorithm = algorithm or ALGORITHMS[kind][0]
    if algorithm not in ALGORITHMS[kind]:
        raise ValueError(f"{kind} has no algorithm {algorithm!r}; known: {', '.join(ALGORITHMS[kind])}")
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    t = _Topo(target, ranks)
    if algorithm == "shm":
        shm = target.shm_links.get(kind)
        if shm is None:
            raise ValueError(f"target {target.name!r} declares no shared-memory path for {kind} ([collectives.shm])")
        if t.n == 1 or nbytes == 0:
            return CollectiveCost(kind, algorithm, nbytes, t.n, 0.0, 0.0, 0.0, 0)
        # bytes through host memory: each rank writes its part into the segment once
        return CollectiveCost(kind, algorithm, nbytes, t.n, shm.latency_s + nbytes / shm.bandwidth,
                              bytes_intra=t.n * nbytes, bytes_inter=0.0, steps=1)
    link = target.collective_links.get(kind)
    if link is not None:  # fitted for this kind alone: how the library implements it, not the ring
        t.bw_i = t.bw_x = link.bandwidth
        t.lat_i = t.lat_x = link.latency_s
    n = t.n
    if n == 1 or nbytes == 0:
        return CollectiveCost(kind, algorithm, nbytes, n, 0.0, 0.0, 0.0, 0)
    if algorithm == "one_shot" and not t.p2p:
        raise ValueError(f"one_shot needs GPU peer-to-peer access, which target {target.name!r} does not have")
    if kind in ("all_gather", "reduce_scatter"):
        return _ring(kind, algorithm, nbytes, t, n - 1)
    if kind == "all_to_all":
        sec, inside, across = _exchange(t, nbytes / n)
        return CollectiveCost(kind, algorithm, nbytes, n, sec, inside, across, 1)
    if algorithm == "ring":
        return _ring(kind, algorithm, nbytes, t, 2 * (n - 1))
    if algorithm == "two_shot":
        sec, inside, across = _exchange(t, nbytes / n)
        return CollectiveCost(kind, algorithm, nbytes, n, 2 * sec, 2 * inside, 2 * across, 2)
    if algorithm == "one_shot":
        sec, inside, across = _exchange(t, nbytes)
        return CollectiveCost(kind, algorithm, nbytes, n, sec, inside, across, 1)
    # hierarchical: ring RS inside islands, ring AR of the shard across, ring AG inside
    k, m = t.k, t.m
    shard = nbytes / k
    inside_steps = 2 * (k - 1)
    sec = inside_steps * (t.lat_i + shard / t.bw_i)
    bytes_intra = n * inside_steps * shard if k > 1 else 0.0
    bytes_inter = 0.0
    if m > 1:
        across_steps = 2 * (m - 1)
        piece = shard / m
        # k rings (one per local rank) cross the same boundary link at once
        sec += across_steps * (t.lat_x + k * piece / t.bw_x)
        bytes_inter = n * across_steps * piece
    return CollectiveCost(kind, algorithm, nbytes, n, sec, bytes_intra, bytes_inter,
                          inside_steps + (2 * (m - 1) if m > 1 else 0))


def candidates(kind: str, nbytes: float, target: Target, ranks=None) -> list[CollectiveCost]:
    """Every algorithm the target allows for this collective, priced."""
    out = []
    for alg in ALGORITHMS[kind]:
        if alg == "one_shot" and not target.topology.p2p or alg == "shm" and kind not in target.shm_links:
            continue
        out.append(collective_cost(kind, nbytes, target, alg, ranks))
    return out


def best(kind: str, nbytes: float, target: Target, ranks=None) -> CollectiveCost:
    """The fastest allowed algorithm (ties: the first listed, i.e. the library default)."""
    return min(candidates(kind, nbytes, target, ranks), key=lambda c: c.seconds)


def send_cost(nbytes: float, target: Target, across_islands: bool) -> CollectiveCost:
    """One rank sending `nbytes` to one peer (a pipeline stage boundary), inside an island or
    across the boundary."""
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    topo = target.topology
    link = topo.inter_island if across_islands and topo.inter_island is not None else topo.intra_island
    across = across_islands and topo.inter_island is not None
    sec = link.latency_s + nbytes / link.bandwidth if nbytes else 0.0
    return CollectiveCost("send", "direct", nbytes, 2, sec, 0.0 if across else nbytes, nbytes if across else 0.0, 1)


# ---- part two: compute ops, from the fake tensors of a graph's nodes ------------------------

_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "var_mean", "any", "all", "argmax", "argmin",
               "cumsum", "topk", "sort", "softmax", "_softmax", "log_softmax", "_log_softmax"}


# ops that only move data: priced by their bytes, on purpose
_DATA_MOVEMENT = {"clone", "copy", "copy_", "_to_copy", "contiguous", "cat", "stack", "index", "index_select",
                  "gather", "scatter", "scatter_add", "scatter_reduce", "index_put", "index_put_", "index_add",
                  "embedding", "constant_pad_nd", "full", "zeros", "ones", "empty", "empty_strided", "new_empty",
                  "new_zeros", "new_ones", "full_like", "zeros_like", "ones_like", "empty_like", "arange", "iota",
                  "scalar_tensor", "lift_fresh_copy", "slice_scatter", "select_scatter", "masked_scatter",
                  "repeat", "repeat_interleave", "flip", "roll", "tril", "triu", "fill", "fill_", "nonzero",
                  "_local_scalar_dense", "bucketize", "searchsorted", "histc", "bincount", "clamp",
                  "clamp_min", "clamp_max"}
# constant fills (no tensor input): Inductor computes the value inside the kernel that reads
# it, so they launch nothing and move nothing of their own
_CONSTANT_FILLS = {"full", "zeros", "ones", "scalar_tensor", "arange", "iota", "empty", "empty_strided"}


@dataclass(frozen=True)
class OpCost:
    flops: float
    bytes: float
    seconds: float
    bound: str  # "compute", "memory", "launch" or "free" (views)
    priced_by_bytes: bool = False  # an op the model does not know: its FLOPs are not counted


def _work_seconds(flops: float, nbytes: float, dtype_key: str, dev, footprint: float | None,
                  stream: bool = False) -> tuple[float, str]:
    """A kernel's time without its launch, and what bounds it: the larger of its arithmetic and
    its memory time, plus the share of the smaller that does not overlap (`memory_overlap`).
    `stream`: a matmul's operands, read at the device's GEMM streaming rate (`DeviceSpec.bandwidth`)."""
    compute, memory = flops / dev.peak_flops[dtype_key], nbytes / dev.bandwidth(footprint, stream)
    body = max(compute, memory) + (1 - dev.memory_overlap) * min(compute, memory)
    return body, "compute" if compute >= memory else "memory"


def roofline(flops: float, nbytes: float, dtype_key: str, target: Target, overhead_s: float | None = None,
             footprint: float | None = None, stream: bool = False) -> OpCost:
    """max(FLOPs / peak, bytes / bandwidth) + launch overhead (or `overhead_s`) on one device
    of `target`; the bandwidth is the cache level's where the program's `footprint` (bytes it
    touches per call) fits in it (`DeviceSpec.bandwidth`); on a device whose loads do not
    overlap its arithmetic, the smaller term is added, not hidden (`memory_overlap`); a matmul's
    bytes (`stream`) move at the device's GEMM streaming rate."""
    dev = target.device
    overhead = dev.launch_overhead_s if overhead_s is None else overhead_s
    body, bound = _work_seconds(flops, nbytes, dtype_key, dev, footprint, stream)
    if overhead > body:
        bound = "launch"
    return OpCost(flops, nbytes, body + overhead, bound)


def _val(x):
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else None


def _tensors(vals):
    out = []
    for v in vals:
        if isinstance(v, (list, tuple)):
            out.extend(_tensors(v))
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return out


_peak_key = op_specs.peak_key


# matmul kernels: their operands stream at the device's GEMM rate (DeviceSpec.stream_bandwidth);
# metainfer's are the ops declared GEMM (kernels/spec.py)
GEMMS = {("aten", "mm"), ("aten", "addmm"), ("aten", "bmm"), ("aten", "baddbmm"), ("transformers", "grouped_mm_fallback")}


def _is_gemm(ns: str, name: str, declared: "op_specs.OpSpec | None") -> bool:
    return (ns, name) in GEMMS or declared is not None and declared.kind == op_specs.GEMM


def _values(args):
    """A call's arguments with graph values replaced by their fake values (what the op specs'
    formulas take)."""
    return [_val(x) if isinstance(x, torch.fx.Node) else x for x in args]


def _flops(name: str, ns: str, a: list, out: list, declared: "op_specs.OpSpec | None") -> tuple[float, str | None]:
    """(FLOPs, dtype key for the peak) of known ops; (0, None) where priced by bytes. `a`: the
    argument values; `declared`: a metainfer op's declaration, whose formula it is."""
    if declared is not None:
        return declared.flops(a, out)
    if ns == "aten" and name in ("mm", "addmm", "bmm", "baddbmm"):
        x, w = (a[1], a[2]) if name in ("addmm", "baddbmm") else (a[0], a[1])
        return 2 * numel(out[0]) * size_hint(x.shape[-1]), _peak_key(x.dtype)
    if ns == "transformers" and name == "grouped_mm_fallback":  # (S, K) rows by (E, K, N) experts
        return 2 * numel(out[0]) * size_hint(a[0].shape[-1]), _peak_key(a[0].dtype)
    return 0.0, None


def custom_op_overhead(name: str, target: Target, experts: float = 1.0) -> float | None:
    """What a call of metainfer's op `name` costs beyond its work on `target` (calibrated: the
    op's own figure, else the target's default); None where the target does not say. A
    call of an op with a host loop over experts (moe_experts; Hugging Face's
    grouped_mm_fallback) adds the per-expert cost for each of the `experts` that can get tokens."""
    dev = target.device
    if not dev.knows_custom_op_costs:
        return None
    default = dev.custom_op_overhead_s if dev.custom_op_overhead_s is not None else dev.launch_overhead_s
    seconds = dev.custom_op_overheads.get(name, default)
    if f"{name}_per_expert" in dev.custom_op_overheads:
        seconds += dev.custom_op_overheads[f"{name}_per_expert"] * experts
    return seconds


def kernel_cost(flops: float, nbytes: float, dtype_key: str, target: Target, custom_op: str | None = None,
                experts: float = 1.0, slowdown: bool = True, footprint: float | None = None,
                gemm: bool = False) -> OpCost:
    """One kernel of `flops` work moving `nbytes` on one device of `target`: the roofline plus
    a launch; for metainfer's custom op `custom_op`, its calibrated call overhead instead of
    the launch and its work scaled by its calibrated slowdown over the roofline (where the
    target has them). The one formula for a kernel, used for graph nodes (`op_cost`), fused
    groups and the planner's modelled layers alike. `slowdown=False`: the work is already
    priced as it runs (the calibrated slowdown was measured on another path of the op).
    `footprint`: the bytes the whole program touches per call (see `roofline`); `gemm`: a
    matmul kernel (its bytes stream at the device's GEMM rate)."""
    custom = custom_op_overhead(custom_op, target, experts) if custom_op else None
    c = roofline(flops, nbytes, dtype_key, target, custom, footprint, gemm)
    factor = target.device.custom_op_slowdown.get(custom_op, 1.0) if custom_op and slowdown else 1.0
    if factor != 1.0:  # calibrated: this op's work runs `factor` times its roofline here
        body, _ = _work_seconds(flops, nbytes, dtype_key, target.device, footprint, gemm)
        c = OpCost(c.flops, c.bytes, c.seconds + (factor - 1) * body, c.bound)
    return c


def custom_op_cost(name: str, flops: float, nbytes: float, dtype_key: str, target: Target,
                   experts: float = 1.0) -> OpCost:
    """`kernel_cost` of one call of metainfer's op `name`, as its declaration (kernels/spec.py)
    says it runs: a GEMM's operands stream at the device's GEMM rate. For work modelled
    without a graph (the planner's layers)."""
    declared = op_specs.spec_for(name)
    if declared is None:
        raise KeyError(f"metainfer has no op {name!r}")
    return kernel_cost(flops, nbytes, dtype_key, target, name, experts, gemm=_is_gemm("metainfer", name, declared))


def op_cost(node: torch.fx.Node, target: Target, footprint: float | None = None) -> OpCost:
    """FLOPs, bytes moved and predicted seconds of one call_function node on one device of
    `target` (see `roofline`). Matmuls, the attention family and metainfer's fused ops are
    priced by their FLOPs; pointwise ops (ATen's `pointwise` tag) at one FLOP per output
    element, reductions at one per input element, data movement by its bytes. Any other op is
    priced by its bytes with `priced_by_bytes=True`, so reports can list what the model does
    not know. Views and constant fills (Inductor inlines them into their readers) are free.
    `footprint`: the bytes the node's graph touches per call (`graph_footprint`), where known."""
    if node.op != "call_function" or node.target is operator.getitem:
        return OpCost(0.0, 0.0, 0.0, "free")
    ns, name = op_name(node)
    if name in VIEW_NAMES or ns == "python":
        return OpCost(0.0, 0.0, 0.0, "free")
    ins = _tensors([_val(x) for x in node.all_input_nodes])
    if name in _CONSTANT_FILLS and not ins:
        return OpCost(0.0, 0.0, 0.0, "free")
    out = _tensors([node.meta.get("val")])
    moved = sum(tensor_bytes(t) for t in ins) + sum(tensor_bytes(t) for t in out)
    declared = spec_of(node)
    args = _values(node.args)
    flops, key = _flops(name, ns, args, out, declared)
    unknown = False
    if key is None:
        tags = getattr(node.target, "tags", ())
        key = _peak_key(out[0].dtype) if out else "fp32"
        if torch.Tag.reduction in tags or name in _REDUCTIONS:
            flops = sum(numel(t) for t in ins)
        elif torch.Tag.pointwise in tags:
            flops = sum(numel(t) for t in out)
        else:
            flops, unknown = 0.0, name not in _DATA_MOVEMENT
    custom_op, as_calibrated = (name if ns == "metainfer" else None), True
    if declared is not None and declared.cpu_work is not None and target.device.kind == "cpu":
        extra = declared.cpu_work(args, {k: _val(v) if isinstance(v, torch.fx.Node) else v
                                         for k, v in node.kwargs.items()})
        if extra is not None:  # e.g. attention's chunked CPU path: the whole score matrix, written and re-read
            flops, moved, as_calibrated = extra[0], moved + extra[1], False
    experts = 1.0
    if declared is not None and declared.experts is not None:  # the experts that can receive a token
        experts = declared.experts(args)
    if ns == "transformers" and name == "grouped_mm_fallback":
        rows, weight = _val(node.args[0]), _val(node.args[1])
        if rows is not None and weight is not None:  # it reads the weights of the experts with rows only
            total = size_hint(weight.shape[0])
            experts = min(total, size_hint(rows.shape[0]))
            moved -= tensor_bytes(weight) * (1 - experts / total)
        if name in target.device.custom_op_overheads:  # calibrated: its host loop's costs
            custom_op = name
    c = kernel_cost(flops, moved, key, target, custom_op, experts, slowdown=as_calibrated, footprint=footprint,
                    gemm=_is_gemm(ns, name, declared))
    return OpCost(c.flops, c.bytes, c.seconds, c.bound, priced_by_bytes=unknown)


# ---- part three: what the lowering emits -----------------------------------------------------
#
# Inductor does not run ATen nodes one by one: it fuses chains of pointwise ops, reductions,
# copies and indexed loads into one kernel that reads its inputs from memory once and writes
# only what later kernels (or the graph's outputs) read. Matmuls, attention and custom ops stay
# kernels of their own ("extern"). `price_graph` prices a graph that way: fusion groups formed
# as Inductor forms them (producer-consumer fusion, none that would make a cycle through a node
# outside the group), each a roofline of its FLOPs and its external bytes plus one launch;
# a table read through an index (embedding, index, gather) counts the rows touched, not the
# table; a scatter writes the rows it touches (Inductor re-inplaces it).

# indexed loads: (op, position of the indexed table)
_INDEXED_LOADS = {"embedding": 0, "index": 0, "index_select": 0, "gather": 0}
# indexed stores: the destination argument, and the argument holding the values written
_INDEXED_STORES = {"index_put": (0, 2), "index_put_": (0, 2), "scatter": (0, 3), "scatter_add": (0, 3),
                   "scatter_reduce": (0, 3), "index_add": (0, 3), "index_copy": (0, 3), "slice_scatter": (0, 1),
                   "select_scatter": (0, 1)}
# data movement Inductor generates inside fused kernels (not extern calls)
_FUSIBLE_MOVES = {"clone", "copy", "copy_", "_to_copy", "contiguous", "cat", "constant_pad_nd", "repeat", "flip",
                  "roll", "tril", "triu", "fill", "clamp", "clamp_min", "clamp_max", "where", "masked_fill",
                  "full_like", "zeros_like", "ones_like", "empty_like", "new_zeros", "new_ones", "new_empty", "expand",
                  *_CONSTANT_FILLS, *_INDEXED_LOADS, *_INDEXED_STORES}


def fusible(node: torch.fx.Node) -> bool:
    """Whether Inductor generates `node` inside a fused kernel (pointwise, reduction, copy,
    indexed load or store, view) rather than calling a kernel of its own for it."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    ns, name = op_name(node)
    if ns != "aten":
        return False
    tags = getattr(node.target, "tags", ())
    return (name in VIEW_NAMES or name in _FUSIBLE_MOVES or name in _REDUCTIONS or torch.Tag.pointwise in tags
            or torch.Tag.reduction in tags)


@dataclass
class FusedKernel:
    """One kernel the lowering emits for a group of fusible nodes."""

    nodes: list
    cost: OpCost

    @property
    def anchor(self) -> torch.fx.Node:
        """The last node of the group in program order: where the kernel runs."""
        return self.nodes[-1]


def fusion_groups(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """The fusible nodes of `graph` in groups, each the nodes one fused kernel computes.

    In program order, a fusible node's group takes in each fusible producer's group unless
    some node outside both lies on a path from one to the other (a matmul reading the
    producer, say): fused, the kernel would feed its own input, a cycle Inductor refuses.
    Ancestor and descendant sets are bitsets over the graph's nodes."""
    nodes = list(graph.nodes)
    bit = {n: 1 << i for i, n in enumerate(nodes)}
    anc: dict[torch.fx.Node, int] = {}
    for n in nodes:
        a = 0
        for i in n.all_input_nodes:
            a |= anc[i] | bit[i]
        anc[n] = a
    desc: dict[torch.fx.Node, int] = {}
    for n in reversed(nodes):
        d = 0
        for u in n.users:
            d |= desc[u] | bit[u]
        desc[n] = d

    class _Group:
        def __init__(self, n):
            self.nodes, self.bits, self.anc, self.desc = [n], bit[n], anc[n], desc[n]

    group_of: dict[torch.fx.Node, _Group] = {}
    for n in nodes:
        if not fusible(n):
            continue
        g = group_of[n] = _Group(n)
        for i in n.all_input_nodes:
            p = group_of.get(i)
            if p is None or p is g or p.desc & g.anc & ~(p.bits | g.bits):
                continue
            p.nodes += g.nodes
            p.bits |= g.bits
            p.anc |= g.anc
            p.desc |= g.desc
            for m in g.nodes:
                group_of[m] = p
            g = p
    seen, groups = set(), []
    for n in nodes:
        g = group_of.get(n)
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            groups.append(sorted(g.nodes, key=lambda m: bit[m]))
    return groups


def _bytes_read(tensor: torch.fx.Node, members: set) -> float:
    """Bytes a group reads of an input: the rows touched where every use of it inside the
    group (through views) is the table of an indexed load or the destination of an indexed
    store; nothing where it only passes through views to readers outside; else all of it."""
    whole = sum(tensor_bytes(t) for t in _tensors([_val(tensor)]))
    total = 0.0
    for user in tensor.users:
        if user not in members:
            continue
        name = op_name(user)[1]
        if name in VIEW_NAMES:
            total += _bytes_read(user, members)
        elif name in _INDEXED_LOADS and user.args[_INDEXED_LOADS[name]] is tensor:
            total += sum(tensor_bytes(t) for t in _tensors([user.meta.get("val")]))
        elif name in _INDEXED_STORES and user.args[_INDEXED_STORES[name][0]] is tensor:
            total += sum(tensor_bytes(t) for t in _tensors([_val(user.args[_INDEXED_STORES[name][1]])]))
        else:
            return whole
    return min(total, whole)


def _computed_inside(view: torch.fx.Node, members: set) -> bool:
    """Whether a view's data is computed by the group (else it views a tensor from outside)."""
    while op_name(view)[1] in VIEW_NAMES:
        base = view.args[0] if view.args and isinstance(view.args[0], torch.fx.Node) else None
        if base is None or base not in members:
            return False
        view = base
    return True


def _group_cost(members: list, target: Target, footprint: float | None = None) -> OpCost:
    inside = set(members)
    flops, outputs_dtype = 0.0, None
    read = sum(_bytes_read(i, inside) for i in {i for n in members for i in n.all_input_nodes if i not in inside})
    written = 0.0
    for n in members:
        name = op_name(n)[1]
        out = _tensors([n.meta.get("val")])
        if name in VIEW_NAMES:
            if any(u not in inside for u in n.users) and _computed_inside(n, inside):
                written += sum(tensor_bytes(t) for t in out)  # the computed base is written
            continue
        flops += op_cost(n, target).flops
        outputs_dtype = outputs_dtype or (out[0].dtype if out else None)
        if any(u not in inside for u in n.users):
            if name in _INDEXED_STORES:  # re-inplaced: only the rows it writes
                written += sum(tensor_bytes(t) for t in _tensors([_val(n.args[_INDEXED_STORES[name][1]])]))
            else:
                written += sum(tensor_bytes(t) for t in out)
    if flops == 0 and read + written == 0:
        return OpCost(0.0, 0.0, 0.0, "free")
    return kernel_cost(flops, read + written, _peak_key(outputs_dtype or torch.float32), target, footprint=footprint)


def graph_footprint(graph: torch.fx.Graph) -> float:
    """Bytes one call of `graph` touches, at most: its inputs (weights included) and every
    tensor a node computes (views and getitems alias what they read). Where it fits in the
    target's cache level, repeated calls find it there."""
    total = 0.0
    for node in graph.nodes:
        if node.op == "placeholder" or (node.op == "call_function" and node.target is not operator.getitem
                                        and op_name(node)[1] not in VIEW_NAMES):
            total += sum(tensor_bytes(t) for t in _tensors([node.meta.get("val")]))
    return total


def price_graph(graph: torch.fx.Graph, target: Target) -> dict[torch.fx.Node, OpCost]:
    """Each call_function node's share of what the lowering of `graph` costs on one device of
    `target`: a fused group's whole cost on its last node (its anchor), nothing on the other
    members; every other node as `op_cost` prices it. Collectives are the simulator's."""
    footprint = graph_footprint(graph)
    prices: dict[torch.fx.Node, OpCost] = {}
    for members in fusion_groups(graph):
        c = _group_cost(members, target, footprint)
        for n in members[:-1]:
            prices[n] = OpCost(0.0, 0.0, 0.0, "fused")
        prices[members[-1]] = c
    for node in graph.nodes:
        if node.op == "call_function" and node not in prices:
            prices[node] = op_cost(node, target, footprint)
    return prices


def fused_kernels(graph: torch.fx.Graph, target: Target) -> list[FusedKernel]:
    """The fused kernels of `graph` with their costs (for reports and tests)."""
    footprint = graph_footprint(graph)
    return [FusedKernel(m, _group_cost(m, target, footprint)) for m in fusion_groups(graph)]
