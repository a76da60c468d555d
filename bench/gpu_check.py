"""The one prepared script for a GPU machine: every metainfer Triton kernel compiled (not
interpreted) and checked against its torch reference, each timed against torch's own path for
the same job, then the cost model's constants measured; one table.

    pip install --no-deps --no-build-isolation -e . && python bench/gpu_check.py [--only attention moe]
    python bench/gpu_check.py --dry-run      # on a CPU: list the checks, run each at a tiny size
                                            # through Triton's interpreter (tests the script)

Checks (bf16 unless said; shapes of a Llama-3-8B / DeepSeek-V3 layer at batch sizes serving uses):
attention prefill (causal, 1 x 32/8 heads x 4096, d128), decode (64 x 1 query over 4096 keys) and
batch-1 decode over 16384 keys (keys split over programs, flash-decoding) against SDPA (flash);
paged attention (a prefill chunk batch and a 64-request decode step over a paged pool) against
SDPA on the gathered keys; rmsnorm, swiglu, geglu, rope against their eager torch forms; fp8_gemm W8A16
at decode (M=16; M=4 over a 2048 x 7168 weight, split-K) and prefill (M=4096) shapes against
dequantise + cuBLAS matmul; moe (256 experts, top 8, 2048 tokens) against the eager loop over
experts; sparse_attention and mla_decode (DeepSeek's R=512, P=64; batch 64, and batch 1 over
8192 cached tokens with the cache split) against their references; the rows added for Ada's
99 KiB (float32 heads of 256, MLA's latent of 1024), sparse attention's unselected rows redone
on the device, the token check's position of the first bad id, 18 op variants through
`torch.ops.metainfer` (the custom-op bodies compiled graphs call), every autotune candidate of
the GPU's attention and fp8_gemm rows run once as a fixed config, NCCL ranks (one a GPU, up to
two) running functional collectives on their tensors (eager and compiled), and a tiny Hugging Face
Llama optimized for the GPU whose generate() (growing cache; static cache, its decode replayed
from CUDA graphs, the replays counted; prompt-lookup speculation) and generate_batch() tokens
must equal eager's. The kernels use the config rows of the GPU's own architecture (sm_90 on
Hopper). On a GPU each check stops after --timeout seconds; --json FILE writes the rows. The
first call of a shape runs triton.autotune over the config row's candidates, untimed (`run`
calls each kernel once before timing it). Then GEMM TFLOP/s, memory bandwidth and launch
overhead (bench/calibrate_gpu.py's measurements). Written for torch 2.11 / Triton 3.6 as well
as this project's pins.

Every check states its peak GPU memory at full size and its estimated time on one H100 (the
Check's peak_gib / est_s; how they are estimated is written beside the Check class). On a GPU a
check whose measured peak (torch.cuda.max_memory_allocated, reset before it) passes its statement
fails, naming both; a check stating more than 92% of the device's memory is skipped by name.
Budget: the estimates add to ~380 s, plus calibration ~30 s (under 8 minutes); `--quick` (one
check per kernel family, the collectives, no end-to-end row) to ~110 s, what a short lease runs
first:

    python bench/gpu_check.py --quick --json quick.json && python bench/gpu_check.py --json full.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable

DRY = "--dry-run" in sys.argv
if DRY:  # the interpreter must be chosen before Triton's modules are imported
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["METAINFER_TRITON_INTERPRET"] = "1"
# the GPU machine's image has its own transformers, installed by no one here: the serving checks
# run on it anyway, warned (models/transformers_adapter.py), and a failure there is a finding
os.environ.setdefault("METAINFER_UNTESTED_TRANSFORMERS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:
    from metainfer import kernels as K  # noqa: E402
    from metainfer.kernels.configs import config_for  # noqa: E402
except ImportError as e:  # the package-dir mapping needs an install
    sys.exit(f"cannot import metainfer ({e}); run `pip install --no-deps --no-build-isolation -e .` first")

TOL = {torch.bfloat16: 3e-2, torch.float16: 3e-3, torch.float32: 1e-4}


@dataclass
class Check:
    kernel: str
    case: str
    build: Callable[[str, float], dict]  # (device, size factor) -> {"ours", "reference", "torch", "dtype"}
    peak_gib: float = 1.0  # stated peak GPU memory at full size (inputs, weights, reference); a run above it fails
    est_s: float = 5.0  # estimated seconds on one H100 (how: the comment below)
    quick: bool = False  # in --quick, the first run of a short lease
    timeout_s: int | None = None  # its own limit on a GPU (None: --timeout)


# How est_s is estimated (counted, not run: no GPU has been lent yet): each Triton specialisation
# JIT-compiles in ~1-3 s (2 s counted), each do_bench of ours and of torch's path ~0.2 s plus the
# call's own time; a reference's time from its FLOPs at ~25 TFLOP/s (fp32 without TF32); the
# end-to-end check's budget from its measured compile count (E2E_COMPILES below). Peaks: the tensors a build makes, the reference's
# largest temporaries (fp32 score matrices, expanded K/V), rounded up.


def _bench(fn) -> float:
    """Milliseconds per call (triton's do_bench on a GPU; one timed call in a dry run)."""
    if DRY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50)


def _n(x: float, f: float, lo: int = 1) -> int:
    return max(lo, int(round(x * f)))


def _attention(decode: bool, batch: int = 64, keys: int = 4096):
    def build(dev, f):
        dt = torch.bfloat16
        B, H, Hkv, D = (_n(batch, f), 32, 8, 128) if decode else (1, 32, 8, 128)
        Sq, Sk = (1, _n(keys, f, 16)) if decode else (_n(4096, f, 16), _n(4096, f, 16))
        q = torch.randn(B, H, Sq, D, device=dev, dtype=dt)
        k, v = (torch.randn(B, Hkv, Sk, D, device=dev, dtype=dt) for _ in range(2))
        causal = not decode
        cfg = config_for("attention", q.device, head_dim=D, dtype=dt)
        return {"ours": lambda: K.attention.launch(q, k, v, None, D ** -0.5, causal, Sk - Sq, config=cfg),
                "reference": lambda: K.attention.reference(q, k, v, None, D ** -0.5, causal, Sk - Sq),
                "torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
                "dtype": dt}
    return build


def _paged(decode: bool):
    def build(dev, f):
        dt = torch.bfloat16
        n = _n(64, f) if decode else _n(8, f)
        lens_q = [1] * n if decode else [_n(512, f, 2)] * n
        lens_k = [_n(2048, f, 2) + q for q in lens_q]
        rows = sum(lens_k) + 256
        kp, vp = (torch.randn(rows, 8, 128, device=dev, dtype=dt) for _ in range(2))
        ki = torch.randperm(rows, device=dev)[:sum(lens_k)].to(torch.int32)
        q = torch.randn(sum(lens_q), 32, 128, device=dev, dtype=dt)
        cu_q = torch.tensor([0] + lens_q, device=dev).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, device=dev).cumsum(0).to(torch.int32)
        args = (q, kp, vp, ki, cu_q, cu_k, max(lens_q), max(lens_k), 128 ** -0.5)
        cfg = config_for("paged_attention", q.device)
        return {"ours": lambda: K.paged_attention.launch(*args, config=cfg),
                "reference": lambda: K.paged_attention.reference(*args[:6], args[8]),
                "torch": lambda: _sdpa_per_request(*args), "dtype": dt}
    return build


def _sdpa_per_request(q, k_pool, v_pool, key_index, cu_q, cu_k, max_q, max_k, scale):
    """What one does without a paged kernel: gather each request's keys, SDPA on them
    (bottom-right causal as a boolean mask for a chunk after cached tokens)."""
    out = torch.empty_like(q)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for r in range(len(cq) - 1):
        rows = key_index[ck[r]:ck[r + 1]].long()
        qr = q[cq[r]:cq[r + 1]].transpose(0, 1)[None]
        k, v = k_pool[rows].transpose(0, 1)[None], v_pool[rows].transpose(0, 1)[None]
        sq, sk = qr.shape[2], k.shape[2]
        mask = None
        if sq > 1:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        out[cq[r]:cq[r + 1]] = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale,
                                                              enable_gqa=True)[0].transpose(0, 1)
    return out


def _rmsnorm(dev, f):
    dt = torch.bfloat16
    x, w = torch.randn(_n(4096, f), 4096, device=dev, dtype=dt), torch.randn(4096, device=dev, dtype=dt)
    cfg = config_for("rmsnorm", x.device)

    def eager():
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt) * w

    return {"ours": lambda: K.rmsnorm.launch(x, w, 1e-6, 0.0, dt, config=cfg),
            "reference": lambda: K.rmsnorm.reference(x, w, 1e-6, 0.0, dt), "torch": eager, "dtype": dt}


def _glu(activation, n):
    def build(dev, f):
        dt = torch.bfloat16
        g, u = (torch.randn(_n(4096, f), n, device=dev, dtype=dt) for _ in range(2))
        cfg = config_for("glu", g.device)
        act = (lambda g: F.silu(g)) if activation == "silu" else (lambda g: F.gelu(g, approximate="tanh"))
        return {"ours": lambda: K.glu.launch(g, u, config=cfg, activation=activation),
                "reference": lambda: K.glu.reference(g, u, activation), "torch": lambda: act(g) * u, "dtype": dt}

    return build


def _rope(dev, f):
    dt = torch.bfloat16
    S = _n(4096, f, 2)
    x = torch.randn(1, 32, S, 128, device=dev, dtype=dt)
    cos, sin = (torch.randn(1, 1, S, 128, device=dev, dtype=dt) for _ in range(2))
    cfg = config_for("rope", x.device)

    def eager():
        half = torch.cat((-x[..., 64:], x[..., :64]), dim=-1)
        return x * cos + half * sin

    return {"ours": lambda: K.rope.launch(x, cos, sin, config=cfg), "reference": lambda: K.rope.reference(x, cos, sin),
            "torch": eager, "dtype": dt}


def _fp8_gemm(m: int, n: int = 7168, k: int = 7168):
    def build(dev, f):
        dt = torch.bfloat16
        M, N, Kd = _n(m, f), _n(n, f, 128) // 128 * 128, _n(k, f, 128) // 128 * 128
        x = torch.randn(M, Kd, device=dev, dtype=dt)
        w = (torch.randn(N, Kd, device=dev) / 8).to(torch.float8_e4m3fn)
        s = torch.rand(N // 128, Kd // 128, device=dev) + 0.5
        cfg = config_for("fp8_gemm", x.device)

        def dequant_matmul():
            wd = (w.float().view(N // 128, 128, Kd // 128, 128) * s[:, None, :, None]).view(N, Kd).to(dt)
            return x @ wd.t()

        return {"ours": lambda: K.fp8_gemm.launch(x, w, s, None, 128, 128, False, config=cfg),
                "reference": lambda: K.fp8_gemm.reference(x, w, s, None, 128, 128, False),
                "torch": dequant_matmul, "dtype": dt}
    return build


def _fp8_channel_gemm(m: int, act_quant: bool, n: int = 4096, k: int = 4096):
    """A compressed-tensors FP8-Dynamic linear: one scale per output row (block_n 1, block_k >= K),
    activations per token (W8A8) or kept (W8A16), against dequantise + cuBLAS matmul."""
    def build(dev, f):
        dt = torch.bfloat16
        M, N, Kd = _n(m, f), _n(n, f, 128) // 128 * 128, _n(k, f, 128) // 128 * 128
        bn, bk = K.fp8_gemm.channel_blocks(N, Kd, "channel")
        x = torch.randn(M, Kd, device=dev, dtype=dt)
        w = (torch.randn(N, Kd, device=dev) / 8).to(torch.float8_e4m3fn)
        s = torch.rand(N, 1, device=dev) + 0.5
        cfg = config_for("fp8_gemm", x.device)
        return {"ours": lambda: K.fp8_gemm.launch(x, w, s, None, bn, bk, act_quant, config=cfg),
                "reference": lambda: K.fp8_gemm.reference(x, w, s, None, bn, bk, act_quant),
                "torch": lambda: x @ (w.float() * s).to(dt).t(), "dtype": dt}
    return build


def _int4_gemm(m: int, n: int = 4096, k: int = 4096, group: int = 128):
    """GPTQ/AWQ-style int4 (group 128, zero points) against dequantise + cuBLAS matmul, fp16."""
    def build(dev, f):
        dt = torch.float16
        M, N, Kd = _n(m, f), _n(n, f, group) // group * group, _n(k, f, group) // group * group
        x = torch.randn(M, Kd, device=dev, dtype=dt)
        q, s, z = K.int4_gemm.quantize_weight(torch.randn(N, Kd, device=dev) / Kd ** 0.5, group, symmetric=False)
        cfg = config_for("int4_gemm", x.device)

        def dequant_matmul():
            return x @ K.int4_gemm.dequantize(q, s, z, group, dt).t()

        return {"ours": lambda: K.int4_gemm.launch(x, q, s, z, None, None, group, config=cfg),
                "reference": lambda: K.int4_gemm.reference(x, q, s, z, None, None, group),
                "torch": dequant_matmul, "dtype": dt}
    return build


def _moe(dev, f):
    dt = torch.bfloat16
    T, E, top, H, I = _n(2048, f, 4), max(8, _n(256, f)), 8, _n(7168, f, 64), _n(2048, f, 64)
    x = torch.randn(T, H, device=dev, dtype=dt)
    ids = torch.stack([torch.randperm(E, device=dev)[:top] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, top, device=dev)
    wg, wu = (torch.randn(E, I, H, device=dev, dtype=dt).div_(H ** 0.5) for _ in range(2))  # in place: no copy
    wd = torch.randn(E, H, I, device=dev, dtype=dt).div_(I ** 0.5)
    cfg = config_for("moe", x.device)
    args = (x, ids, tw, wg, wu, wd)
    return {"ours": lambda: K.moe.launch(*args, config=cfg), "reference": lambda: K.moe.reference(*args),
            "torch": lambda: K.moe.reference(*args),  # the eager loop over experts
            "dtype": dt}


def _moe_align(dev, f):
    """The routing sort at the bound between its two paths (ALIGN_MAX_PAIRS pairs): the one-program
    kernel against align_by_expert's torch ops, which it must equal exactly; the timing says
    whether the bound is right (both sides are timed as one step's routing would run them)."""
    E, top = 256, 8
    cfg = config_for("moe", torch.device(dev))
    T = max(1, _n(cfg["ALIGN_MAX_PAIRS"] // top, f))
    ids = torch.stack([torch.randperm(E, device=dev)[:top] for _ in range(T)]).to(torch.int32)
    bm = cfg["BLOCK_M"]

    def both(sorted_pairs, experts):  # one tensor to compare: pair ids, then tile experts
        return torch.cat([sorted_pairs.long(), experts.long()])

    return {"ours": lambda: both(*K.moe.launch_align(ids, E, bm)),
            "reference": lambda: both(*K.moe.align_by_expert(ids, E, bm)[:2]),
            "torch": lambda: both(*K.moe.align_by_expert(ids, E, bm)[:2]), "dtype": torch.int64}


def _moe_decode(dev, f):
    """MoE at the bound between its decode path (two matrix-vector kernels, GEMV_MAX_PAIRS pairs)
    and the sort + tile kernels, DeepSeek-V3's expert shapes in block FP8 (bf16 below sm_89): the
    timing ("torch" is the tile path here) says whether the bound is right."""
    dt, E, top = torch.bfloat16, max(8, _n(256, f)), 8
    H, I = _n(7168, f, 64), _n(2048, f, 64)
    cfg = config_for("moe", torch.device(dev))
    T = max(1, _n(cfg["GEMV_MAX_PAIRS"] // top, f))
    x = torch.randn(T, H, device=dev, dtype=dt)
    ids = torch.stack([torch.randperm(E, device=dev)[:top] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, top, device=dev)
    fp8 = dev != "cuda" or torch.cuda.get_device_capability() >= (8, 9)

    def weights(n, k):  # expert by expert: a whole fp32 stack would be 14 GiB per projection
        w = torch.empty(E, n, k, device=dev, dtype=torch.float8_e4m3fn if fp8 else dt)
        for e in range(E):
            we = torch.randn(n, k, device=dev) / k ** 0.5
            w[e] = (we * 8).clamp(-448, 448).to(w.dtype) if fp8 else we.to(dt)
        if not fp8:
            return w, None
        s = torch.rand(E, -(-n // 128), -(-k // 128), device=dev) + 0.5
        return w, s / 8

    (wg, sg), (wu, su), (wd, sd) = weights(I, H), weights(I, H), weights(H, I)
    args = (x, ids, tw, wg, wu, wd, sg, su, sd, 128, 128)
    tiles = {**cfg, "GEMV_MAX_PAIRS": 0}
    return {"ours": lambda: K.moe.launch(*args, config=cfg), "reference": lambda: K.moe.reference(*args),
            "torch": lambda: K.moe.launch(*args, config=tiles), "dtype": dt}


def _sparse(dev, f):
    dt = torch.bfloat16
    Sq, Sk, topk = _n(1024, f, 4), _n(8192, f, 64), _n(2048, f, 16)
    q = torch.randn(1, 64, Sq, 192, device=dev, dtype=dt)
    k = torch.randn(1, 1, Sk, 192, device=dev, dtype=dt)
    v = torch.randn(1, 1, Sk, 128, device=dev, dtype=dt)
    # distinct keys per query (the kernel counts a duplicate twice, the reference once)
    idx = torch.stack([torch.randperm(Sk, device=dev)[:topk] for _ in range(Sq)])[None].to(torch.int32)
    cfg = config_for("sparse_attention", q.device)
    args = (q, k, v, idx, None, 192 ** -0.5, False, 0)
    return {"ours": lambda: K.sparse_attention.launch(*args, config=cfg),
            "reference": lambda: K.sparse_attention.reference(*args),
            "torch": lambda: K.sparse_attention.reference(*args), "dtype": dt}


def _mla(batch: int, cache: int, latent: int = 512):
    return lambda dev, f: _mla_build(dev, f, batch, cache, latent)


def _mla_build(dev, f, batch, cache, R):
    dt = torch.bfloat16
    B, H, T = _n(batch, f), 16, _n(cache, f, 16)
    ql, qp = torch.randn(B, H, 1, R, device=dev, dtype=dt), torch.randn(B, H, 1, 64, device=dev, dtype=dt)
    ckv, kpe = torch.randn(B, T, R, device=dev, dtype=dt), torch.randn(B, T, 64, device=dev, dtype=dt)
    cfg = config_for("mla_decode", ql.device)  # a latent above 512 takes the row's WIDE_R blocks
    args = (ql, qp, ckv, kpe, None, None, (R + 64) ** -0.5, True, T - 1)
    return {"ours": lambda: K.mla_decode.launch(*args, config=cfg), "reference": lambda: K.mla_decode.reference(*args),
            "torch": lambda: K.mla_decode.reference(*args), "dtype": dt}


def _token_ids(dev, f):
    ids = torch.randint(0, 128000, (_n(64, f), _n(4096, f)), device=dev)
    cfg = config_for("token_ids", ids.device)
    return {"ours": lambda: K.token_ids.launch(ids, 128256, config=cfg)[0],
            "reference": lambda: K.token_ids.reference(ids, 128256)[0],
            "torch": lambda: torch.where((ids >= 0) & (ids < 128256), ids, 0), "dtype": torch.int64}


def _dispatch(dev, f):
    """Every metainfer op a graph can call without the serving engine's pool, through
    torch.ops.metainfer (the custom-op body that picks the kernel), against the kernels'
    references, each at its own scale; the paged ops run in the end-to-end check's
    generate_batch."""
    from metainfer.kernels import ops  # noqa: F401  (registers torch.ops.metainfer)

    mi, dt, g = torch.ops.metainfer, torch.bfloat16, torch.Generator(dev).manual_seed(0)

    def randn(*shape, dtype=dt):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    S, T = _n(1024, f, 16), _n(64, f, 4)
    q, k, v = randn(2, 8, S, 64), randn(2, 2, S, 64), randn(2, 2, S, 64)
    x, res, w = randn(T, 4096), randn(T, 4096), randn(4096)
    cos, sin = randn(1, 1, S, 64), randn(1, 1, S, 64)
    w8 = (randn(512, 1024, dtype=torch.float32) / 8).to(torch.float8_e4m3fn)
    s8 = torch.rand(4, 8, device=dev, generator=g) + 0.5
    x8 = randn(T, 1024)
    # experts of 1024 -> 256 on a GPU; 256 -> 128 in a dry run (the interpreter took ~55 s at full size)
    E, H, I = 8, _n(1024, f, 256), _n(256, f, 128)
    xe = randn(T, H)
    ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:2] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, 2, device=dev, generator=g)
    we = (randn(E, I, H, dtype=torch.float32) / 8).to(torch.float8_e4m3fn)
    wd = (randn(E, H, I, dtype=torch.float32) / 8).to(torch.float8_e4m3fn)
    se = torch.rand(E, I // 128, H // 128, device=dev, generator=g) + 0.5
    sd = torch.rand(E, H // 128, I // 128, device=dev, generator=g) + 0.5
    idx = torch.stack([torch.randperm(S, device=dev, generator=g)[:16] for _ in range(S)])[None].expand(2, S, 16)
    idx = idx.to(torch.int32).contiguous()
    ql, qp, ckv, kpe = randn(2, 16, 1, 512), randn(2, 16, 1, 64), randn(2, S, 512), randn(2, S, 64)
    # the variants a quantized checkpoint reaches: per-channel FP8 (W8A16 and per-token W8A8), int4
    # with zero points, act-order and bias, int4 symmetric at M=1 (the GEMV), bf16 experts
    bn, bk = K.fp8_gemm.channel_blocks(512, 1024, "channel")
    sc = torch.rand(512, 1, device=dev, generator=g) + 0.5
    q4, s4, z4 = K.int4_gemm.quantize_weight(randn(512, 1024, dtype=torch.float32), 128, symmetric=False)
    perm = torch.randperm(1024, device=dev, generator=g).to(torch.int32)
    b4 = randn(512)
    q4s, s4s, _ = K.int4_gemm.quantize_weight(randn(512, 1024, dtype=torch.float32), 128)
    web, wdb = randn(E, I, H) / 8, randn(E, H, I) / 8
    pairs = [
        (lambda: mi.attention(q, k, v, None, 0.125, True, 0, False),
         lambda: K.attention.reference(q, k, v, None, 0.125, True, 0)),
        (lambda: mi.rmsnorm(x, w, 1e-6, 0.0, dt), lambda: K.rmsnorm.reference(x, w, 1e-6, 0.0, dt)),
        (lambda: torch.cat(mi.add_rmsnorm(x, res, w, 1e-6, 0.0, dt)),
         lambda: torch.cat([K.rmsnorm.reference(x + res, w, 1e-6, 0.0, dt), x + res])),
        (lambda: mi.swiglu(x, res), lambda: K.glu.reference(x, res, "silu")),
        (lambda: mi.geglu(x, res), lambda: K.glu.reference(x, res, "gelu_tanh")),
        (lambda: mi.rope(q, cos, sin), lambda: K.rope.reference(q, cos, sin)),
        (lambda: mi.fp8_linear(x8, w8, s8, None, 128, 128, False),
         lambda: K.fp8_gemm.reference(x8, w8, s8, None, 128, 128, False)),
        (lambda: mi.moe_experts(xe, ids, tw, we, we, wd, se, se, sd, 128, 128),
         lambda: K.moe.reference(xe, ids, tw, we, we, wd, se, se, sd)),
        (lambda: mi.sparse_attention(q, k, v, idx, None, 0.125, True, 0, False, float("-inf")),
         lambda: K.sparse_attention.reference(q, k, v, idx, None, 0.125, True, 0)),
        (lambda: mi.mla_decode(ql, qp, ckv, kpe, None, None, 0.04, True, S - 1, False),
         lambda: K.mla_decode.reference(ql, qp, ckv, kpe, None, None, 0.04, True, S - 1)),
        (lambda: mi.fp8_linear(x8, w8, s8, None, 128, 128, True),
         lambda: K.fp8_gemm.reference(x8, w8, s8, None, 128, 128, True)),
        (lambda: mi.fp8_linear(x8, w8, sc, None, bn, bk, False),
         lambda: K.fp8_gemm.reference(x8, w8, sc, None, bn, bk, False)),
        (lambda: mi.fp8_linear(x8, w8, sc, None, bn, bk, True),
         lambda: K.fp8_gemm.reference(x8, w8, sc, None, bn, bk, True)),
        # W8A8 with the activations quantised once for several linears (share_act_quant)
        (lambda: mi.fp8_linear_quantized(x8, *mi.fp8_quantize_activations(x8, 128), w8, s8, None, 128, 128),
         lambda: K.fp8_gemm.reference(x8, w8, s8, None, 128, 128, True)),
        (lambda: mi.int4_linear(x8, q4, s4, z4, perm, b4, 128),
         lambda: K.int4_gemm.reference(x8, q4, s4, z4, perm, b4, 128)),
        (lambda: mi.int4_linear(x8[:1], q4s, s4s, None, None, None, 128),
         lambda: K.int4_gemm.reference(x8[:1], q4s, s4s, None, None, None, 128)),
        (lambda: mi.moe_experts(xe, ids, tw, web, web, wdb, None, None, None, 128, 128),
         lambda: K.moe.reference(xe, ids, tw, web, web, wdb)),
        (lambda: mi.fp8_dequantize(w8, sc, bn, bk, dt), lambda: K.fp8_gemm.dequantize(w8, sc, bn, bk, dt)),
        (lambda: mi.int4_dequantize(q4, s4, z4, 128, dt), lambda: K.int4_gemm.dequantize(q4, s4, z4, 128, dt)),
    ]
    cache: list = []

    def expected():
        if not cache:
            cache.extend(r().float() for _, r in pairs)
        return cache

    def ours():
        return torch.cat([(o().float() / max(1.0, e.abs().max().item())).flatten()
                          for (o, _), e in zip(pairs, expected())])

    def ref():
        return torch.cat([(e / max(1.0, e.abs().max().item())).flatten() for e in expected()])
    return {"ours": ours, "reference": ref, "torch": ref, "dtype": dt, "once": True}


def _wide_fp32_attention(dev, f):
    """float32 heads of 256 (the rows that fit Ada's 99 KiB)."""
    S = _n(512, f, 16)
    q, k, v = (torch.randn(1, 4, S, 256, device=dev), torch.randn(1, 4, S, 256, device=dev),
               torch.randn(1, 4, S, 256, device=dev))
    cfg = config_for("attention", q.device, head_dim=256, dtype=torch.float32)
    args = (q, k, v, None, 256 ** -0.5, True, 0)
    return {"ours": lambda: K.attention.launch(*args, config=cfg), "reference": lambda: K.attention.reference(*args),
            "torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), "dtype": torch.float32}


def _sparse_filled(dev, f):
    """Sparse attention whose unselected keys carry HF's finite fill, with padding rows that keep
    no selected key: recomputed densely on the device (no read-back)."""
    dt = torch.bfloat16
    Sq, Sk, topk = _n(256, f, 8), _n(2048, f, 64), _n(256, f, 16)
    q = torch.randn(2, 16, Sq, 128, device=dev, dtype=dt)
    k, v = torch.randn(2, 1, Sk, 128, device=dev, dtype=dt), torch.randn(2, 1, Sk, 128, device=dev, dtype=dt)
    idx = torch.stack([torch.stack([torch.randperm(Sk, device=dev)[:topk] for _ in range(Sq)]) for _ in range(2)])
    mask = torch.ones(2, 1, Sq, Sk, dtype=torch.bool, device=dev)
    mask[1, :, : Sq // 4] = False  # padding rows
    fill = float(torch.finfo(torch.float32).min)
    args = (q, k, v, idx.to(torch.int32), mask, 128 ** -0.5, False, 0)
    cfg = config_for("sparse_attention", q.device)

    def ours():
        return K.sparse_attention.launch_unselected_rows(K.sparse_attention.launch(*args, config=cfg), *args, fill)

    def ref():
        return K.sparse_attention.fix_unselected_rows(K.sparse_attention.reference(*args), *args, fill)
    return {"ours": ours, "reference": ref, "torch": ref, "dtype": dt}


def _bad_token_ids(dev, f):
    """The token check finds the first out-of-range id (its position, not only the safe copy)."""
    ids = torch.randint(0, 128000, (_n(64, f), _n(4096, f)), device=dev)
    ids.view(-1)[ids.numel() // 3] = -5
    ids.view(-1)[ids.numel() // 2] = 200000
    cfg = config_for("token_ids", ids.device)

    def ours():
        safe, first = K.token_ids.launch(ids, 128256, config=cfg)
        return torch.cat([safe.flatten(), first.flatten()])

    def ref():
        safe, first = K.token_ids.reference(ids, 128256)
        return torch.cat([safe.flatten(), first.flatten()])
    return {"ours": ours, "reference": ref, "torch": ref, "dtype": torch.int64}


def _gpu_arch(dev) -> str:
    if dev != "cuda":
        return "sm_89"  # a dry run checks the Ada rows' candidates under the interpreter
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _autotune_candidates(dev, f):
    """Every AUTOTUNE candidate of this GPU's attention rows (bf16 d64/d128/d256 and float32
    d128/d256) and fp8_gemm rows (decode and prefill M), each run once as a fixed config
    against the reference: triton.autotune would pick any of them."""
    from metainfer.kernels import fp8_gemm as G
    from metainfer.kernels.configs import config_for_arch

    arch, outs, refs = _gpu_arch(dev), [], []
    for d, dt in ((64, torch.bfloat16), (128, torch.bfloat16), (256, torch.bfloat16), (128, torch.float32),
                  (256, torch.float32)):
        row = config_for_arch("attention", arch, head_dim=d, dtype=dt)
        S = _n(512, f, 24)
        q, k, v = (torch.randn(1, 2, S, d, device=dev, dtype=dt) for _ in range(3))
        for alt in ({}, *row.get("AUTOTUNE", ())):
            cfg = {k2: v2 for k2, v2 in {**row, **alt}.items() if k2 != "AUTOTUNE"}
            outs.append(lambda q=q, k=k, v=v, cfg=cfg, d=d: K.attention.launch(q, k, v, None, d ** -0.5, True, 0,
                                                                               config=cfg))
            refs.append(lambda q=q, k=k, v=v, d=d: K.attention.reference(q, k, v, None, d ** -0.5, True, 0))
    gpu = config_for_arch("fp8_gemm", arch)
    for m in (4, 48, _n(512, f, 16)):
        row, _ = G._row_for_m(gpu, m)
        x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(512, 1024, device=dev) / 8).to(torch.float8_e4m3fn)
        sc = torch.rand(4, 8, device=dev) + 0.5
        for alt in ({}, *row.get("AUTOTUNE", ())):
            cfg = {**{k2: v2 for k2, v2 in {**row, **alt}.items() if k2 != "AUTOTUNE"}, "SMALL_M": ()}
            outs.append(lambda x=x, w=w, sc=sc, cfg=cfg: G.launch(x, w, sc, None, 128, 128, False, config=cfg))
            refs.append(lambda x=x, w=w, sc=sc: G.reference(x, w, sc, None, 128, 128, False))

    cache: list = []

    def expected():  # each candidate is compared relative to its own problem's magnitude
        if not cache:
            cache.extend(r().float() for r in refs)
        return cache

    def ours():
        return torch.cat([(o().float() / max(1.0, e.abs().max().item())).flatten() for o, e in zip(outs, expected())])

    def ref():
        return torch.cat([(e / max(1.0, e.abs().max().item())).flatten() for e in expected()])
    return {"ours": ours, "reference": ref, "torch": ref, "dtype": torch.bfloat16, "once": True}


def _two_ranks(dev, f):
    """Ranks on this machine: functional collectives on their device's tensors, eager and
    compiled, against the sums each rank computes itself. On CUDA the ranks use NCCL, one GPU
    each (gloo's CUDA support is broadcast and all_reduce only; NCCL refuses two ranks on one
    GPU): two ranks where two GPUs are visible, else one (the NCCL path, no peer). On CPU two
    gloo ranks."""
    from metainfer.parallel import multirank
    from metainfer.testing import functional_collectives_check

    cuda = dev == "cuda"
    world = min(2, torch.cuda.device_count()) if cuda else 2
    backend = "nccl" if cuda else "gloo"

    def run():
        bad = [b for rank in multirank.run(functional_collectives_check, world, args=(dev,), timeout_s=120,
                                           backend=backend) for b in rank]
        if bad:
            raise AssertionError("; ".join(bad[:3]))
        return torch.zeros(1)
    return {"ours": run, "reference": lambda: torch.zeros(1), "torch": lambda: torch.zeros(1),
            "dtype": torch.float32, "once": True}


# Graphs Dynamo compiles in the end-to-end check (the target's and the draft model's prefill,
# decode, verify, draft and serving graphs), measured in the dry run (tests/test_gpu_check.py
# asserts it still is): its time budget is E2E_BASE_S plus E2E_PER_COMPILE_S a cold Inductor
# compile of these 1-2 layer graphs (estimated: ~2 s each in the dry run's C++ lowering on 2
# cores, plus the Triton kernels Inductor compiles for each on a GPU).
E2E_COMPILES, E2E_BASE_S, E2E_PER_COMPILE_S = 17, 30, 8
E2E_BUDGET_S = E2E_BASE_S + E2E_COMPILES * E2E_PER_COMPILE_S


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _end_to_end(dev, f):
    """A tiny Hugging Face Llama optimized for this GPU: generate() and generate_batch() (paged
    attention over the engine's pool) give eager's greedy tokens."""
    import metainfer
    from metainfer.testing import tiny_hf_model
    from transformers import ContinuousBatchingConfig, GenerationConfig

    m = tiny_hf_model("Llama", "sdpa", layers=2).to(dev)
    draft = tiny_hf_model("Llama", "sdpa", layers=1, seed=1).to(dev)  # a draft model: assisted generation
    ids = torch.randint(3, 128, (2, 12), device=dev, generator=torch.Generator(dev).manual_seed(0))
    target = "cuda" if dev == "cuda" else "cpu"
    opt = metainfer.optimize(m, target, example_inputs=(ids,), serve_compile="always")
    greedy = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=-1, pad_token_id=0)
    reqs = [list(range(3, 3 + n)) for n in (5, 17, 9)]
    cb = ContinuousBatchingConfig(num_blocks=32, page_size=16, max_batch_tokens=64)

    def tokens(model):
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
        # decode over a static cache: on a GPU metainfer replays it from CUDA graphs
        static = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
        spec = model.generate(ids[:1], max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
        # greedy verification keeps the target's tokens whatever the draft proposes
        drafted = model.generate(ids[:1], max_new_tokens=8, do_sample=False, assistant_model=draft)
        batch = model.generate_batch(reqs, generation_config=greedy, continuous_batching_config=cb)
        return torch.cat([out.flatten().cpu(), static.flatten().cpu(), spec.flatten().cpu(), drafted.flatten().cpu()]
                         + [torch.tensor(r.generated_tokens) for r in batch.values()])

    def ours():
        import logging

        from metainfer.lowering.backend import RUNNING_SECTION

        replays, skipped = [], []

        class Skips(logging.Handler):  # Inductor says why it runs a graph without CUDA graphs
            def emit(self, record):
                if "skipping cudagraphs" in record.getMessage():
                    skipped.append(record.getMessage())

        handler, inductor_log = Skips(), logging.getLogger("torch._inductor")
        if dev == "cuda":  # replays of metainfer's own graphs only: while one of its sections runs
            real = torch.cuda.CUDAGraph.replay

            def replay(self):
                if RUNNING_SECTION.get() is not None:
                    replays.append(RUNNING_SECTION.get())
                return real(self)

            torch.cuda.CUDAGraph.replay = replay
            inductor_log.addHandler(handler)
        graphs_before = _unique_graphs()
        try:
            got = tokens(opt)
        finally:
            if dev == "cuda":
                torch.cuda.CUDAGraph.replay = real
                inductor_log.removeHandler(handler)
        marked = [s.index for s in opt.report.sections if s.cuda_graphs]
        if dev == "cuda" and (skipped or not (marked and set(replays) & set(marked))):
            raise AssertionError(f"decode graphs marked for CUDA graphs: {marked}; replays of them: {len(replays)}; "
                                 f"Inductor: {skipped[:2]}")
        compiles = _unique_graphs() - graphs_before
        print(f"  CUDA graphs: decode graphs {marked}, {len(replays)} replays of them; {compiles} graphs compiled "
              f"(its budget counts {E2E_COMPILES}, measured in the dry run)", flush=True)
        if compiles > E2E_COMPILES:
            raise AssertionError(f"{compiles} graphs compiled, more than the {E2E_COMPILES} its time budget counts")
        return got
    return {"ours": ours, "reference": lambda: tokens(m), "torch": lambda: tokens(m),
            "dtype": torch.int64, "once": True}


CHECKS = [
    Check("attention", "prefill causal 1x32/8x4096 d128", _attention(False), 8, 6, quick=True),
    Check("attention", "decode 64x1 over 4096 keys", _attention(True), 12, 6),
    Check("attention", "decode 1x1 over 16384 keys, split", _attention(True, batch=1, keys=16384), 1, 5),
    Check("paged_attention", "prefill chunks 8x512 after 2048", _paged(False), 2, 6),
    Check("paged_attention", "decode 64 requests over 2048", _paged(True), 4, 6, quick=True),
    Check("rmsnorm", "4096 x 4096", _rmsnorm, 1, 3, quick=True),
    Check("glu", "silu 4096 x 14336", _glu("silu", 14336), 2, 3, quick=True),
    Check("glu", "gelu_tanh 4096 x 16384", _glu("gelu_tanh", 16384), 2, 3),
    Check("rope", "1x32x4096 d128", _rope, 1, 3, quick=True),
    Check("fp8_gemm", "W8A16 decode M=16, 7168^2", _fp8_gemm(16), 2, 5, quick=True),
    Check("fp8_gemm", "W8A16 decode M=4, 2048x7168 split-K", _fp8_gemm(4, n=2048), 1, 5),
    Check("fp8_gemm", "W8A16 prefill M=4096, 7168^2", _fp8_gemm(4096), 2, 5),
    Check("fp8_gemm", "W8A16 per-channel decode M=8, 4096^2 split-K", _fp8_channel_gemm(8, False), 1, 5),
    Check("fp8_gemm", "W8A8 per-channel, per-token prefill M=2048, 4096^2", _fp8_channel_gemm(2048, True), 1, 5),
    Check("int4_gemm", "W4A16 decode M=1, 4096^2, group 128 (GEMV)", _int4_gemm(1), 1, 4, quick=True),
    Check("int4_gemm", "W4A16 decode M=16, 4096^2, group 128 (tiles)", _int4_gemm(16), 1, 4),
    Check("int4_gemm", "W4A16 prefill M=4096, 4096^2, group 128", _int4_gemm(4096), 1, 5),
    Check("moe", "256 experts top-8, 2048 tokens", _moe, 26, 20),
    Check("moe", "routing sort at ALIGN_MAX_PAIRS: one program vs torch ops", _moe_align, 1, 3),
    Check("moe", "decode at GEMV_MAX_PAIRS, DeepSeek experts: matrix-vector vs sorted tiles", _moe_decode, 24, 15,
          quick=True),
    Check("sparse_attention", "top-2048 of 8192, 64 heads", _sparse, 6, 6, quick=True),
    Check("mla_decode", "64 x 16 heads over 4096, R512 P64", _mla(64, 4096), 3, 5, quick=True),
    Check("mla_decode", "1 x 16 heads over 8192, cache split", _mla(1, 8192), 1, 5),
    Check("token_ids", "64 x 4096 ids", _token_ids, 1, 2, quick=True),
    Check("token_ids", "64 x 4096 ids, two out of range", _bad_token_ids, 1, 2),
    Check("attention", "fp32 d256 prefill 1x4x512 (wide-head row)", _wide_fp32_attention, 1, 4),
    Check("mla_decode", "8 x 16 heads over 2048, R1024 (WIDE_R)", _mla(8, 2048, latent=1024), 1, 4),
    Check("sparse_attention", "unselected keys filled, padding rows", _sparse_filled, 2, 5),
    Check("dispatch", "18 op variants via torch.ops.metainfer", _dispatch, 2, 35, quick=True),
    Check("autotune", "every attention / fp8_gemm candidate of this arch, fixed", _autotune_candidates, 2, 60),
    Check("collectives", "ranks on their GPUs (NCCL): functional collectives, eager and compiled", _two_ranks, 1, 25,
          quick=True),
    Check("end_to_end", "tiny Llama: generate (dynamic, static/CUDA graphs, prompt lookup) + generate_batch = eager",
          _end_to_end, 2, E2E_BUDGET_S, timeout_s=E2E_BUDGET_S + 60),  # not in --quick: its compiles alone
]


class CheckTimeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: int):
    """A check that runs past `seconds` is stopped (SIGALRM, between Python calls) and failed."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise CheckTimeout(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run(checks, device: str, size: float, timeout: int = 0) -> list[dict]:
    rows = []
    gpu = device == "cuda"
    total = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpu else math.inf
    for c in checks:
        row = {"kernel": c.kernel, "case": c.case, "stated_peak_gib": c.peak_gib, "est_s": c.est_s}
        if c.peak_gib > 0.92 * total:  # skipped by name: this device is smaller than the check
            row.update(ok=True, skipped=f"needs {c.peak_gib} GiB, this GPU has {total:.0f} GiB")
            rows.append(row)
            print(_line(row), flush=True)
            continue
        t0 = time.perf_counter()
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        b = None
        try:
            with _time_limit(c.timeout_s if c.timeout_s and timeout else timeout):
                b = c.build(device, size)
                t1 = time.perf_counter()
                ours = b["ours"]()
                first_ms = (time.perf_counter() - t1) * 1e3
                ref = b["reference"]()
                tol = TOL.get(b["dtype"], 0)
                diff = (ours.float() - ref.float()).abs().max().item() if ours.numel() else 0.0
                scale = ref.float().abs().max().item() if ref.numel() else 1.0
                row.update(ok=diff <= tol * max(1.0, scale), max_diff=diff)
                if b.get("once"):  # an end-to-end check: correctness only
                    row.update(ours_ms=math.nan, torch_ms=math.nan, speedup=math.nan)
                else:
                    # a dry run's one timed call is the one just made (the interpreter is slow)
                    row.update(ours_ms=first_ms if DRY else _bench(b["ours"]), torch_ms=_bench(b["torch"]))
                    row["speedup"] = row["torch_ms"] / row["ours_ms"] if row["ours_ms"] > 0 else math.nan
        except Exception as e:  # noqa: BLE001 - one failing kernel must not hide the others
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        del b
        if gpu:  # the check's own peak (reset above), held to what it states
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if row["peak_gib"] > c.peak_gib and "error" not in row:
                row.update(ok=False, error=f"peak {row['peak_gib']} GiB over the stated {c.peak_gib} GiB")
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(r: dict) -> str:
    if "skipped" in r:
        return f"{r['kernel']:16s} {r['case']:36s} SKIPPED {r['skipped']}"
    if "error" in r:
        return f"{r['kernel']:16s} {r['case']:36s} FAILED {r['error']}"
    return (f"{r['kernel']:16s} {r['case']:36s} {'ok' if r['ok'] else 'WRONG':5s} max diff {r['max_diff']:.2e}  "
            f"ours {r['ours_ms']:.3f} ms  torch {r['torch_ms']:.3f} ms  x{r['speedup']:.2f}")


def _activate_this_gpu() -> None:
    """The kernels' config rows of this GPU's architecture (a Hopper runs the sm_90 rows)."""
    import dataclasses

    from metainfer.hardware import targets
    from metainfer.kernels import configs as kernel_configs

    major, minor = torch.cuda.get_device_capability()
    base = targets.get("cuda")
    kernel_configs.activate(dataclasses.replace(base, device=dataclasses.replace(base.device, arch=f"sm_{major}{minor}")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU: list the checks and run each at a tiny size "
                    "through Triton's interpreter")
    ap.add_argument("--only", nargs="+", help="kernels to check (default all)")
    ap.add_argument("--no-calibration", action="store_true", help="skip the cost-model constants")
    ap.add_argument("--timeout", type=int, help="seconds one check may take (0: no limit; default 120 on a GPU, "
                    "where a hung kernel must not spend the device's budget; none in a dry run, whose "
                    "time is the machine's load and whose caller bounds the whole run)")
    ap.add_argument("--json", metavar="FILE", help="write the rows here as JSON")
    ap.add_argument("--quick", action="store_true", help="one check per kernel family and the end-to-end row "
                    "(estimated under 3 minutes on an H100): what a short lease runs first")
    a = ap.parse_args(argv)
    checks = [c for c in CHECKS if (not a.only or c.kernel in a.only) and (not a.quick or c.quick)]
    est = sum(c.est_s for c in checks)
    print(f"{len(checks)} checks, stated peak at most {max(c.peak_gib for c in checks)} GiB, estimated {est:.0f} s on "
          "one H100 (counted: JIT compiles, timings, reference FLOPs; see the comment beside Check)")
    if a.dry_run:
        print("dry run: every check at a tiny size through Triton's interpreter on CPU (timings mean nothing)")
        device, size = "cpu", 1 / 128
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --dry-run on a CPU", file=sys.stderr)
            return 2
        device, size = "cuda", 1.0
        _activate_this_gpu()
        print(f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
              f"torch {torch.__version__}, triton {__import__('triton').__version__}")
    t0 = time.perf_counter()
    timeout = a.timeout if a.timeout is not None else (0 if a.dry_run else 120)
    rows = run(checks, device, size, timeout)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows)} checks, {len(bad)} failed, {time.perf_counter() - t0:.0f} s")
    calibration = None
    if not a.dry_run and not a.no_calibration and not a.quick:
        import calibrate_gpu

        calibration = {"bf16_gemm_tflops": calibrate_gpu.gemm_tflops("bf16"), "copy_gbs": calibrate_gpu.memory_gbs(),
                       "launch_us": calibrate_gpu.launch_us()}
        print(f"calibration: bf16 GEMM {calibration['bf16_gemm_tflops']:.0f} TFLOP/s, "
              f"copy {calibration['copy_gbs']:.0f} GB/s, launch {calibration['launch_us']:.1f} us")
    if a.json:
        device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
        with open(a.json, "w") as fh:
            json.dump({"device": device_name, "checks": rows, "calibration": calibration,
                       "estimated_s": sum(c.est_s for c in checks)}, fh, indent=1, default=str)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
