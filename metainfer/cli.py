"""The `metainfer` command line.

Only argparse and the target registry load before a command runs (torch takes seconds to
import), so `--help`, `--version` and argument errors answer at once. `optimize` checks its
target and model description before it builds anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


class UsageError(Exception):
    """Something the user typed cannot be done; the message is the whole answer (exit 2)."""


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _version() -> str:
    from importlib import metadata

    from metainfer import __version__

    deps = []
    for dist in ("torch", "triton", "transformers"):
        try:
            deps.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            deps.append(f"{dist} not installed")
    return f"metainfer {__version__} ({', '.join(deps)})"


class _VersionAction(argparse.Action):
    """--version, computed only when asked (argparse's own takes a fixed string)."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version())
        parser.exit()


def _target(name: str):
    from metainfer.api import resolve_target

    try:
        return resolve_target(name)
    except (ValueError, FileNotFoundError, TypeError) as e:
        raise UsageError(f"--target {name}: {e}") from None


class _ModelSpec:
    """What --model names, checked before anything is built: a models/ name or a Hugging
    Face config.json (or its folder)."""

    def __init__(self, spec: str):
        self.spec = spec
        self.hf_config: dict | None = None
        self.path: Path | None = None
        from metainfer import models  # imports torch: --help never gets here

        if spec in models.names():
            return
        path = Path(spec)
        if not (path.exists() or spec.endswith(".json")):
            raise UsageError(f"--model {spec}: neither a models/ name ({', '.join(models.names())}) nor a Hugging "
                             "Face config.json or folder holding one")
        from metainfer.hardware.shapes import read_config_json

        try:
            self.path, self.hf_config = read_config_json(path)
        except (ValueError, FileNotFoundError) as e:
            raise UsageError(f"--model {spec}: {e}") from None
        try:
            import transformers
        except ImportError:
            raise UsageError("--model: a Hugging Face config needs transformers (pip install transformers)") from None
        try:
            self.config = transformers.AutoConfig.from_pretrained(str(self.path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"--model {spec}: transformers cannot read this config: {e}") from None

    def build(self, dtype, device: str, attn: str | None):
        """(model, vocabulary size, what it is) with random weights, nothing downloaded."""
        import torch

        from metainfer import models

        if self.hf_config is None:
            model = models.build(self.spec, dtype=dtype, device=device)
            return model, models.config(self.spec).vocab_size, f"models/{self.spec}"
        import transformers

        from metainfer.models import transformers_adapter as hf

        cfg = self.config
        if attn:
            hf.set_attention_implementation(cfg, attn)
        try:
            with torch.random.fork_rng(devices=[]), torch.device(device):
                torch.manual_seed(0)
                model = transformers.AutoModelForCausalLM.from_config(cfg)
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
            raise UsageError(f"--model {self.spec}: transformers cannot build a causal LM from this config: "
                             f"{type(e).__name__}: {e}") from None
        return model.to(dtype).eval(), cfg.vocab_size, f"{type(model).__name__} from {self.path}"


def _device_for(target) -> str:
    """The torch device the target drives, if this machine has it."""
    import torch

    kind = target.device.kind
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--target {target.name}: it drives CUDA GPUs ({target.device.name}) and this machine has "
                         f"none (torch {torch.__version__}). Use --target cpu here, or see what metainfer would "
                         f"plan on that box with `metainfer plan --model ... --target {target.name}`.")
    return kind


def cmd_optimize(a) -> int:
    target = _target(a.target)
    spec = _ModelSpec(a.model)
    device = _device_for(target)
    import torch

    import metainfer

    dtype = getattr(torch, _DTYPES[a.dtype])
    model, vocab, what = spec.build(dtype, device, a.attn)
    ids = torch.randint(0, vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(0)).to(device)
    print(f"optimizing {what} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{str(dtype).replace('torch.', '')}) for target {target.name}, input {a.batch}x{a.seq} tokens")
    t0 = time.perf_counter()
    opt = metainfer.optimize(model, target, example_inputs=(ids,), passes=a.passes, disable=a.disable or (),
                             verify=a.verify, dump_dir=a.dump, lowering=a.lowering, cache_dir=a.cache_dir)
    print(f"compiled in {time.perf_counter() - t0:.1f} s\n")
    print(opt.report)
    if a.dump:
        print(f"\nreport and graph dumps written to {a.dump}/")
    return 0


def cmd_plan(a) -> int:
    import dataclasses

    from metainfer.hardware import planner, shapes

    target = _target(a.target)
    try:
        model = shapes.resolve(a.model)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"--model {a.model}: {e}") from None
    if a.weights:
        model = dataclasses.replace(model, weight_bytes=2.0 if a.weights == "bf16" else shapes.FP8_BLOCK_BYTES)
    phases = planner.PHASES if a.phase == "both" else (a.phase,)
    result = planner.plan(model, target, phases=phases, batch=a.batch, seq=a.seq, acceptance=a.acceptance)
    print(json.dumps(result.to_dict(), indent=2) if a.json else result)
    return 0


def _workload(a):
    from metainfer import servebench

    if a.workload:
        try:
            return servebench.Workload.load(a.workload)
        except (OSError, ValueError) as e:
            raise UsageError(f"--workload {a.workload}: {e}") from None
    return servebench.Workload.synthetic(a.requests, prompt=tuple(a.prompt), output=a.output,
                                         prefix_groups=a.prefix_groups, prefix_tokens=a.prefix_tokens,
                                         arrival_rate=a.arrival_rate)


def _bench_urls(a, workload) -> int:
    import asyncio

    from metainfer import loadgen, servebench

    tokenizer, vocab = None, a.vocab
    if a.model in servebench.MODELS:
        vocab = vocab or servebench.MODELS[a.model]["vocab_size"]
        tokenizer = servebench.word_tokenizer(vocab) if a.text else None
    elif a.text:
        raise UsageError("--text needs --model to be a benchmark model (its word tokenizer makes the text)")
    if vocab is None:
        raise UsageError("--url: give --vocab (the served model's vocabulary size) or a benchmark --model")
    results = []
    for url in a.url:
        try:
            results.append(asyncio.run(loadgen.run(url, workload, vocab=vocab, tokenizer=tokenizer, api_key=a.api_key,
                                                   concurrency=a.concurrency, progress=sys.stderr.isatty())))
        except OSError as e:
            raise UsageError(f"--url {url}: {e}") from None
    return _report(a, workload, f"concurrency {a.concurrency or 'all'}", loadgen.table(results), results)


def _report(a, workload, setting: str, table: str, rows) -> int:
    """A bench-serving run's table (and, with --json, the workload and every row)."""
    print(f"{len(workload.requests)} requests, {sum(r.prompt_tokens for r in workload.requests)} prompt tokens "
          f"(+{workload.prefix_tokens} shared per prefix group), {setting}")
    print(table)
    if a.json:
        Path(a.json).write_text(json.dumps({"workload": workload.to_dict(), "rows": [r.to_dict() for r in rows]},
                                           indent=2, default=str))
    return 0


def cmd_bench_serving(a) -> int:
    from metainfer import servebench

    if a.url:
        return _bench_urls(a, _workload(a))
    target = _target(a.target)
    _device_for(target)

    workload = _workload(a)
    if a.model not in servebench.MODELS and not a.model.endswith(".json") and not Path(a.model).is_dir():
        raise UsageError(f"--model {a.model}: neither a benchmark model ({', '.join(servebench.MODELS)}) nor a Hugging "
                         "Face config.json")
    try:
        model = servebench.build_model(a.model, attn=a.attn)
    except (ValueError, OSError) as e:
        raise UsageError(f"--model {a.model}: {e}") from None
    cfg = {k: v for k, v in (("num_blocks", a.num_blocks), ("max_batch_tokens", a.max_batch_tokens),
                             ("page_size", a.page_size)) if v is not None} or None
    rows = servebench.run(model, workload, target=target, variants=a.variants, cb_config=cfg,
                          lowering=a.lowering, engine_sizing=a.engine_sizing)
    sizing = ("each engine its own" if a.engine_sizing else
              f"a pool of {servebench.workload_blocks(workload, a.page_size or 256)} blocks for the plain engines, "
              "metainfer's own")
    return _report(a, workload, f"engine config {cfg or sizing}", servebench.table(rows), rows)


def _serve_world(a) -> int:
    """How many ranks `serve` runs: --ranks, or --tp, or the job torchrun started (WORLD_SIZE)."""
    job = int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else None
    asked = {k: v for k, v in (("--ranks", a.ranks), ("--tp", a.tp), ("WORLD_SIZE", job)) if v is not None}
    if len(set(asked.values())) > 1:
        raise UsageError("the server runs one engine over every rank (tensor parallel; data-parallel replicas behind "
                         f"one endpoint are not built): {', '.join(f'{k} {v}' for k, v in asked.items())} must agree")
    return next(iter(asked.values()), 1)


def cmd_serve(a) -> int:
    target = _target(a.target)
    device = _device_for(target)
    world = _serve_world(a)
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"metainfer serve needs the serve extra (pip install 'metainfer[serve]'): no {', '.join(missing)}")
    import logging

    import metainfer
    from metainfer import servebench
    from metainfer.server import app
    from metainfer.server.protocol import ModelInfo

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from transformers import ContinuousBatchingConfig

    cfg = ContinuousBatchingConfig(**{k: v for k, v in (("num_blocks", a.num_blocks),
                                                        ("max_batch_tokens", a.max_batch_tokens)) if v is not None})
    dtype, dtype_note = _serve_dtype(a, device)
    if dtype_note:
        logging.getLogger("metainfer.serve").info(dtype_note)
    run_options = dict(host=a.host, port=a.port, api_key=a.api_key or os.environ.get("METAINFER_API_KEY"),
                       max_running=a.max_running, max_queue=a.max_queue, request_timeout=a.request_timeout,
                       grace=a.grace, max_request_bytes=a.max_request_bytes,
                       speculation=_speculation(a, device, dtype))

    def load(on: str):
        try:
            model, tokenizer, name = servebench.load_model(a.model, dtype=dtype, attn=a.attn)
        except (ValueError, OSError) as e:
            raise UsageError(f"--model {a.model}: {e}") from None
        return model.to(on), tokenizer, a.served_model_name or name

    if world > 1:
        from metainfer.server import ranks

        if a.speculative:
            raise UsageError("--speculative over several ranks is not built: each rank would draft on its own, and "
                             "the ranks' steps must be the same")

        if a.model not in servebench.MODELS and not Path(a.model).exists():  # before any rank starts
            raise UsageError(f"--model {a.model}: neither a benchmark model ({', '.join(servebench.MODELS)}) nor a "
                             "Hugging Face config.json or model folder")

        ep = {"auto": None, "on": True, "off": False}[a.ep]
        return ranks.serve(world=world, argv=a.argv, load=load, target=target, lowering=a.lowering,
                           expert_parallel=ep, cb_config=cfg, run_options=run_options,
                           rank_timeout_s=a.rank_timeout, step_timeout_s=a.step_timeout)
    model, tokenizer, name = load(device)
    opt = metainfer.optimize(model, target, lowering=a.lowering, serve_compile="always")
    if dtype_note:
        opt.report.notes.append(dtype_note)
    info = ModelInfo(name=name, vocab_size=model.config.vocab_size,
                     max_positions=getattr(model.config, "max_position_embeddings", None), tokenizer=tokenizer)
    return app.run(opt, info, cb_config=cfg, **run_options)


def _serve_dtype(a, device: str):
    """(the dtype to serve in, why where it is not the one the model was saved in): --dtype, or
    for auto the checkpoint's own dtype, computed in float32 on a CPU whose half-precision
    GEMMs measure far slower than float32's (hardware.machine.cpu_compute_dtype)."""
    import torch

    from metainfer import servebench

    if a.dtype != "auto":
        return getattr(torch, _DTYPES[a.dtype]), None
    try:
        saved = servebench.checkpoint_dtype(a.model)
    except (ValueError, OSError) as e:
        raise UsageError(f"--model {a.model}: {e}") from None
    if device != "cpu":
        return saved, None
    from metainfer.hardware import machine

    return machine.cpu_compute_dtype(saved)


def _speculation(a, device, dtype):
    """(drafter, max draft tokens) from --speculative prompt-lookup | draft MODEL, or None."""
    if not a.speculative:
        return None
    from metainfer import servebench
    from metainfer.runtime import serve_speculation

    kind, *rest = a.speculative
    if kind == "prompt-lookup" and not rest:
        return serve_speculation.drafter(kind), a.draft_tokens
    if kind == "draft" and len(rest) == 1:
        try:
            draft, _tok, _name = servebench.load_model(rest[0], dtype=dtype, attn=a.attn)
        except (ValueError, OSError) as e:
            raise UsageError(f"--speculative draft {rest[0]}: {e}") from None
        return serve_speculation.drafter(kind, draft.to(device)), a.draft_tokens
    raise UsageError(f"--speculative {' '.join(a.speculative)}: give 'prompt-lookup' or 'draft MODEL'")


def cmd_targets(a) -> int:
    from metainfer.hardware import targets

    if a.describe:
        print(targets.describe())
        return 0
    if a.json:
        print(json.dumps({n: t.to_dict() for n, t in targets.builtins().items()}, indent=2, default=str))
        return 0
    for name, t in targets.builtins().items():
        islands = " + ".join(str(len(i)) for i in t.topology.islands)
        print(f"{name:10s} {t.device.kind:5s} {t.num_devices} x {t.device.name:20s} islands {islands:7s} "
              f"p2p {'yes' if t.topology.p2p else 'no':3s}  {t.description}")
    return 0


def cmd_cache(a) -> int:
    from metainfer import cache

    if a.action == "clear":
        n = cache.clear(a.dir)
        print(f"removed {n} file(s) from {cache.directory(a.dir)}")
        return 0
    i = cache.info(a.dir)
    print(f"{i['root']}")
    for part in ("records", "inductor", "serving"):
        print(f"  {part:9s} {i[part]['files']:6d} files  {i[part]['bytes'] / 2**20:8.1f} MiB")
    return 0


def cmd_passes(a) -> int:
    from metainfer import passes

    from metainfer.passes import options

    for name in passes.pass_names():
        p = passes.get_pass(name)
        print(f"{name:20s} {p.summary}")
        for o in p.options:
            print(f"{'':20s}   option {o.describe()}")
    print("pass manager options (optimize(pass_options=...) or a target's [passes] table):")
    for o in options.MANAGER_OPTIONS:
        print(f"{'':20s}   option {o.describe()}")
    return 0


def cmd_calibrate(a) -> int:
    import json

    from metainfer import calibrate

    base = _target(a.target)  # a bad name fails now, not after the measurements
    m = calibrate.measure(base, [r for r in a.ranks if r > 1], quick=a.quick, progress=lambda s: print(s, file=sys.stderr))
    print(calibrate.table(m), file=sys.stderr)
    text = calibrate.to_toml(m, base)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
        print(f"wrote {a.out}", file=sys.stderr)
    else:
        print(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(m.to_dict(), f, indent=1)
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="metainfer", description="Compiler passes for LLM inference on long-tail "
                                 "accelerators: optimize a model for a target and report what each pass did.")
    ap.add_argument("--version", action=_VersionAction,
                    help="print metainfer's version and those of torch, triton and transformers")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    o = sub.add_parser("optimize", help="optimize a model for a target and print the pass report",
                       description="Build a model with random weights (nothing is downloaded), optimize it for a "
                       "target on random token ids, and print the pass report.")
    o.add_argument("--model", required=True, metavar="NAME_OR_CONFIG",
                   help="a models/ name (e.g. llama-tiny, llama-small, deepseek-tiny) or a Hugging Face config.json "
                        "(or the folder holding it)")
    o.add_argument("--target", default="cpu", help="target name (see `metainfer targets`) or a target TOML file; "
                   "default: cpu")
    o.add_argument("--dump", metavar="DIR", help="write report.json, report.md and graph dumps here")
    o.add_argument("--batch", type=_positive_int, default=1, metavar="N",
                   help="sequences in the example batch (default 1)")
    o.add_argument("--seq", type=_positive_int, default=64, metavar="N",
                   help="tokens per sequence in the example batch (default 64)")
    o.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="weight and activation dtype "
                   "(default float32)")
    o.add_argument("--attn", choices=("eager", "sdpa"), help="attention implementation of a Hugging Face model "
                   "(default: the config's)")
    o.add_argument("--passes", nargs="+", metavar="PASS", help="explicit pipeline (pass names, see `metainfer passes`)")
    o.add_argument("--disable", nargs="+", metavar="PASS", help="pass names to skip")
    o.add_argument("--lowering", choices=("inductor", "aot_eager"),
                   help="inductor (default) or aot_eager (same passes, no code generation; compiles faster)")
    o.add_argument("--verify", action="store_true", help="check outputs against eager; name the first bad pass")
    o.add_argument("--cache-dir", metavar="DIR",
                   help="compile cache root (default $METAINFER_CACHE_DIR or ~/.cache/metainfer)")
    o.set_defaults(fn=cmd_optimize)

    pl = sub.add_parser("plan", help="choose parallelism per phase for a model on a target (cost-model predictions)")
    pl.add_argument("--model", required=True, metavar="NAME_OR_CONFIG",
                    help="a models/ name (e.g. llama3-70b, deepseek-v3) or a Hugging Face config.json / model folder; "
                         "no weights are read")
    pl.add_argument("--target", default="pcie8", help="target name (see `metainfer targets`) or TOML path; "
                    "default: pcie8")
    pl.add_argument("--phase", choices=("prefill", "decode", "both"), default="both",
                    help="which phase to plan (default both)")
    pl.add_argument("--batch", type=_positive_int, metavar="N", help="sequences per batch (default: prefill 4, decode 64)")
    pl.add_argument("--seq", type=_positive_int, metavar="N",
                    help="prompt tokens (prefill) / context tokens (decode); default 4096")
    pl.add_argument("--acceptance", type=float, metavar="A", help="speculative decoding acceptance rate per drafted "
                    "token (0..1): choose the draft length for decode")
    pl.add_argument("--weights", choices=("bf16", "fp8"), help="weight precision (default: the model's own)")
    pl.add_argument("--json", action="store_true", help="print the candidates and choices as JSON")
    pl.set_defaults(fn=cmd_plan)

    b = sub.add_parser("bench-serving", help="serve a workload of many requests with transformers' continuous "
                       "batching, plain, with Inductor and with metainfer, side by side (input/output tok/s)",
                       description="Serve one workload several ways in one run and print input and output tokens/s, "
                       "TTFT, TPOT, peak memory, graphs compiled and whether greedy tokens equal the plain engine's "
                       "(method: metainfer/servebench.py, docs/serving.md).")
    b.add_argument("--model", default="hf-llama-tiny", metavar="NAME_OR_CONFIG",
                   help="hf-llama-tiny (default), hf-llama-512x4, or a Hugging Face config.json (random weights)")
    b.add_argument("--target", default="cpu", help="target name or TOML path; default: cpu")
    b.add_argument("--workload", metavar="FILE", help="workload JSON: {\"requests\": [{\"prompt_tokens\", "
                   "\"output_tokens\", \"prefix_group\", \"arrival_s\"}], \"prefix_tokens\"}; else synthetic")
    b.add_argument("--requests", type=_positive_int, default=32, metavar="N", help="synthetic: requests (default 32)")
    b.add_argument("--prompt", type=_positive_int, nargs=2, default=(64, 512), metavar=("LO", "HI"),
                   help="synthetic: prompt lengths drawn uniformly from LO..HI (default 64 512)")
    b.add_argument("--output", type=_positive_int, default=32, metavar="N", help="synthetic: new tokens per request "
                   "(default 32)")
    b.add_argument("--prefix-groups", type=int, default=0, metavar="G",
                   help="synthetic: requests share a prompt prefix in G groups (default 0: none)")
    b.add_argument("--prefix-tokens", type=int, default=0, metavar="N", help="synthetic: length of a group's shared "
                   "prefix")
    b.add_argument("--arrival-rate", type=float, metavar="R", help="synthetic: Poisson arrivals at R requests/s "
                   "(default: all at once)")
    b.add_argument("--variants", nargs="+", default=("hf-generate", "cb", "cb+inductor", "cb+metainfer"),
                   choices=("hf-generate", "cb", "cb-tuned", "cb+inductor", "cb+metainfer", "cb+metainfer-auto"),
                   help="what to compare (default: hf-generate cb cb+inductor cb+metainfer); cb-tuned: the plain "
                   "engine at its best max_batch_tokens; cb+metainfer compiles at the first step, cb+metainfer-auto "
                   "once compiling pays (the default of optimize())")
    b.add_argument("--num-blocks", type=_positive_int, metavar="N", help="KV pool blocks for every engine "
                   "(default: a pool that holds the workload; metainfer sizes its own for it)")
    b.add_argument("--engine-sizing", action="store_true", help="leave each engine to size its own pool (the plain "
                   "engine's default can take most of the machine's memory and be slow to fill)")
    b.add_argument("--max-batch-tokens", type=_positive_int, metavar="N", help="tokens per engine step for every "
                   "engine (default: each engine's own)")
    b.add_argument("--page-size", type=_positive_int, metavar="N", help="tokens per KV page (default 256)")
    b.add_argument("--attn", choices=("eager", "sdpa"), default="sdpa", help="the model's attention (default sdpa)")
    b.add_argument("--lowering", choices=("inductor", "aot_eager"), help="metainfer's lowering (default inductor)")
    b.add_argument("--json", metavar="FILE", help="write the workload and every row as JSON")
    b.add_argument("--url", nargs="+", metavar="URL", help="instead: drive these OpenAI-compatible servers (one "
                   "after the other) with the workload over HTTP, streamed /v1/completions, and compare them")
    b.add_argument("--concurrency", type=_positive_int, metavar="N", help="with --url: requests in flight at once "
                   "(default: all)")
    b.add_argument("--api-key", help="with --url: sent as 'Authorization: Bearer KEY'")
    b.add_argument("--vocab", type=_positive_int, metavar="N", help="with --url: the served model's vocabulary "
                   "size (random token-id prompts; default: --model's)")
    b.add_argument("--text", action="store_true", help="with --url: send prompts as text through --model's word "
                   "tokenizer (for servers that take text only, e.g. transformers serve)")
    b.set_defaults(fn=cmd_bench_serving)

    cal = sub.add_parser("calibrate", help="measure this machine (GEMM, memory, per-kernel overhead, gloo) and "
                         "write a target TOML with the measured numbers",
                         description="Measure this machine and write the target TOML the cost model prices it "
                         "with (method: metainfer/calibrate.py, docs/cost-model.md).")
    cal.add_argument("--target", default="cpu", choices=("cpu",), help="the target to calibrate (only cpu here: "
                     "bench/calibrate_gpu.py on a GPU machine)")
    cal.add_argument("--out", metavar="FILE", help="write the TOML here (default: print it)")
    cal.add_argument("--ranks", type=_positive_int, nargs="*", default=[2], metavar="N",
                     help="gloo loopback collectives over these rank counts (default 2; none: skip)")
    cal.add_argument("--quick", action="store_true", help="fewer sizes and repeats (about 20 s)")
    cal.add_argument("--json", metavar="FILE", help="also write every measurement as JSON")
    cal.set_defaults(fn=cmd_calibrate)

    c = sub.add_parser("cache", help="show or clear the compile cache")
    c.add_argument("action", choices=("info", "clear"), help="info: files and bytes held; clear: remove them")
    c.add_argument("--dir", help="cache root (default $METAINFER_CACHE_DIR or ~/.cache/metainfer)")
    c.set_defaults(fn=cmd_cache)

    sv = sub.add_parser("serve", help="serve a model over HTTP with an OpenAI-compatible API (continuous batching "
                        "on metainfer's graphs)",
                        description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming, "
                        "/v1/models, /health, /ready, /metrics) whose engine is transformers' continuous batching "
                        "running metainfer's graphs. Stops on SIGTERM/SIGINT after draining (docs/serving.md).")
    sv.add_argument("--model", required=True, metavar="NAME_CONFIG_OR_FOLDER",
                    help="a benchmark model (hf-llama-tiny, hf-llama-512x4, hf-llama-tiny-kv1, hf-deepseek-v3-tiny, "
                         "hf-qwen3-moe-tiny: random weights), a Hugging Face config.json (random weights) or a local "
                         "model folder (weights and tokenizer)")
    sv.add_argument("--target", default="cpu", help="target name or TOML file (default cpu)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (default $METAINFER_API_KEY)")
    sv.add_argument("--served-model-name", metavar="NAME", help="the model name clients send (default: from --model)")
    sv.add_argument("--max-running", type=_positive_int, default=64, metavar="N",
                    help="requests in the engine at once (default 64)")
    sv.add_argument("--max-request-bytes", type=_positive_int, metavar="N",
                    help="a request body past N bytes is a 413 (default: 128 bytes a position of the model's context, "
                         "at least 1 MiB)")
    sv.add_argument("--max-queue", type=int, default=256, metavar="N",
                    help="requests waiting beyond those; past it a 429 (default 256)")
    sv.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                    help="seconds a request may take before it is cancelled with a 504 (default 600)")
    sv.add_argument("--grace", type=float, default=30.0, metavar="S",
                    help="on SIGTERM, seconds in-flight requests get to finish (default 30)")
    sv.add_argument("--num-blocks", type=_positive_int, metavar="N", help="KV pool blocks (default: the planner's)")
    sv.add_argument("--speculative", nargs="+", metavar="KIND", help="speculative decoding of greedy requests: "
                    "'prompt-lookup' (drafts from the request's own n-grams) or 'draft MODEL' (a small model of the "
                    "same vocabulary: a benchmark name, config.json or folder, as --model)")
    sv.add_argument("--draft-tokens", type=_positive_int, default=4, metavar="K",
                    help="with --speculative: at most K draft tokens a request a step (default 4)")
    sv.add_argument("--max-batch-tokens", type=_positive_int, metavar="N", help="tokens per engine step")
    sv.add_argument("--dtype", default="auto", choices=["auto", *sorted(_DTYPES)],
                    help="the dtype to compute in (default auto: the checkpoint's own, but float32 on a CPU whose "
                         "bf16/fp16 GEMMs measure at least 2x slower than float32's; the log and the report say why)")
    sv.add_argument("--attn", choices=("eager", "sdpa"), default="sdpa", help="the model's attention (default sdpa)")
    sv.add_argument("--lowering", choices=("inductor", "aot_eager"), help="metainfer's lowering (default inductor)")
    sv.add_argument("--ranks", type=_positive_int, metavar="N",
                    help="serve over N ranks of this host (rank 0 serves HTTP and spawns the others; the model "
                         "tensor-parallel over all of them). Under torchrun: its WORLD_SIZE (default 1)")
    sv.add_argument("--tp", type=_positive_int, metavar="N", help="tensor-parallel degree: the same as --ranks N")
    sv.add_argument("--ep", choices=("auto", "on", "off"), default="auto",
                    help="spread a MoE model's routed experts over the ranks: the planner's choice (auto, default), "
                         "or on / off")
    sv.add_argument("--rank-timeout", type=float, default=3.0, metavar="S",
                    help="with several ranks: a rank silent this long is lost and the server fails (default 3)")
    sv.add_argument("--step-timeout", type=float, default=120.0, metavar="S",
                    help="with several ranks: an engine loop that does not advance this long, while not compiling, "
                         "fails the server (default 120)")
    sv.set_defaults(fn=cmd_serve)

    t = sub.add_parser("targets", help="list the built-in targets")
    t.add_argument("--json", action="store_true", help="every target's full description as JSON")
    t.add_argument("--describe", action="store_true", help="every key a target TOML may hold: its unit, what a value "
                   "must be, what its absence means, what it is for and the Target attribute it fills")
    t.set_defaults(fn=cmd_targets)

    p = sub.add_parser("passes", help="list the registered passes")
    p.set_defaults(fn=cmd_passes)
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parser().parse_args(argv)
    a.argv = argv  # what started this command: `serve --ranks N` starts its other ranks with it
    try:
        return a.fn(a)
    except (UsageError, ValueError, FileNotFoundError) as e:  # refused input: the message says why
        print(f"metainfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("metainfer: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from metainfer import CaptureError, EquivalenceError

        if not isinstance(e, (CaptureError, EquivalenceError)):
            raise  # a fault of metainfer's own: the traceback is what a bug report needs
        print(f"metainfer: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
