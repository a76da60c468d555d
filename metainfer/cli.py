"""The `metainfer` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def _load_model(spec: str, dtype, attn: str | None):
    """A models/ name, or a Hugging Face config.json (random weights, nothing downloaded)."""
    import torch

    from metainfer import models

    if spec in models.names():
        model = models.build(spec, dtype=dtype)
        vocab = models.config(spec).vocab_size
        return model, vocab, f"models/{spec}"
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SystemExit(f"metainfer: --model {spec!r} is neither a models/ name ({', '.join(models.names())}) "
                         "nor a Hugging Face config.json")
    try:
        import transformers
    except ImportError:
        raise SystemExit("metainfer: a Hugging Face config needs `pip install transformers`")
    cfg = transformers.AutoConfig.from_pretrained(str(path))
    if attn:
        cfg._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype).eval(), cfg.vocab_size, f"{type(model).__name__} from {path}"


def cmd_optimize(a) -> int:
    import torch

    import metainfer

    dtype = getattr(torch, _DTYPES[a.dtype])
    model, vocab, what = _load_model(a.model, dtype, a.attn)
    ids = torch.randint(0, vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    print(f"optimizing {what} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{str(dtype).replace('torch.', '')}) for target {a.target}, input {a.batch}x{a.seq} tokens")
    t0 = time.perf_counter()
    opt = metainfer.optimize(model, a.target, example_inputs=(ids,), passes=a.passes, disable=a.disable or (),
                             verify=a.verify, dump_dir=a.dump, lowering=a.lowering, cache_dir=a.cache_dir)
    print(f"compiled in {time.perf_counter() - t0:.1f} s\n")
    print(opt.report)
    if a.dump:
        print(f"\nreport and graph dumps written to {a.dump}/")
    return 0


def cmd_plan(a) -> int:
    import dataclasses

    from metainfer import planner, shapes

    model = shapes.resolve(a.model)
    if a.weights:
        model = dataclasses.replace(model, weight_bytes=2.0 if a.weights == "bf16" else shapes._FP8_BYTES)
    phases = planner.PHASES if a.phase == "both" else (a.phase,)
    result = planner.plan(model, a.target, phases=phases, batch=a.batch, seq=a.seq, acceptance=a.acceptance)
    print(json.dumps(result.to_dict(), indent=2) if a.json else result)
    return 0


def cmd_targets(a) -> int:
    from metainfer import targets

    for name in targets.names():
        t = targets.get(name)
        if a.json:
            continue
        islands = " + ".join(str(len(i)) for i in t.topology.islands)
        print(f"{name:10s} {t.device.kind:5s} {t.num_devices} x {t.device.name:20s} islands {islands:7s} "
              f"p2p {'yes' if t.topology.p2p else 'no':3s}  {t.description}")
    if a.json:
        print(json.dumps({n: targets.get(n).to_dict() for n in targets.names()}, indent=2, default=str))
    return 0


def cmd_cache(a) -> int:
    from metainfer import cache

    if a.action == "clear":
        n = cache.clear(a.dir)
        print(f"removed {n} file(s) from {cache.directory(a.dir)}")
        return 0
    i = cache.info(a.dir)
    print(f"{i['root']}")
    for part in ("records", "inductor"):
        print(f"  {part:9s} {i[part]['files']:6d} files  {i[part]['bytes'] / 2**20:8.1f} MiB")
    return 0


def cmd_passes(a) -> int:
    from metainfer import passes

    for name in passes.pass_names():
        p = passes.get_pass(name)
        print(f"{name:16s} {p.summary}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="metainfer", description="Compiler passes for LLM inference on long-tail accelerators.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    o = sub.add_parser("optimize", help="optimize a model for a target and print the pass report")
    o.add_argument("--model", required=True, help="a models/ name (e.g. llama-tiny) or a Hugging Face config.json")
    o.add_argument("--target", default="cpu", help="target name (see `metainfer targets`) or TOML path")
    o.add_argument("--dump", metavar="DIR", help="write report.json, report.md and graph dumps here")
    o.add_argument("--batch", type=int, default=1)
    o.add_argument("--seq", type=int, default=64)
    o.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    o.add_argument("--attn", choices=("eager", "sdpa"), help="attention implementation of a Hugging Face model")
    o.add_argument("--passes", nargs="+", help="explicit pipeline (pass names)")
    o.add_argument("--disable", nargs="+", help="pass names to skip")
    o.add_argument("--lowering", choices=("inductor", "aot_eager"))
    o.add_argument("--verify", action="store_true", help="check outputs against eager; name the first bad pass")
    o.add_argument("--cache-dir", help="compile cache root (default $METAINFER_CACHE_DIR or ~/.cache/metainfer)")
    o.set_defaults(fn=cmd_optimize)

    pl = sub.add_parser("plan", help="choose parallelism per phase for a model on a target (cost-model predictions)")
    pl.add_argument("--model", required=True, help="a models/ name (e.g. llama3-70b, deepseek-v3) or a Hugging Face "
                    "config.json / model folder; no weights are read")
    pl.add_argument("--target", default="pcie8", help="target name (see `metainfer targets`) or TOML path")
    pl.add_argument("--phase", choices=("prefill", "decode", "both"), default="both")
    pl.add_argument("--batch", type=int, help="sequences per batch (default: prefill 4, decode 64)")
    pl.add_argument("--seq", type=int, help="prompt tokens (prefill) / context tokens (decode); default 4096")
    pl.add_argument("--acceptance", type=float, help="speculative decoding acceptance rate per drafted token: "
                    "choose the draft length for decode")
    pl.add_argument("--weights", choices=("bf16", "fp8"), help="weight precision (default: the model's own)")
    pl.add_argument("--json", action="store_true", help="print the candidates and choices as JSON")
    pl.set_defaults(fn=cmd_plan)

    c = sub.add_parser("cache", help="show or clear the compile cache")
    c.add_argument("action", choices=("info", "clear"))
    c.add_argument("--dir", help="cache root (default $METAINFER_CACHE_DIR or ~/.cache/metainfer)")
    c.set_defaults(fn=cmd_cache)

    t = sub.add_parser("targets", help="list the built-in targets")
    t.add_argument("--json", action="store_true")
    t.set_defaults(fn=cmd_targets)

    p = sub.add_parser("passes", help="list the registered passes")
    p.set_defaults(fn=cmd_passes)

    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"metainfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
