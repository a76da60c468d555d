"""Quantized checkpoints on metainfer: what each format costs in memory and accuracy, and what its
linears cost per call, side by side in one run.

    python bench/bench_quant.py                 # both tables (a few minutes on 2 cores)
    python bench/bench_quant.py --formats gptq,fp8-block --skip-linears

Table 1, per format: a random-weight Llama (hf-llama-512x4's shape: hidden 512, 4 layers, vocab
32000) written as that format by metainfer.checkpoint_writers, then loaded
- by metainfer.load: bytes its quantized linears hold, and the whole model's;
- by transformers' own from_pretrained on this CPU: the same linears' bytes, or the error it gives;
- the dequantised fp32 model (the writer's real weights in a float copy) as the reference: max
  |logit error| of the loaded model over a batch of prompts, and greedy decoding of 32 new tokens
  by metainfer.optimize(loaded) ("aot_eager" lowering: the passes and ops of the real pipeline,
  without Inductor's compile time) against the reference's: equal, or the first step where they
  differ with the reference's gap between the two tokens' logits;
- matches of fp8_gemm / int4_gemm over the optimized graphs.

Table 2, per shape (N = K = 4096, M = 1, 4, 16 decode-shaped and 512 prefill-shaped): measured
seconds per call on this CPU, as ratios to the bf16 F.linear, of metainfer::int4_linear (group
128, zero points) and metainfer::fp8_linear (128x128 blocks, and per channel) on their CPU path
(plain torch: dequantise 16 MiB row chunks to fp32, then matmul; the Triton interpreter is not
timed) and of the dequantise-then-linear fallback a quantized model runs without metainfer; plus
the cost model's predicted ratio on one pcie8 GPU (metainfer.analyze of the same layer, its
pass pipeline run, nothing executed). CPU timings say what this CPU path costs, not what a GPU
kernel does: the prediction is the GPU's number, from a model that is not checked against a GPU
measurement here.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import metainfer
from metainfer import servebench
from metainfer.checkpoint_writers import FORMATS, save_quantized
from metainfer.models.checkpoint import weight_bytes
from metainfer.models.quantized import QUANTIZED, FP8Linear, Int4Linear

# ct-int4 symmetric: transformers 5.25 with compressed-tensors 0.20 refuses asymmetric pack-quantized
# checkpoints, the library's own included (its zero points come packed, its model expects them not)
OPTIONS = {"fp8-block": dict(block=(128, 128)), "ct-int4": dict(group=128, symmetric=True),
           "gptq": dict(group=128, act_order=True), "gptq_v2": dict(group=128), "awq": dict(group=128)}


def _linear_bytes(model: nn.Module) -> int:
    """Bytes of every linear but lm_head: quantized layers' stored tensors, or float weights."""
    total = 0
    for name, m in model.named_modules():
        if name.endswith("lm_head"):
            continue
        if isinstance(m, QUANTIZED):
            total += m.weight_bytes()
        elif isinstance(m, nn.Linear) or type(m).__name__.endswith(("QuantLinear", "FP8Linear", "CompressedLinear")):
            total += sum(t.numel() * t.element_size() for t in list(m.parameters(recurse=False))
                         + list(m.buffers(recurse=False)) if t is not getattr(m, "bias", None))
    return total


def _transformers_load(folder: str) -> str:
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    except Exception as e:  # what a user gets: the message is the result
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:70]}"
    return f"{_linear_bytes(model) / 2**20:.2f} MiB"


def _reference(model: nn.Module, real: dict) -> nn.Module:
    ref = copy.deepcopy(model).float()
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16).float()  # the checkpoint stores the float tensors in bf16
    for name, w in real.items():
        ref.get_parameter(name).data.copy_(w)
    return ref.eval()


def _greedy(ref, opt, prompt, new: int) -> str:
    gen = dict(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=-1)
    want = ref.generate(prompt, **gen)[0, prompt.shape[1]:]
    got = opt.generate(prompt, **gen)[0, prompt.shape[1]:]
    if torch.equal(got, want):
        return f"{new}/{new} equal"
    step = int((got != want).nonzero()[0])
    ctx = torch.cat([prompt[0], want[:step]])[None]
    with torch.no_grad():
        logits = ref(ctx).logits[0, -1]
    gap = (logits[want[step]] - logits[got[step]]).item()
    return f"differ at step {step} (reference logit gap {gap:.2e})"


def formats_table(formats: list[str]) -> list[str]:
    model = servebench.build_model("hf-llama-512x4")  # fp32, random weights
    float_bytes = sum(m.weight.numel() * 2 for n, m in model.named_modules()
                      if isinstance(m, nn.Linear) and not n.endswith("lm_head"))
    prompts = torch.randint(3, 32000, (4, 24), generator=torch.Generator().manual_seed(0))
    rows = [("format", "linears, metainfer", "whole model", "linears, transformers on CPU", "max |logit err|",
             "greedy 32 tokens", "matches")]
    rows.append(("(bf16 checkpoint)", f"{float_bytes / 2**20:.2f} MiB", "", "", "", "", ""))
    for fmt in formats:
        with tempfile.TemporaryDirectory() as folder:
            real = save_quantized(model, folder, fmt, **OPTIONS.get(fmt, {}))
            t0 = time.perf_counter()
            loaded = metainfer.load(folder, dtype=torch.float32)
            load_s = time.perf_counter() - t0
            theirs = _transformers_load(folder)
        ref = _reference(model, real)
        with torch.no_grad():
            err = (loaded(prompts).logits - ref(prompts).logits).abs().max().item()
        opt = metainfer.optimize(loaded, "cpu", lowering="aot_eager")
        greedy = _greedy(ref, opt, prompts[:1], 32)
        pass_name = "fp8_gemm" if any(isinstance(m, FP8Linear) for m in loaded.modules()) else "int4_gemm"
        per_graph = {opt.report.record(pass_name, g).matches for g in range(len(opt.report.sections))}
        rows.append((fmt, f"{_linear_bytes(loaded) / 2**20:.2f} MiB", f"{weight_bytes(loaded)['total'] / 2**20:.1f} MiB",
                     theirs, f"{err:.1e}", greedy, f"{pass_name} {'/'.join(map(str, sorted(per_graph)))} per graph"))
        print(f"  {fmt}: loaded in {load_s:.2f} s", file=sys.stderr)
    return _table(rows)


def _time(fn, min_s: float = 0.3) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s and n >= 3:
            return dt / n


def _predicted(layer: nn.Module, M: int, K: int) -> float:
    """The simulator's predicted seconds for one call of `layer` on one pcie8 GPU, after the passes."""
    report = metainfer.analyze(layer.to("meta"), "pcie8",
                               example_inputs=(torch.empty(M, K, dtype=torch.bfloat16, device="meta"),))
    return sum([r.predicted_after_s for r in s.records if r.predicted_after_s is not None][-1]
               for s in report.sections)


def linears_table(N: int = 4096, K: int = 4096, ms=(1, 4, 16, 512)) -> list[str]:
    torch.manual_seed(0)
    dense = nn.Linear(K, N, bias=False).to(torch.bfloat16).eval()
    int4 = Int4Linear.from_linear(dense.float(), 128, symmetric=False).eval()
    fp8_block = FP8Linear.from_linear(dense.float(), (128, 128)).eval()
    fp8_channel = FP8Linear.from_linear(dense.float(), "channel").eval()
    dense = dense.to(torch.bfloat16)
    ops = torch.ops.metainfer
    rows = [("M", "bf16 linear", "int4 op", "int4 fallback", "fp8 op (128x128)", "fp8 op (channel)", "fp8 fallback",
             "predicted on pcie8: int4 / bf16", "fp8 / bf16")]
    layers = {"bf16": dense, "int4": int4, "fp8": fp8_block}
    for M in ms:
        x = torch.randn(M, K, dtype=torch.bfloat16)
        with torch.no_grad():
            base = _time(lambda: F.linear(x, dense.weight))
            t = {
                "int4": _time(lambda: ops.int4_linear(x, int4.qweight, int4.scales, int4.zeros, None, None, 128)),
                "int4 fallback": _time(lambda: int4(x)),  # dequantise the whole weight, then F.linear
                "fp8": _time(lambda: ops.fp8_linear(x, fp8_block.weight, fp8_block.weight_scale, None, 128, 128,
                                                    False)),
                "fp8 channel": _time(lambda: ops.fp8_linear(x, fp8_channel.weight, fp8_channel.weight_scale, None,
                                                            fp8_channel.block_n, fp8_channel.block_k, False)),
                "fp8 fallback": _time(lambda: fp8_block(x)),
            }
        pred = {k: _predicted(copy.deepcopy(v), M, K) for k, v in layers.items()}
        rows.append((str(M), f"{base * 1e3:.2f} ms", *(f"{t[k] / base:.2f}x" for k in t),
                     f"{pred['int4'] / pred['bf16']:.2f}x", f"{pred['fp8'] / pred['bf16']:.2f}x"))
    return _table(rows)



def _table(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, from {', '.join(FORMATS)}")
    ap.add_argument("--skip-formats", action="store_true")
    ap.add_argument("--skip-linears", action="store_true")
    a = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not a.skip_formats:
        print("\n# formats: hf-llama-512x4 shape, random weights; reference: the dequantised fp32 model")
        print("\n".join(formats_table([f for f in a.formats.split(",") if f])))
    if not a.skip_linears:
        print("\n# linears N = K = 4096, bf16 activations: CPU seconds per call as a ratio to the bf16 linear "
              "(ops on their plain-torch CPU path); predicted ratio on one pcie8 GPU")
        print("\n".join(linears_table()))


if __name__ == "__main__":
    main()
