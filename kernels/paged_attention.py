"""Paged varlen attention: the queries of many requests packed into one batch, each request's
keys and values read in place from a KV pool through an index, causal per request.

Shapes: q (Tq, Hq, D) packed query tokens, request r owning rows cu_q[r]:cu_q[r+1];
k_pool (R, Hkv, D) and v_pool (R', Hkv, Dv) the pool's rows (a row index means the same token
in both); key_index (Tk,) int the pool rows of each request's keys in position order, request
r's at key_index[cu_k[r]:cu_k[r+1]]; or key_index None when k_pool / v_pool already hold
every request's keys in that order (MLA, whose keys are decompressed from cached latents).
A request's queries are its last len_q positions: query i keeps key j iff
j <= i + len_k - len_q (bottom-right causal; a decode token sees every key). GQA: query
head h reads kv head h // (Hq // Hkv); K/V are never expanded or copied out of the pool.
The output is (Tq, Hq, Dv) in q's dtype; accumulation is float32.

The kernel runs one program per (request, block of query rows, kv head, key split): a block's
rows are (token, query head of the group) pairs, so the group's heads share every K/V tile it
loads (what decode needs: one token, G heads). With several key splits (flash-decoding, for
decode steps over long contexts) each split writes its partial max, sum and accumulator and
`_flash.SplitMerge` merges them (one small launch, shared with attention and mla_decode);
with one split the kernel writes the output itself.

Three implementations of the same function:
- `_paged_fwd`: the Triton kernel;
- `cpu_forward`: torch's fused SDPA on the keys gathered from the pool, few calls a step (decode
  requests batched by length class, shared prefixes attended once per group, short chunks
  padded together);
- `reference`: plain math per request, materialising everything, for tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import attention
from ._common import softmax_rows, GuardedPlans, fail, cdiv, retries_smaller, check_float, next_pow2
from . import configs, spec  # (modules: configs reads the kernel files' declarations when first used)
from ._flash import SplitMerge, dot, dot_flags, normalise, soft_cap, softmax_step

NAME = "paged_attention"
MAX_HEAD_DIM = 256
INDEX_DTYPES = (torch.int32, torch.int64)
# rows are (token, query head of the group) pairs; decode splits keys 512 at a time
DEFAULT_CONFIGS = {"interpreter": dict(BLOCK_M=16, BLOCK_N=16),
                   "cuda": dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2, KEYS_PER_SPLIT=512, MAX_SPLITS=8)}


@triton.jit
def _paged_fwd(
    Q, K, V, KI, CU_Q, CU_K, O, WS,
    stride_qt, stride_qh, stride_qd,
    stride_kr, stride_kh, stride_kd,
    stride_vr, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    group, head_d, head_dv, num_q_heads, total_q, blocks_per_request, split_keys,
    scale, softcap, window,
    KEYS_IN_ORDER: tl.constexpr,  # no key index: request r's keys are rows cu_k[r]: of K / V
    SPLIT: tl.constexpr,  # several key splits: write partial results to WS (_flash.SplitMerge)
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,  # keys before each query's sliding window are dropped
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    # 64-bit: a pool stored head-major (Hkv, rows, D) and viewed (rows, Hkv, D) has a kv head
    # stride of rows x D, and hk times it passes 2^31 on a pool of a few million tokens
    hk = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    r = pid // blocks_per_request
    mb = pid % blocks_per_request
    q0 = tl.load(CU_Q + r).to(tl.int64)
    len_q = tl.load(CU_Q + r + 1).to(tl.int64) - q0
    k0 = tl.load(CU_K + r).to(tl.int64)
    len_k = tl.load(CU_K + r + 1).to(tl.int64) - k0
    offset = len_k - len_q  # query i is at position i + offset

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # (token, head of the group) pairs
    t = rows // group
    h = hk * group + rows % group
    row_ok = t < len_q
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + (q0 + t)[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < head_d), other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    lo = split * split_keys
    last_t = tl.minimum((mb + 1) * BLOCK_M - 1, len_q * group - 1) // group  # the block's last token
    hi = tl.minimum(tl.minimum(len_k, lo + split_keys), last_t + offset + 1)
    hi = tl.where(mb * BLOCK_M < len_q * group, hi, lo)  # a block past this request's rows: nothing to do
    if WINDOW:
        # the block's first token sees keys from (its index + offset - window + 1): start at the
        # key block holding that one
        first = (mb * BLOCK_M) // group + offset - window + 1
        lo = tl.maximum(lo, (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < hi
        if KEYS_IN_ORDER:
            kr = k0 + offs_n
        else:
            kr = tl.load(KI + k0 + offs_n, mask=col_ok, other=0).to(tl.int64)
        kt = tl.load(K + kr[None, :] * stride_kr + hk * stride_kh + offs_d[:, None] * stride_kd,
                     mask=col_ok[None, :] & (offs_d[:, None] < head_d), other=0.0)
        s = dot(q, kt, DOT_PRECISION, DOT_UPCAST) * scale
        if SOFTCAP:
            s = soft_cap(s, softcap)
        keep = row_ok[:, None] & col_ok[None, :] & (offs_n[None, :] <= t[:, None] + offset)
        if WINDOW:
            keep = keep & (offs_n[None, :] > t[:, None] + offset - window)
        s = tl.where(keep, s, float("-inf"))
        p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
        v = tl.load(V + kr[:, None] * stride_vr + hk * stride_vh + offs_dv[None, :] * stride_vd,
                    mask=col_ok[:, None] & (offs_dv[None, :] < head_dv), other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    tok = q0 + t
    if SPLIT:
        # partial results, in (split, token, head) order; merged by SplitMerge.combine
        base = (split * total_q + tok) * num_q_heads + h
        WS_ML = WS + tl.num_programs(2).to(tl.int64) * total_q * num_q_heads * head_dv
        tl.store(WS + base[:, None] * head_dv + offs_dv[None, :], acc,
                 mask=row_ok[:, None] & (offs_dv[None, :] < head_dv))
        tl.store(WS_ML + base * 2, m_i, mask=row_ok)
        tl.store(WS_ML + base * 2 + 1, l_i, mask=row_ok)
    else:
        out = normalise(acc, l_i, row_ok, True)
        tl.store(O + tok[:, None] * stride_ot + h[:, None] * stride_oh + offs_dv[None, :] * stride_od,
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < head_dv))


def check_inputs(q, k_pool, v_pool, key_index, cu_q, cu_k, max_q: int, max_k: int, scale: float,
                 window: int = 0, softcap: float = 0.0) -> None:
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        check_float(NAME, name, t)
        if not t.dim() == 3:
            fail(NAME, f"{name} must be 3-D (tokens or rows, heads, head_dim), got {tuple(t.shape)}")
    if not q.dtype == k_pool.dtype == v_pool.dtype:
        fail(NAME, f"q, k_pool, v_pool dtypes differ: {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_pool.shape[1]
    if not k_pool.shape[2] == D:
        fail(NAME, f"q and k head dims differ: {D} vs {k_pool.shape[2]}")
    if not v_pool.shape[1] == k_pool.shape[1]:
        fail(NAME, f"v_pool {tuple(v_pool.shape)} and k_pool {tuple(k_pool.shape)} have different kv heads")
    if not (Hkv > 0 and Hq % Hkv == 0):
        fail(NAME, f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if not (0 < D <= MAX_HEAD_DIM and 0 < v_pool.shape[2] <= MAX_HEAD_DIM):
        fail(NAME, f"head dims must be in 1..{MAX_HEAD_DIM}, got {D} and {v_pool.shape[2]}")
    for name, t in (("key_index", key_index), ("cu_q", cu_q), ("cu_k", cu_k)):
        if t is None and name == "key_index":
            continue
        if not (isinstance(t, torch.Tensor) and t.dtype in INDEX_DTYPES and t.dim() == 1
                and (t.stride(0) == 1 or t.numel() <= 1)):  # the kernel reads them with unit stride
            what = (f"{t.dtype} of shape {tuple(t.shape)}, strides {t.stride()}" if isinstance(t, torch.Tensor)
                    else type(t).__name__)
            fail(NAME, f"{name} must be a contiguous 1-D int32/int64 tensor, got {what}")
        if not t.device == q.device:
            fail(NAME, f"{name} is on {t.device}, q on {q.device}")
    if not (cu_q.shape == cu_k.shape and cu_q.numel() >= 1):
        fail(NAME, f"cu_q and cu_k must both have n_requests + 1 entries, got {cu_q.numel()} and {cu_k.numel()}")
    if not (isinstance(max_q, int) and isinstance(max_k, int) and max_q >= 0 and max_k >= 0):
        fail(NAME, f"max_q and max_k must be non-negative ints, got {max_q!r}, {max_k!r}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        fail(NAME, f"scale must be finite, got {scale!r}")
    if not (isinstance(window, int) and not isinstance(window, bool) and window >= 0):
        fail(NAME, f"window must be an int >= 0 (0: none), got {window!r}")
    if not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and math.isfinite(softcap)
          and softcap >= 0):
        fail(NAME, f"softcap must be a finite number >= 0 (0: none), got {softcap!r}")


class _KeySplits:
    """How a launch splits each request's keys, read from its config once per launch signature:
    called with the longest request's key count (it moves every decode step), (splits, keys per
    split), splits starting on BLOCK_N boundaries. Without a forced SPLITS count only decode
    (one query token per request) splits, at most MAX_SPLITS, one per KEYS_PER_SPLIT keys."""

    __slots__ = ("forced", "most", "per", "block_n", "last")

    def __init__(self, config, max_q: int, block_n: int):
        forced = config.get("SPLITS")
        self.forced = None if forced is None else max(1, int(forced))
        self.most = 1 if max_q != 1 else config.get("MAX_SPLITS", 8)
        self.per, self.block_n = config.get("KEYS_PER_SPLIT", 512), block_n
        self.last = (None, None)  # (max_k, answer): every layer of a decode step asks the same

    def __call__(self, max_k: int) -> tuple[int, int]:
        last = self.last
        if last[0] == max_k:
            return last[1]
        keys = max(max_k, 1)
        splits = self.forced if self.forced is not None else max(1, min(self.most, -(-max_k // self.per)))
        block_n = self.block_n
        split_keys = -(-(-(-keys // splits)) // block_n) * block_n
        answer = (-(-keys // split_keys), split_keys)
        self.last = (max_k, answer)
        return answer


class _Launch:
    """What a launch decides from everything but the longest request's key count (read per call:
    it grows every decode step): blocks, grid, constexprs."""

    __slots__ = ("empty", "n", "blocks", "Hkv", "Dv", "scalars", "meta", "meta_split", "block_n", "splits", "merge",
                 "out_shape", "contiguous_out", "head", "tail")

    def __init__(self, q, k_pool, v_pool, key_index, cu_q, max_q, scale, window, softcap, config):
        config = default_config(q) if config is None else config
        Tq, Hq, D = q.shape
        Hkv, Dv = k_pool.shape[1], v_pool.shape[2]
        self.Hkv, self.Dv, self.n = Hkv, Dv, cu_q.numel() - 1
        self.empty = Tq * Hq * Dv == 0 or self.n == 0 or max_q == 0
        group = Hq // Hkv
        block_m, self.block_n = config["BLOCK_M"], config["BLOCK_N"]
        self.blocks = cdiv(max_q * group, block_m)
        self.scalars = (group, D, Dv, Hq, Tq, self.blocks)
        self.meta = dict(
            KEYS_IN_ORDER=key_index is None, SOFTCAP=softcap > 0, WINDOW=window > 0,
            BLOCK_M=block_m, BLOCK_N=self.block_n,
            BLOCK_D=max(16, next_pow2(D)), BLOCK_DV=max(16, next_pow2(Dv)),
            **dot_flags(q.dtype),
            num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 2), SPLIT=False,
        )
        self.meta_split = {**self.meta, "SPLIT": True}
        self.splits = _KeySplits(config, max_q, self.block_n)
        self.merge = SplitMerge(Tq * Hq, Dv, True)  # rows in (token, head) order
        self.out_shape, self.contiguous_out = (Tq, Hq, Dv), Dv == D and q.is_contiguous()
        # the kernel's arguments that follow from the signature, around the per-call ones
        self.head = (*q.stride(), *k_pool.stride(), *v_pool.stride(), Hq * Dv, Dv, 1, *self.scalars)
        self.tail = (float(scale), float(softcap or 1.0), int(window))


# the pools' row counts are not part of a plan: the ring-buffer and no-write paths gather each
# step's keys anew; nor is the key index' length
_launches = GuardedPlans(vary={1: ((0,), ()), 2: ((0,), ()), 5: ((0,), ())})


def default_config(q, *args) -> dict:
    """The config row for the inputs' device (kernels/configs.py)."""
    return configs.config_for(NAME, q.device)


@retries_smaller(NAME, default_config)
def launch(q, k_pool, v_pool, key_index, cu_q, cu_k, max_q: int, max_k: int, scale: float,
           window: int = 0, softcap: float = 0.0, *, config: dict | None = None) -> torch.Tensor:
    """Run the Triton kernel (`config` None: the device's row). max_q / max_k (the longest request's query and key counts) size
    the grid without reading cu_q / cu_k on the host. Checks and decisions that do not depend on
    max_k or the key index's length are made once per signature."""
    args = (q, k_pool, v_pool, key_index, cu_q, cu_k, max_q, max_k, scale, window, softcap)
    if key_index is None:
        plan = _launches.get_guarded((max_q, scale, window, softcap, False), (q, k_pool, v_pool, cu_q, cu_k), config,
                                     _key, _checked_launch, args, config)
    else:
        plan = _launches.get_guarded((max_q, scale, window, softcap, True), (q, k_pool, v_pool, cu_q, cu_k, key_index),
                                     config, _key, _checked_launch, args, config)
    if not (type(max_k) is int and max_k >= 0):
        check_inputs(*args)
    out = torch.empty_like(q) if plan.contiguous_out else q.new_empty(plan.out_shape)
    if plan.empty:
        return out
    splits, split_keys = plan.splits(max_k)
    if splits > 1:
        ws = plan.merge.workspace(splits, q)
        meta = plan.meta_split
    else:
        ws = out  # not written
        meta = plan.meta
    _paged_fwd[(plan.n * plan.blocks, plan.Hkv, splits)](
        q, k_pool, v_pool, cu_q if key_index is None else key_index, cu_q, cu_k, out, ws,
        *plan.head, split_keys, *plan.tail, **meta,
    )
    if splits > 1:
        plan.merge.combine(ws, splits, out)
    return out


def _key(args: tuple, config) -> tuple:
    """The plan's key behind the guards: the signature without the pools' row counts and the key
    index' length."""
    q, k_pool, v_pool, key_index, cu_q, cu_k, max_q, _, scale, window, softcap = args
    try:
        index_sig = None if key_index is None else (key_index.dtype, key_index.device, key_index.dim())
        return (q.shape, q.stride(), q.dtype, q.device, k_pool.shape[1:], k_pool.stride(), k_pool.dtype,
                k_pool.device, v_pool.shape[1:], v_pool.stride(), v_pool.dtype, v_pool.device, index_sig,
                cu_q.shape, cu_q.dtype, cu_q.device, cu_k.shape, cu_k.dtype, cu_k.device, max_q, scale,
                window, softcap)
    except AttributeError:  # an input is not a tensor: check_inputs says which
        check_inputs(*args)
        raise


def _checked_launch(args: tuple, config) -> _Launch:
    check_inputs(*args)
    q, k_pool, v_pool, key_index, cu_q, _, max_q, _, scale, window, softcap = args
    return _Launch(q, k_pool, v_pool, key_index, cu_q, max_q, scale, window, softcap, config)


def _requests(cu_q, cu_k):
    """(query rows, key rows) of each request, read on the host."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [((cq[i], cq[i + 1]), (ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def reference(q, k_pool, v_pool, key_index, cu_q, cu_k, scale: float, window: int = 0,
              softcap: float = 0.0) -> torch.Tensor:
    """Plain math in float32 per request (K/V gathered and expanded, full score matrix)."""
    out = torch.empty((q.shape[0], q.shape[1], v_pool.shape[2]), dtype=q.dtype, device=q.device)
    group = q.shape[1] // k_pool.shape[1]
    for (q0, q1), (k0, k1) in _requests(cu_q, cu_k):
        rows = torch.arange(k0, k1, device=q.device) if key_index is None else key_index[k0:k1].long()
        k = k_pool[rows].float().repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, Sk, D)
        v = v_pool[rows].float().repeat_interleave(group, dim=1).transpose(0, 1)
        s = (q[q0:q1].float().transpose(0, 1) @ k.transpose(1, 2)) * scale  # (Hq, Sq, Sk)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        sq, sk = q1 - q0, k1 - k0
        j, i = torch.arange(sk, device=q.device)[None, :], torch.arange(sq, device=q.device)[:, None]
        keep = j <= i + sk - sq
        if window:
            keep &= j > i + sk - sq - window
        p = softmax_rows(s.masked_fill(~keep, float("-inf")), True)
        out[q0:q1] = (p @ v).transpose(0, 1).to(q.dtype)
    return out


def cpu_forward(q, k_pool, v_pool, key_index, cu_q, cu_k, max_q: int, max_k: int, scale: float,
                plans: dict | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """CPU path: torch's fused SDPA kernels on keys gathered from the pool (O(the keys used)),
    few calls per step, since on CPU a call costs about as much as a short request's attention:
    - decode requests (one query token, every key kept) in a few calls by length class, each
      padded to its longest member (at most DECODE_WASTE x the real keys) and the padding
      masked; keys a group of them shares (a cached prefix, the same pool rows) are attended
      once for the whole group and merged (cascade attention);
    - short prompt chunks of similar length in one padded, masked call;
    - every other request in its own call: causal SDPA for a fresh prompt, and for a chunk after
      cached tokens the flash kernel on the cached and the new keys, merged (_after_cache).
    With a sliding window each request reads only the keys its queries' windows reach (a decode
    token its last `window`), the band masked in padded calls; soft-capped scores (which SDPA
    cannot cap) take attention.cpu_forward per request.
    How the step's requests are grouped (the Plan) depends only on cu_q, cu_k, key_index and the
    window; `plans`, a dict that lives for one serving step, lets every layer of the step reuse
    it (keyed by the index tensors' addresses: the step must not modify them in place)."""
    check_inputs(q, k_pool, v_pool, key_index, cu_q, cu_k, max_q, max_k, scale, window, softcap)
    if softcap:
        return _per_request(q, k_pool, v_pool, key_index, cu_q, cu_k, scale, window, softcap)
    flash_ok = q.dtype == k_pool.dtype and v_pool.shape[-1] == q.shape[-1]
    if plans is None:
        plan = Plan(q.shape[0], key_index, cu_q, cu_k, flash_ok, window)
    else:
        key = (q.shape[0], flash_ok, window) + tuple((t.data_ptr(), t.numel()) for t in (cu_q, cu_k, key_index)
                                                     if t is not None)
        plan = plans.get(key) or plans.setdefault(key, Plan(q.shape[0], key_index, cu_q, cu_k, flash_ok, window))
    out = torch.empty((q.shape[0], q.shape[1], v_pool.shape[2]), dtype=q.dtype, device=q.device)
    gqa = q.shape[1] != k_pool.shape[1]
    if plan.decode is not None:
        _decode_batch(q, k_pool, v_pool, plan.decode, scale, gqa, out)
    for batch in plan.chunk_batches:
        _chunk_batch(q, k_pool, v_pool, batch, scale, gqa, out)
    for (q0, q1), (k0, k1), rows in plan.alone:
        sq, sk = q1 - q0, k1 - k0
        k, v = (k_pool[k0:k1], v_pool[k0:k1]) if rows is None else (_take(k_pool, rows), _take(v_pool, rows))
        qr, k, v = q[q0:q1].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if window:
            o = attention.cpu_forward(qr, k, v, None, scale, True, sk - sq, True, 0.0, window)
        elif sk == sq:
            o = F.scaled_dot_product_attention(qr, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            o = _after_cache(qr, k, v, sk - sq, scale)
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def _windowed(requests, window: int):
    """Each request's keys cut to those its queries' windows reach: the first query (position
    past) sees keys from past - window + 1 on."""
    if not window:
        return requests
    return [((q0, q1), (k0 + max(0, (k1 - k0) - (q1 - q0) - window + 1), k1)) for (q0, q1), (k0, k1) in requests]


def _per_request(q, k_pool, v_pool, key_index, cu_q, cu_k, scale: float, window: int, softcap: float):
    """One attention.cpu_forward call per request (soft-capped scores, chunked, windowed)."""
    out = torch.empty((q.shape[0], q.shape[1], v_pool.shape[2]), dtype=q.dtype, device=q.device)
    for (q0, q1), (k0, k1) in _windowed(_requests(cu_q, cu_k), window):
        rows = torch.arange(k0, k1, device=q.device) if key_index is None else key_index[k0:k1]
        k, v = _take(k_pool, rows).transpose(0, 1)[None], _take(v_pool, rows).transpose(0, 1)[None]
        o = attention.cpu_forward(q[q0:q1].transpose(0, 1)[None], k, v, None, scale, True, (k1 - k0) - (q1 - q0),
                                  True, softcap, window)
        out[q0:q1] = o[0].transpose(0, 1)
    return out


SHORT_CHUNK = 256  # prompt chunks up to this long may share a padded call
MASK_BUDGET = 1 << 22  # (requests x queries x keys) of one padded call's mask
MIN_SHARED = 64  # keys a group of decode requests must share to be attended once for the group


class Plan:
    """How the CPU path runs one step's requests: index tensors and masks built once per step."""

    def __init__(self, total_q: int, key_index, cu_q, cu_k, flash_ok: bool, window: int = 0):
        device = cu_q.device
        requests = _windowed(_requests(cu_q, cu_k), window)
        decode = [r for r in requests if r[0][1] - r[0][0] == 1]
        # a decode token's window is all it reads: no mask; a shared prefix is not worth finding
        self.decode = _DecodePlan(decode, key_index, flash_ok and not window, device) if decode else None
        batches, alone = _chunk_batches([r for r in requests if r[0][1] - r[0][0] > 1])
        self.chunk_batches = [_ChunkPlan(b, key_index, device, window) for b in batches]
        self.alone = [(rq, rk, None if key_index is None else key_index[rk[0]:rk[1]]) for rq, rk in alone]


def _rows(key_index, pos):
    return pos if key_index is None else key_index[pos]


def _take(pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """pool[rows] for an index of any shape, by index_select (3-4x faster than advanced indexing
    on this CPU for a few thousand rows of a KV pool)."""
    return pool.index_select(0, rows.reshape(-1)).view(*rows.shape, *pool.shape[1:])


def _chunk_batches(chunks):
    """Short chunks grouped by length class (a power of two, so padding at most doubles a
    chunk's queries), each class cut where its padded mask would pass MASK_BUDGET; a class of
    one, and long chunks, run alone."""
    classes: dict[int, list] = {}
    alone = []
    for r in chunks:
        sq = r[0][1] - r[0][0]
        (classes.setdefault(next_pow2(sq), []) if sq <= SHORT_CHUNK else alone).append(r)
    batches = []
    for members in classes.values():
        batch: list = []
        for r in sorted(members, key=lambda r: r[1][1] - r[1][0]):
            longest_q = max([r[0][1] - r[0][0]] + [b[0][1] - b[0][0] for b in batch])
            if batch and (len(batch) + 1) * longest_q * (r[1][1] - r[1][0]) > MASK_BUDGET:
                batches.append(batch) if len(batch) > 1 else alone.extend(batch)
                batch = []
            batch.append(r)
        batches.append(batch) if len(batch) > 1 else alone.extend(batch)
    return batches, alone


def _padded_rows(starts, lengths, device):
    """Rows start + 0..max(length)-1 per entry, the padding repeating the last row; and the keep mask."""
    start = torch.tensor(starts, device=device)
    length = torch.tensor(lengths, device=device)
    span = torch.arange(max(lengths), device=device)
    return start[:, None] + torch.minimum(span[None, :], length[:, None] - 1), span[None, :] < length[:, None]


class _ChunkPlan:
    """Prompt chunks, each after its own cached tokens (bottom-right causal), padded to one call.
    A padded query row keeps every key of its request (no empty softmax) and is dropped."""

    def __init__(self, batch, key_index, device, window: int = 0):
        len_q = torch.tensor([q1 - q0 for (q0, q1), _ in batch], device=device)
        len_k = torch.tensor([k1 - k0 for _, (k0, k1) in batch], device=device)
        self.qi, self.q_ok = _padded_rows([q0 for (q0, _), _ in batch], len_q.tolist(), device)
        pos, _ = _padded_rows([k0 for _, (k0, _) in batch], len_k.tolist(), device)
        self.rows = _rows(key_index, pos)
        i = torch.arange(self.qi.shape[1], device=device)[None, :, None]
        j = torch.arange(pos.shape[1], device=device)[None, None, :]
        offset = (len_k - len_q)[:, None, None]
        keep = (j < len_k[:, None, None]) & (j <= i + offset)
        if window:  # real rows only: a padded row must keep a key
            keep &= (j > i + offset - window) | (i >= len_q[:, None, None])
        self.keep = keep[:, None]


def _chunk_batch(q, k_pool, v_pool, plan: _ChunkPlan, scale: float, gqa: bool, out: torch.Tensor) -> None:
    o = F.scaled_dot_product_attention(_take(q, plan.qi).transpose(1, 2), _take(k_pool, plan.rows).transpose(1, 2),
                                       _take(v_pool, plan.rows).transpose(1, 2), attn_mask=plan.keep, scale=scale,
                                       enable_gqa=gqa)  # (B, Hq, Sq, Dv)
    out[plan.qi[plan.q_ok]] = o.transpose(1, 2)[plan.q_ok]


def _after_cache(q, k, v, past: int, scale: float) -> torch.Tensor:
    """A prompt chunk after `past` cached tokens (bottom-right causal) with torch's CPU flash
    kernel, which is causal only top-left: the cached keys, every one kept, and the chunk's own
    keys, causal, attended separately and merged by their log-sum-exps. Memory O(chunk x D),
    never a [chunk x keys] mask or score matrix."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if q.dtype != k.dtype or v.shape[-1] != q.shape[-1]:
        return attention.cpu_forward(q, k, v, None, scale, True, past, zero_empty_rows=True)
    o1, l1 = flash(q, k[:, :, :past], v[:, :, :past], 0.0, False, scale=scale)
    o2, l2 = flash(q, k[:, :, past:], v[:, :, past:], 0.0, True, scale=scale)
    return _merge(o1, l1, o2, l2)


def _merge(o1, l1, o2, l2) -> torch.Tensor:
    """Two attentions of the same queries over disjoint key sets, by their log-sum-exps."""
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top).unsqueeze(-1), torch.exp(l2 - top).unsqueeze(-1)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(o1.dtype)


def _shared_prefixes(key_index, starts, lengths):
    """Groups of decode requests whose keys begin with the same pool rows (a cached prefix the
    engine shares between them): [(member positions, number of shared keys)]. Each member keeps
    at least its last key to itself."""
    groups: dict[int, list[int]] = {}
    for b, first in enumerate(key_index[torch.tensor(starts, device=key_index.device)].tolist()):
        groups.setdefault(first, []).append(b)
    shared = []
    for members in groups.values():
        span = min(lengths[b] for b in members) - 1
        if len(members) < 2 or span < MIN_SHARED:
            continue
        rows = torch.stack([key_index[starts[b]:starts[b] + span] for b in members])
        differ = (rows != rows[0]).any(dim=0).nonzero()
        common = int(differ[0]) if differ.numel() else span
        if common >= MIN_SHARED:
            shared.append((members, common))
    return shared


def length_classes(lengths: list[int], waste: float) -> list[list[int]]:
    """Positions of `lengths` grouped so that each group padded to its longest member costs at
    most `waste` x its members' own lengths: sorted by length, a new group where the next
    (longer) member would pass the bound."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and lengths[i] * (len(groups[-1]) + 1) > waste * (total + lengths[i]):
            groups.append([])
            total = 0
        if not groups:
            groups.append([])
        groups[-1].append(i)
        total += lengths[i]
    return groups


DECODE_WASTE = 1.25  # padded keys / real keys of one decode call (measured, see _DecodePlan)


class _DecodePlan:
    """One query token per request, in a few calls: requests grouped by their number of keys
    (length classes, each padded to its longest member, DECODE_WASTE at most), so a long
    request does not pad every short one to its length. On this CPU (bench: a long-tailed
    batch of 32, 30-613 keys, 8/2 heads, d 64) one padded call took 2-4 ms (bf16) and 7-9 ms
    (fp32) a layer, classes 0.9 and 1.6 ms, one call per request 1.2 and 1.7 ms. Where requests
    share a cached prefix, its keys are attended once for the group (cascade attention: the
    group's queries as one sequence), the rest per class, merged by log-sum-exp."""

    def __init__(self, requests, key_index, flash_ok: bool, device):
        rows_q = [q0 for (q0, _), _ in requests]
        starts = [k0 for _, (k0, _) in requests]
        lengths = [k1 - k0 for _, (k0, k1) in requests]
        shared = _shared_prefixes(key_index, starts, lengths) if flash_ok and key_index is not None else []
        skip = [0] * len(requests)
        for members, common in shared:
            for b in members:
                skip[b] = common
        rest = [n - d for n, d in zip(lengths, skip)]
        self.rows_q = torch.tensor(rows_q, device=device)
        # per class: (positions in the step's decode requests, their query rows, key rows (n, S),
        # keep mask (n, 1, 1, S) or None where every member has S keys)
        self.classes = []
        for members in length_classes(rest, DECODE_WASTE):
            pos, keep = _padded_rows([starts[b] + skip[b] for b in members], [rest[b] for b in members], device)
            full = all(rest[b] == rest[members[-1]] for b in members)
            self.classes.append((torch.tensor(members, device=device), self.rows_q[members], _rows(key_index, pos),
                                 None if full else keep[:, None, None, :]))
        self.groups = [(torch.tensor(m, device=device), key_index[starts[m[0]]:starts[m[0]] + common])
                       for m, common in shared]
        self._masks: dict = {}

    def additive_mask(self, index: int, dtype: torch.dtype) -> torch.Tensor | None:
        keep = self.classes[index][3]
        if keep is None:
            return None
        if (index, dtype) not in self._masks:
            self._masks[index, dtype] = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(
                ~keep, float("-inf"))
        return self._masks[index, dtype]


def _decode_batch(q, k_pool, v_pool, plan: _DecodePlan, scale: float, gqa: bool, out: torch.Tensor) -> None:
    if not plan.groups:
        for members, rows_q, rows, keep in plan.classes:
            k = _take(k_pool, rows).transpose(1, 2)  # (n, Hkv, S, D)
            v = _take(v_pool, rows).transpose(1, 2)
            o = F.scaled_dot_product_attention(_take(q, rows_q)[:, :, None], k, v, attn_mask=keep, scale=scale,
                                               enable_gqa=gqa)  # (n, Hq, 1, Dv)
            out[rows_q] = o[:, :, 0]
        return
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    n, hq = plan.rows_q.numel(), q.shape[1]
    o = torch.empty((n, hq, v_pool.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((n, hq), dtype=torch.float32, device=q.device)
    for i, (members, rows_q, rows, _) in enumerate(plan.classes):
        oc, lc = flash(_take(q, rows_q)[:, :, None], _take(k_pool, rows).transpose(1, 2),
                       _take(v_pool, rows).transpose(1, 2), 0.0, False, attn_mask=plan.additive_mask(i, q.dtype),
                       scale=scale)  # (n, Hq, 1, Dv), (n, Hq, 1)
        o[members], lse[members] = oc[:, :, 0], lc[:, :, 0]
    for members, prefix_rows in plan.groups:
        # the group's queries attend to the shared keys as one sequence of len(members) queries
        o1, l1 = flash(_take(q, plan.rows_q[members]).transpose(0, 1)[None], _take(k_pool, prefix_rows).transpose(0, 1)[None],
                       _take(v_pool, prefix_rows).transpose(0, 1)[None], 0.0, False, scale=scale)  # (1, Hq, n, Dv), (1, Hq, n)
        o[members] = _merge(o1[0].transpose(0, 1), l1[0].transpose(0, 1), o[members], lse[members])
    out[plan.rows_q] = o


# ---- the declaration (kernels/spec.py) ----------------------------------------------------------

def _aot_cases():
    from .configs import config_for_arch

    g, randn = spec.aot_inputs()

    def paged(decode, key_index=True, window=0, softcap=0.0):
        def call(arch):
            lens_q, lens_k = ([1, 1, 1], [700, 90, 1500]) if decode else ([37, 5, 64], [37, 300, 64])
            kp, vp = randn(4096, 2, 128), randn(4096, 2, 128)
            cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
            cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
            ki = torch.randperm(4096, generator=g)[:sum(lens_k)].to(torch.int32) if key_index else None
            launch(randn(sum(lens_q), 8, 128), kp, vp, ki, cu_q, cu_k, max(lens_q), max(lens_k), 128 ** -0.5, window,
                   softcap, config=config_for_arch(NAME, arch))
        return call

    return [
        ("bf16 d128 prefill chunks", paged(False)),
        ("bf16 d128 decode, key splits", paged(True)),
        ("bf16 d128 keys in pool order (no key index)", paged(False, key_index=False)),
        ("bf16 d128 decode, window 512, softcap 30", paged(True, window=512, softcap=30.0)),
    ]


def _example():
    """Keys given in cu_k order (no pool): two requests of 3 and 1 query tokens over 5 and 4 keys."""
    return (torch.randn(4, 4, 24), torch.randn(9, 2, 24), torch.randn(9, 2, 12), None, None,
            torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32), 3, 5, 0, 0.2)


KERNEL = spec.KernelSpec(NAME, DEFAULT_CONFIGS, _aot_cases)
# the serving step's ops: tokens of many requests packed in rows, the pool outside the graph
# (not modelled yet: priced by bytes)
OPS = (spec.OpSpec("paged_attention", spec.ATTENTION, spec.by_bytes, spec.OPAQUE_LAYOUT, _example, KERNEL),)
