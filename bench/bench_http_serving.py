"""Serving over HTTP, side by side in one run: `metainfer serve` against `transformers serve
--continuous-batching` on the same model, workload and KV pool, driven by the same client
(metainfer.loadgen: streamed /v1/completions, greedy, text prompts through the model's word
tokenizer), and, in this process on the same workload, the server's engine without HTTP (one
persistent manager with the server's sampling config, requests at temperature 0: what HTTP
costs) and `generate_batch` (an engine started per call).

    python bench/bench_http_serving.py [--model hf-llama-512x4] [--requests 32] [--concurrency 32] [--ranks 1 2]

Each server runs alone on 127.0.0.1 (one after the other, so they do not share the cores), is
warmed up with two passes of the workload (compiles, the engine's first steps), then measured
over `--rounds` passes; the table reports the best measured pass of each. transformers serve
needs `accelerate` (pip install accelerate).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from metainfer import loadgen, servebench
from metainfer.testing import free_port, scrape_metrics


def _start(cmd: list[str], url: str, ready: str, log_path: str, timeout_s: float = 900) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=os.path.dirname(log_path),
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited; see {log_path}")
        try:
            if httpx.get(f"{url}{ready}", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise TimeoutError(f"{' '.join(cmd[:3])} not ready in {timeout_s} s; see {log_path}")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


WARM_UP = 2  # passes before measuring: packed sizes met for the first time can compile another graph


def _measure(name, url, workload, tokenizer, concurrency, rounds):
    for _ in range(WARM_UP):
        asyncio.run(loadgen.run(url, workload, tokenizer=tokenizer, concurrency=concurrency))
    runs = [asyncio.run(loadgen.run(url, workload, name=name, tokenizer=tokenizer, concurrency=concurrency))
            for _ in range(rounds)]
    return max(runs, key=lambda r: r.input_tps)


def _in_process(folder, workload, num_blocks, rounds) -> loadgen.LoadResult:
    """metainfer's generate_batch on the workload in this process (all requests at once)."""
    import transformers

    import metainfer

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    opt = metainfer.optimize(model, "cpu", serve_compile="always")
    prompts = workload.prompts(model.config.vocab_size)
    gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=workload.requests[0].output_tokens,
                                        eos_token_id=model.generation_config.eos_token_id, pad_token_id=0)
    cfg = transformers.ContinuousBatchingConfig(num_blocks=num_blocks)
    best = None
    for i in range(WARM_UP + rounds):
        t0 = time.perf_counter()
        out = opt.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg,
                                 record_timestamps=True)
        sent = []
        for p, o in zip(prompts, out.values()):
            s = loadgen.Sent(prompt_tokens=len(p), start=t0, output_tokens=len(o.generated_tokens))
            s.token_times = list(o.timestamps or [])  # perf_counter times, as t0
            sent.append(s)
        if i >= WARM_UP:
            r = loadgen.summarise("generate_batch (in process)", sent, t0)
            r.seconds = max(r.seconds, time.perf_counter() - t0)
            best = r if best is None or r.input_tps > best.input_tps else best
    return best


def _in_process_engine(folder, workload, num_blocks, rounds) -> loadgen.LoadResult:
    """The server's engine without HTTP: one persistent manager in this process
    (`opt.init_continuous_batching` with the server's sampling config, so metainfer's sampler),
    each pass's requests added at once at temperature 0."""
    import transformers

    import metainfer

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    opt = metainfer.optimize(model, "cpu", serve_compile="always")
    prompts = workload.prompts(model.config.vocab_size)
    new = workload.requests[0].output_tokens
    gen = transformers.GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                                        eos_token_id=model.generation_config.eos_token_id, pad_token_id=0)
    manager = opt.init_continuous_batching(generation_config=gen, continuous_batching_config=(
        transformers.ContinuousBatchingConfig(num_blocks=num_blocks)))
    manager.start()
    best = None
    try:
        for i in range(WARM_UP + rounds):
            t0 = time.perf_counter()
            ids = manager.add_requests(prompts, max_new_tokens=new, record_timestamps=True, temperature=0.0)
            done = servebench.collect(manager, ids)
            sent = []
            for rid, p in zip(ids, prompts):
                o = done[rid]
                s = loadgen.Sent(prompt_tokens=len(p), start=t0, output_tokens=len(o.generated_tokens),
                                 error=o.error)
                s.token_times = list(o.timestamps or [])
                sent.append(s)
            if i >= WARM_UP:
                r = loadgen.summarise("server's engine in process", sent, t0)
                best = r if best is None or r.input_tps > best.input_tps else best
    finally:
        manager.stop()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="hf-llama-512x4", choices=sorted(servebench.MODELS))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, nargs=2, default=(64, 512))
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=256, help="KV pool blocks of 256 tokens, every engine")
    ap.add_argument("--skip", nargs="*", default=(), choices=("metainfer", "transformers", "in-process"))
    ap.add_argument("--target", default="cpu", help="metainfer serve's target (a calibrated TOML declares the "
                    "shared-memory collectives between its ranks)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1],
                    help="metainfer serve over each of these rank counts (--ranks N), one after the other")
    ap.add_argument("--speculative", action="store_true",
                    help="also metainfer serve --speculative prompt-lookup (one rank), after the others")
    a = ap.parse_args()
    workload = servebench.Workload.synthetic(a.requests, prompt=tuple(a.prompt), output=a.output, seed=1)
    tokenizer = servebench.word_tokenizer(servebench.MODELS[a.model]["vocab_size"])
    results, exchanges = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, a.model)
        servebench.build_model(a.model).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        variants = [(ranks, []) for ranks in a.ranks] + ([(1, ["--speculative", "prompt-lookup"])] if a.speculative else [])
        for ranks, extra in variants if "metainfer" not in a.skip else ():
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = _start([sys.executable, "-m", "metainfer", "serve", "--model", folder, "--port", str(port),
                           "--num-blocks", str(a.num_blocks), "--max-running", str(max(64, a.concurrency)),
                           "--ranks", str(ranks), "--target", a.target, *extra],
                          url, "/ready", os.path.join(tmp, f"metainfer-{ranks}{'-spec' if extra else ''}.log"))
            try:
                name = "metainfer serve" + (f" --ranks {ranks}" if len(a.ranks) > 1 else "") + \
                    (" --speculative" if extra else "")
                before = scrape_metrics(url)
                results.append(_measure(name, url, workload, tokenizer, a.concurrency, a.rounds))
                after = scrape_metrics(url)
                exchanges.append((name, after, before))
                drafted = after.get("metainfer_spec_drafted_tokens", 0) - before.get("metainfer_spec_drafted_tokens", 0)
                if drafted:
                    accepted = after["metainfer_spec_accepted_tokens"] - before.get("metainfer_spec_accepted_tokens", 0)
                    chosen = {key.split('"')[1]: v - before.get(key, 0) for key, v in after.items()
                              if key.startswith("metainfer_spec_draft_length_steps{")}
                    print(f"{name}: {drafted:.0f} tokens drafted, {accepted:.0f} accepted "
                          f"({accepted / drafted:.0%}) over the warm-up and measured passes; engine steps by the "
                          f"draft length chosen: {', '.join(f'{k}: {v:.0f}' for k, v in sorted(chosen.items()) if v)}")
            finally:
                _stop(proc)
        if "transformers" not in a.skip:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = _start(["transformers", "serve", folder, "--continuous-batching", "--port", str(port),
                           "--cb-num-blocks", str(a.num_blocks)], url, "/v1/models",
                          os.path.join(tmp, "transformers.log"))
            try:
                results.append(_measure("transformers serve --cb", url, workload, tokenizer, a.concurrency, a.rounds))
            finally:
                _stop(proc)
        if "in-process" not in a.skip:
            results.append(_in_process_engine(folder, workload, a.num_blocks, a.rounds))
            results.append(_in_process(folder, workload, a.num_blocks, a.rounds))
    print(f"{a.model}, {a.requests} requests, prompts {a.prompt[0]}..{a.prompt[1]} tokens "
          f"({sum(r.prompt_tokens for r in workload.requests)} in all), {a.output} new each, concurrency "
          f"{a.concurrency}, KV pool {a.num_blocks} blocks; best of {a.rounds} measured passes each")
    print(loadgen.table(results))
    for name, after, before in exchanges:
        steps = after.get("metainfer_rank_exchange_steps", 0) - before.get("metainfer_rank_exchange_steps", 0)
        if steps:
            spent = after["metainfer_rank_exchange_seconds"] - before["metainfer_rank_exchange_seconds"]
            print(f"{name}: rank 0's engine loop made {steps:.0f} iterations over the warm-up and measured passes, "
                  f"{spent / steps * 1e6:.0f} us each in the per-step exchange (waiting for the other ranks "
                  "included)")


if __name__ == "__main__":
    main()
