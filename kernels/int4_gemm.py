"""Group-quantised int4 GEMM, y = x @ w_real^T (+ bias), the weight kept packed (GPTQ, AWQ and
compressed-tensors' pack-quantized checkpoints, as metainfer holds them after loading).

Storage (metainfer's one layout; loaders convert each checkpoint format to it once):
- `qweight` (N, K / 8) int32: eight unsigned 4-bit values per word along K, value k % 8 in bits
  4 (k % 8) .. 4 (k % 8) + 3 (compressed-tensors' pack-quantized order; GPTQ packs the same way
  along K, transposed);
- `scales` (N, ceil(K / group)) float16 / bfloat16 / float32, one per output row and group of
  `group` consecutive K;
- `zeros` (N, ceil(K / group)) uint8 in [0, 15], or None: symmetric, every zero point 8;
- `perm` (K,) int32 / int64, or None: act-order (GPTQ's desc_act): the weight's K axis was put
  in group order once at load (`columns k of the checkpoint -> perm order`), so the kernel reads
  x's columns through `perm` (x[:, perm] @ w^T), never the weight twice.
The real weight is `w[n, k] = (q[n, k] - z[n, k // group]) * s[n, k // group]`.

Two kernels:
- `_int4_gemm` (prefill-shaped, M above the row's GEMV_MAX_M): BLOCK_M x BLOCK_N tiles over K in
  BLOCK_K steps; the packed words are loaded for the tile and unpacked in registers (a shift and
  a mask per element), q - z (an integer in [-15, 15], exact in every float type) is dotted with
  the x tile in float32 accumulation, and the group's scale multiplies the tile's partial sum
  (BLOCK_K divides `group`: a tile sees one group);
- `_int4_gemv` (decode-shaped): one program per BLOCK_N outputs of one row, a multiply and a
  reduction over K per tile instead of a dot (tl.dot's tile of 16 rows would waste 15 of them
  on a single-token row); the weight's bytes are the cost.

Implementations of the same function: `launch` (Triton), `cpu_forward` (float32 matmuls over
chunks of dequantised rows, the whole dequantised weight never held), `reference` (float32 on the
whole dequantised weight, rounded once: the oracle), `fallback` (what a model does without the
kernel: dequantise to x's dtype, then F.linear).

Tolerances (tests/test_kernel_int4_gemm.py): with A = |x| @ |w_real|^T + |bias| and u the unit
roundoff of x's dtype, launch and cpu_forward against reference: |y - ref| <= 2u |ref| + 1e-4 A
(both round a float32 sum once; the kernel applies each group's scale to its partial sum, which
reorders the float32 arithmetic only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import configs, spec  # (modules: configs reads the kernel files' declarations when first used)
from ._common import (GuardedPlans, cdiv, check_float, fail, interpreted, next_pow2, retries_smaller, rows_of,
                      signature)

NAME = "int4_gemm"
PACK = 8  # 4-bit values per int32 word
SYMMETRIC_ZERO = 8

# BLOCK_K is clamped to the largest power of two dividing `group`; BLOCK_M to M (at least 16).
# M <= GEMV_MAX_M takes the GEMV kernel with GEMV_BLOCK_N outputs and GEMV_BLOCK_K of K a step.
DEFAULT_CONFIGS = {
    # small tiles: the interpreter reaches partial tiles and several groups cheaply
    "interpreter": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1,
                        GEMV_MAX_M=4, GEMV_BLOCK_N=16, GEMV_BLOCK_K=32, GEMV_WARPS=1),
    # The words are read as a [BLOCK_K, BLOCK_N] int32 tile (each word for its eight k): with a
    # BLOCK_K of 128 and 3 stages that asked 112 KiB of shared memory (AOT for sm_89, which has
    # 99 KiB); 64 x 64 tiles over K in steps of 64, 3 stages: within it. Decode: 64 outputs a
    # program keep N / 64 programs per row busy on a 4096-wide layer; 128 K a step is 64 bytes of
    # packed weight per output. Compiled for sm_80/89/90 by `python -m metainfer.lowering.aot`;
    # none timed on a GPU yet.
    "cuda": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3,
                 GEMV_MAX_M=8, GEMV_BLOCK_N=64, GEMV_BLOCK_K=128, GEMV_WARPS=4),
}


@triton.jit
def _unpacked(QW, offs_n, ks, n_ok, k_ok, stride_qn, Z, zs_group, stride_zn, HAS_ZEROS: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of q - z as int32, from the packed words (a word read once per
    eight k: the repeats hit the cache)."""
    words = tl.load(QW + offs_n.to(tl.int64)[None, :] * stride_qn + (ks // 8)[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0)
    q = (words >> ((ks % 8) * 4)[:, None]) & 0xF
    if HAS_ZEROS:
        z = tl.load(Z + offs_n.to(tl.int64) * stride_zn + zs_group, mask=n_ok, other=8).to(tl.int32)
    else:
        z = tl.zeros_like(offs_n) + 8
    return q - z[None, :]


@triton.jit
def _int4_gemm(
    X, PERM, QW, S, Z, BIAS, Y,
    M, N, K, group,
    stride_xm, stride_qn, stride_sn, stride_zn, stride_ym,
    HAS_PERM: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in float32 (fp32 x, and bf16 x under the interpreter)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        cols = tl.load(PERM + ks, mask=k_ok, other=0) if HAS_PERM else ks
        a = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        g = k0 // group  # BLOCK_K divides group: one group a tile
        w = _unpacked(QW, offs_n, ks, n_ok, k_ok, stride_qn, Z, g, stride_zn, HAS_ZEROS)
        if UPCAST:
            d = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            d = tl.dot(a, w.to(a.dtype))
        s = tl.load(S + offs_n.to(tl.int64) * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        acc += d * s[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int4_gemv(
    X, PERM, QW, S, Z, BIAS, Y,
    N, K, group,
    stride_xm, stride_qn, stride_sn, stride_zn, stride_ym,
    HAS_PERM: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        cols = tl.load(PERM + ks, mask=k_ok, other=0) if HAS_PERM else ks
        a = tl.load(X + row * stride_xm + cols, mask=k_ok, other=0.0).to(tl.float32)
        g = k0 // group
        w = _unpacked(QW, offs_n, ks, n_ok, k_ok, stride_qn, Z, g, stride_zn, HAS_ZEROS)
        s = tl.load(S + offs_n.to(tl.int64) * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        acc += tl.sum(a[:, None] * w.to(tl.float32), axis=0) * s
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_ym + offs_n, acc.to(Y.dtype.element_ty), mask=n_ok)


# ---- checks -----------------------------------------------------------------------------------

def groups(K: int, group: int) -> int:
    return cdiv(K, group)


def check_inputs(x, qweight, scales, zeros, perm, bias, group) -> None:
    """Raise KernelInputError unless every implementation supports these inputs."""
    check_float(NAME, "x", x)
    for name, t in (("qweight", qweight), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            fail(NAME, f"{name} must be a tensor, got {type(t).__name__}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        fail(NAME, f"qweight must be 2-D int32 (N, K / {PACK}) of packed 4-bit values, got {qweight.dtype} "
                   f"{tuple(qweight.shape)}")
    N, K = qweight.shape[0], qweight.shape[1] * PACK
    if not (isinstance(group, int) and not isinstance(group, bool) and group >= 16 and group % 16 == 0):
        fail(NAME, f"group must be a positive multiple of 16 (32, 64, 128; or K for one group a row), got {group!r}")
    if K == 0:
        fail(NAME, f"qweight has no columns (shape {tuple(qweight.shape)})")
    if not (x.dim() >= 1 and x.shape[-1] == K):
        fail(NAME, f"x's last dim must equal K = {K} (qweight's {qweight.shape[1]} words x {PACK}), got x shape "
                   f"{tuple(x.shape)}")
    G = groups(K, group)
    if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32) or tuple(scales.shape) != (N, G):
        fail(NAME, f"scales must be float16/bfloat16/float32 of shape (N, ceil(K/group)) = {(N, G)}, got "
                   f"{scales.dtype} {tuple(scales.shape)}")
    devices = {x.device, qweight.device, scales.device}
    if zeros is not None:
        if zeros.dtype != torch.uint8 or tuple(zeros.shape) != (N, G):
            fail(NAME, f"zeros must be uint8 zero points of shape {(N, G)} (or None: symmetric), got {zeros.dtype} "
                       f"{tuple(zeros.shape)}")
        devices.add(zeros.device)
    if perm is not None:
        if perm.dtype not in (torch.int32, torch.int64) or tuple(perm.shape) != (K,):
            fail(NAME, f"perm must be an int32/int64 permutation of shape ({K},) (or None), got {perm.dtype} "
                       f"{tuple(perm.shape)}")
        devices.add(perm.device)
    if bias is not None:
        check_float(NAME, "bias", bias)
        if tuple(bias.shape) != (N,):
            fail(NAME, f"bias shape must be ({N},), got {tuple(bias.shape)}")
        devices.add(bias.device)
    if len(devices) != 1:
        fail(NAME, f"inputs are on different devices: {sorted(str(d) for d in devices)}")


# ---- packing, quantising, dequantising (loaders, tests, references) -----------------------------

def pack(q: torch.Tensor) -> torch.Tensor:
    """(N, K) integers in [0, 15] -> (N, K / 8) int32, value k % 8 in bits 4 (k % 8)."""
    N, K = q.shape
    if K % PACK:
        fail(NAME, f"K = {K} is not a multiple of {PACK}: it cannot be packed into int32 words")
    q = q.to(torch.int64).view(N, K // PACK, PACK)
    shifts = torch.arange(0, 4 * PACK, 4, device=q.device, dtype=torch.int64)
    words = (q << shifts).sum(-1)  # < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K / 8) int32 -> (N, K) uint8 in [0, 15]."""
    shifts = torch.arange(0, 4 * PACK, 4, device=qweight.device, dtype=torch.int32)
    return ((qweight[..., None] >> shifts) & 0xF).flatten(-2).to(torch.uint8)


def dequantize(qweight, scales, zeros, group: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real weight (N, K) in `dtype` (float32 math, one rounding)."""
    q = unpack(qweight).float()
    K = q.shape[1]
    z = zeros.float() if zeros is not None else torch.full_like(scales, SYMMETRIC_ZERO, dtype=torch.float32)
    expand = lambda t: t.repeat_interleave(group, dim=1)[:, :K]  # noqa: E731
    return ((q - expand(z)) * expand(scales.float())).to(dtype)


def quantize_weight(w_real: torch.Tensor, group: int, symmetric: bool = True, scale_dtype=torch.float16):
    """w_real (N, K) -> (qweight, scales, zeros or None), round to nearest per group as GPTQ's
    quantiser does without its error feedback: symmetric, scale = max|w| / 7.5 (GPTQ: 2 max|w| / 15)
    and zero 8; asymmetric, scale = (max - min) / 15 and zero round(-min / scale). A group of zeros
    gets scale 1."""
    N, K = w_real.shape
    G = groups(K, group)
    pad = G * group - K
    wg = F.pad(w_real.float(), (0, pad)).view(N, G, group)
    if symmetric:
        amax = wg.abs().amax(-1)
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / 7.5)
        zero = torch.full_like(scale, SYMMETRIC_ZERO)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 15)
        zero = (-lo / scale).round().clamp(0, 15)
    scale = scale.to(scale_dtype)
    q = (wg / scale.float()[..., None] + zero[..., None]).round().clamp(0, 15)
    qweight = pack(q.view(N, G * group)[:, :K])
    return qweight, scale, (None if symmetric else zero.to(torch.uint8))


def act_order(qweight, scales, zeros, g_idx: torch.Tensor, group: int):
    """A checkpoint's act-order weight (column k in group g_idx[k]) put in group order once:
    (qweight with its K axis permuted, scales, zeros, perm) where x[:, perm] @ w_perm^T is the
    layer. The scales and zeros are indexed by group already; groups become contiguous."""
    perm = torch.argsort(g_idx.to(torch.int64), stable=True)
    expected = torch.arange(g_idx.numel(), device=g_idx.device) // group
    if not torch.equal(g_idx.to(torch.int64)[perm], expected):
        fail(NAME, f"g_idx does not put exactly {group} columns in each group: not an act-order permutation")
    return pack(unpack(qweight)[:, perm]), scales, zeros, perm.to(torch.int32)


# ---- implementations ---------------------------------------------------------------------------

def reference(x, qweight, scales, zeros=None, perm=None, bias=None, group: int = 128) -> torch.Tensor:
    """Plain float32 math on the whole dequantised weight, rounded once to x.dtype: the oracle."""
    xf = x.float() if perm is None else x.float()[..., perm.long()]
    y = xf @ dequantize(qweight, scales, zeros, group).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fallback(x, qweight, scales, zeros, perm, bias, group: int) -> torch.Tensor:
    """The model's code without this kernel: dequantise the whole weight to x's dtype, then F.linear."""
    xp = x if perm is None else x[..., perm.long()]
    return F.linear(xp, dequantize(qweight, scales, zeros, group, x.dtype), None if bias is None else bias.to(x.dtype))


_CPU_CHUNK_BYTES = 16 * 2**20  # float32 dequantised rows per chunk in the CPU path


def cpu_forward(x, qweight, scales, zeros, perm, bias, group: int) -> torch.Tensor:
    """CPU path: float32 matmuls over chunks of dequantised rows (never the whole weight)."""
    check_inputs(x, qweight, scales, zeros, perm, bias, group)
    N, K = qweight.shape[0], qweight.shape[1] * PACK
    x2 = x.reshape(-1, K)
    a = x2.float() if perm is None else x2.float()[:, perm.long()]
    out = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    rows = max(1, _CPU_CHUNK_BYTES // (K * 4))
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        wc = dequantize(qweight[n0:n1], scales[n0:n1], None if zeros is None else zeros[n0:n1], group)
        yc = a @ wc.T if bias is None else torch.addmm(bias[n0:n1].float(), a, wc.T)
        out[:, n0:n1] = yc  # each output element whole here: rounded once
    return out.view(*x.shape[:-1], N)


def _largest_pow2_dividing(n: int) -> int:
    return n & -n


class _Launch:
    """One signature's checks and decisions: which kernel, blocks, grid, constexprs."""

    __slots__ = ("M", "N", "K", "stride_xm", "grid", "meta", "gemv", "out_shape", "strides")

    def __init__(self, args: tuple, config):
        check_inputs(*args)
        x, qweight, scales, zeros, perm, bias, group = args
        config = default_config(x) if config is None else config
        M, self.stride_xm = rows_of(NAME, "x", x)
        N, K = qweight.shape[0], qweight.shape[1] * PACK
        self.M, self.N, self.K = M, N, K
        self.out_shape = (*x.shape[:-1], N)
        self.strides = (qweight.stride(0), scales.stride(0), zeros.stride(0) if zeros is not None else 0)
        if M * N == 0:
            self.grid = None
            return
        flags = dict(HAS_PERM=perm is not None, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None)
        # a tile sees one group: BLOCK_K a power of two dividing group (group is a multiple of 16)
        in_group = min(_largest_pow2_dividing(group), max(16, next_pow2(K)))
        self.gemv = M <= config.get("GEMV_MAX_M", 0)
        if self.gemv:
            bk = min(config["GEMV_BLOCK_K"], in_group)
            bn = min(config["GEMV_BLOCK_N"], max(16, next_pow2(N)))
            self.grid = (cdiv(N, bn), M)
            self.meta = dict(**flags, BLOCK_N=bn, BLOCK_K=bk, num_warps=config.get("GEMV_WARPS", 4))
            return
        bm = min(config["BLOCK_M"], max(16, next_pow2(M)))
        bn = min(config["BLOCK_N"], max(16, next_pow2(N)))
        bk = min(config["BLOCK_K"], in_group)
        self.grid = (cdiv(M, bm), cdiv(N, bn))
        self.meta = dict(**flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                         # Triton 3.9's interpreter multiplies bfloat16 dot operands as raw bits
                         # (see attention.py); float32 x takes an ieee float32 dot
                         UPCAST=x.dtype == torch.float32 or (interpreted() and x.dtype == torch.bfloat16),
                         num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 2))


_launches = GuardedPlans()


def _key(args: tuple, config) -> tuple:
    return signature(*args)


def default_config(x, *args) -> dict:
    """The config row for the input's device (kernels/configs.py)."""
    return configs.config_for(NAME, x.device)


@retries_smaller(NAME, default_config)
def launch(x, qweight, scales, zeros, perm, bias, group: int, *, config: dict | None = None) -> torch.Tensor:
    """Run the Triton kernel (GEMV for M up to the row's GEMV_MAX_M, tiles above). `config`
    (kernels/configs.py; None: the device's row): BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
    num_stages; GEMV_MAX_M, GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS."""
    args = (x, qweight, scales, zeros, perm, bias, group)
    tensors = tuple(t for t in (x, qweight, scales, zeros, perm, bias) if t is not None)
    plan = _launches.get_guarded((group, zeros is None, perm is None, bias is None, qweight.shape), tensors, config,
                                 _key, _Launch, args, config)
    out = x.new_empty(plan.out_shape)
    if plan.grid is None:
        return out
    stride_qn, stride_sn, stride_zn = plan.strides
    dummy = qweight
    common = (x, perm if perm is not None else dummy, qweight, scales, zeros if zeros is not None else dummy,
              bias if bias is not None else out, out)
    if plan.gemv:
        _int4_gemv[plan.grid](*common, plan.N, plan.K, group, plan.stride_xm, stride_qn, stride_sn, stride_zn,
                              plan.N, **plan.meta)
    else:
        _int4_gemm[plan.grid](*common, plan.M, plan.N, plan.K, group, plan.stride_xm, stride_qn, stride_sn,
                              stride_zn, plan.N, **plan.meta)
    return out


# ---- the declarations (kernels/spec.py) ---------------------------------------------------------

def _linear_flops(args, outs):  # K = PACK values a packed word; its bytes: the packed ones
    x, qweight = args[0], args[1]
    return 2 * spec.numel(outs[0]) * PACK * spec.size_hint(qweight.shape[1]), spec.peak_key(x.dtype)


def _aot_cases():
    from .configs import config_for_arch

    g, randn = spec.aot_inputs()

    def int4(m, group=128, zeros=True, act_order=False, bias=False, k=1024):
        def call(arch):
            n = 512
            qweight = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int64).to(torch.int32)
            scales = torch.rand(n, k // group, generator=g).to(torch.float16)
            z = torch.randint(0, 16, (n, k // group), generator=g).to(torch.uint8) if zeros else None
            perm = torch.randperm(k, generator=g).to(torch.int32) if act_order else None
            launch(randn(m, k, dtype=torch.float16), qweight, scales, z, perm, randn(n) if bias else None, group,
                   config=config_for_arch(NAME, arch))
        return call

    return [
        ("decode m=1, fp16, group 128, zero points (GEMV)", int4(1)),
        ("decode m=8, fp16, act-order, symmetric (GEMV)", int4(8, zeros=False, act_order=True)),
        ("prefill m=512, fp16, group 128, zero points, bias", int4(512, bias=True)),
        ("prefill m=512, fp16, group 32, act-order", int4(512, group=32, act_order=True)),
    ]


def _example():
    return (torch.randn(3, 5, 48), *quantize_weight(torch.randn(40, 48), 16, symmetric=False), None, torch.randn(40), 16)


KERNEL = spec.KernelSpec(NAME, DEFAULT_CONFIGS, _aot_cases)
OPS = (
    spec.OpSpec("int4_linear", spec.GEMM, _linear_flops, spec.rows(0), _example, KERNEL),
    # plain torch, folded into int4_linear by the int4_gemm pass where it feeds a linear
    spec.OpSpec("int4_dequantize", spec.MEMORY, spec.by_bytes, spec.OPAQUE_LAYOUT,
                lambda: (*_example()[1:4], 16, torch.float32)),
)
