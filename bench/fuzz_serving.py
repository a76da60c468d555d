"""A serving stream fuzzer: random requests through `opt.init_continuous_batching` (metainfer's
graphs, paged attention and sampler in transformers' engine), checked against invariants.

A stream (seeded) is 16-40 requests over a tiny model drawn from the families metainfer's paged
attention serves: arrivals spread over time while the engine runs, prompt lengths 1-60 with
shared prefixes, max_new_tokens 1-12; greedy requests (temperature 0), sampled ones
(temperature, top-k, top-p), early cancellations, and bad requests interleaved (empty, ids
outside the vocabulary, longer than the model's positions). Invariants:
- every bad request is refused at add_request with a ValueError, and no other request is;
- every admitted request ends with exactly one final result: none lost, none duplicated;
- a good greedy request's tokens equal the plain engine's (transformers' own generate_batch on
  the same model, without metainfer) for the same prompt;
- a sampled request's tokens are in the vocabulary and no more than it asked for;
- a cancelled request ends with error "cancelled", or had finished before the cancel landed;
- at the end no KV block is held by a request (prefix blocks kept for reuse are not held);
- the stream ends within its deadline.

    python bench/fuzz_serving.py --streams 3 --seed 0
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

FAMILIES = ("Llama", "Qwen2", "Mistral", "Qwen3")
DEADLINE_S = 300


def _model(rng: random.Random):
    from metainfer.testing import tiny_hf_model

    arch = rng.choice(FAMILIES)
    extra = {"sliding_window": rng.choice([6, 16])} if arch == "Mistral" else {}
    model = tiny_hf_model(arch, "sdpa", layers=rng.choice([1, 2]), seed=rng.randrange(1000),
                          max_position_embeddings=128, **extra)
    return arch, model


def _requests(rng: random.Random, vocab: int) -> list[dict]:
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.choice([16, 24, 32]))] for _ in range(3)]
    out = []
    for i in range(rng.randint(16, 40)):
        r = rng.random()
        if r < 0.12:
            bad = rng.choice([[], [vocab + rng.randrange(5)], [5] * 200])  # empty, outside vocab, past 128 positions
            out.append({"i": i, "kind": "bad", "prompt": bad, "max_new": 4})
            continue
        prompt = (rng.choice(prefixes) if rng.random() < 0.4 else []) + [rng.randrange(3, vocab)
                                                                       for _ in range(rng.randint(1, 60 - 32))]
        item = {"i": i, "prompt": prompt, "max_new": rng.randint(1, 12), "delay": rng.random() * 0.03}
        if r < 0.27:
            item.update(kind="cancel", cancel_after=rng.random() * 0.1)
        elif r < 0.45:
            item.update(kind="sampled", sampling={"temperature": rng.choice([0.5, 1.0, 1.3]),
                                                  "top_k": rng.choice([0, 5, 50]), "top_p": rng.choice([0.8, 1.0])})
        else:
            item.update(kind="greedy")
        out.append(item)
    return out


def run_stream(seed: int) -> dict:
    """One stream; returns {"seed", "arch", "requests", "problems": [...], "seconds"}."""
    import transformers

    import metainfer

    rng = random.Random(seed)
    arch, model = _model(rng)
    vocab = model.config.vocab_size
    reqs = _requests(rng, vocab)
    problems: list[str] = []
    started = time.perf_counter()
    good = [r for r in reqs if r["kind"] == "greedy"]
    if good:  # the plain engine's greedy tokens (its own attention; metainfer not involved)
        plain = model.generate_batch([r["prompt"] for r in good], generation_config=transformers.GenerationConfig(
            do_sample=False, max_new_tokens=12, eos_token_id=model.config.eos_token_id, pad_token_id=0),
            continuous_batching_config=transformers.ContinuousBatchingConfig(num_blocks=64, page_size=16))
        want = {r["i"]: list(o.generated_tokens) for r, o in zip(good, plain.values())}
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager", serve_compile="always")
    gen = transformers.GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=12,
                                        eos_token_id=model.config.eos_token_id, pad_token_id=0)
    manager = opt.init_continuous_batching(generation_config=gen, continuous_batching_config=(
        transformers.ContinuousBatchingConfig(num_blocks=32, page_size=16, max_batch_tokens=64)))
    admitted: dict[str, dict] = {}
    finals: dict[str, list] = {}
    manager.start()
    try:
        cancel_at: list[tuple[float, str]] = []
        for r in reqs:
            time.sleep(r.get("delay", 0.0))
            kwargs = {"temperature": 0.0} if r["kind"] in ("greedy", "cancel") else r.get("sampling", {})
            try:
                rid = manager.add_request(r["prompt"], request_id=f"r{r['i']}", max_new_tokens=r["max_new"], **kwargs)
            except ValueError as e:
                if r["kind"] != "bad":
                    problems.append(f"request {r['i']} ({r['kind']}) refused: {e}")
                continue
            if r["kind"] == "bad":
                problems.append(f"bad request {r['i']} ({r['prompt'][:3]}...) admitted")
            admitted[rid] = r
            if r["kind"] == "cancel":
                cancel_at.append((time.perf_counter() + r["cancel_after"], rid))
            _drain(manager, finals, timeout=0.0)
            for at, rid in [c for c in cancel_at if c[0] <= time.perf_counter()]:
                manager.cancel_request(rid)
                cancel_at.remove((at, rid))
        for _, rid in cancel_at:
            manager.cancel_request(rid)
        deadline = started + DEADLINE_S
        while any(rid not in finals for rid in admitted) and time.perf_counter() < deadline:
            _drain(manager, finals, timeout=0.5)
        _drain(manager, finals, timeout=0.2)  # a duplicate final would arrive here
        used = _settle(manager)
    finally:
        manager.stop(block=True, timeout=60)
    for rid, r in admitted.items():
        outs = finals.get(rid, [])
        if len(outs) != 1:
            problems.append(f"request {r['i']} ({r['kind']}): {len(outs)} final results")
            continue
        out = outs[0]
        tokens = list(out.generated_tokens)
        if r["kind"] == "cancel":
            if out.error not in (None, "cancelled"):
                problems.append(f"cancelled request {r['i']}: error {out.error!r}")
        elif out.error is not None:
            problems.append(f"request {r['i']} ({r['kind']}): error {out.error!r}")
        elif r["kind"] == "greedy" and tokens != want[r["i"]][:r["max_new"]]:
            problems.append(f"greedy request {r['i']}: {tokens} != plain engine's {want[r['i']][:r['max_new']]}")
        elif r["kind"] == "sampled" and (len(tokens) > r["max_new"] or not all(0 <= t < vocab for t in tokens)):
            problems.append(f"sampled request {r['i']}: {len(tokens)} tokens for max {r['max_new']}, ids {tokens}")
    if used:
        problems.append(f"{used:g} KV blocks still held by requests at the end")
    if time.perf_counter() - started > DEADLINE_S:
        problems.append(f"the stream took more than {DEADLINE_S} s")
    kinds = {k: sum(r["kind"] == k for r in reqs) for k in ("greedy", "sampled", "cancel", "bad")}
    return {"seed": seed, "arch": arch, "requests": len(reqs), "kinds": kinds, "problems": problems,
            "seconds": round(time.perf_counter() - started, 1)}


def _drain(manager, finals: dict, timeout: float) -> None:
    while True:
        out = manager.get_result(timeout=timeout)
        if out is None:
            return
        if out.is_finished():
            finals.setdefault(out.request_id, []).append(out)
        timeout = 0.0


def _settle(manager, wait_s: float = 5.0) -> float:
    """KV blocks held by requests once the engine has had a moment to free the last ones."""
    end = time.perf_counter() + wait_s
    while True:
        used = manager.kv_blocks()[0]
        if used == 0 or time.perf_counter() > end:
            return used
        time.sleep(0.05)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    bad = 0
    for i in range(a.streams):
        s = run_stream(a.seed * 1_000_003 + i)
        bad += bool(s["problems"])
        print(f"stream {s['seed']} {s['arch']}: {s['requests']} requests {s['kinds']}, {s['seconds']} s: "
              + ("ok" if not s["problems"] else "; ".join(s["problems"])))
    return 1 if bad else 0


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    sys.exit(main())
