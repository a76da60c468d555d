"""Differential fuzzing: random Hugging Face models and inputs through metainfer against eager,
and random request streams through the serving engine against the plain engine.

    python bench/fuzz.py --cases 20 --seed 0 [--streams 1] [--json]     # CI's short run
    python bench/fuzz.py --cases 500 --streams 20 --seed 1               # the long run
    python bench/fuzz.py --case '{"arch": "Llama", ...}'                 # replay one case

Model cases. A case is drawn from a seeded generator (one `random.Random(seed * 1_000_003 + i)`
per case, so case i replays alone): an architecture (ARCHS below: the decoder-only causal LMs
transformers ships whose tiny configs build and run offline and whose attention, norms, MLPs
and MoE metainfer's passes claim; OUT_OF_SCOPE says why the others are not drawn), its config
knobs (heads, KV heads, head dim, hidden and intermediate sizes, layers, rope type and scaling,
tied embeddings, biases, norm eps, sliding window, soft-capping, MoE experts / top-k / shared
experts, MLA ranks: each where the config has the field), the attention implementation, dtype
(fp32 / bf16), lowering (inductor / aot_eager), batch and sequence lengths (1 and odd sizes
included) and a left-padding mask. It runs optimize(..., verify=True), the forward and a greedy
generate() of 4 tokens against eager.

Tolerance (from outside metainfer): both outputs are compared with the same model in float64
on the same inputs; err(x) = ||x - ref64|| / ||ref64|| over the positions the mask keeps. A
forward mismatches when err(metainfer) > 3 err(eager) + 2u (u: the dtype's unit roundoff,
2^-24 for fp32, 2^-8 for bf16): metainfer may round differently from eager, not by more than
eager's own distance from exact arithmetic. Greedy tokens mismatch at the first position where
they differ unless the two tokens' float64 logits there are closer than eager's largest logit
error at that step (a tie that either order of rounding may break).

A mismatch is shrunk (fewer layers, smaller batch and sequence, knobs back to their defaults,
while it still mismatches) and bisected to the first pass that breaks it (metainfer.bisect);
the reproduction is one line, `python bench/fuzz.py --case '<json>'`.

Serving streams: bench/fuzz_serving.py (a random stream through opt.init_continuous_batching
checked against invariants).

With --json the last line is one JSON object: {"cases", "architectures", "mismatches",
"crashes", "failures": [reproductions], "by_architecture", "streams", "stream_failures"}.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import random
import sys
import time
import traceback

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# architecture -> config fields every case of it sets (constraints of the family, not knobs)
ARCHS: dict[str, dict] = {
    "Llama": {}, "Qwen2": {}, "Qwen3": {}, "Mistral": {}, "Ministral": {}, "Phi3": {},
    "Gemma": dict(hidden_activation="gelu_pytorch_tanh"), "Gemma2": {}, "Gemma3Text": {},
    "Glm4": {}, "Olmo2": {}, "Granite": {}, "StableLm": {}, "GPTNeoX": {}, "Phi": {}, "Starcoder2": {},
    "Cohere": {}, "SmolLM3": {}, "Exaone4": {}, "Helium": {}, "Arcee": {},
    "Mixtral": {}, "Qwen2Moe": {}, "Qwen3Moe": {}, "DeepseekV3": {},
}
# what a family's config or code allows, where it is narrower than the knobs drawn for all
ATTN = {"Gemma2": ("eager",)}  # transformers refuses sdpa for Gemma 2 (its soft-capping)
ROPE = {"Phi3": ("default",)}  # Phi-3 validates its own rope types (longrope needs per-dim factor lists)
HIDDEN_IS_HEADS_X_HEAD_DIM = {"Helium"}  # its o_proj assumes it
OUT_OF_SCOPE = {
    "GPT2, GPTJ, Bloom, OPT, CodeGen, GPTBigCode": "absolute or ALiBi positions and fused QKV layouts: no pass "
                                                    "claims their attention (they run unchanged)",
    "DeepseekV32": "its sparse attention's indexer draws a top-k over all keys per query: covered by "
                   "tests/test_pass_deepseek.py at fixed shapes; too slow per case here",
    "GptOss, Qwen3Next, Lfm2, Zamba2, MiniMax": "sinks, linear attention or state-space layers: no pass claims them",
}
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


@dataclasses.dataclass
class Case:
    arch: str
    config: dict
    attn: str
    dtype: str
    lowering: str
    batch: int
    seq: int
    pad: list[int]  # left padding per row
    seed: int
    experts: str | None = None  # MoE: transformers' experts implementation (eager, grouped_mm, batched_mm)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Case":
        return Case(**json.loads(text))


@dataclasses.dataclass
class Outcome:
    status: str  # ok | mismatch | crash | invalid (eager itself fails: not counted)
    detail: str = ""
    passes: dict = dataclasses.field(default_factory=dict)
    pass_name: str | None = None
    err_opt: float = 0.0
    err_eager: float = 0.0


# ---- drawing a case ---------------------------------------------------------------------------

def _defaults(arch: str):
    import transformers

    return getattr(transformers, f"{arch}Config")()


def draw(rng: random.Random, arch: str | None = None) -> Case:
    arch = arch or rng.choice(sorted(ARCHS))
    d = _defaults(arch)
    has = lambda k: hasattr(d, k)  # noqa: E731
    heads = rng.choice([1, 2, 4, 4, 6])
    kv = rng.choice([h for h in (1, 2, 3, 4, 6) if heads % h == 0])
    head_dim = rng.choice([8, 16, 16, 32])
    cfg = dict(vocab_size=rng.randint(96, 160), num_hidden_layers=rng.choice([1, 2, 2, 3]),
               num_attention_heads=heads, intermediate_size=rng.choice([16, 40, 64, 96]),
               max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               tie_word_embeddings=rng.random() < 0.5, **ARCHS[arch])
    own_head_dim = has("head_dim") and arch not in HIDDEN_IS_HEADS_X_HEAD_DIM and rng.random() < 0.5
    cfg["hidden_size"] = heads * (rng.choice([8, 12, 16]) if own_head_dim else head_dim)
    if has("head_dim"):
        cfg["head_dim"] = head_dim
    if has("num_key_value_heads"):
        cfg["num_key_value_heads"] = kv
    for eps in ("rms_norm_eps", "layer_norm_eps", "norm_eps"):
        if has(eps):
            cfg[eps] = rng.choice([1e-6, 1e-5, 1e-2])
    for bias in ("attention_bias", "mlp_bias", "use_qkv_bias", "qkv_bias"):
        if has(bias) and isinstance(getattr(d, bias), bool):
            cfg[bias] = rng.random() < 0.5
    if has("rope_parameters") and isinstance(getattr(d, "rope_parameters", None), dict):
        rope = dict(d.rope_parameters)
        kind = rng.choice(ROPE.get(arch, ROPE_TYPES))
        rope["rope_type"] = kind
        if kind != "default":
            rope["factor"] = rng.choice([2.0, 4.0])
        if kind in ("yarn", "llama3"):
            rope["original_max_position_embeddings"] = int(128 // rope["factor"])
        if kind == "llama3":
            rope.update(low_freq_factor=1.0, high_freq_factor=4.0)
        cfg["rope_parameters"] = rope
    if has("partial_rotary_factor") and rng.random() < 0.5:
        cfg["partial_rotary_factor"] = rng.choice([0.5, 1.0])
    if has("sliding_window") and rng.random() < 0.5:
        cfg["sliding_window"] = rng.choice([3, 5, 8])
        if has("use_sliding_window"):
            cfg["use_sliding_window"] = True
            cfg["max_window_layers"] = rng.randint(0, cfg["num_hidden_layers"])
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if has(cap) and rng.random() < 0.5:
            cfg[cap] = rng.choice([None, 5.0, 30.0])
    _draw_moe(rng, d, cfg)
    if arch == "DeepseekV3":
        _draw_mla(rng, cfg)
    batch = rng.choice([1, 1, 2, 3])
    seq = rng.choice([1, 2, 3, 5, 8, 13, 16, 24])
    pad = [0] * batch
    if batch > 1 and seq > 1 and rng.random() < 0.5:
        pad = [rng.randint(0, seq - 1) for _ in range(batch)]
        pad[rng.randrange(batch)] = 0
    experts = rng.choice(["eager", "grouped_mm", "batched_mm"]) if any(
        k in cfg for k in ("num_local_experts", "num_experts", "n_routed_experts")) else None
    return Case(arch=arch, config=cfg, attn=rng.choice(ATTN.get(arch, ("eager", "sdpa"))), dtype=rng.choice(["float32", "bfloat16"]),
                lowering=rng.choice(["aot_eager"] * 4 + ["inductor"]), batch=batch, seq=seq, pad=pad,
                seed=rng.randrange(2 ** 31), experts=experts)


def _draw_moe(rng, d, cfg) -> None:
    experts_key = next((k for k in ("n_routed_experts", "num_local_experts", "num_experts") if hasattr(d, k)), None)
    if experts_key is None:
        return
    experts = rng.choice([2, 4, 6, 8])
    cfg[experts_key] = experts
    cfg["num_experts_per_tok"] = rng.randint(1, min(3, experts))
    if hasattr(d, "moe_intermediate_size"):
        cfg["moe_intermediate_size"] = rng.choice([8, 16, 24])
    if hasattr(d, "shared_expert_intermediate_size"):
        cfg["shared_expert_intermediate_size"] = rng.choice([0, 16, 32])
    if hasattr(d, "n_shared_experts"):
        cfg["n_shared_experts"] = rng.choice([1, 2])
    if hasattr(d, "norm_topk_prob"):
        cfg["norm_topk_prob"] = rng.random() < 0.5
    if hasattr(d, "decoder_sparse_step"):
        cfg["decoder_sparse_step"] = 1
        cfg["mlp_only_layers"] = []


def _draw_mla(rng, cfg) -> None:
    experts = cfg["n_routed_experts"]
    groups = rng.choice([g for g in (1, 2) if experts % g == 0])
    cfg.update(q_lora_rank=rng.choice([None, 16, 24]), kv_lora_rank=rng.choice([8, 16]),
               qk_nope_head_dim=rng.choice([8, 16]), qk_rope_head_dim=rng.choice([4, 8]),
               v_head_dim=rng.choice([8, 12, 16]), n_group=groups, topk_group=rng.randint(1, groups),
               first_k_dense_replace=rng.randint(0, cfg["num_hidden_layers"]))
    cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], cfg["topk_group"] * experts // groups)
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg.pop("head_dim", None)


# ---- running a case ---------------------------------------------------------------------------

def build(case: Case):
    """The model (case.dtype not applied yet), input ids and the left-padding mask."""
    import transformers

    cfg = getattr(transformers, f"{case.arch}Config")(**case.config)
    cfg._attn_implementation = case.attn
    if case.experts:
        cfg._experts_implementation = case.experts
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case.seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        g = torch.Generator().manual_seed(case.seed)
        ids = torch.randint(3, cfg.vocab_size, (case.batch, case.seq), generator=g)
    mask = torch.ones(case.batch, case.seq, dtype=torch.long)
    for row, n in enumerate(case.pad):
        mask[row, :n] = 0
        ids[row, :n] = cfg.pad_token_id
    return model, ids, mask


def inputs(ids, mask) -> dict:
    """The forward's keyword inputs: positions counted from each row's first kept token, as
    generate() counts them, so a padded row computes what the row alone computes."""
    return dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))


def _logits(model, **kw):
    with torch.no_grad():
        return model(**kw).logits


def reference(exact, ids, mask) -> torch.Tensor:
    """float64 logits, each row run alone without its padding (a padded float64 eager forward
    overflows the mask's minimum to -inf and spreads NaN from the padded rows)."""
    out = torch.zeros(*ids.shape, exact.config.vocab_size, dtype=torch.float64)
    for row in range(ids.shape[0]):
        kept = mask[row].bool()
        out[row, kept] = _logits(exact, input_ids=ids[row:row + 1, kept])[0]
    return out


def _err(x, ref, keep) -> float:
    x, ref = x.double()[keep], ref[keep]
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run(case: Case) -> Outcome:
    import metainfer
    from metainfer.verify import EquivalenceError

    dtype = getattr(torch, case.dtype)
    try:
        model, ids, mask = build(case)
        exact = copy.deepcopy(model).double()
        exact.config._experts_implementation = "eager"  # the grouped kernels take no float64
        model = model.to(dtype)
        kw = inputs(ids, mask)
        ref64 = reference(exact, ids, mask)
        eager = _logits(model, **kw)
        if not torch.isfinite(eager[mask.bool()]).all():
            return Outcome("invalid", "eager's logits are not finite")
    except Exception as e:  # the config itself does not build or run: not metainfer's
        return Outcome("invalid", f"eager: {type(e).__name__}: {e}".splitlines()[0][:300])
    keep = mask.bool()
    err_eager = _err(eager, ref64, keep)
    bound = 3 * err_eager + 2 * UNIT_ROUNDOFF[dtype]
    try:
        opt = metainfer.optimize(model, "cpu", example_inputs=kw, verify=True, lowering=case.lowering)
        out = _logits(opt, **kw)
    except EquivalenceError as e:
        # verify's own tolerance flagged it; judged here against float64 like every case
        opt = metainfer.optimize(model, "cpu", lowering=case.lowering)
        out = _logits(opt, **kw)
        err = _err(out, ref64, keep)
        if err > bound:
            return Outcome("mismatch", f"verify: {e}", pass_name=e.pass_name, err_opt=err, err_eager=err_eager)
        return Outcome("mismatch", f"verify flags a result within the float64 bound ({err:.3g} <= {bound:.3g}): "
                                   f"{e}", pass_name=e.pass_name, err_opt=err, err_eager=err_eager)
    except Exception as e:
        return Outcome("crash", _crash(e))
    passes = collections.Counter()
    for r in opt.report.passes:  # every graph's record: matches summed per pass
        passes[r.name] += r.matches
    passes = {name: n for name, n in passes.items() if n}
    err = _err(out, ref64, keep)
    if err > bound:
        return Outcome("mismatch", f"forward: err {err:.3g} > bound {bound:.3g} (eager's err {err_eager:.3g})",
                       passes, err_opt=err, err_eager=err_eager)
    try:
        why = _generate_mismatch(opt, model, exact, ids, mask)
    except Exception as e:
        return Outcome("crash", "generate: " + _crash(e), passes)
    if why:
        return Outcome("mismatch", why, passes, err_opt=err, err_eager=err_eager)
    return Outcome("ok", "", passes, err_opt=err, err_eager=err_eager)


def _generate_mismatch(opt, model, exact, ids, mask, new: int = 4) -> str | None:
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        got = opt.generate(ids, **kw)
    if torch.equal(want, got):
        return None
    for row in range(ids.shape[0]):
        diff = (want[row] != got[row]).nonzero()
        if not len(diff):
            continue
        at = int(diff[0])
        prefix = want[row:row + 1, :at][:, mask[row].bool().tolist() + [True] * (at - ids.shape[1])]
        l64 = _logits(exact, input_ids=prefix)[0, -1]
        eager_err = (_logits(model, input_ids=prefix)[0, -1].double() - l64).abs().max().item()
        a, b = int(want[row, at]), int(got[row, at])
        gap = abs(l64[a] - l64[b]).item()
        # the forward's bound, in logits: eager off by eager_err, metainfer by up to 3 times that + 2u
        allowed = 4 * eager_err + 2 * UNIT_ROUNDOFF[model.dtype] * l64.abs().max().item()
        if gap > allowed:
            return (f"generate: row {row} token {at - ids.shape[1]}: eager {a}, metainfer {b}; float64 logits "
                    f"{gap:.3g} apart, more than the {allowed:.3g} eager's error ({eager_err:.3g}) allows")
    return None


def _crash(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = next((f"{f.filename.split('/')[-1]}:{f.lineno}" for f in reversed(tb)
                  if "/metainfer/" in f.filename or "/passes/" in f.filename or "/lowering/" in f.filename
                  or "/kernels/" in f.filename), "?")
    return f"{type(e).__name__} at {where}: {e}".splitlines()[0][:400]


# ---- shrinking and bisecting a failure ---------------------------------------------------------

def _smaller(case: Case):
    """Simpler cases than `case`, one change each, simplest first."""
    c = case.config
    if c.get("num_hidden_layers", 1) > 1:
        yield dataclasses.replace(case, config={**c, "num_hidden_layers": 1,
                                                **({"first_k_dense_replace": 0} if "first_k_dense_replace" in c else {}),
                                                **({"max_window_layers": 0} if "max_window_layers" in c else {})})
    if case.batch > 1:
        yield dataclasses.replace(case, batch=1, pad=[0])
    if any(case.pad):
        yield dataclasses.replace(case, pad=[0] * case.batch)
    if case.seq > 2:
        seq = case.seq // 2
        yield dataclasses.replace(case, seq=seq, pad=[min(p, seq - 1) for p in case.pad])
    if case.lowering != "aot_eager":
        yield dataclasses.replace(case, lowering="aot_eager")
    if case.dtype != "float32":
        yield dataclasses.replace(case, dtype="float32")
    d = _defaults(case.arch).to_dict()
    for key in sorted(c):
        if key in ("vocab_size", "num_hidden_layers", "hidden_size", "num_attention_heads", "pad_token_id",
                   "bos_token_id", "eos_token_id", "max_position_embeddings", "intermediate_size", "head_dim",
                   "num_key_value_heads") or key in ARCHS[case.arch]:
            continue
        if key in d and c[key] != d[key] and key not in ("n_routed_experts", "num_local_experts", "num_experts"):
            yield dataclasses.replace(case, config={**c, key: d[key]})


def shrink(case: Case, outcome: Outcome, budget: int = 40) -> tuple[Case, Outcome]:
    tried = 0
    improved = True
    while improved and tried < budget:
        improved = False
        for smaller in _smaller(case):
            tried += 1
            got = run(smaller)
            if got.status == outcome.status:
                case, outcome, improved = smaller, got, True
                break
            if tried >= budget:
                break
    return case, outcome


def bisect_case(case: Case) -> str | None:
    import metainfer

    model, ids, mask = build(case)
    model = model.to(getattr(torch, case.dtype))
    found = metainfer.bisect(model, inputs(ids, mask), "cpu", lowering=case.lowering)
    return found.pass_name


def reproduction(case: Case) -> str:
    return f"python bench/fuzz.py --case '{case.to_json()}'"


# ---- the run ----------------------------------------------------------------------------------

def fuzz_models(n: int, seed: int, arch: str | None = None, shard: tuple[int, int] = (0, 1), first: int = 0,
                log=print) -> dict:
    by_arch = collections.Counter()
    fired = collections.Counter()
    failures, mismatches, crashes, invalid = [], 0, 0, 0
    started = time.perf_counter()
    for i in range(first, first + n):
        if i % shard[1] != shard[0]:
            continue
        case = draw(random.Random(seed * 1_000_003 + i), arch)
        t0 = time.perf_counter()
        out = run(case)
        if out.status == "invalid":
            invalid += 1
            log(f"case {i} {case.arch}: invalid ({out.detail})")
            continue
        by_arch[case.arch] += 1
        fired.update(out.passes)
        line = (f"case {i} {case.arch} {case.attn} {case.dtype} {case.lowering} b{case.batch} s{case.seq}: "
                f"{out.status} in {time.perf_counter() - t0:.1f} s")
        if out.status == "ok":
            log(line + f" (err {out.err_opt:.2g} vs eager {out.err_eager:.2g})")
            continue
        mismatches += out.status == "mismatch"
        crashes += out.status == "crash"
        small, small_out = shrink(case, out)
        culprit = small_out.pass_name
        if small_out.status == "mismatch" and culprit is None:
            try:
                culprit = bisect_case(small)
            except Exception as e:  # noqa: BLE001  (the bisection itself failing is reported, not fatal)
                culprit = f"bisect failed: {_crash(e)}"
        failures.append({"case": i, "arch": case.arch, "status": out.status, "detail": small_out.detail,
                         "pass": culprit, "reproduction": reproduction(small)})
        log(line + f": {small_out.detail} [pass: {culprit}]\n    {reproduction(small)}")
    return {"cases": sum(by_arch.values()), "invalid": invalid, "architectures": sorted(by_arch),
            "by_architecture": dict(sorted(by_arch.items())), "mismatches": mismatches, "crashes": crashes,
            "failures": failures, "passes_fired": dict(fired.most_common()),
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--streams", type=int, default=0, help="serving streams (bench/fuzz_serving.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", choices=sorted(ARCHS), help="draw only this architecture")
    ap.add_argument("--first", type=int, default=0, help="the first case index (a run continued)")
    ap.add_argument("--shard", default="0/1", help="K/N: only cases i with i %% N == K (N processes share a run)")
    ap.add_argument("--case", help="replay one case (its JSON, as a failure's reproduction prints it)")
    ap.add_argument("--json", action="store_true", help="the last line: one JSON object of the results")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if a.case:
        case = Case.from_json(a.case)
        out = run(case)
        print(f"{out.status}: {out.detail} passes {out.passes}")
        if out.status == "mismatch" and out.pass_name is None:
            print(f"first pass breaking it: {bisect_case(case)}")
        return 0 if out.status in ("ok", "invalid") else 1
    k, n = (int(x) for x in a.shard.split("/"))
    results = fuzz_models(a.cases, a.seed, a.arch, (k, n), a.first)
    if a.streams:
        import fuzz_serving  # bench/, beside this script

        streams = [fuzz_serving.run_stream(a.seed * 1_000_003 + i) for i in range(a.streams) if i % n == k]
        for s in streams:
            print(f"stream {s['seed']}: {s['requests']} requests, {'ok' if not s['problems'] else s['problems']}")
        results.update(streams=len(streams), stream_failures=[s for s in streams if s["problems"]])
    print(f"{results['cases']} cases over {len(results['architectures'])} architectures "
          f"({results['invalid']} invalid draws), {results['mismatches']} mismatches, {results['crashes']} crashes, "
          f"{results['seconds']} s")
    if a.json:
        print(json.dumps(results, default=str))
    bad = results["mismatches"] + results["crashes"] + len(results.get("stream_failures", []))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
