"""The work each DeepSeek fast path removes, fallback vs fast path side by side, on CPU.

    python bench/bench_deepseek_cpu.py                 # prefill 1k, 4k, 8k
    python bench/bench_deepseek_cpu.py --seqs 1024 --quick

For each fast path the fallback is the code models/deepseek.py runs (DeepSeek's own
reference form) and the fast path is the metainfer op the pass puts in its place, run here
through its CPU implementation. Reported per case:
- launches: top-level ops executed (one kernel each in eager execution; view ops excluded);
- bytes: sum over those ops of the bytes they read and write (tensor sizes at each op's
  inputs and outputs: the traffic of one kernel per op, not of this CPU's caches; a sparse
  kernel is charged only for the K/V rows and mask entries at its selected indices);
- weight bytes (FP8 GEMM): bytes of weight read by the GEMM plus any dequantised copy
  written and read again;
- FLOPs (attention): 2 x queries x keys attended x (qk dim + v dim) x heads, by formula;
- peak: the process's peak RSS growth while the case runs (sampled every 2 ms).
Shapes are DeepSeek-V3's where a CPU can hold them (per-projection GEMMs, head dims, latent
rank, top-k 2048), with fewer heads and experts where the full layer would not fit in memory;
every scaled dimension is printed. Timing on CPU says nothing about a GPU; none is reported.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode


import deepseek_forms as forms  # noqa: E402  (bench/ is the script's directory)
from _memory import PeakRSS  # noqa: E402
from metainfer.kernels import fp8_gemm as F8  # noqa: E402

_VIEWS = {"view", "reshape", "_unsafe_view", "permute", "expand", "slice", "select", "unsqueeze", "squeeze", "t",
          "transpose", "alias", "detach", "as_strided", "split", "split_with_sizes", "unbind", "_to_copy_view"}


def _nbytes(t) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class Traffic(TorchDispatchMode):
    """Counts top-level ops (kernels) and the bytes each reads and writes."""

    def __init__(self):
        super().__init__()
        self.launches, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name not in _VIEWS:
            self.launches += 1
            flat = list(args) + list(kwargs.values())
            flat = [x for a in flat for x in (a if isinstance(a, (list, tuple)) else [a])]
            outs = out if isinstance(out, (list, tuple)) else [out]
            self.bytes += sum(_nbytes(x) for x in flat) + sum(_nbytes(x) for x in outs)
            if name in ("sparse_attention", "mla_decode"):
                self.bytes -= _gather_discount(name, args)
        return out


def _gather_discount(name, args) -> int:
    """A sparse kernel reads its K/V and mask only at the selected indices, not whole."""
    if name == "sparse_attention":
        q, k, v, idx, mask = args[:5]
        tensors = [k, v, mask]
    else:
        q, _, ckv, kpe, idx, mask = args[:6]
        tensors = [ckv, kpe, mask]
    if idx is None:
        return 0
    B, S, K = idx.shape
    saved = 0
    for t in tensors:
        if t is None:
            continue
        keys = t.shape[-2] if t is not mask else t.shape[-1]
        read = _nbytes(t) * min(1.0, S * K / max(1, keys * (S if t is mask else 1)))
        saved += _nbytes(t) - int(read)
    return saved


def measure(fn):
    """(launches, bytes moved, peak RSS growth) of one call of fn()."""
    with torch.no_grad(), PeakRSS() as mem:
        with Traffic() as t:
            out = fn()
        del out
    return t.launches, t.bytes, mem.growth


def _gb(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def row(*cells):
    print("| " + " | ".join(str(c) for c in cells) + " |")


# ---- FP8 GEMM ---------------------------------------------------------------------------

def bench_fp8(seqs, dtype):
    print("\n### FP8 block-scaled GEMM (W8A16), DeepSeek-V3 projections, bf16 activations\n")
    row("projection [N, K]", "tokens", "weight bytes fallback", "weight bytes fp8_linear", "ratio",
        "bytes fallback", "bytes fp8_linear", "peak fallback", "peak fp8_linear")
    row(*["---"] * 9)
    # attention output wo (7168 <- 128 x 128), an MLP down projection (7168 <- 18432) is 2.5x this
    for name, (N, K) in (("wo [7168, 16384]", (7168, 16384)), ("wq_b [24576, 1536]", (24576, 1536))):
        w, s = F8.quantize_weight(torch.randn(N, K) * 0.02, 128, 128)
        for S in seqs:
            x = torch.randn(S, K, dtype=dtype)
            fb = measure(lambda: forms.fp8_fallback(x, w, s))
            fp = measure(lambda: forms.fp8_fast(x, w, s))
            # fallback: read fp8 + write bf16 copy + GEMM reads it; fast path: read fp8 (+ scales)
            wb_fb = N * K * (1 + 2 * dtype.itemsize)
            wb_fp = N * K + s.numel() * 4
            row(name, S, _gb(wb_fb), _gb(wb_fp), f"{wb_fp / wb_fb:.2f}", _gb(fb[1]), _gb(fp[1]), _gb(fb[2]), _gb(fp[2]))
            del x
        del w, s


# ---- sparse MLA (DSA) -------------------------------------------------------------------

def bench_sparse(seqs, topk, heads, dtype):
    D, Dv = 192, 128
    print(f"\n### Sparse MLA prefill (DSA top-{topk}): {heads} heads (V3: 128) of q/k {D}, v {Dv}, batch 1\n")
    row("tokens", "FLOPs dense", "FLOPs sparse", "ratio", "bytes dense", "bytes sparse", "peak dense", "peak sparse",
        "launches dense / sparse")
    row(*["---"] * 9)
    for S in seqs:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, S, D, generator=g).to(dtype)
        k = torch.randn(1, heads, S, D, generator=g).to(dtype)
        v = torch.randn(1, heads, S, Dv, generator=g).to(dtype)
        causal = torch.full((S, S), float("-inf")).triu_(1)
        idx = (torch.randn(1, S, S, generator=g) + causal).topk(min(topk, S), dim=-1)[1]
        scale = D ** -0.5
        fd, fs = 2 * heads * S * S * (D + Dv), 2 * heads * S * min(topk, S) * (D + Dv)
        md, ms = (measure(lambda: f(q, k, v, idx, causal, scale)) for f in (forms.topk_dense, forms.topk_sparse))
        row(S, f"{fd / 1e9:.1f} G", f"{fs / 1e9:.1f} G", f"{fs / fd:.2f}", _gb(md[1]), _gb(ms[1]), _gb(md[2]),
            _gb(ms[2]), f"{md[0]} / {ms[0]}")
        del q, k, v, idx, causal
        gc.collect()


# ---- MLA decode (absorbed) --------------------------------------------------------------

def bench_mla_decode(lengths, heads, dtype):
    R, P, nope, dv = 512, 64, 128, 128
    print(f"\n### MLA decode step over the latent cache: {heads} heads (V3: 128), latent {R} + rope {P}, batch 1\n")
    row("cached tokens", "bytes decompress+attend", "bytes absorbed", "ratio", "peak decompress", "peak absorbed")
    row(*["---"] * 6)
    for T in lengths:
        g = torch.Generator().manual_seed(0)
        c = torch.randn(1, T, R, generator=g).to(dtype)
        kpe = torch.randn(1, T, P, generator=g).to(dtype)
        W = (torch.randn(heads * (nope + dv), R, generator=g) * R ** -0.5).to(dtype)
        q_nope = torch.randn(1, heads, 1, nope, generator=g).to(dtype)
        q_pe = torch.randn(1, heads, 1, P, generator=g).to(dtype)
        scale = (nope + P) ** -0.5
        a, b = (measure(lambda: f(q_nope, q_pe, c, kpe, W, dv, scale))
                for f in (forms.mla_decompressed, forms.mla_absorbed))
        row(T, _gb(a[1]), _gb(b[1]), f"{b[1] / a[1]:.3f}", _gb(a[2]), _gb(b[2]))


# ---- MoE --------------------------------------------------------------------------------

def bench_moe(seqs, E, topk, H, I, dtype):
    print(f"\n### Routed experts: {E} experts (V3: 256) top-{topk}, hidden {H} (V3: 7168), expert width {I} "
          "(V3: 2048)\n")
    row("tokens", "launches loop", "launches fused", "bytes loop", "bytes fused", "peak loop", "peak fused")
    row(*["---"] * 7)
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(E, I, H, generator=g) * H ** -0.5).to(dtype)
    w3 = (torch.randn(E, I, H, generator=g) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(dtype)
    for S in seqs:
        x = torch.randn(S, H, generator=g).to(dtype)
        ids = torch.rand(S, E, generator=g).topk(topk, dim=-1)[1]
        wts = torch.rand(S, topk, generator=g).to(dtype)

        a, b = (measure(lambda: f(x, ids, wts, w1, w3, w2)) for f in (forms.moe_loop, forms.moe_fused))
        row(S, a[0], b[0], _gb(a[1]), _gb(b[1]), _gb(a[2]), _gb(b[2]))


def main():
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        # big blocks straight from (and back to) the OS, so RSS shows each case's peak
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    ap.add_argument("--only", nargs="+", choices=("fp8", "sparse", "mla", "moe"), default=("fp8", "sparse", "mla", "moe"))
    a = ap.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    print(f"# DeepSeek fast paths on CPU ({torch.get_num_threads()} threads, torch {torch.__version__}, bf16)")
    small = a.quick
    if "fp8" in a.only and not small:
        bench_fp8(sorted({a.seqs[0], a.seqs[-1]}), dtype)
    if "sparse" in a.only:
        bench_sparse(a.seqs, a.topk, 2 if small else a.heads, dtype)
    if "mla" in a.only:
        bench_mla_decode(a.seqs, 2 if small else 16, dtype)
    if "moe" in a.only:
        bench_moe(a.seqs, *((8, 2, 64, 32) if small else (64, 8, 1024, 256)), dtype)


if __name__ == "__main__":
    main()
