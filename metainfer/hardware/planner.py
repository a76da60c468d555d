"""The planner: which parallelism plan to run a model with on a target, per phase, how much
it can hold, and how long a speculative draft pays.

    result = metainfer.plan("llama3-70b", "pcie8", batch=64, seq=4096)
    print(result)                      # candidates per phase, the chosen plans and why
    result.to_dict()                   # the same as JSON (`metainfer plan --json`)

A plan splits the target's N devices as tp x dp x pp (x ep for MoE experts):
- `tp`: tensor parallel inside each replica: attention heads, MLP columns/rows, the
  vocabulary; two all-reduces per layer.
- `dp`: replicas of attention (data parallel over sequences). For a dense model they are
  whole replicas; for MoE with expert parallelism this is DeepSeek's "DP attention".
- `pp`: pipeline stages of layers/pp layers, activations sent between stages.
- `ep`: experts spread over the ep = tp x dp ranks of a stage, tokens sent to their experts
  and back by all-to-all; ep = 1 keeps every expert on every rank, split like the MLP (tp).

Each plan is priced by running one modelled layer per kind (dense, MoE) through the
simulator's timeline with the cost model (metainfer.hardware.cost): its GEMMs, attention, norms and
collectives at the plan's per-rank shapes, collectives on the best algorithm for the target
(what metainfer's collective selection picks), issued and waited in order (no overlap): the
floor is the same layer with communication fully hidden. Throughput is for a steady stream
of such batches (pipeline stages kept busy). Everything here is a prediction from a model.

Capacity, per device: weights + activation workspace + KV cache within 90% of memory (the
rest for the runtime, as vLLM's default gpu_memory_utilization); the KV budget gives the
tokens each replica can cache and so the longest context a plan supports.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from metainfer.hardware import cost
from metainfer.hardware import targets as _targets
from metainfer.hardware.shapes import ModelShape, resolve
from metainfer.hardware.simulate import Timeline

MEMORY_UTILIZATION = 0.9
PHASES = ("prefill", "decode")
MAX_DRAFT = 8


class PlanError(ValueError):
    """No plan can run the model on the target (it does not fit), or bad planner input."""


@dataclass(frozen=True)
class Plan:
    tp: int
    dp: int
    pp: int
    ep: int  # 1, or tp * dp

    @property
    def devices(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def executable(self) -> bool:
        """Whether metainfer runs this plan inside a job today: tensor parallel in groups of
        tp ranks, replicated dp times, experts spread only inside a tensor-parallel group (its
        ranks see the same tokens, so an all-reduce combines their experts' outputs). Pipeline
        stages and all-to-all expert dispatch across replicas are priced, not executed."""
        return self.pp == 1 and (self.ep == 1 or self.dp == 1)

    @property
    def label(self) -> str:
        parts = [f"tp{self.tp}"]
        if self.dp > 1:
            parts.append(f"dp{self.dp}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return " ".join(parts)


@dataclass
class Capacity:
    weights_bytes: float  # per device (the fullest one)
    activation_bytes: float
    kv_budget_bytes: float  # per device, after weights and workspace
    kv_tokens_per_replica: int  # tokens one dp replica can cache
    kv_tokens_total: int  # over the whole box
    max_context: int  # one sequence: memory and the model's position limit
    max_context_by_memory: int
    fits: bool
    why: str = ""

    @property
    def million_token_context(self) -> bool:
        return self.max_context_by_memory >= 1 << 20


@dataclass
class Candidate:
    plan: Plan
    phase: str
    capacity: Capacity
    step_seconds: float = math.inf  # one batch, steady state
    floor_seconds: float = math.inf
    comm_seconds: float = 0.0
    tokens: int = 0  # tokens produced (decode) or processed (prefill) per step
    # speculative decoding (decode, with an acceptance rate): the best draft length and the
    # step of a verify over draft + 1 tokens plus the draft steps. A what-if: nothing applies
    # a draft length yet, so it never enters tokens_per_second
    draft: int = 0
    accepted_per_step: float = 1.0
    speculative_step_seconds: float = math.inf
    runs: bool = False
    why_not: str = ""

    @property
    def executable(self) -> bool:
        return self.plan.executable

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step_seconds if self.runs else 0.0

    @property
    def floor_tokens_per_second(self) -> float:
        return self.tokens / self.floor_seconds if self.runs else 0.0

    @property
    def speculative_tokens_per_second(self) -> float:
        """Tokens per second with the draft (not executed yet); 0 without one."""
        return self.tokens * self.accepted_per_step / self.speculative_step_seconds if self.runs and self.draft else 0.0

    def to_dict(self) -> dict[str, Any]:
        c = self.capacity
        return {"plan": self.plan.label, "tp": self.plan.tp, "dp": self.plan.dp, "pp": self.plan.pp,
                "ep": self.plan.ep, "runs": self.runs, "executable": self.executable, "why_not": self.why_not,
                "tokens_per_second": self.tokens_per_second, "floor_tokens_per_second": self.floor_tokens_per_second,
                "step_s": self.step_seconds if self.runs else None, "comm_s": self.comm_seconds,
                "draft_length": self.draft, "accepted_per_step": self.accepted_per_step,
                "speculative_tokens_per_second": self.speculative_tokens_per_second,
                "weights_gib_per_device": c.weights_bytes / 2**30, "kv_budget_gib_per_device": c.kv_budget_bytes / 2**30,
                "kv_tokens_total": c.kv_tokens_total, "max_context": c.max_context,
                "max_context_by_memory": c.max_context_by_memory, "million_token_context": c.million_token_context}


@dataclass
class PhasePlan:
    phase: str
    batch: int
    seq: int
    candidates: list[Candidate] = field(default_factory=list)
    chosen: Candidate | None = None  # the fastest plan metainfer executes
    what_if: Candidate | None = None  # a faster plan that nothing executes yet, if any
    reason: str = ""


@dataclass
class PlanResult:
    model: ModelShape
    target: _targets.Target
    phases: dict[str, PhasePlan]
    acceptance: float | None

    def to_dict(self) -> dict[str, Any]:
        out = {"model": self.model.to_dict(), "target": self.target.name, "acceptance_rate": self.acceptance,
               "predicted": True, "phases": {}}
        for name, ph in self.phases.items():
            out["phases"][name] = {
                "batch": ph.batch, "seq": ph.seq, "reason": ph.reason,
                "chosen": ph.chosen.to_dict() if ph.chosen else None,
                "what_if_not_executable": ph.what_if.to_dict() if ph.what_if else None,
                "candidates": [c.to_dict() for c in ph.candidates]}
        return out

    def __str__(self) -> str:
        t = self.target
        lines = [f"plan for {self.model} on {t.name} ({t.description}); predictions from metainfer's cost model, "
                 "not measurements"]
        for ph in self.phases.values():
            what = (f"{ph.batch} sequence(s) x {ph.seq} prompt tokens" if ph.phase == "prefill" else
                    f"{ph.batch} sequence(s), {ph.seq} tokens of context each")
            lines += ["", f"{ph.phase}: {what}"]
            rows = [("plan", "tok/s", "floor tok/s", "step ms", "comm %", "weights GiB/dev", "KV GiB/dev",
                     "max context", "note")]
            for c in sorted(ph.candidates, key=lambda c: -c.tokens_per_second):
                cap = c.capacity
                note = c.why_not if not c.runs else "; ".join(n for n in (
                    "" if c.executable else "not executable (priced only)",
                    f"what-if draft {c.draft}: {c.speculative_tokens_per_second:,.0f} tok/s "
                    f"({c.accepted_per_step:.2f} tok/step)" if c.draft else "") if n)
                rows.append((c.plan.label, f"{c.tokens_per_second:,.0f}" if c.runs else "-",
                             f"{c.floor_tokens_per_second:,.0f}" if c.runs else "-",
                             f"{c.step_seconds * 1e3:.2f}" if c.runs else "-",
                             f"{100 * c.comm_seconds / c.step_seconds:.0f}" if c.runs else "-",
                             f"{cap.weights_bytes / 2**30:.1f}", f"{max(cap.kv_budget_bytes, 0) / 2**30:.1f}",
                             _tokens(cap.max_context) if cap.fits else "-", note))
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
            for r in rows:
                lines.append("  " + "  ".join(r[i].rjust(widths[i]) if i else r[i].ljust(widths[i])
                                              for i in range(len(widths))) + "  " + r[-1])
            lines.append(f"  chosen: {ph.chosen.plan.label if ph.chosen else '(none executable)'}: {ph.reason}")
        return "\n".join(lines)


def _tokens(n: int) -> str:
    return f"{n / 2**20:.2f}M" if n >= 1 << 20 else f"{n / 1024:.0f}K" if n >= 1024 else str(n)


# ---- enumeration ---------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_plans(model: ModelShape, devices: int) -> list[tuple[Plan, str]]:
    """Every tp x dp x pp (x ep) split of `devices`, each with "" or why it cannot shard."""
    out = []
    for pp in _divisors(devices):
        for tp in _divisors(devices // pp):
            dp = devices // (pp * tp)
            for ep in ((1, tp * dp) if model.moe and tp * dp > 1 else (1,)):
                p = Plan(tp, dp, pp, ep)
                out.append((p, _why_not_shardable(model, p)))
    return out


def _why_not_shardable(m: ModelShape, p: Plan) -> str:
    if m.heads % p.tp:
        return f"{m.heads} heads do not split over tp {p.tp}"
    if not m.mla and m.kv_heads % p.tp and p.tp % m.kv_heads:
        return f"{m.kv_heads} kv heads neither split over nor replicate onto tp {p.tp}"
    if m.layers < p.pp:
        return f"{m.layers} layers cannot fill {p.pp} stages"
    if p.ep > 1 and m.experts % p.ep:
        return f"{m.experts} experts do not split over ep {p.ep}"
    return ""


# ---- capacity -------------------------------------------------------------------------

def _weights_per_device(m: ModelShape, p: Plan) -> float:
    att = m.attention_params()
    stage_layers = math.ceil(m.layers / p.pp)
    moe_frac = m.moe_layers / m.layers
    per_layer = (att["sharded"] / p.tp + att["whole"]) * m.weight_bytes
    dense = (1 - moe_frac) * m.mlp_params() / p.tp * m.weight_bytes
    moe = 0.0
    if m.moe:
        experts = m.experts * m.expert_params() / (p.ep if p.ep > 1 else p.tp)
        shared = 3 * m.hidden * m.shared_intermediate / (1 if p.ep > 1 else p.tp)  # whole with EP
        moe = moe_frac * (experts + shared) * m.weight_bytes
        moe += moe_frac * m.hidden * m.experts * 4  # the router, float32
    embed = m.vocab * m.hidden * m.act_bytes / p.tp  # embedding and LM head: vocabulary-parallel, bf16
    return stage_layers * (per_layer + dense + moe) + (2 * embed if p.pp == 1 else embed)


def activation_per_token(m: ModelShape, p: Plan) -> float:
    """Live activations per token inside one layer (fused attention: no score matrix)."""
    width = max(m.intermediate / p.tp, m.experts_per_token * m.expert_intermediate if m.moe else 0)
    heads = m.heads / p.tp
    return m.act_bytes * (4 * m.hidden + 2 * heads * (m.qk_dim + m.v_dim) + 3 * width)


def kv_per_token(m: ModelShape, p: Plan) -> float:
    """KV cache bytes of one token on one device: GQA heads split over tp (replicated where
    tp > kv heads); the MLA latent is not split by heads, every tp rank keeps it."""
    stage = math.ceil(m.layers / p.pp) / m.layers
    if m.mla:
        return m.kv_bytes_per_token() * stage
    return m.kv_bytes_per_token() * stage / min(p.tp, m.kv_heads)


def capacity(m: ModelShape, p: Plan, target, chunk_tokens: int, logits_rows: int) -> Capacity:
    mem = target.device.memory_bytes * MEMORY_UTILIZATION
    weights = _weights_per_device(m, p)
    act = chunk_tokens * activation_per_token(m, p) + logits_rows * m.vocab / p.tp * 4
    budget = mem - weights - act
    per_token = kv_per_token(m, p)
    tokens = int(budget // per_token) if budget > 0 else 0
    fits = weights + act < mem
    why = "" if fits else (f"needs {weights / 2**30:.1f} GiB of weights + {act / 2**30:.1f} GiB of activations per "
                           f"device, {mem / 2**30:.1f} GiB usable ({MEMORY_UTILIZATION:.0%} of {target.device.memory_bytes / 2**30:.1f})")
    return Capacity(weights, act, budget, tokens, tokens * p.dp, min(tokens, m.max_context), tokens, fits, why)


# ---- one modelled layer through the timeline ---------------------------------------------

class _Layer:
    """Per-rank work of one layer for `tokens` tokens (over `seqs` sequences) attending to
    `context` keys each (prefill: the prompt itself, causal)."""

    def __init__(self, m: ModelShape, p: Plan, target, phase: str, tokens: float, seqs: float, context: float):
        self.m, self.p, self.t, self.phase = m, p, target, phase
        self.tokens, self.seqs, self.context = tokens, seqs, context
        self.tl = Timeline(target)
        fp8 = m.weight_bytes < 2 and target.pass_options.get("fp8_mode") == "w8a8"
        self.gemm_key = "fp8" if fp8 else "bf16"

    # each modelled kernel is priced by the cost model's one kernel formula (cost.kernel_cost),
    # as the op the target's pipeline emits for it: a matmul, or metainfer's custom op as its
    # declaration says it runs (cost.custom_op_cost, kernels/spec.py)

    def gemm(self, name: str, k: float, n: float, tokens: float | None = None, weights: float | None = None):
        """tokens x k @ k x n; the weight read once (`weights` experts' worth of it)."""
        t = self.tokens if tokens is None else tokens
        w_bytes = k * n * self.m.weight_bytes * (1 if weights is None else weights)
        c = cost.kernel_cost(2 * t * k * n, w_bytes + t * (k + n) * self.m.act_bytes, self.gemm_key, self.t,
                             "fp8_linear" if self.gemm_key == "fp8" else None, gemm=True)
        self.tl.compute(name, c.seconds, detail=f"{c.bound}-bound")

    def pointwise(self, name: str, elements: float, passes: int = 2):
        """A fused element-wise kernel (`passes` reads and writes of `elements`); `name` is
        metainfer's op for it, kept only where the target's cost gate finds it no slower than
        the kernel the lowering would generate, as the pass manager does."""
        flops, nbytes = elements, passes * elements * self.m.act_bytes
        c = min(cost.custom_op_cost(name, flops, nbytes, "bf16", self.t), cost.kernel_cost(flops, nbytes, "bf16", self.t),
                key=lambda c: c.seconds)
        self.tl.compute(name, c.seconds)

    def attention_core(self, name: str, heads: float, qk: float, v: float, kv_bytes_per_key: float):
        """metainfer's `name` op ("attention" or "mla_decode") over the cached keys."""
        keys = self.context
        if self.m.index_topk:
            keys = min(keys, self.m.index_topk)
        if self.phase == "prefill":
            keys = keys / 2  # causal: on average half the prompt
        flops = 2 * self.tokens * heads * keys * (qk + v)
        cache = self.seqs * self.context * kv_bytes_per_key  # every sequence's keys read once
        io = self.tokens * heads * (qk + v) * self.m.act_bytes
        c = cost.custom_op_cost(name, flops, cache + io, "bf16", self.t)
        self.tl.compute(name, c.seconds, detail=f"{c.bound}-bound")

    def collective(self, kind: str, nbytes: float, ranks: int):
        if ranks <= 1 or nbytes <= 0:
            return
        c = cost.best(kind, nbytes, self.t, ranks=ranks)
        self.tl.wait(self.tl.communicate(c, c.seconds, self.tl.compute_free))

    def attention(self):
        m, p = self.m, self.p
        H = m.heads / p.tp
        self.pointwise("add_rmsnorm", self.tokens * m.hidden, passes=4)  # residual add + norm
        if m.mla:
            if m.q_lora_rank:
                self.gemm("q_a", m.hidden, m.q_lora_rank)
            self.gemm("q_b", m.q_lora_rank or m.hidden, H * m.qk_dim)
            self.gemm("kv_a", m.hidden, m.kv_lora_rank + m.qk_rope_head_dim)
            if m.index_heads:  # DSA indexer: scores every cached key with its own small heads
                self.gemm("indexer_q", m.q_lora_rank or m.hidden, m.index_heads * m.index_head_dim)
                flops = 2 * self.tokens * self.context * m.index_heads * m.index_head_dim
                flops /= 2 if self.phase == "prefill" else 1
                c = cost.kernel_cost(flops, self.seqs * self.context * m.index_head_dim * m.act_bytes, "fp8", self.t)
                self.tl.compute("indexer", c.seconds)
            latent = (m.kv_lora_rank + m.qk_rope_head_dim) * m.act_bytes
            if self.phase == "prefill":  # decompress the prompt's latent, attend over full heads
                self.gemm("kv_b", m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim))
                self.attention_core("attention", H, m.qk_dim, m.v_head_dim, 0.0)
            else:  # absorbed: the queries move into the latent space, the cache stays compressed
                self.gemm("q_absorb", m.qk_nope_head_dim, m.kv_lora_rank, tokens=self.tokens * H, weights=H)
                self.attention_core("mla_decode", H, m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank, latent)
                self.gemm("v_absorb", m.kv_lora_rank, m.v_head_dim, tokens=self.tokens * H, weights=H)
            self.gemm("o", H * m.v_head_dim, m.hidden)
        else:
            kv = max(m.kv_heads / p.tp, 1)
            self.gemm("qkv", m.hidden, (H + 2 * kv) * m.head_dim)
            self.pointwise("rope", self.tokens * (H + kv) * m.head_dim)
            self.attention_core("attention", H, m.head_dim, m.head_dim, 2 * kv * m.head_dim * m.act_bytes)
            self.gemm("o", H * m.head_dim, m.hidden)
        self.collective("all_reduce", self.tokens * m.hidden * m.act_bytes, p.tp)

    def dense_mlp(self, width: float):
        self.pointwise("add_rmsnorm", self.tokens * self.m.hidden, passes=4)
        self.gemm("gate_up", self.m.hidden, 2 * width / self.p.tp)
        self.pointwise("swiglu", self.tokens * width / self.p.tp, passes=3)
        self.gemm("down", width / self.p.tp, self.m.hidden)
        self.collective("all_reduce", self.tokens * self.m.hidden * self.m.act_bytes, self.p.tp)

    def moe(self):
        m, p = self.m, self.p
        self.pointwise("add_rmsnorm", self.tokens * m.hidden, passes=4)  # residual add + norm
        self.gemm("router", m.hidden, m.experts)
        k, I = m.experts_per_token, m.expert_intermediate
        if p.ep > 1:
            # each tp rank sends its 1/tp share of the (replicated) tokens to their experts
            send = self.tokens / p.tp
            pairs = self.tokens * p.dp * k / p.ep  # token-expert pairs each rank computes (balanced)
            local = m.experts / p.ep
            self.collective("all_to_all", send * k * m.hidden * m.act_bytes, p.ep)
        else:
            pairs, local = self.tokens * k, m.experts
        touched = local * (1 - (1 - 1 / m.experts) ** (self.tokens * p.dp * k if p.ep > 1 else self.tokens * k))
        split = 1 if p.ep > 1 else p.tp
        # the experts as fuse_moe emits them, one metainfer.moe_experts call: three GEMMs per
        # (token, expert) pair, the weights of the experts that received tokens read once
        width = I / split
        c = cost.custom_op_cost("moe_experts", 2 * pairs * 3 * m.hidden * width,
                                touched * 3 * m.hidden * width * m.weight_bytes + pairs * 2 * m.hidden * m.act_bytes,
                                self.gemm_key, self.t, experts=touched)
        self.tl.compute("moe_experts", c.seconds, detail=f"{c.bound}-bound")
        if p.ep > 1:
            # back to the token's rank; the shared expert (whole on every rank) runs on the
            # rank's token share, and the tp ranks gather their shares
            self.collective("all_to_all", self.tokens / p.tp * k * m.hidden * m.act_bytes, p.ep)
            if m.shared_intermediate:
                self.gemm("shared_gate_up", m.hidden, 2 * m.shared_intermediate, tokens=self.tokens / p.tp)
                self.gemm("shared_down", m.shared_intermediate, m.hidden, tokens=self.tokens / p.tp)
            self.collective("all_gather", self.tokens * m.hidden * m.act_bytes, p.tp)
            return
        if m.shared_intermediate:
            self.gemm("shared_gate_up", m.hidden, 2 * m.shared_intermediate / p.tp)
            self.gemm("shared_down", m.shared_intermediate / p.tp, m.hidden)
        self.collective("all_reduce", self.tokens * m.hidden * m.act_bytes, p.tp)


def _layer_time(kind: str, m, p, target, phase, tokens, seqs, context) -> tuple[float, float, float]:
    """(step, floor, communication) seconds of one layer of `kind` ("dense" or "moe")."""
    layer = _Layer(m, p, target, phase, tokens, seqs, context)
    layer.attention()
    if kind == "moe":
        layer.moe()
    else:
        layer.dense_mlp(m.intermediate)
    s = layer.tl.schedule()
    return s.step_seconds, s.floor_seconds, s.comm_seconds


def _head_time(m: ModelShape, p: Plan, target, rows: float) -> tuple[float, float]:
    """LM head on the rows that need logits (vocabulary-parallel) and gathering them."""
    c = cost.kernel_cost(2 * rows * m.hidden * m.vocab / p.tp, m.hidden * m.vocab / p.tp * m.act_bytes, "bf16", target,
                         gemm=True)
    comm = cost.best("all_gather", rows * m.vocab * 4, target, ranks=p.tp).seconds if p.tp > 1 else 0.0
    return c.seconds + comm, comm


def step_time(m: ModelShape, p: Plan, target, phase: str, batch: int, seq: int,
              tokens_per_seq: int = 1) -> tuple[float, float, float]:
    """(step, floor, communication) seconds for one batch through the whole model, steady
    state: each replica takes ceil(batch / dp) sequences, split into pp micro-batches."""
    seqs = math.ceil(batch / p.dp)
    per_seq = seq if phase == "prefill" else tokens_per_seq
    micro = max(1, min(p.pp, seqs))
    mb_seqs = seqs / micro
    tokens = mb_seqs * per_seq
    context = seq
    stage_layers = m.layers / p.pp
    total = floor = comm = 0.0
    for kind, count in (("dense", m.layers - m.moe_layers), ("moe", m.moe_layers)):
        if count:
            s, f, c = _layer_time(kind, m, p, target, phase, tokens, mb_seqs, context)
            share = count / m.layers * stage_layers
            total, floor, comm = total + share * s, floor + share * f, comm + share * c
    if p.pp > 1:  # the stage hands its activations on (the last hop crosses islands on 2 x 4)
        across = target.topology.inter_island is not None and len(target.topology.islands) > 1
        send = cost.send_cost(tokens * m.hidden * m.act_bytes, target, across_islands=across).seconds
        total, comm = total + send, comm + send
    head, head_comm = _head_time(m, p, target, mb_seqs * tokens_per_seq)
    total, floor, comm = total + head, floor + head - head_comm, comm + head_comm
    # `total` is one stage's time per micro-batch. Prefill streams independent prompts, so a
    # batch occupies each stage for `micro` slots; a decode step needs the previous step's
    # token, so a batch's step takes all pp stages in turn (its micro-batches fill them).
    scale = micro if phase == "prefill" else p.pp
    return total * scale, floor * scale, comm * scale


# ---- the planner ----------------------------------------------------------------------

def expected_accepted(acceptance: float, draft: int) -> float:
    """Tokens a verify step yields per sequence with `draft` drafted tokens, each accepted
    with probability `acceptance` until the first rejection, plus the verifier's own token."""
    if acceptance >= 1:
        return draft + 1.0
    return (1 - acceptance ** (draft + 1)) / (1 - acceptance)


def best_draft_length(acceptance: float, verify_seconds, draft_seconds, max_draft: int = MAX_DRAFT
                      ) -> tuple[int, float, float]:
    """(k, accepted tokens per step, step seconds) maximising accepted tokens per second over
    k in 0..max_draft (0: no speculation): a step is one verify over k + 1 tokens per sequence,
    `verify_seconds(k + 1)`, plus drafting k tokens, `draft_seconds(k)` (0 for k = 0)."""
    best = (0, 1.0, verify_seconds(1))
    for k in range(1, max_draft + 1):
        step = verify_seconds(k + 1) + draft_seconds(k)
        acc = expected_accepted(acceptance, k)
        if acc / step > best[1] / best[2]:
            best = (k, acc, step)
    return best


def one_layer_drafter(m: ModelShape) -> ModelShape:
    """The drafter the cost model prices: one layer of the model (MoE if the model has experts,
    as DeepSeek's MTP layer) plus its embedding and head."""
    return dataclasses.replace(m, name=f"{m.name} one-layer drafter", layers=1, dense_layers=0 if m.moe else 1)


def _best_draft(m, p, target, batch, seq, acceptance: float) -> tuple[int, float, float]:
    """best_draft_length with predicted times: a verify step of the model on plan p, and
    `draft` steps of a one-layer drafter (an MTP head, as DeepSeek's) on the same plan."""
    draft_step = step_time(one_layer_drafter(m), Plan(p.tp, p.dp, 1, p.ep), target, "decode", batch, seq)[0]
    return best_draft_length(
        acceptance, lambda n: step_time(m, p, target, "decode", batch, seq, tokens_per_seq=n)[0],
        lambda k: k * draft_step)


def plan(model, target: _targets.Target, *, phases=PHASES, batch: int | dict | None = None, seq: int | dict | None = None,
         acceptance: float | None = None) -> PlanResult:
    """Price every parallelism plan of `model` on `target` for each phase and choose the one
    with the highest predicted throughput that fits; see the module docstring. `target` is a
    Target (metainfer.plan takes a name or TOML path too).

    model: a models/ name or config, a Hugging Face config (object or config.json path), or a
        ModelShape.
    phases: "prefill", "decode" or both.
    batch, seq: sequences per batch and tokens (prefill: prompt length; decode: context);
        an int for both phases or a dict per phase. Defaults: prefill 4 x 4096, decode 64 x 4096.
    acceptance: speculative decoding's per-token acceptance rate in [0, 1]; with it, decode
        picks the draft length that maximises accepted tokens per second.
    Raises PlanError when no plan fits the model on the target."""
    m = resolve(model)
    t = _targets.required(target, "planner.plan")
    phases = (phases,) if isinstance(phases, str) else tuple(phases)
    for ph in phases:
        if ph not in PHASES:
            raise PlanError(f"unknown phase {ph!r}; phases: {', '.join(PHASES)}")
    if acceptance is not None and not 0 <= acceptance <= 1:
        raise PlanError(f"acceptance rate must be in [0, 1], got {acceptance!r}")
    defaults = {"prefill": (4, 4096), "decode": (64, 4096)}
    result = PlanResult(m, t, {}, acceptance)
    plans = candidate_plans(m, t.num_devices)
    for ph in phases:
        b = _per_phase(batch, ph, defaults[ph][0], "batch")
        s = _per_phase(seq, ph, defaults[ph][1], "seq")
        pp_out = PhasePlan(ph, b, s)
        for p, why in plans:
            seqs = math.ceil(b / p.dp)
            chunk = seqs * (s if ph == "prefill" else 1) / max(1, min(p.pp, seqs))
            cap = capacity(m, p, t, chunk_tokens=chunk, logits_rows=seqs)
            c = Candidate(p, ph, cap)
            needed = seqs * (s + (1 if ph == "decode" else 0))
            if why:
                c.why_not = why
            elif not cap.fits:
                c.why_not = "does not fit: " + cap.why
            elif cap.kv_tokens_per_replica < needed:
                c.why_not = (f"KV cache holds {cap.kv_tokens_per_replica:,} tokens per replica, the batch needs "
                             f"{needed:,}")
            else:
                c.runs = True
                if ph == "prefill":
                    c.step_seconds, c.floor_seconds, c.comm_seconds = step_time(m, p, t, ph, b, s)
                    c.tokens = b * s
                else:
                    c.step_seconds, c.floor_seconds, c.comm_seconds = step_time(m, p, t, ph, b, s)
                    c.tokens = b
                    if acceptance is not None:
                        c.draft, c.accepted_per_step, c.speculative_step_seconds = _best_draft(m, p, t, b, s, acceptance)
            pp_out.candidates.append(c)
        _choose(pp_out, m, t)
        result.phases[ph] = pp_out
    return result


def _per_phase(value, phase: str, default: int, what: str) -> int:
    v = value.get(phase, default) if isinstance(value, dict) else (default if value is None else value)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise PlanError(f"{what} must be a positive integer, got {v!r}")
    return v


def _choose(ph: PhasePlan, m: ModelShape, t) -> None:
    running = sorted((c for c in ph.candidates if c.runs), key=lambda c: -c.tokens_per_second)
    if not running:
        shardable = [c for c in ph.candidates if not _why_not_shardable(m, c.plan)]
        if not shardable:
            raise PlanError(f"{m.name} cannot be sharded over {t.num_devices} devices: "
                            + "; ".join(sorted({c.why_not for c in ph.candidates})))
        if not any(c.capacity.fits for c in shardable):
            least = min(shardable, key=lambda c: c.capacity.weights_bytes)
            usable = t.device.memory_bytes * MEMORY_UTILIZATION
            raise PlanError(
                f"{m.name} does not fit {t.name}: {m.params() / 1e9:.0f}B parameters are "
                f"{m.params() * m.weight_bytes / 2**30:.0f} GiB of weights, {least.capacity.weights_bytes / 2**30:.1f} GiB "
                f"per device even as {least.plan.label}, and each {t.device.name} has {usable / 2**30:.1f} GiB usable "
                f"({t.num_devices} x {t.device.memory_bytes / 2**30:.1f} GiB in all)")
        raise PlanError(f"no plan of {m.name} on {t.name} runs {ph.phase} with {ph.batch} sequence(s) x {ph.seq} "
                        "tokens: " + "; ".join(f"{c.plan.label}: {c.why_not}" for c in shardable))
    executable = [c for c in running if c.executable]
    faster = running[0] if not running[0].executable else None
    ph.what_if = faster
    if not executable:
        ph.reason = (f"no plan that fits is one metainfer executes (pipeline stages or all-to-all expert dispatch "
                     f"are priced only); fastest of them {faster.plan.label}, {faster.tokens_per_second:,.0f} tok/s")
        return
    best = executable[0]
    ph.chosen = best
    comm = best.comm_seconds / best.step_seconds
    reason = f"highest predicted throughput of the plans metainfer executes, {best.tokens_per_second:,.0f} tok/s"
    if len(executable) > 1:
        nxt = executable[1]
        reason += f" ({best.tokens_per_second / nxt.tokens_per_second:.2f}x {nxt.plan.label})"
    reason += f"; communication {comm:.0%} of the step, floor {best.floor_tokens_per_second:,.0f} tok/s"
    if faster is not None:
        reason += (f"; not executable yet: {faster.plan.label} would give {faster.tokens_per_second:,.0f} tok/s "
                   f"({faster.tokens_per_second / best.tokens_per_second:.2f}x)")
    if ph.phase == "decode" and best.draft:
        reason += (f"; what-if, not applied yet: speculative draft length {best.draft} "
                   f"({best.accepted_per_step:.2f} tokens accepted per step) would give "
                   f"{best.speculative_tokens_per_second:,.0f} tok/s")
    reason += f"; holds {_tokens(best.capacity.kv_tokens_total)} KV tokens, max context {_tokens(best.capacity.max_context)}"
    if best.capacity.max_context_by_memory > best.capacity.max_context:
        reason += f" (memory allows {_tokens(best.capacity.max_context_by_memory)}; the model's positions end there)"
    ph.reason = reason
