"""DeepSeek kernels on a GPU: correctness against the torch fallback, then time, side by side.

    pip install --no-deps --no-build-isolation -e . && python bench/bench_deepseek_gpu.py [--quick]

For each kernel (fp8_gemm, moe, sparse_attention, mla_decode) at DeepSeek-V3 shapes: the
fallback models/deepseek.py runs, in torch on the GPU, and the metainfer op (its Triton kernel
on CUDA tensors); outputs compared (bf16 tolerance), then median time over repetitions with
CUDA events, as a ratio. Needs CUDA; fp8 kernels need sm_89+ for native e4m3 (older GPUs take
the byte-decoding path). Written to run on torch >= 2.11 / triton >= 3.6.
"""

from __future__ import annotations

import argparse
import sys

import torch

from _cuda_timing import timed  # bench/ is on sys.path as the script's folder


def compare(name: str, shape: str, fallback, fast, reps: int, tol: float = 3e-2) -> None:
    with torch.no_grad():
        ref, out = fallback().float(), fast().float()
        err = ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        ok = err < tol and not torch.isnan(out).any().item()
        t_ref, t_fast = timed(fallback, reps) * 1e3, timed(fast, reps) * 1e3  # ms
    print(f"| {name} | {shape} | {'ok' if ok else 'MISMATCH'} ({err:.1e}) | {t_ref:.3f} ms | {t_fast:.3f} ms | "
          f"{t_ref / t_fast:.2f}x |")
    if not ok:
        compare.failed = True


compare.failed = False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    import deepseek_forms as forms  # bench/ is the script's directory
    from metainfer.kernels import fp8_gemm as F8

    dev, bf16 = "cuda", torch.bfloat16
    torch.manual_seed(0)
    tokens = 1024 if a.quick else 4096
    print(f"# DeepSeek kernels on {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    print("| kernel | shape | check (rel. error) | torch fallback | metainfer | speed-up |")
    print("|---|---|---|---|---|---|")

    # FP8 GEMM: F.linear(x, dequant(w)) vs fp8_linear (W8A16 and W8A8)
    for N, K in ((7168, 16384), (24576, 1536)):
        w, s = F8.quantize_weight(torch.randn(N, K, device=dev) * 0.02, 128, 128)
        x = torch.randn(tokens, K, device=dev, dtype=bf16)
        for mode in (False, True):
            compare(f"fp8_gemm {'W8A8' if mode else 'W8A16'}", f"{tokens}x{K} @ [{N},{K}]",
                    lambda: forms.fp8_fallback(x, w, s), lambda: forms.fp8_fast(x, w, s, mode), a.reps,
                    tol=6e-2 if mode else 3e-2)

    # sparse MLA prefill: dense attention with the top-k mask vs sparse_attention
    H, S, D, Dv, topk = (16 if a.quick else 128), (2048 if a.quick else 8192), 192, 128, 2048
    q = torch.randn(1, H, S, D, device=dev, dtype=bf16)
    k = torch.randn(1, H, S, D, device=dev, dtype=bf16)
    v = torch.randn(1, H, S, Dv, device=dev, dtype=bf16)
    causal = torch.full((S, S), float("-inf"), device=dev).triu_(1)
    idx = (torch.randn(1, S, S, device=dev) + causal).topk(topk, dim=-1)[1]

    compare("sparse_attention", f"{H} heads, {S} tokens, top-{topk}",
            lambda: forms.topk_dense(q, k, v, idx, causal, D ** -0.5),
            lambda: forms.topk_sparse(q, k, v, idx, causal, D ** -0.5), a.reps)
    del q, k, v, causal, idx

    # MLA decode: decompress the latent cache + attend vs absorbed mla_decode
    H, T, R, P, nope, dv, B = 128, (4096 if a.quick else 32768), 512, 64, 128, 128, 8
    c = torch.randn(B, T, R, device=dev, dtype=bf16)
    kpe = torch.randn(B, T, P, device=dev, dtype=bf16)
    W = (torch.randn(H * (nope + dv), R, device=dev) * R ** -0.5).to(bf16)
    q_nope = torch.randn(B, H, 1, nope, device=dev, dtype=bf16)
    q_pe = torch.randn(B, H, 1, P, device=dev, dtype=bf16)
    scale = (nope + P) ** -0.5
    compare("mla_decode", f"batch {B}, {H} heads, {T} cached tokens",
            lambda: forms.mla_decompressed(q_nope, q_pe, c, kpe, W, dv, scale),
            lambda: forms.mla_absorbed(q_nope, q_pe, c, kpe, W, dv, scale), a.reps)
    del c, kpe, W

    # MoE: DeepSeek's loop over experts vs moe_experts
    E, K, Hd, I, Tk = 256, 8, 7168, 2048, tokens
    w1 = (torch.randn(E, I, Hd, device=dev, dtype=bf16) * Hd ** -0.5)
    w3 = (torch.randn(E, I, Hd, device=dev, dtype=bf16) * Hd ** -0.5)
    w2 = (torch.randn(E, Hd, I, device=dev, dtype=bf16) * I ** -0.5)
    x = torch.randn(Tk, Hd, device=dev, dtype=bf16)
    ids = torch.rand(Tk, E, device=dev).topk(K, dim=-1)[1]
    wts = torch.rand(Tk, K, device=dev, dtype=bf16)

    compare("moe_experts", f"{Tk} tokens, {E} experts top-{K}, {Hd}->{I}",
            lambda: forms.moe_loop(x, ids, wts, w1, w3, w2), lambda: forms.moe_fused(x, ids, wts, w1, w3, w2),
            max(3, a.reps // 4))
    return 1 if compare.failed else 0


if __name__ == "__main__":
    sys.exit(main())
