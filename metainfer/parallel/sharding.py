"""A model's own parallel plans applied to it for inference: tensor parallelism through DTensor
(`torch.distributed.tensor.parallel.parallelize_module`) and expert parallelism of its MoE
layers, inside one group of ranks.

- `tp_plan(model)`: Hugging Face's `base_model_tp_plan` (FQN pattern -> style name), or
  `TP_PLAN` declared beside a models/ model.
- `check_shardable(model, degree)` / `shard(model, mesh)`: every style name Hugging Face's
  plans use, honoured as torch's parallel styles (`_torch_styles`); styles that only matter
  for gradients are no-ops here; a style that cannot be honoured is refused by name before
  any collective.
- More ranks than key-value heads: each K/V projection keeps the one head its rank's query
  heads read, whole (the heads are replicated across the ranks that share them, as vLLM does),
  and the attention modules are told their new query-per-KV-head ratio.
- `expert_parallel(model, group)`: the routed experts spread over the group's ranks, for
  models/ MoE layers (`shard_experts`) and for Hugging Face MoE models (their
  `base_model_ep_plan`): each rank keeps E / n experts, routing ids are shifted to local ones
  (the others point past the last expert, with weight 0) and the ranks' outputs are summed by
  an all-reduce.
"""

from __future__ import annotations

import fnmatch
import warnings

import torch
from torch.distributed.tensor.parallel import ParallelStyle

# Hugging Face's tensor-parallel style names (transformers.distributed.tensor_parallel) and what
# each is at inference. "gradients only": the style adds a collective to the backward, none to
# the forward, so the module stays whole on every rank.
_GRADIENTS_ONLY = {"replicated_with_grad_allreduce", "replicate", "mla_kv_a_proj", "local_params"}
_REFUSED = {
    "moe_tp_experts": "deprecated by transformers in favour of expert parallelism; metainfer spreads such "
                      "experts with expert_parallel=True",
    "packed_rowwise": "a packed expert weight split for tensor-parallel experts; metainfer spreads experts with "
                      "expert_parallel=True",
}
_KV_PROJECTIONS = ("k_proj", "v_proj", "wk", "wv")  # names of the key / value projections


def _torch_styles() -> dict:
    """Hugging Face's style name -> the torch parallel style that does what it does in a forward."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel)

    return {
        "colwise": ColwiseParallel, "unit_colwise": ColwiseParallel, "packed_colwise": ColwiseParallel,
        "rowwise": RowwiseParallel, "unit_rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        # vocabulary split, partial lookups summed / each rank a slice of every vector, gathered
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
        # the module's output is a partial sum
        "all_reduce": lambda: PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
    }


_TORCH_STYLES = _torch_styles()
STYLES = (*_TORCH_STYLES, *sorted(_GRADIENTS_ONLY))


def tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan: FQN pattern -> style name."""
    declared = getattr(type(model), "TP_PLAN", None)
    if declared is not None:
        return dict(declared)
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if plan:
        return _prefixed(model, plan)
    raise ValueError(f"{type(model).__name__} has no tensor-parallel plan: neither a Hugging Face "
                     "config.base_model_tp_plan nor a TP_PLAN declared on the model class")


def ep_plan(model: torch.nn.Module) -> dict[str, str]:
    """Hugging Face's expert-parallel plan of the model (empty if it has none)."""
    return _prefixed(model, getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {})


def _prefixed(model, plan: dict) -> dict[str, str]:
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), torch.nn.Module):
        return {f"{prefix}.{k}": v for k, v in plan.items()}
    return dict(plan)


def _heads(model) -> tuple[int, int, int] | None:
    """(attention heads, key-value heads, head dim) from the model's config, or None."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_heads", None)
    if not heads:
        return None
    kv = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "n_kv_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "dim", None)
    head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if hidden else None)
    return heads, kv, head_dim


def _matching(model, pattern: str):
    return [(n, m) for n, m in model.named_modules() if fnmatch.fnmatchcase(n, pattern)]


def _replicated_kv(model, plan: dict[str, str], degree: int) -> dict[str, str]:
    """The K/V projection entries whose heads are replicated at `degree` (more ranks than KV
    heads), after checking they can be; empty where the heads split."""
    h, kv, head_dim = _heads(model)
    if kv % degree == 0 or h == kv:  # heads split (MHA: the query heads' check covers it)
        return {}
    if kv > degree or degree % kv:
        raise ValueError(f"{type(model).__name__}: {kv} key-value heads neither split over nor replicate onto "
                         f"tensor-parallel degree {degree} (a divisor or a multiple of {kv})")
    if not head_dim:
        raise ValueError(f"{type(model).__name__}: the config gives no head size: cannot replicate its {kv} "
                         f"key-value heads over {degree} ranks")
    entries = {p: s for p, s in plan.items()
               if p.rsplit(".", 1)[-1] in _KV_PROJECTIONS and s in ("colwise", "unit_colwise")}
    for pattern in entries:
        for name, m in _matching(model, pattern):
            if getattr(m, "out_features", None) != kv * head_dim:
                raise ValueError(f"{name}: {getattr(m, 'out_features', None)} output features, not {kv} key-value "
                                 f"heads of {head_dim}: cannot replicate its heads over {degree} ranks")
    return entries


def local_kv_heads(model: torch.nn.Module) -> int | None:
    """The key-value heads this rank's K projections compute (after sharding: its share, or
    the one head it keeps whole where they are replicated); None where the model has no K
    projection of whole heads (MLA's latents, a fused qkv)."""
    from torch.distributed.tensor import DTensor

    heads = _heads(model)
    if heads is None or not heads[2]:
        return None
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if name.rsplit(".", 1)[-1] in ("k_proj", "wk") and hasattr(m, "qweight"):  # a quantized layer's own rows
            return m.out_features // heads[2] if m.out_features % heads[2] == 0 else None
        if name.rsplit(".", 1)[-1] in ("k_proj", "wk") and isinstance(w, torch.Tensor):
            rows = (w.to_local() if isinstance(w, DTensor) else w).shape[0]
            return rows // heads[2] if rows % heads[2] == 0 else None
    return None


def check_shardable(model: torch.nn.Module, degree: int) -> dict[str, str]:
    """The plan, after checking it can be applied at `degree` (before any collective)."""
    plan = tp_plan(model)
    bad = sorted({v for v in plan.values() if v not in STYLES})
    if bad:
        why = "; ".join(f"{s}: {_REFUSED[s]}" for s in bad if s in _REFUSED)
        raise ValueError(f"tensor-parallel plan of {type(model).__name__} uses style(s) {bad} that metainfer cannot "
                         f"honour{' (' + why + ')' if why else ''}; it applies {list(STYLES)}")
    heads = _heads(model)
    if heads is not None:
        h, kv, _ = heads
        if h % degree:
            raise ValueError(f"{type(model).__name__}: {h} attention heads / {kv} key-value heads do not split "
                             f"over tensor-parallel degree {degree}")
        if kv % degree:
            _replicated_kv(model, plan, degree)
    modules = [n for n, _ in model.named_modules()]
    for pattern, style in plan.items():
        owners = [n for n in modules if fnmatch.fnmatchcase(n, pattern)]
        if not owners and style not in _GRADIENTS_ONLY:
            for name, p in model.named_parameters():
                if fnmatch.fnmatchcase(name, pattern) and not _bare_parameter_ok(name, p, style):
                    raise ValueError(f"tensor-parallel plan entry {pattern!r} names the parameter {name} "
                                     f"({p.dim()}-D) with style {style!r}: metainfer splits a bare parameter only "
                                     "colwise (1-D or 2-D) or rowwise (not a bias)")
    for name, m, how in _quantized_cuts(model, plan, degree):
        for rank in range(degree):
            lo, hi = _cut_range(name, m, how, rank, degree, heads)
            try:
                (m.check_columns if how == "columns" else m.check_rows)(lo, hi)
            except ValueError as e:
                raise ValueError(f"{name}: tensor parallelism over {degree} ranks: {e}") from None
    quantised = [n for n, m in model.named_modules() if getattr(m, "block", 0) and any(fnmatch.fnmatchcase(n, p) for p in plan)]
    if quantised:
        raise ValueError(f"{type(model).__name__}: tensor parallelism over FP8 block-quantised weights is not "
                         f"supported yet ({quantised[0]} and others would need their scales split too)")
    names = modules + [n for n, _ in model.named_parameters()]
    unmatched = [p for p in plan if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if len(unmatched) == len(plan):
        raise ValueError(f"tensor-parallel plan of {type(model).__name__} matches none of its modules "
                         f"(e.g. {unmatched[0]!r})")
    return plan


# ---- quantized linears (models/quantized.py): cut by their own rows() / columns() ------------------

_COLWISE, _ROWWISE = ("colwise", "unit_colwise"), ("rowwise", "unit_rowwise")


def _quantized_cuts(model, plan: dict[str, str], degree: int) -> list[tuple[str, torch.nn.Module, str]]:
    """(name, layer, "rows" | "columns" | "kv") for each quantized linear the plan shards; a style
    other than colwise / rowwise on one is refused by name."""
    from metainfer.models.quantized import QUANTIZED

    replicated = _replicated_kv(model, plan, degree) if _heads(model) else {}
    cuts = []
    for pattern, style in plan.items():
        if style in _GRADIENTS_ONLY:
            continue
        for name, m in _matching(model, pattern):
            if not isinstance(m, QUANTIZED):
                continue
            if pattern in replicated:
                cuts.append((name, m, "kv"))
            elif style in _COLWISE:
                cuts.append((name, m, "rows"))
            elif style in _ROWWISE:
                cuts.append((name, m, "columns"))
            else:
                raise ValueError(f"{name}: a quantized linear under tensor-parallel style {style!r}; metainfer cuts "
                                 "quantized weights colwise (rows) or rowwise (columns) only")
    return cuts


def _cut_range(name: str, m, how: str, rank: int, degree: int, heads) -> tuple[int, int]:
    if how == "kv":  # this rank's one key-value head, whole (ReplicatedHeads)
        kv, head_dim = heads[1], heads[2]
        head = rank // (degree // kv)
        return head * head_dim, (head + 1) * head_dim
    size = m.out_features if how == "rows" else m.in_features
    if size % degree:
        raise ValueError(f"{name}: {size} {'outputs' if how == 'rows' else 'inputs'} do not split over {degree} ranks")
    step = size // degree
    return rank * step, (rank + 1) * step


class RowParallelQuantized(torch.nn.Module):
    """A quantized linear's row-parallel shard: this rank's input columns (`local`), the partial
    sums all-reduced over the mesh (a functional collective, as DTensor's RowwiseParallel emits),
    the bias added once, after."""

    def __init__(self, local: torch.nn.Module, bias, mesh):
        super().__init__()
        self.local, self.mesh = local, mesh
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = local.in_features, local.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        y = funcol.all_reduce(self.local(x), "sum", self.mesh)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def _shard_quantized(model, cuts, mesh, heads) -> None:
    degree, rank = mesh.size(), mesh.get_local_rank()
    for name, m, how in cuts:
        lo, hi = _cut_range(name, m, how, rank, degree, heads)
        new = RowParallelQuantized(m.columns(lo, hi), m.bias, mesh) if how == "columns" else m.rows(lo, hi)
        new.train(m.training)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)


def _bare_parameter_ok(name: str, p: torch.Tensor, style: str) -> bool:
    return (style == "colwise" and p.dim() in (1, 2)) or (style == "rowwise" and not name.endswith("bias"))


def _local_chunk(t: torch.Tensor, dim: int, rank: int, degree: int, what: str) -> torch.nn.Parameter:
    if t.shape[dim] % degree:
        raise ValueError(f"{what}: size {t.shape[dim]} along dim {dim} does not split over {degree} ranks")
    return torch.nn.Parameter(t.detach().chunk(degree, dim)[rank].clone(), requires_grad=False)


def _interleave(module: torch.nn.Module, degree: int) -> None:
    """A packed colwise weight and bias ([gate; up] along the output dim) reordered so that rank
    r's contiguous chunk is [gate_r; up_r]: the module's own split of its local output then
    finds its halves."""
    for name, dim in (("weight", 0), ("bias", 0)):
        t = getattr(module, name, None)
        if t is None:
            continue
        n = t.shape[dim]
        if n % (2 * degree):
            raise ValueError(f"packed {name} of {n} along dim {dim} does not split into 2 x {degree} shards")
        parts = [p.chunk(degree, dim) for p in t.detach().chunk(2, dim)]
        setattr(module, name, torch.nn.Parameter(
            torch.cat([q for r in range(degree) for q in (parts[0][r], parts[1][r])], dim), requires_grad=False))


def shard(model: torch.nn.Module, mesh) -> dict[str, str]:
    """Shard `model` in place over the 1-D `mesh` with its plan; returns the plan."""
    from torch.distributed.tensor.parallel import parallelize_module

    degree, rank = mesh.size(), mesh.get_local_rank()
    plan = check_shardable(model, degree)
    replicated = _replicated_kv(model, plan, degree) if _heads(model) else {}
    params = dict(model.named_parameters())
    cuts = _quantized_cuts(model, plan, degree)
    quantized = {name for name, _, _ in cuts}
    styles = {}
    for pattern, style in plan.items():
        if style in _GRADIENTS_ONLY:
            continue
        owners = _matching(model, pattern)
        if quantized & {n for n, _ in owners}:  # the float owners by name; the quantized cut below
            float_owners = [n for n, _ in owners if n not in quantized]
            if pattern in replicated:
                styles.update({n: ReplicatedHeads(*_heads(model)[1:]) for n in float_owners})
            else:
                styles.update({n: _TORCH_STYLES[style]() for n in float_owners})
            continue
        if not owners:  # a plan entry may name a bare parameter (per-head sinks): this rank's chunk
            for name in [n for n in params if fnmatch.fnmatchcase(n, pattern)]:
                parent, _, leaf = name.rpartition(".")
                dim = 0 if style == "colwise" else -1
                setattr(model.get_submodule(parent), leaf, _local_chunk(params[name], dim, rank, degree, name))
            continue
        if pattern in replicated:
            styles[pattern] = ReplicatedHeads(*_heads(model)[1:])
            continue
        if style == "packed_colwise":
            for _, m in owners:
                _interleave(m, degree)
        styles[pattern] = _TORCH_STYLES[style]()
    _shard_quantized(model, cuts, mesh, _heads(model))
    with warnings.catch_warnings():  # a pattern need not match in every layer (dense vs MoE layers)
        warnings.filterwarnings("ignore", message="Parallelize plan key")
        parallelize_module(model, mesh, styles)
    if replicated:
        h = _heads(model)[0]
        for m in model.modules():  # each rank: h / degree query heads over its one KV head
            if isinstance(getattr(m, "num_key_value_groups", None), int):
                m.num_key_value_groups = h // degree
    return plan


class ReplicatedHeads(ParallelStyle):
    """A K/V projection at a degree above the KV head count: rank r keeps, whole, the head its
    query heads read (r // (degree / kv)); the input is the replicated hidden state and the
    output this rank's heads, so there is nothing to communicate."""

    def __init__(self, kv: int, head_dim: int):
        self.kv, self.head_dim = kv, head_dim

    def _apply(self, module, mesh):
        head = mesh.get_local_rank() // (mesh.size() // self.kv)
        rows = slice(head * self.head_dim, (head + 1) * self.head_dim)
        module.weight = torch.nn.Parameter(module.weight.detach()[rows].clone(), requires_grad=False)
        if getattr(module, "bias", None) is not None:
            module.bias = torch.nn.Parameter(module.bias.detach()[rows].clone(), requires_grad=False)
        return module


# ---- expert parallelism ------------------------------------------------------------------

def hf_expert_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules Hugging Face's expert-parallel plan dispatches to (`ep_dispatch_experts`)."""
    out = []
    for pattern, style in ep_plan(model).items():
        if style == "ep_dispatch_experts":
            out += [(n, m) for n, m in _matching(model, pattern) if isinstance(getattr(m, "num_experts", None), int)]
    return out


def _expert_weights(model: torch.nn.Module, name: str, experts: torch.nn.Module) -> list[str]:
    """The parameters (names relative to `experts`) the plan's `grouped_gemm` entries split by
    expert; any other parameter with a leading dim of E would be read with local ids: refused."""
    named = [n for pattern, style in ep_plan(model).items() if style == "grouped_gemm"
             for n, _ in experts.named_parameters() if fnmatch.fnmatchcase(f"{name}.{n}", pattern)]
    E = experts.num_experts
    left = [n for n, p in experts.named_parameters() if n not in named and p.dim() >= 1 and p.shape[0] == E]
    if not named or left:
        raise ValueError(f"{name}: the expert-parallel plan splits {named or 'none'} of its per-expert parameters"
                         + (f" but not {left}" if left else "") + ": cannot spread its experts")
    return named


def _own_moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """models/ MoE layers, which spread their own experts (`shard_experts`)."""
    return [m for m in model.modules() if callable(getattr(m, "shard_experts", None))]


def has_experts(model: torch.nn.Module) -> bool:
    """Whether `model` has MoE layers that expert_parallel() can spread."""
    return bool(_own_moe_layers(model) or hf_expert_modules(model))


def check_expert_parallel(model: torch.nn.Module, degree: int) -> list[tuple[str, torch.nn.Module, list[str]]]:
    """Refuse, before any collective, experts that cannot be spread over `degree` ranks; the
    Hugging Face experts modules with the weights to slice."""
    hf = [(name, m, _expert_weights(model, name, m)) for name, m in hf_expert_modules(model)]
    counts = {m.n_experts for m in _own_moe_layers(model)} | {m.num_experts for _, m, _ in hf}
    bad = sorted(e for e in counts if e % degree)
    if bad:
        raise ValueError(f"{bad[0]} experts do not split over {degree} ranks for expert parallelism")
    return hf


def expert_parallel(model: torch.nn.Module, group) -> int:
    """Spread the routed experts of every MoE layer over the group's ranks; returns how many
    layers."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hf = check_expert_parallel(model, world)
    layers = _own_moe_layers(model)
    for m in layers:
        m.shard_experts(rank, world, group)
    for name, m, weights in hf:
        _spread_hf_experts(name, m, weights, rank, world, group)
    return len(layers) + len(hf)


def _spread_hf_experts(name: str, experts: torch.nn.Module, weights: list[str], rank: int, world: int,
                       group) -> None:
    """Keep experts [rank E/world, (rank+1) E/world) of a transformers experts module: its
    per-expert `weights` sliced, `num_experts` the local count, routing ids shifted
    (others point at the sentinel E/world with weight 0, which transformers' experts skip),
    the ranks' partial outputs summed."""
    from torch.distributed import _functional_collectives as funcol

    per = experts.num_experts // world  # check_expert_parallel: it divides
    lo = rank * per
    for pname in weights:
        parent, _, leaf = pname.rpartition(".")
        owner = experts.get_submodule(parent) if parent else experts
        p = getattr(owner, leaf)
        setattr(owner, leaf, torch.nn.Parameter(p.detach()[lo:lo + per].clone(), requires_grad=False))
    experts.num_experts = per
    if hasattr(experts, "_is_expert_parallel"):  # transformers' implementations mask the sentinel ids
        experts._is_expert_parallel = True

    def local_routing(module, args, kwargs):
        if len(args) < 3:
            raise TypeError(f"{name}: expert parallelism expects the experts called as (hidden, ids, weights) "
                            f"positionally, got {len(args)} positional argument(s) and {sorted(kwargs)}")
        hidden, ids, weights = args[:3]
        local = ids - lo
        off = (local < 0) | (local >= per)
        return (hidden, local.masked_fill(off, per), weights.masked_fill(off, 0.0), *args[3:]), kwargs

    experts.register_forward_pre_hook(local_routing, with_kwargs=True)
    experts.register_forward_hook(lambda module, args, out: funcol.all_reduce(out, "sum", group))
