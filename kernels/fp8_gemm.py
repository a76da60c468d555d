"""Block-scaled FP8 GEMM, y = x @ w_real^T (+ bias), with weights stored as DeepSeek-V3 does.

Storage: `w` (N, K) torch.float8_e4m3fn and `scale_inv` (ceil(N/block_n), ceil(K/block_k))
float32, the real weight being `w[n, k].float() * scale_inv[n // block_n, k // block_k]`.
DeepSeek-V3 uses 128x128 blocks; block_n / block_k are arguments, powers of two (block_k >= 16).
The same map holds per-channel scales (compressed-tensors' "channel": block_n 1, block_k >= K,
scales (N, 1)) and one per-tensor scale (block_n >= N, block_k >= K): `channel_blocks`.
`x` is (..., K) in float32 / bfloat16 / float16; the output is (..., N) in x's dtype, and
`bias` (N,) is added in float32 before the one final rounding.

Two modes:
- W8A16 (`act_quant=False`): x stays in its dtype. The kernel loads FP8 weight tiles and
  converts them to x's dtype in registers, which is exact (every e4m3 value is a bf16, fp16
  and fp32 value), so `dot(x_tile, w_tile)` is accumulated in float32 and multiplied by the
  tile's scales (BLOCK_K divides block_k: one scale group per K tile; each column its scale row,
  the same row for a whole tile of a 128-row block). The weight
  is never dequantised to a copy in memory.
- W8A8 (`act_quant=True`): the launcher first quantises x with `quantize_activations(x,
  block_k)` (DeepSeek's act_quant: per row and per group of block_k elements, scale =
  amax/448, 0 -> 1; with block_k >= K that is per-token dynamic quantisation, compressed-tensors'
  FP8-Dynamic); per K tile the kernel computes dot(x_fp8, w_fp8) in float32 (a real
  FP8 tensor-core dot on sm_89+; an exact fp16 dot elsewhere) times x_scale[row, g] *
  scale_inv[n // block_n, g].
Decode shapes (a few rows of x): the config's SMALL_M rows give small BLOCK_M tiles, and when
the output tiles are fewer than the GPU's SMs the K axis is split over programs (split-K), each
writing float32 partial sums that a second small kernel (`_sum_splits`) adds, with the bias, and
rounds once: no atomics, so the result is deterministic and autotuning may rerun the kernel.
On a CUDA GPU triton.autotune picks among the row's AUTOTUNE alternatives per M bucket.
On GPUs without e4m3 support in Triton (before sm_89, ROCm) the kernel is handed the bytes
and decodes e4m3 itself (exactly), then takes the fp16 / x.dtype dot. Under Triton 3.9's
interpreter fp8 loads, casts and fp8 x fp8 dots are exact, so it runs the sm_89+ path; only
bfloat16 dot operands are upcast to float32 there (the interpreter mishandles bf16 dots).

Implementations of the same function:
- `launch`: the Triton kernel;
- `cpu_forward`: the CPU path: float32 matmuls over chunks of whole scale rows of w, so
  the dequantised weight never exists whole (O(_CPU_CHUNK_BYTES) extra memory);
- `reference`: plain float32 math on the whole dequantised weight (and, for W8A8, on the
  quantised-then-dequantised activations), rounded once to x's dtype: the oracle;
- `fallback`: what a model does without this kernel, `F.linear(x, dequantize(w, ..., x.dtype),
  bias)`: the weight rounded to x's dtype, then an x.dtype linear.

Tolerances (what tests/test_kernel_fp8_gemm.py checks). With A = |x| @ |w_real|^T + |bias|
(the sum of the magnitudes of the terms; rounding errors of a dot product scale with it) and u
the unit roundoff of x's dtype (2^-24 fp32, 2^-8 bf16, 2^-11 fp16):
- launch and cpu_forward vs reference, both modes: |y - ref| <= 2u |ref| + 1e-4 A
  (2u = one ulp of the output: both round nearly equal float32 sums once);
- W8A16 launch vs fallback: |y - fb| <= 2u |fb| + (2u + 1e-4) A, the fallback's extra error
  being its rounding of each weight, of the bias and (torch's CPU linear) of x @ w^T to x's
  dtype; for bf16: 2^-7 |fb| + 7.9e-3 A;
- W8A8 vs W8A16 (the activation quantisation error): e4m3 keeps 3 mantissa bits, so each
  quantised activation is off by at most 2^-4 relative (normal range) or 2^-10 * scale
  (subnormal range), which bounds |y8 - y16| <= 2^-4 A + 2^-10 (x_scale @ |w_real|^T) per
  element (tested, with 1e-4 A slack). Over a dot product the independent errors average
  down: for Gaussian data the relative Frobenius error ||y8 - y16||_F / ||y16||_F is about
  the RMS relative activation error, measured 0.019-0.029 (median 0.024) over 2000 random
  shapes with K >= 64 and M*N >= 256; the tests assert < 0.04 on such shapes (with small K
  or few outputs a sum can cancel unluckily, so there only the elementwise bound is asserted).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _common
from . import configs, spec  # (modules: configs reads the kernel files' declarations when first used)
from ._common import (fail, cdiv, retries_smaller, GuardedPlans, signature, TUNED_KEYS, as_rows, rows_of, autotuned, check_float, gpu_capability, interpreted, next_pow2,
                      split_count, tune_candidates)

NAME = "fp8_gemm"

FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = 448.0  # largest finite float8_e4m3fn

# Two config rows (kernels/configs.py adds SM_COUNT); BLOCK_N / BLOCK_K are clamped to
# block_n / block_k at launch, BLOCK_M to M rounded up to a power of two (at least 16).
# SMALL_M: decode-sized M, the first row with M <= MAX_M replaces the blocks (and AUTOTUNE).
# Split-K (M <= SPLIT_MAX_M and fewer output tiles than SM_COUNT): K cut into splits of at
# least SPLIT_MIN, at most MAX_SPLITS, each program writing float32 partial sums that
# _sum_splits adds in a second launch (no atomics: deterministic, and safe to autotune).
DEFAULT_CONFIGS = {
    # small tiles: the interpreter then reaches partial tiles and several scale blocks cheaply
    "interpreter": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1,
                        SMALL_M=(dict(MAX_M=16, BLOCK_N=16, BLOCK_K=64),),
                        SPLIT_MAX_M=16, SPLIT_MIN=64, MAX_SPLITS=4, SUM_BLOCK=128),
    # 3 stages of a 64x64 bf16 x tile + a 64x128 fp8 w tile is 48 KiB of shared memory,
    # within Ada's 99 KiB as well as Hopper's 227 KiB. Decode rows: a GEMV-like launch is
    # bound by reading w, so narrow N tiles (more programs) and deep K tiles and pipelines.
    # The alternatives are compiled for sm_80/89/90 by `python -m metainfer.lowering.aot
    # --autotune`; none timed on a GPU yet.
    "cuda": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3,
                 AUTOTUNE=(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
                           dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
                 SMALL_M=(dict(MAX_M=16, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4,
                               AUTOTUNE=(dict(BLOCK_N=128, num_stages=3), dict(BLOCK_N=32, num_warps=2, num_stages=5))),
                          dict(MAX_M=32, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4,
                               AUTOTUNE=(dict(BLOCK_N=128, num_stages=3), dict(BLOCK_K=64, num_stages=5))),
                          dict(MAX_M=64, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3,
                               AUTOTUNE=(dict(BLOCK_N=128, num_warps=8), dict(BLOCK_K=64, num_stages=4)))),
                 SPLIT_MAX_M=64, SPLIT_MIN=512, MAX_SPLITS=8, SUM_BLOCK=1024),
}


@triton.jit
def _e4m3_bits_to_f32(b):
    """float8_e4m3fn bit patterns (uint8) -> float32, for GPUs without e4m3 conversions."""
    b = b.to(tl.int32)
    mag = b & 0x7F
    # exponent field e (bias 7) -> e + 120 (bias 127); mantissa moves up 20 bits
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    # exponent field 0 is subnormal: m * 2^-9, built without float subnormals (GPUs may flush them)
    sub = (mag & 0x7).to(tl.float32) * 0.001953125
    v = tl.where(mag >= 8, normal, sub)
    return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def _fp8_gemm_fwd(
    X, XS, W, WS, BIAS, Y, PARTIAL,
    M, N, K, block_n, block_k, k_per_split,
    stride_xm, stride_xsm, stride_xsg,
    stride_wn, stride_wk, stride_wsn, stride_wsk,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,  # K split over grid axis 2: float32 partial sums to PARTIAL (S, M, N)
    ACT_QUANT: tl.constexpr,
    FP8_NATIVE: tl.constexpr,  # W (and X in W8A8) hold float8_e4m3fn, else their uint8 bits
    FP8_DOT: tl.constexpr,  # W8A8: dot the fp8 tiles directly, else as (exact) fp16
    UPCAST: tl.constexpr,  # W8A16: dot in float32 (fp32 x, and bf16 x under the interpreter)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    col_ok = offs_n < N
    # int64 row offsets: M * K, N * K and M * N reach 2^31 on real models
    rows64 = offs_m.to(tl.int64)
    cols64 = offs_n.to(tl.int64)
    x_rows = X + rows64[:, None] * stride_xm
    w_cols = W + cols64[None, :] * stride_wn
    # each column's scale row: one for a whole tile of a block-scaled weight, one per column of a
    # per-channel weight (block_n 1)
    ws_cols = WS + (offs_n // block_n).to(tl.int64) * stride_wsn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # this program's share of K (all of it without split-K); k_per_split is a multiple of
    # block_k, so every tile still lies in one scale group
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < k_hi
        # BLOCK_K divides block_k: the tile lies in one scale group
        g = k0 // block_k
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # 64-bit: a K-major weight (stride_wk = N) of a 256k-vocab head passes 2^31 elements
        b = tl.load(w_cols + ks.to(tl.int64)[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        w_scale = tl.load(ws_cols + g * stride_wsk, mask=col_ok, other=0.0)[None, :]
        if ACT_QUANT:
            if FP8_DOT:
                d = tl.dot(a, b)
            elif FP8_NATIVE:
                d = tl.dot(a.to(tl.float16), b.to(tl.float16))
            else:
                d = tl.dot(_e4m3_bits_to_f32(a).to(tl.float16), _e4m3_bits_to_f32(b).to(tl.float16))
            x_scale = tl.load(XS + rows64 * stride_xsm + g * stride_xsg, mask=row_ok, other=0.0)
            acc += d * (x_scale[:, None] * w_scale)
        else:
            if FP8_NATIVE:
                b = b.to(a.dtype)
            else:
                b = _e4m3_bits_to_f32(b).to(a.dtype)
            if UPCAST:
                d = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                d = tl.dot(a, b)
            acc += d * w_scale
    if SPLIT_K:
        part = PARTIAL + (pid_k * M + rows64)[:, None] * N + cols64[None, :]
        tl.store(part, acc, mask=row_ok[:, None] & col_ok[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows64[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits(PARTIAL, BIAS, Y, N, numel, splits, stride_ym, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Y = sum over splits of PARTIAL (splits, M, N) (+ bias), in float32, rounded once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    at = offs  # element e of split s is at s * numel + e; stepped, so the index stays 64-bit
    for _ in range(0, splits):
        acc += tl.load(PARTIAL + at, mask=ok, other=0.0)
        at += numel
    col = offs % N
    if HAS_BIAS:
        acc += tl.load(BIAS + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + (offs // N) * stride_ym + col, acc.to(Y.dtype.element_ty), mask=ok)



def _is_block(b, least: int = 16) -> bool:
    return isinstance(b, int) and not isinstance(b, bool) and b >= least and b & (b - 1) == 0


def check_blocks(block_n, block_k) -> None:
    # block_n 1 is a per-channel scale, block_n >= N and block_k >= K one scale for the weight
    if not _is_block(block_n, 1):
        fail(NAME, f"block_n must be a power of two, got {block_n!r}")
    if not _is_block(block_k):
        fail(NAME, f"block_k must be a power of two >= 16, got {block_k!r}")


def channel_blocks(N: int, K: int, per: str) -> tuple[int, int]:
    """(block_n, block_k) that express a per-channel ("channel": scales (N, 1)) or per-tensor
    ("tensor": scales (1, 1)) FP8 weight as this kernel's block map."""
    whole_k = max(16, next_pow2(K))
    if per == "channel":
        return 1, whole_k
    if per == "tensor":
        return next_pow2(max(N, 1)), whole_k
    raise ValueError(f"per must be 'channel' or 'tensor', got {per!r}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_inputs(x, w, scale_inv, bias, block_n, block_k, act_quant) -> None:
    """Raise KernelInputError unless the inputs are ones every implementation supports."""
    check_blocks(block_n, block_k)
    check_float(NAME, "x", x)
    if not isinstance(w, torch.Tensor):
        fail(NAME, f"w must be a tensor, got {type(w).__name__}")
    if w.dtype not in FP8_DTYPES:
        fail(NAME, f"w has dtype {w.dtype}; supported FP8 weight format: torch.float8_e4m3fn (DeepSeek-V3's); "
          "float8_e5m2, float8_e4m3fnuz and float8_e5m2fnuz are not supported")
    if not w.dim() == 2:
        fail(NAME, f"w must be 2-D (N, K), got shape {tuple(w.shape)}")
    N, K = w.shape
    if not K >= 1:
        fail(NAME, f"w has no columns (shape {tuple(w.shape)}); K must be >= 1")
    if not (x.dim() >= 1 and x.shape[-1] == K):
        fail(NAME, f"x's last dim must equal w's K={K}, got x shape {tuple(x.shape)}")
    if not isinstance(scale_inv, torch.Tensor):
        fail(NAME, f"scale_inv must be a tensor, got {type(scale_inv).__name__}")
    if not scale_inv.dtype == torch.float32:
        fail(NAME, f"scale_inv has dtype {scale_inv.dtype}; it must be float32")
    expected = (_cdiv(N, block_n), _cdiv(K, block_k))
    if not tuple(scale_inv.shape) == expected:
        fail(NAME, f"scale_inv shape must be (ceil(N/block_n), ceil(K/block_k)) = {expected} for w {tuple(w.shape)} "
          f"with blocks {block_n}x{block_k}, got {tuple(scale_inv.shape)}")
    devices = {x.device, w.device, scale_inv.device}
    if bias is not None:
        check_float(NAME, "bias", bias)
        if not tuple(bias.shape) == (N,):
            fail(NAME, f"bias shape must be ({N},), got {tuple(bias.shape)}")
        devices.add(bias.device)
    if not len(devices) == 1:
        fail(NAME, f"inputs are on different devices: {sorted(str(d) for d in devices)}")
    if not isinstance(act_quant, bool):
        fail(NAME, f"act_quant must be a bool, got {act_quant!r}")


def _row_for_m(config: dict, M: int) -> tuple[dict, int]:
    """(the config for M rows, its autotune bucket): the first SMALL_M row with M <= MAX_M over
    the base row (its own AUTOTUNE alternatives replacing the base row's), bucket MAX_M; else
    the base row, bucket M rounded up to a power of two (capped)."""
    for small in config.get("SMALL_M", ()):
        if M <= small["MAX_M"]:
            base = {k: v for k, v in config.items() if k not in ("AUTOTUNE", "SMALL_M")}
            return {**base, **{k: v for k, v in small.items() if k != "MAX_M"}}, small["MAX_M"]
    return config, min(next_pow2(M), _MAX_M_BUCKET)


def _clamp(config: dict, M: int, N: int, K: int, block_n: int, block_k: int) -> dict:
    """BLOCK_M/N/K of `config`, clamped so each tile uses one scale and is no larger than needed."""
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        if not _is_block(config.get(key)):
            fail(NAME, f"config[{key!r}] must be a power of two >= 16 (tl.dot's minimum), got {config.get(key)!r}")
    small = lambda n: max(16, next_pow2(n))  # noqa: E731
    # all powers of two, so min() of them divides block_k (a tile lies in one scale group; along N
    # each column reads its own scale row)
    return {**config, "BLOCK_M": min(config["BLOCK_M"], small(M)),
            "BLOCK_N": min(config["BLOCK_N"], small(N)),
            "BLOCK_K": min(config["BLOCK_K"], block_k, small(K))}


def _plan(device: torch.device) -> dict:
    """How the kernel reads FP8 on `device`: natively (interpreter, sm_89+) or from its bits."""
    cap = gpu_capability(device)
    if cap is None:
        # Triton 3.9's interpreter converts and dots float8_e4m3fn tiles exactly (checked), so
        # the interpreter runs the same native path as a Hopper/Ada GPU
        return dict(FP8_NATIVE=True, FP8_DOT=True)
    # e4m3 ("fp8e4nv") conversions and dots need sm_89+; ROCm GPUs use the fnuz format instead
    native = torch.version.hip is None and cap >= (8, 9)
    return dict(FP8_NATIVE=native, FP8_DOT=native)


FP8_DOT_MIN_K = 32  # "Input shapes should have M >= 1, N >= 1 and K >= 32" (Triton 3.9, fp8 dot on sm_89/sm_90)

# triton.autotune (CUDA only) re-times per weight shape and these flags, once per M bucket
_TUNE_KEY = ("N", "K", "HAS_BIAS", "ACT_QUANT", "FP8_DOT", "SPLIT_K")
_MAX_M_BUCKET = 4096


class _Launch:
    """A launch's checks and decisions for one signature (a decode step's rows and weight shapes
    repeat every step): blocks, split-K, constexprs, tuner."""

    __slots__ = ("M", "N", "K", "stride_xm", "grid", "splits", "k_per_split", "meta", "native", "tuned",
                 "out_shape", "weight_strides", "sum_grid", "sum_meta")

    def __init__(self, args: tuple, config):
        check_inputs(*args)
        x, w, scale_inv, bias, block_n, block_k, act_quant = args
        config = default_config(x) if config is None else config
        M, self.stride_xm = rows_of(NAME, "x", x)
        (N, K), has_bias, dtype, device = w.shape, bias is not None, x.dtype, x.device
        self.M, self.N, self.K = M, N, K
        self.out_shape = (*x.shape[:-1], N)
        self.weight_strides = (*w.stride(), *scale_inv.stride(), N)
        if M * N == 0:
            self.grid = None
            return
        row, bucket = _row_for_m(config, M)

        def clamp(c: dict) -> dict:
            return _clamp(c, M, N, K, block_n, block_k)

        fixed = clamp({key: row[key] for key in TUNED_KEYS if key in row})
        bm, bn, bk = fixed["BLOCK_M"], fixed["BLOCK_N"], fixed["BLOCK_K"]
        plan = _plan(device)
        # split-K for decode: few rows and few N tiles leave most SMs idle; splits start on
        # scale-group boundaries (block_k), a multiple of every candidate's BLOCK_K
        tiles = cdiv(M, bm) * cdiv(N, bn)
        splits, k_per_split = 1, K
        candidates = tune_candidates(row, clamp) if _common.autotune_enabled(device) else []
        if M <= row.get("SPLIT_MAX_M", 0) or "SPLITS" in row:
            # one scale group over all of K (a per-channel weight): any whole tiles will do
            align = block_k if block_k < K else max([bk] + [c["BLOCK_K"] for c in candidates])
            splits, k_per_split = split_count(row, tiles, K, align)
        # an FP8 tl.dot needs a K tile of FP8_DOT_MIN_K on sm_89/sm_90 (the interpreter does not
        # enforce it): a smaller tile (a small K or scale block) dots the tiles as fp16, which holds
        # every e4m3 value exactly, so the result is the same
        fp8_dot = plan["FP8_DOT"] and min([bk] + [c["BLOCK_K"] for c in candidates]) >= FP8_DOT_MIN_K
        self.meta = dict(
            HAS_BIAS=has_bias, SPLIT_K=splits > 1, ACT_QUANT=bool(act_quant),
            FP8_NATIVE=plan["FP8_NATIVE"], FP8_DOT=fp8_dot,
            # Triton 3.9's interpreter multiplies bfloat16 dot operands as their raw uint16 bits
            # (see attention.py); fp32 x takes an ieee fp32 dot (the GPU path is unaffected)
            UPCAST=dtype == torch.float32 or (interpreted() and dtype == torch.bfloat16),
        )
        self.native, self.splits, self.k_per_split = plan["FP8_NATIVE"], splits, k_per_split
        block = row.get("SUM_BLOCK", 1024)
        self.sum_grid = (cdiv(M * N, block),)
        self.sum_meta = dict(HAS_BIAS=has_bias, BLOCK=block, num_warps=4)
        if len(candidates) > 1:
            self.tuned = autotuned(_fp8_gemm_fwd, candidates, _TUNE_KEY, (bucket, splits))
            self.grid = lambda meta: (cdiv(M, meta["BLOCK_M"]), cdiv(N, meta["BLOCK_N"]), splits)
        else:
            self.tuned = None
            self.grid = (cdiv(M, bm), cdiv(N, bn), splits)
            self.meta.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             num_warps=fixed.get("num_warps", 4), num_stages=fixed.get("num_stages", 3))


_launches = GuardedPlans()


def _key(args: tuple, config) -> tuple:
    """The plan's key behind the guards."""
    return signature(*args)


def default_config(x, *args) -> dict:
    """The config row for the input's device (kernels/configs.py)."""
    return configs.config_for(NAME, x.device)


@retries_smaller(NAME, default_config)
def launch(x, w, scale_inv, bias, block_n: int, block_k: int, act_quant: bool, *,
           config: dict | None = None, activations: tuple | None = None) -> torch.Tensor:
    """Run the Triton kernel. `config` (kernels/configs.py; None: the device's row) holds BLOCK_M, BLOCK_N,
    BLOCK_K, num_warps, num_stages; SMALL_M rows for decode-sized M; split-K's SM_COUNT,
    SPLIT_MAX_M, SPLIT_MIN, MAX_SPLITS (or SPLITS to force a count) and SUM_BLOCK; and AUTOTUNE
    alternatives that triton.autotune times on a CUDA GPU (elsewhere the row's config runs).
    `activations`: W8A8's (x_fp8, x_scale) of x, quantised already (`quantize_activations`, shared
    by the linears that read x); x then gives only its shape and dtype."""
    if activations is not None:
        check_activations(x, *activations, block_k, act_quant)
    args = (x, w, scale_inv, bias, block_n, block_k, act_quant)
    # the weight's shape in the scalars: a step's linears of one config each find their own few plans
    plan = _launches.get_guarded((block_n, block_k, act_quant, w.shape),
                                 (x, w, scale_inv) if bias is None else (x, w, scale_inv, bias), config, _key, _Launch,
                                 args, config)
    M, N = plan.M, plan.N
    out = x.new_empty(plan.out_shape)
    if plan.grid is None:
        return out
    if activations is not None:
        a, xs = activations[0].reshape(M, plan.K), activations[1].reshape(M, -1)
        stride_am, xs_strides = a.stride(0), xs.stride()
    elif act_quant:
        a, xs = quantize_activations(as_rows(NAME, "x", x), block_k)
        stride_am, xs_strides = a.stride(0), xs.stride()
    else:
        a, xs, stride_am, xs_strides = x, x, plan.stride_xm, (0, 0)
    wk = w
    if not plan.native:
        # hand the kernel the bytes; it decodes e4m3 itself
        wk = w.view(torch.uint8)
        if act_quant:
            a = a.view(torch.uint8)
    splits = plan.splits
    partial = x.new_empty((splits, M, N), dtype=torch.float32) if splits > 1 else out
    args = (a, xs, wk, scale_inv, bias if bias is not None else out, out, partial,
            M, N, plan.K, block_n, block_k, plan.k_per_split, stride_am, *xs_strides, *plan.weight_strides)
    if plan.tuned is None:
        _fp8_gemm_fwd[plan.grid](*args, **plan.meta)
    else:
        plan.tuned[plan.grid](*args, **plan.meta)
    if splits > 1:
        _sum_splits[plan.sum_grid](partial, bias if bias is not None else out, out, N, M * N, splits, N, **plan.sum_meta)
    return out


def scale_layout(N: int, K: int, block_n: int, block_k: int) -> str:
    """How reports name a weight's scales: per-channel, per-tensor or its blocks."""
    if block_k >= K and block_n == 1:
        return "per-channel"
    if block_k >= K and block_n >= N:
        return "per-tensor"
    return f"{block_n}x{block_k} block"


def _expanded_scales(scale_inv, rows: range, K: int, block_n: int, block_k: int) -> torch.Tensor:
    """scale_inv[n // block_n, k // block_k] for n in `rows` and every k: (len(rows), K) float32."""
    dev = scale_inv.device
    r = torch.arange(rows.start, rows.stop, device=dev) // block_n
    c = torch.arange(K, device=dev) // block_k
    return scale_inv.float().index_select(0, r).index_select(1, c)


def _blocked(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(R, C) -> (R/rows, rows, C/cols, cols), zero-padding R and C up to block multiples."""
    R, C = t.shape
    pr, pc = _cdiv(R, rows) * rows - R, _cdiv(C, cols) * cols - C
    if pr or pc:
        t = F.pad(t, (0, pc, 0, pr))
    return t.view(t.shape[0] // rows, rows, t.shape[1] // cols, cols)


def dequantize(w, scale_inv, block_n: int, block_k: int, dtype: torch.dtype) -> torch.Tensor:
    """w (N, K) e4m3 and its block scales -> the real weight (N, K) in `dtype` (float32 math, one rounding)."""
    N, K = w.shape
    return (w.float() * _expanded_scales(scale_inv, range(N), K, block_n, block_k)).to(dtype)


def quantize_weight(w_real, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w_real (N, K) -> (w (N, K) float8_e4m3fn, scale_inv (ceil(N/bn), ceil(K/bk)) float32).

    Per block scale = amax / 448 (1 for an all-zero block), w = w_real / scale rounded to e4m3."""
    check_blocks(block_n, block_k)
    if not w_real.dim() == 2:
        fail(NAME, f"w_real must be 2-D (N, K), got shape {tuple(w_real.shape)}")
    N, K = w_real.shape
    wb = _blocked(w_real.float(), block_n, block_k)
    amax = wb.abs().amax(dim=(1, 3))
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    q = (wb / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.flatten(2).flatten(0, 1)[:N, :K].contiguous(), scale


def quantize_activations(x, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's act_quant: per row and per `group` consecutive K elements, scale = amax / 448
    (1 where amax is 0), x_fp8 = (x / scale) in e4m3. Returns x_fp8 (x.shape, contiguous)
    and x_scale (*x.shape[:-1], ceil(K/group)) float32."""
    if not (isinstance(group, int) and group >= 1):
        fail(NAME, f"group must be a positive int, got {group!r}")
    K = x.shape[-1]
    G = _cdiv(K, group)
    xf = x.float()
    if G * group != K:
        xf = F.pad(xf, (0, G * group - K))
    xg = xf.unflatten(-1, (G, group))
    amax = xg.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    q = (xg / scale).to(torch.float8_e4m3fn).flatten(-2)[..., :K].contiguous()
    return q, scale.squeeze(-1)


def check_activations(x, x_fp8, x_scale, group: int, act_quant: bool = True) -> None:
    """Raise KernelInputError unless (x_fp8, x_scale) are what quantize_activations(x, group) returns."""
    if not act_quant:
        fail(NAME, "quantised activations were given to a W8A16 linear (act_quant=False)")
    if not (isinstance(x_fp8, torch.Tensor) and x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == x.shape):
        fail(NAME, f"x_fp8 must be float8_e4m3fn of x's shape {tuple(x.shape)}, got "
                   f"{getattr(x_fp8, 'dtype', type(x_fp8).__name__)} {tuple(getattr(x_fp8, 'shape', ()))}")
    groups = (*x.shape[:-1], _cdiv(x.shape[-1], group))
    if not (isinstance(x_scale, torch.Tensor) and x_scale.dtype == torch.float32 and tuple(x_scale.shape) == groups):
        fail(NAME, f"x_scale must be float32 of shape {groups} (one scale per row and group of {group}), got "
                   f"{getattr(x_scale, 'dtype', type(x_scale).__name__)} {tuple(getattr(x_scale, 'shape', ()))}")
    if not (x_fp8.is_contiguous() and x_scale.is_contiguous()):
        fail(NAME, "x_fp8 and x_scale must be contiguous (quantize_activations returns them so)")
    if not x_fp8.device == x_scale.device == x.device:
        fail(NAME, f"x, x_fp8 and x_scale must be on one device, got {x.device}, {x_fp8.device}, {x_scale.device}")


def _dequantize_activations(q, x_scale, group: int) -> torch.Tensor:
    K = q.shape[-1]
    return (q.float() * x_scale.repeat_interleave(group, dim=-1)[..., :K])


def reference(x, w, scale_inv, bias=None, block_n=128, block_k=128, act_quant=False) -> torch.Tensor:
    """Plain float32 math on the whole dequantised weight, rounded once to x.dtype: the oracle."""
    xf = _dequantize_activations(*quantize_activations(x, block_k), block_k) if act_quant else x.float()
    y = xf @ dequantize(w, scale_inv, block_n, block_k, torch.float32).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fallback(x, w, scale_inv, bias, block_n: int, block_k: int) -> torch.Tensor:
    """The model's code without this kernel: dequantise the whole weight to x's dtype, then F.linear."""
    return F.linear(x, dequantize(w, scale_inv, block_n, block_k, x.dtype),
                    None if bias is None else bias.to(x.dtype))


# Bytes of float32 dequantised weight per chunk in the CPU path.
_CPU_CHUNK_BYTES = 16 * 2**20


def cpu_forward(x, w, scale_inv, bias, block_n: int, block_k: int, act_quant: bool,
                activations: tuple | None = None) -> torch.Tensor:
    """CPU path: float32 matmuls over chunks of whole scale rows of w (never the whole dequantised w).
    `activations`: (x_fp8, x_scale) of x quantised already, as for `launch`."""
    check_inputs(x, w, scale_inv, bias, block_n, block_k, act_quant)
    N, K = w.shape
    x2 = x.reshape(-1, K)
    if activations is not None:
        check_activations(x, *activations, block_k, act_quant)
        a = _dequantize_activations(activations[0].reshape(-1, K), activations[1].reshape(x2.shape[0], -1), block_k)
    else:
        a = _dequantize_activations(*quantize_activations(x2, block_k), block_k) if act_quant else x2.float()
    out = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    rows = max(1, _CPU_CHUNK_BYTES // (K * 4))
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        wc = w[n0:n1].float() * _expanded_scales(scale_inv, range(n0, n1), K, block_n, block_k)
        if bias is None:
            yc = a @ wc.T
        else:
            yc = torch.addmm(bias[n0:n1].float(), a, wc.T)
        out[:, n0:n1] = yc  # each output element is whole here: rounded once
    return out.view(*x.shape[:-1], N)


# ---- the declarations (kernels/spec.py) ---------------------------------------------------------

def _linear_flops(args, outs):
    x, w, act_quant = args[0], args[1], args[6]
    return 2 * spec.numel(outs[0]) * spec.size_hint(w.shape[1]), "fp8" if act_quant else spec.peak_key(x.dtype)


def _aot_cases():
    from .configs import config_for_arch

    g, randn = spec.aot_inputs()

    def gemm(m, act_quant, bias=False, k=1024, block_k=128, block_n=128):
        def call(arch):
            n = 512
            launch(randn(m, k), randn(n, k, dtype=torch.float8_e4m3fn),
                   torch.rand(-(-n // block_n), -(-k // block_k), generator=g), randn(n) if bias else None,
                   block_n, block_k, act_quant, config=config_for_arch(NAME, arch))
        return call

    return [
        ("decode m=4, bf16 activations, split-K", gemm(4, False)),
        ("decode m=24, fp8 activations, split-K", gemm(24, True)),
        ("prefill m=512, fp8 activations", gemm(512, True)),
        ("prefill m=512, bf16 activations, bias", gemm(512, False, bias=True)),
        ("m=64, fp8 activations, K=16 (one small tile)", gemm(64, True, k=16, block_k=16)),
        ("m=64, fp8 activations, scale blocks of 16", gemm(64, True, block_k=16)),
        ("decode m=8, per-channel scales, split-K", gemm(8, False, block_n=1, block_k=1024)),
        ("prefill m=512, per-channel scales, per-token fp8 activations", gemm(512, True, block_n=1, block_k=1024)),
    ]


def _aot_autotune_cases():
    """Every AUTOTUNE alternative of each M row, as a fixed config."""
    from .configs import config_for_arch

    g, randn = spec.aot_inputs()

    def gemm(m):
        def call(arch):
            row, _ = _row_for_m(config_for_arch(NAME, arch), m)
            x, w = randn(m, 1024), randn(512, 1024, dtype=torch.float8_e4m3fn)
            for alt in ({}, *row.get("AUTOTUNE", ())):
                launch(x, w, torch.rand(4, 8, generator=g), None, 128, 128, False, config={**row, **alt, "SMALL_M": ()})
        return call

    return [(f"autotune m={m}", gemm(m)) for m in (4, 24, 48, 512)]


def _example():
    w, scales = quantize_weight(torch.randn(40, 48), 16, 32)
    return torch.randn(3, 5, 48), w, scales, torch.randn(40), 16, 32, False


KERNEL = spec.KernelSpec(NAME, DEFAULT_CONFIGS, _aot_cases, splits=True, aot_autotune_cases=_aot_autotune_cases)
def _quantized_linear_flops(args, outs):
    return 2 * spec.numel(outs[0]) * spec.size_hint(args[3].shape[1]), "fp8"


def _quantized_example():
    x, w, scales, bias, block_n, block_k, _ = _example()
    return (x, *quantize_activations(x, block_k), w, scales, bias, block_n, block_k)


OPS = (
    spec.OpSpec("fp8_linear", spec.GEMM, _linear_flops, spec.rows(0), _example, KERNEL),
    # W8A8 with x quantised once for the linears that read it (the share_act_quant pass)
    spec.OpSpec("fp8_quantize_activations", spec.POINTWISE, spec.per_output_element, spec.rows(0, token_wise=True),
                lambda: (torch.randn(3, 5, 48), 32)),
    spec.OpSpec("fp8_linear_quantized", spec.GEMM, _quantized_linear_flops, spec.rows(0, 1, 2), _quantized_example,
                KERNEL),
    # plain torch, folded into fp8_linear by the fp8_gemm pass where it feeds a linear
    spec.OpSpec("fp8_dequantize", spec.MEMORY, spec.by_bytes, spec.OPAQUE_LAYOUT,
                lambda: (*_example()[1:3], 16, 32, torch.float32)),
)
