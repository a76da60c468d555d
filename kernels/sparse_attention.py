"""Sparse (top-k) attention, DeepSeek DSA style: each query attends only to its selected keys.

Shapes: q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), Hq a multiple of Hkv (GQA:
query head h reads kv head h // (Hq // Hkv)), indices (B, Sq, TOPK) int32 or int64, shared by
all heads (as DSA's indexer produces them). The function is dense attention (see
kernels/attention.py) with one more condition: key j is kept for query i only if j appears in
indices[b, i, :]. An index < 0 or >= Sk is an empty slot (DeepSeek pads with -1).
Indices in a row are assumed distinct (they come from topk); a duplicate index is NOT
deduplicated by `launch`/`cpu_forward`: it counts twice in the softmax (weight doubled).
`reference` builds a set (scatter), so it counts once: they agree only on distinct indices.

Other rules as in dense attention: `mask` (optional, broadcastable to (B, Hq, Sq, Sk)) is a
float added to the scaled scores or a bool where True keeps, and it is read only at the
selected positions; `causal` keeps key j for query i iff j <= i + causal_offset; a query row
with no key kept gives NaN, or 0 with `zero_empty_rows`. D and Dv up to 256, may differ.
Output (B, Hq, Sq, Dv), contiguous, in q's dtype; accumulation float32.

Work and memory are O(Sq x TOPK), never O(Sq x Sk):
- `_sparse_attention_fwd`: Triton kernel. One program per (query row i, batch, kv head,
  block of BLOCK_H query heads of that kv group): the row's TOPK indices are walked in blocks
  of BLOCK_N, the K/V rows (and mask values) at those indices are gathered once and shared by
  all the group's heads in the program (the head tile is padded to >= 16 rows for tl.dot);
  online softmax in float32.
- `cpu_forward`: torch gathers, chunked over queries so one chunk's gathered K/V stay
  bounded (about 64 MiB);
- `reference`: the index set scattered into a dense keep-mask, plain float32 math (tests).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._flash import dot, flash_meta, mask_operand, masked_scores, normalise, softmax_step
from . import _common
from ._common import (softmax_rows, dot_block, FLOAT_DTYPES, GuardedPlans, broadcasts_to, cdiv, check, check_grid, check_qkv, fail,
                      next_pow2, retries_smaller)
from . import configs, spec  # (modules: configs reads the kernel files' declarations when first used)

NAME = "sparse_attention"
MAX_HEAD_DIM = 256
INDEX_DTYPES = (torch.int32, torch.int64)

# Suggested launch rows (the lead wires them into kernels/configs.py).
# BLOCK_H: query heads of one kv group per program (power of two >= 16; the tile is
# min(BLOCK_H, max(16, next_pow2(group))) rows); BLOCK_N: selected keys per step (>= 16).
DEFAULT_CONFIGS = {
    "interpreter": {"BLOCK_H": 16, "BLOCK_N": 16},
    # bf16, sm_90, D/Dv up to 256: compiled ahead of time with Triton 3.9 (no run), 0 spills
    # (4 warps spilled at D=256). Not timed on a GPU yet.
    "cuda": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
}


@triton.jit
def _sparse_attention_fwd(
    Q, K, V, IDX, M, O,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ib, stride_im, stride_it,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    num_kv_heads, group, head_blocks, seq_k, topk, head_d, head_dv,
    scale, causal_offset, batch_start,
    MASK_KIND: tl.constexpr,  # 0 none, 1 additive float, 2 boolean keep
    CAUSAL: tl.constexpr,
    ZERO_EMPTY_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # see `launch`
):
    # 64-bit row, head and batch offsets: at long contexts seq x stride passes 2**31 elements
    # (the kv head's too: hk x Sk x D for a few kv heads of a long cache)
    i = tl.program_id(0).to(tl.int64)  # query row
    pid = tl.program_id(1).to(tl.int64)
    hb = pid % head_blocks
    bk = pid // head_blocks
    hk = bk % num_kv_heads
    b = batch_start + bk // num_kv_heads  # a launch covers a slice of the batch (grid y is capped)

    offs_g = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # position inside the kv group
    row_ok = offs_g < group
    heads = (hk * group + offs_g).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q = tl.load(Q + b * stride_qb + i * stride_qm + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < head_d), other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    i_base = IDX + b * stride_ib + i * stride_im
    m_base = M + b * stride_mb + i * stride_mm + heads[:, None] * stride_mh

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)

    for start in range(0, topk, BLOCK_N):
        offs_t = start + tl.arange(0, BLOCK_N)
        idx = tl.load(i_base + offs_t * stride_it, mask=offs_t < topk, other=-1).to(tl.int64)
        # out-of-range slots (DeepSeek's -1 padding) and causally hidden keys are never loaded
        col_ok = (idx >= 0) & (idx < seq_k)
        if CAUSAL:
            col_ok = col_ok & (idx <= i + causal_offset)
        idx = tl.where(col_ok, idx, 0)

        kt = tl.load(k_base + idx[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=col_ok[None, :] & (offs_d[:, None] < head_d), other=0.0)
        s = dot(q, kt, DOT_PRECISION, DOT_UPCAST) * scale
        keep = col_ok[None, :] & row_ok[:, None]
        s = masked_scores(s, keep, m_base + idx[None, :] * stride_mn, MASK_KIND)

        p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
        v = tl.load(v_base + idx[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=col_ok[:, None] & (offs_dv[None, :] < head_dv), other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    out = normalise(acc, l_i, row_ok, ZERO_EMPTY_ROWS)
    tl.store(O + b * stride_ob + i * stride_om + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < head_dv))



def check_indices(kernel: str, indices, B: int, Sq: int, device) -> None:
    """indices must be an integer (B, Sq, TOPK) tensor with TOPK >= 1 (shared with mla_decode)."""
    if not isinstance(indices, torch.Tensor):
        fail(kernel, f"indices must be a tensor, got {type(indices).__name__}")
    if indices.dtype not in INDEX_DTYPES:
        fail(kernel, f"indices has dtype {indices.dtype}; supported: int32, int64 (the top-k positions)")
    if not indices.dim() == 3:
        fail(kernel, f"indices must be 3-D (batch, seq_q, topk), got shape {tuple(indices.shape)}")
    if not tuple(indices.shape[:2]) == (B, Sq):
        fail(kernel, f"indices shape {tuple(indices.shape)} does not match (batch, seq_q) = {(B, Sq)}")
    check(indices.shape[2] >= 1, kernel, "indices has topk = 0; at least one slot is needed (pad with -1)")
    check(indices.device == device, kernel, "indices is on a different device than q")


def check_mask(kernel: str, mask, full_shape: tuple, device) -> None:
    if mask is None:
        return
    check(isinstance(mask, torch.Tensor), kernel, "mask must be a tensor or None")
    if not (mask.dtype == torch.bool or mask.dtype in FLOAT_DTYPES):
        fail(kernel, f"mask dtype {mask.dtype} unsupported: use bool (True keeps) or a float additive mask")
    check(mask.device == device, kernel, "mask is on a different device than q")
    if not mask.dim() <= 4:
        fail(kernel, f"mask must have at most 4 dims, got {mask.dim()}")
    if not broadcasts_to(mask.shape, full_shape):
        fail(kernel, f"mask shape {tuple(mask.shape)} does not broadcast to {tuple(full_shape)}")


def check_scalars(kernel: str, scale, causal, causal_offset, zero_empty_rows) -> None:
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)):
        fail(kernel, f"scale must be a finite number, got {scale!r}")
    if not isinstance(causal, bool):
        fail(kernel, f"causal must be a bool, got {causal!r}")
    if not (isinstance(causal_offset, int) and not isinstance(causal_offset, bool)):
        fail(kernel, f"causal_offset must be an int, got {causal_offset!r}")
    if not isinstance(zero_empty_rows, bool):
        fail(kernel, f"zero_empty_rows must be a bool, got {zero_empty_rows!r}")


def check_inputs(q, k, v, indices, mask, scale, causal, causal_offset, zero_empty_rows=False) -> None:
    """Raise KernelInputError unless the inputs are ones every implementation supports."""
    B, Hq, Sq, D, Hkv, Sk = check_qkv(NAME, q, k, v)
    check(Sk > 0, NAME, "k and v have no keys (seq 0)")
    Dv = v.shape[3]
    if not (0 < D <= MAX_HEAD_DIM and 0 < Dv <= MAX_HEAD_DIM):
        fail(NAME, f"head dims must be in 1..{MAX_HEAD_DIM}, got q/k {D}, v {Dv}")
    check_indices(NAME, indices, B, Sq, q.device)
    check_mask(NAME, mask, (B, Hq, Sq, Sk), q.device)
    check_scalars(NAME, scale, causal, causal_offset, zero_empty_rows)


class _Launch:
    """What a launch decides from everything but the key count and causal offset (read per
    call: a decode step's context grows by one each step): blocks, grid slices, constexprs."""

    __slots__ = ("B", "Hq", "Sq", "D", "Hkv", "Dv", "topk", "group", "head_blocks", "slices", "meta",
                 "contiguous_out", "head", "index_strides", "dims")

    def __init__(self, q, k, v, indices, mask, causal, zero_empty_rows, config):
        config = default_config(q, k, v) if config is None else config
        B, Hq, Sq, D = q.shape
        Hkv, Dv = k.shape[1], v.shape[3]
        self.B, self.Hq, self.Sq, self.D, self.Hkv, self.Dv = B, Hq, Sq, D, Hkv, Dv
        self.topk, self.group = indices.shape[2], Hq // Hkv
        # the head tile is padded to 16 rows (tl.dot's minimum) when the group is smaller
        block_h = min(dot_block(NAME, config, "BLOCK_H"), max(16, next_pow2(self.group)))
        block_n = dot_block(NAME, config, "BLOCK_N")
        self.head_blocks = head_blocks = cdiv(self.group, block_h)
        # query rows along x (a long prefill passes 65,535); batch x kv heads x head blocks along y,
        # launched in slices of the batch where they would pass CUDA's 65,535
        per_batch = Hkv * head_blocks
        check_grid((Sq, per_batch), NAME, f"{Hkv} kv heads x {head_blocks} head blocks")
        step = max(1, _common.GRID_YZ_MAX // per_batch)
        self.slices = [(b0, (Sq, (min(B, b0 + step) - b0) * per_batch)) for b0 in range(0, B, step)]
        self.meta = flash_meta(q.dtype, mask, causal, zero_empty_rows, config, BLOCK_H=block_h, BLOCK_N=block_n,
                               BLOCK_D=max(16, next_pow2(D)), BLOCK_DV=max(16, next_pow2(Dv)))
        self.contiguous_out = Dv == D and q.is_contiguous()  # empty_like(q) is then the output's layout
        # the kernel's arguments that follow from the signature, around the per-call ones (k's and
        # v's strides are read per call: a cache grown by concatenation moves them every step)
        self.head = q.stride()
        self.index_strides = indices.stride()
        self.dims = (Hq * Sq * Dv, Sq * Dv, Dv, 1, Hkv, self.group, head_blocks)


# k / v: the key count, and the strides a cache grown by concatenation moves; the mask: its shape
_launches = GuardedPlans(vary={1: ((2,), None), 2: ((2,), None), 4: (None, None)})


def _key(args: tuple, config) -> tuple:
    """The plan's key behind the guards: everything check_inputs and _Launch read but the key
    count and causal offset (inputs that are not tensors of the right rank get check_inputs' error)."""
    q, k, v, indices, mask, scale, causal, _, zero_empty_rows = args
    try:
        Bk, Hkv, _, Dk = k.shape
        Bv, Hv, _, Dv = v.shape
        mask_sig = None if mask is None else (mask.dtype, mask.device, mask.dim())
        return (q.shape, q.stride(), q.dtype, q.device, Bk, Hkv, Dk, k.dtype, k.device,
                Bv, Hv, Dv, v.dtype, v.device, indices.shape, indices.stride(), indices.dtype,
                indices.device, mask_sig, scale, causal, zero_empty_rows)
    except (AttributeError, ValueError, TypeError):
        check_inputs(*args)
        raise


def default_config(q, k, v, *args) -> dict:
    """The config row for these inputs on their device (kernels/configs.py)."""
    return configs.config_for(NAME, q.device, head_dim=max(q.shape[-1], v.shape[-1]))


@retries_smaller(NAME, default_config)
def launch(q, k, v, indices, mask, scale: float, causal: bool, causal_offset: int,
           zero_empty_rows: bool = False, *, config: dict | None = None) -> torch.Tensor:
    """Run the Triton kernel. `config` (None: the device's row for the head dims) holds BLOCK_H,
    BLOCK_N, num_warps, num_stages. Checks and decisions that do not depend on the key count are
    made once per signature."""
    args = (q, k, v, indices, mask, scale, causal, causal_offset, zero_empty_rows)
    plan = _launches.get_guarded((scale, causal, zero_empty_rows),
                                 (q, k, v, indices) if mask is None else (q, k, v, indices, mask), config, _key,
                                 _checked_launch, args, config)
    Sk = k.shape[2]
    B, Hq, Sq, Dv = plan.B, plan.Hq, plan.Sq, plan.Dv
    if not (v.shape[2] == Sk > 0 and type(causal_offset) is int
            and (mask is None or broadcasts_to(mask.shape, (B, Hq, Sq, Sk)))):
        check_inputs(*args)
    out = torch.empty_like(q) if plan.contiguous_out else q.new_empty((B, Hq, Sq, Dv))
    if B * Hq * Sq * Dv == 0:
        return out
    m, mstrides = mask_operand(mask, q, (B, Hq, Sq, Sk))
    for b0, grid in plan.slices:
        _sparse_attention_fwd[grid](
            q, k, v, indices, m, out, *plan.head, *k.stride(), *v.stride(), *plan.index_strides, *mstrides,
            *plan.dims, Sk, plan.topk, plan.D, Dv,
            float(scale), causal_offset, b0, **plan.meta,
        )
    return out


def _checked_launch(args: tuple, config) -> _Launch:
    check_inputs(*args)
    q, k, v, indices, mask, _, causal, _, zero_empty_rows = args
    return _Launch(q, k, v, indices, mask, causal, zero_empty_rows, config)


def index_keep_mask(indices: torch.Tensor, Sk: int) -> torch.Tensor:
    """(B, Sq, TOPK) indices -> (B, Sq, Sk) bool, True where j is one of the row's indices
    (a set: duplicates collapse; out-of-range slots select nothing)."""
    idx = indices.long()
    valid = (idx >= 0) & (idx < Sk)
    keep = torch.zeros(*idx.shape[:2], Sk + 1, dtype=torch.bool, device=idx.device)
    keep.scatter_(-1, torch.where(valid, idx, Sk), True)  # slot Sk collects the empty ones
    return keep[..., :Sk]


def _causal_keep(Sq: int, Sk: int, causal_offset: int, device) -> torch.Tensor:
    i = torch.arange(Sq, device=device)[:, None]
    j = torch.arange(Sk, device=device)[None, :]
    return j <= i + causal_offset


def reference(q, k, v, indices, mask=None, scale=None, causal=False, causal_offset=0,
              zero_empty_rows=False) -> torch.Tensor:
    """Dense float32 math with the index set scattered into a keep-mask: the oracle for tests."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    Sq, Sk = q.shape[2], k.shape[2]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    if causal:
        s = s.masked_fill(~_causal_keep(Sq, Sk, causal_offset, q.device), float("-inf"))
    s = s.masked_fill(~index_keep_mask(indices, Sk)[:, None], float("-inf"))
    p = softmax_rows(s, zero_empty_rows)
    return (p @ vf).to(q.dtype)


# Bytes of gathered K/V (float32) + scores per query chunk in the CPU path.
_CPU_CHUNK_BYTES = 64 * 2**20


def gather_mask(mask, full_shape: tuple, i0: int, i1: int, idx: torch.Tensor) -> torch.Tensor:
    """The mask values at the selected positions for query rows i0:i1: (B, H, rows, TOPK).
    `idx` is (B, rows, TOPK), already clamped into range."""
    B, H = full_shape[0], full_shape[1]
    m = mask.expand(full_shape)[:, :, i0:i1]  # a view, nothing copied
    return torch.gather(m, -1, idx[:, None].expand(B, H, *idx.shape[1:]))


def cpu_forward(q, k, v, indices, mask, scale: float, causal: bool, causal_offset: int,
                zero_empty_rows: bool = False) -> torch.Tensor:
    """CPU path: gather the selected K/V rows per chunk of queries; never an Sq x Sk matrix."""
    check_inputs(q, k, v, indices, mask, scale, causal, causal_offset, zero_empty_rows)
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    topk = indices.shape[2]
    out = torch.empty((B, Hq, Sq, Dv), dtype=q.dtype, device=q.device)
    og = out.view(B, Hkv, G, Sq, Dv)
    qg = q.unflatten(1, (Hkv, G))  # (B, Hkv, G, Sq, D), a view
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # (B, Sk, Hkv, .): gather rows by position
    bidx = torch.arange(B, device=q.device)[:, None, None]
    per_row = B * topk * 4 * (Hkv * (D + Dv) + 3 * Hq)  # gathered K, V; mask, scores, probabilities
    chunk = max(1, min(Sq, _CPU_CHUNK_BYTES // max(1, per_row)))
    for i0 in range(0, Sq, chunk):
        i1 = min(Sq, i0 + chunk)
        idx = indices[:, i0:i1].long()  # (B, c, TOPK)
        keep = (idx >= 0) & (idx < Sk)
        if causal:
            rows = torch.arange(i0, i1, device=q.device)[None, :, None]
            keep = keep & (idx <= rows + causal_offset)
        idx = torch.where(keep, idx, 0)
        kg = kt[bidx, idx].float().permute(0, 3, 1, 2, 4)  # (B, Hkv, c, TOPK, D)
        vg = vt[bidx, idx].float().permute(0, 3, 1, 2, 4)  # (B, Hkv, c, TOPK, Dv)
        s = torch.einsum("bhgcd,bhctd->bhgct", qg[:, :, :, i0:i1].float(), kg) * scale
        keep5 = keep[:, None, None]  # (B, 1, 1, c, TOPK)
        if mask is not None:
            mg = gather_mask(mask, (B, Hq, Sq, Sk), i0, i1, idx).unflatten(1, (Hkv, G))
            if mg.dtype == torch.bool:
                keep5 = keep5 & mg
            else:
                s = s + mg.float()
        s = s.masked_fill(~keep5, float("-inf"))
        p = softmax_rows(s, zero_empty_rows)
        og[:, :, :, i0:i1] = torch.einsum("bhgct,bhctv->bhgcv", p, vg).to(q.dtype)
    return out


def fix_unselected_rows(out, q, k, v, indices, mask, scale: float, causal: bool, causal_offset: int,
                        unselected_fill: float) -> torch.Tensor:
    """Make `out` equal to dense attention whose unselected keys get the finite additive
    `unselected_fill` (e.g. finfo.min, as transformers writes it) instead of being dropped.

    The two agree on every query row that keeps at least one selected key (the fill's
    exp() underflows to exactly 0 there). A row whose selected keys are all masked is, in the
    dense form, a softmax over every key with the fill (and a boolean mask's dropped keys)
    at `unselected_fill`: those rare rows (padding) are recomputed densely, O(Sk) each."""
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    empty = empty_rows(q, k, indices, mask, causal, causal_offset)  # (B, Hq, Sq)
    if not bool(empty.any()):  # the CPU path: reading it back costs nothing
        return out
    b, h, i = empty.nonzero(as_tuple=True)
    group = Hq // Hkv
    s = torch.einsum("nd,ntd->nt", q[b, h, i].float(), k[b, h // group].float()) * scale
    # the empty rows' selected sets only (the invalid slots go to a spare column: a -1 clamped to
    # key 0 would otherwise overwrite key 0's own selection)
    sel = index_keep_mask(indices[b, i][None], Sk)[0]
    m = torch.full((len(b), Sk), unselected_fill, device=q.device)
    if mask is not None:
        full = mask.expand(B, Hq, Sq, Sk)[b, h, i]
        if full.dtype == torch.bool:
            m = torch.where(sel & full, torch.zeros((), device=q.device), m)
        else:
            m = torch.where(sel, full.float(), m)
    else:
        m = torch.where(sel, torch.zeros((), device=q.device), m)
    if causal:  # the dense op drops keys past the causal limit whatever the mask says
        late = torch.arange(Sk, device=q.device)[None, :] > (i[:, None] + causal_offset)
        m = m.masked_fill(late, float("-inf"))
    p = torch.softmax(s + m, dim=-1)
    out = out.clone()
    out[b, h, i] = torch.einsum("nt,ntd->nd", p, v[b, h // group].float()).to(out.dtype)
    return out


_DROP_FLOOR = torch.finfo(torch.float16).min


def empty_rows(q, k, indices, mask, causal: bool, causal_offset: int) -> torch.Tensor:
    """(B, Hq, Sq) bool: the query rows that keep none of their selected keys (on the device)."""
    B, Hq, Sq, _ = q.shape
    Sk = k.shape[2]
    idx = indices.long()
    valid = (idx >= 0) & (idx < Sk)
    gidx = idx.clamp(0, Sk - 1)
    kept = valid[:, None].expand(B, Hq, Sq, idx.shape[-1])
    if causal:
        rows = torch.arange(Sq, device=q.device)[None, :, None]
        kept = kept & (gidx <= rows + causal_offset)[:, None]
    if mask is not None:
        vals = gather_mask(mask, (B, Hq, Sq, Sk), 0, Sq, gidx)
        kept = kept & (vals if vals.dtype == torch.bool else vals > _DROP_FLOOR)
    return ~kept.any(-1)


@triton.jit
def _unselected_rows_fwd(
    Q, K, V, IDX, M, EMPTY, O,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ib, stride_im, stride_it,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    num_heads, group, seq_q, seq_kv, topk, dim, dim_v,
    scale, causal_offset, fill,
    MASK_FLOAT: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # one program per (batch x head, query row); a row that keeps a selected key returns at once
    bh = tl.program_id(0)
    i = tl.program_id(1)
    if tl.load(EMPTY + bh.to(tl.int64) * seq_q + i) == 0:
        return
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    kvh = h // group
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * stride_qb + h * stride_qh + i * stride_qm + offs_d * stride_qd,
                mask=offs_d < dim, other=0.0).to(tl.float32)
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for start in range(0, seq_kv, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_kv
        k = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=n_ok[:, None] & (offs_d[None, :] < dim), other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], 1) * scale
        if MASK_FLOAT:
            # a selected key carries the mask's value (it dropped the key), the rest the fill
            hits = tl.zeros([BLOCK_N], tl.int32)
            for t0 in range(0, topk, BLOCK_T):
                offs_t = t0 + tl.arange(0, BLOCK_T)
                idx = tl.load(IDX + b * stride_ib + i * stride_im + offs_t * stride_it, mask=offs_t < topk, other=-1)
                hits += tl.sum((offs_n[:, None] == idx[None, :]).to(tl.int32), 1)
            mv = tl.load(M + b * stride_mb + h * stride_mh + i * stride_mm + offs_n * stride_mn,
                         mask=n_ok, other=0.0).to(tl.float32)
            s = s + tl.where(hits > 0, mv, fill)
        else:
            # no mask, or a boolean one: every key a row could keep was dropped, so all carry the fill
            s = s + fill
        keep = n_ok
        if CAUSAL:
            keep = keep & (offs_n <= i + causal_offset)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=n_ok[:, None] & (offs_dv[None, :] < dim_v), other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    tl.store(O + b * stride_ob + h * stride_oh + i * stride_om + offs_dv * stride_od,
             (acc / l_i).to(O.dtype.element_ty), mask=offs_dv < dim_v)


def launch_unselected_rows(out, q, k, v, indices, mask, scale: float, causal: bool, causal_offset: int,
                           unselected_fill: float) -> torch.Tensor:
    """`fix_unselected_rows` on the GPU, without reading anything back: which rows are empty is
    decided on the device, and one program per row recomputes it densely or returns at once.
    Writes `out` in place (the launcher's own output) and returns it."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if out.numel() == 0:
        return out
    empty = empty_rows(q, k, indices, mask, causal, causal_offset).to(torch.int8).contiguous()
    mask_float = mask is not None and mask.dtype != torch.bool
    m = mask.expand(B, Hq, Sq, Sk) if mask_float else q
    mstrides = m.stride() if mask_float else (0, 0, 0, 0)
    check_grid((B * Hq, Sq), NAME, f"{Sq} query rows")
    _unselected_rows_fwd[(B * Hq, Sq)](
        q, k, v, indices, m, empty, out,
        *q.stride(), *k.stride(), *v.stride(), *indices.stride(), *mstrides, *out.stride(),
        Hq, Hq // Hkv, Sq, Sk, indices.shape[2], D, Dv,
        float(scale), int(causal_offset), float(unselected_fill),
        MASK_FLOAT=mask_float, CAUSAL=bool(causal),
        BLOCK_N=64, BLOCK_T=64, BLOCK_D=max(16, next_pow2(D)), BLOCK_DV=max(16, next_pow2(Dv)),
        num_warps=4,
    )
    return out


# ---- the declaration (kernels/spec.py) ----------------------------------------------------------

def _flops(args, outs):  # each query scores the keys its indices select
    q, v, indices = args[0], args[2], args[3]
    B, H, Sq, D = (spec.size_hint(s) for s in q.shape)
    keys = spec.size_hint(indices.shape[-1])
    return 2 * B * H * Sq * keys * (D + spec.size_hint(v.shape[-1])), spec.peak_key(q.dtype)


def _aot_cases():
    from .configs import config_for_arch

    g, randn = spec.aot_inputs()

    def sparse(mask=None, fill=None):
        def call(arch):
            q, k, v = randn(1, 16, 8, 128), randn(1, 1, 256, 128), randn(1, 1, 256, 128)
            idx = torch.randint(0, 256, (1, 8, 64), generator=g, dtype=torch.int32)
            m = randn(1, 1, 8, 256) if mask == "additive" else None
            out = launch(q, k, v, idx, m, 128 ** -0.5, True, 248, config=config_for_arch(NAME, arch))
            if fill is not None:
                launch_unselected_rows(out, q, k, v, idx, m, 128 ** -0.5, True, 248, fill)
        return call

    return [
        ("bf16 d128 top-64", sparse()),
        ("bf16 d128 top-64, additive mask, unselected keys filled", sparse("additive", float(torch.finfo(torch.float32).min))),
        ("bf16 d128 top-64, unselected keys filled", sparse(None, -1e9)),
    ]


def _example():
    q, k, v = torch.randn(2, 4, 5, 24), torch.randn(2, 2, 9, 24), torch.randn(2, 2, 9, 12)
    return q, k, v, torch.randn(2, 5, 9).topk(3, dim=-1)[1], None, 0.3, True, 4, False, float("-inf")


KERNEL = spec.KernelSpec(NAME, DEFAULT_CONFIGS, _aot_cases)
OPS = (spec.OpSpec("sparse_attention", spec.ATTENTION, _flops, spec.batch_first(0, 1, 2, 3, mask=4), _example,
                   KERNEL),)
