"""metainfer's ops, all registered here: the opaque nodes passes put in the graph.

Each op is defined in the dispatcher from its Python signature, with a fake (shape/dtype)
implementation, so Dynamo, AOTAutograd and Inductor treat it as one extern call that no
decomposition can undo. Its body picks the implementation per call: the Triton kernel for CUDA
tensors (and for CPU tensors under the interpreter, see `metainfer.kernels.interpret_enabled`),
else the kernel's CPU path. Every output is a new contiguous tensor, as the fakes promise.

The ops are registered with `torch.library.Library` rather than `torch.library.custom_op`:
custom_op wraps every call in an autograd function, a Dynamo-disabled frame and an aliasing
check (measured: 8.0 us a call against 1.5 us for the same op defined here, a decode step pays
it per op per layer); these ops are inference-only (optimize() runs under no_grad) and their outputs are
fresh tensors (tests/test_ops.py: opcheck's schema test and a storage check on both paths).
"""

from __future__ import annotations

import types
from typing import Optional

import torch
from torch import Tensor

from metainfer import kernels
from metainfer.kernels import attention as _attention
from metainfer.kernels import fp8_gemm as _fp8_gemm
from metainfer.kernels import int4_gemm as _int4_gemm
from metainfer.kernels import mla_decode as _mla_decode
from metainfer.kernels import paged_attention as _paged_attention
from metainfer.kernels import moe as _moe
from metainfer.kernels import sparse_attention as _sparse_attention
from metainfer.kernels import rmsnorm as _rmsnorm
from metainfer.kernels import rope as _rope
from metainfer.kernels import glu as _glu

from . import kv_pool, shm_collectives, symm_mem  # noqa: F401  (they register metainfer::shm_*, symm_mem_all_reduce)

_LIB = torch.library.Library("metainfer", "FRAGMENT")

# Each op's implementation as a plain function, called without the dispatcher: Inductor's wrapper
# calls these (lowering/direct_calls.py), sparing a decode step the dispatcher's argument parsing
# (~3 us per call of a ten-argument op). Same arguments, same outputs as torch.ops.metainfer.<name>.
direct = types.SimpleNamespace()
__all__: list[str] = []  # the ops defined below, as `_op` defines them


def _op(name: str):
    """Define metainfer::<name> from the decorated function's signature, with the function as
    its implementation on every backend; the op (torch.ops.metainfer.<name>) replaces it, and
    the function stays reachable as `direct.<name>`."""

    def register(fn):
        schema = torch.library.infer_schema(fn, mutates_args=())
        _LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        setattr(direct, name, fn)
        __all__.append(name)
        op = getattr(torch.ops.metainfer, name)
        op.__doc__ = fn.__doc__
        return op

    return register


def _fake(op):
    """Register the decorated function as `op`'s fake (shapes and dtypes of its outputs)."""
    return torch.library.register_fake(op._qualified_op_name, lib=_LIB)




@_op("attention")
def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float,
              causal: bool, causal_offset: int, zero_empty_rows: bool, softcap: float = 0.0,
              window: int = 0) -> Tensor:
    """softmax(softcap(q k^T * scale) + mask) v with GQA, causal / sliding-window masks built
    in; see metainfer.kernels.attention."""
    if kernels.use_triton(q):  # the launcher looks its config row up once per signature
        return _attention.launch(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows, softcap, window)
    return _attention.cpu_forward(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows, softcap,
                                  window).contiguous()


@_fake(attention)
def _(q, k, v, mask, scale, causal, causal_offset, zero_empty_rows, softcap=0.0, window=0):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


@_op("rmsnorm")
def rmsnorm(x: Tensor, weight: Tensor, eps: float, weight_offset: float, out_dtype: torch.dtype) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * (weight + weight_offset), see metainfer.kernels.rmsnorm."""
    if kernels.use_triton(x):
        return _rmsnorm.launch(x, weight, eps, weight_offset, out_dtype)
    return _rmsnorm.cpu_forward(x, weight, eps, weight_offset, out_dtype).contiguous()


@_fake(rmsnorm)
def _(x, weight, eps, weight_offset, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


@_op("add_rmsnorm")
def add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, weight_offset: float,
                out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(rmsnorm(x + residual), x + residual) in one pass over the rows."""
    if kernels.use_triton(x):
        y, h = _rmsnorm.launch(x, weight, eps, weight_offset, out_dtype, residual=residual)
    else:
        y, h = _rmsnorm.cpu_forward(x, weight, eps, weight_offset, out_dtype, residual=residual)
    return y.contiguous(), h.contiguous()


@_fake(add_rmsnorm)
def _(x, residual, weight, eps, weight_offset, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape)


@_op("swiglu")
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, see metainfer.kernels.glu."""
    return _gated(gate, up, "silu")


@_op("geglu")
def geglu(gate: Tensor, up: Tensor) -> Tensor:
    """gelu_tanh(gate) * up, see metainfer.kernels.glu."""
    return _gated(gate, up, "gelu_tanh")


def _gated(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    if kernels.use_triton(gate):
        return _glu.launch(gate, up, activation=activation)
    return _glu.cpu_forward(gate, up, activation).contiguous()


def _gated_fake(gate, up):
    return gate.new_empty(gate.shape, dtype=_glu.out_dtype(gate, up))


_fake(swiglu)(_gated_fake)
_fake(geglu)(_gated_fake)


@_op("rope")
def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, see metainfer.kernels.rope."""
    if kernels.use_triton(x):
        return _rope.launch(x, cos, sin)
    return _rope.cpu_forward(x, cos, sin).contiguous()


@_fake(rope)
def _(x, cos, sin):
    return x.new_empty(x.shape, dtype=_rope.out_dtype(x, cos, sin))


@_op("fp8_linear")
def fp8_linear(x: Tensor, weight: Tensor, scale_inv: Tensor, bias: Optional[Tensor], block_n: int, block_k: int,
               act_quant: bool) -> Tensor:
    """x @ dequant(weight)^T (+ bias) from the FP8 weight and its block scales, see
    metainfer.kernels.fp8_gemm; act_quant: W8A8 (activations quantised per 1 x block_k)."""
    if not x.is_contiguous() and (x.dim() > 1 and x.stride(-1) != 1 or not _rows_viewable(x)):
        x = x.contiguous()  # e.g. a batched view of a cache slice
    if kernels.use_triton(x):  # the launcher looks its config row up once per signature
        return _fp8_gemm.launch(x, weight, scale_inv, bias, block_n, block_k, act_quant)
    return _fp8_gemm.cpu_forward(x, weight, scale_inv, bias, block_n, block_k, act_quant).contiguous()


def _rows_viewable(x: Tensor) -> bool:
    try:
        x.view(-1, x.shape[-1])
        return True
    except RuntimeError:
        return False


@_fake(fp8_linear)
def _(x, weight, scale_inv, bias, block_n, block_k, act_quant):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_op("fp8_quantize_activations")
def fp8_quantize_activations(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """(x_fp8, x_scale): x quantised per row and per `group` consecutive features to e4m3, as a
    W8A8 fp8_linear quantises its input (metainfer.kernels.fp8_gemm.quantize_activations), in plain
    torch; the share_act_quant pass runs it once for the linears that read one x."""
    return _fp8_gemm.quantize_activations(x, group)


@_fake(fp8_quantize_activations)
def _(x, group):
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((*x.shape[:-1], -(-x.shape[-1] // group)), dtype=torch.float32))


@_op("fp8_linear_quantized")
def fp8_linear_quantized(x: Tensor, x_fp8: Tensor, x_scale: Tensor, weight: Tensor, scale_inv: Tensor,
                         bias: Optional[Tensor], block_n: int, block_k: int) -> Tensor:
    """fp8_linear(x, weight, scale_inv, bias, block_n, block_k, act_quant=True) with x's activations
    quantised already: (x_fp8, x_scale) = fp8_quantize_activations(x, block_k). x gives the shape
    and the output dtype; the result is the same, bit for bit."""
    if not x.is_contiguous() and (x.dim() > 1 and x.stride(-1) != 1 or not _rows_viewable(x)):
        x = x.contiguous()  # (only its metadata is read; as fp8_linear)
    if kernels.use_triton(x):
        return _fp8_gemm.launch(x, weight, scale_inv, bias, block_n, block_k, True, activations=(x_fp8, x_scale))
    return _fp8_gemm.cpu_forward(x, weight, scale_inv, bias, block_n, block_k, True,
                                 activations=(x_fp8, x_scale)).contiguous()


@_fake(fp8_linear_quantized)
def _(x, x_fp8, x_scale, weight, scale_inv, bias, block_n, block_k):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_op("fp8_dequantize")
def fp8_dequantize(weight: Tensor, scale_inv: Tensor, block_n: int, block_k: int, dtype: torch.dtype) -> Tensor:
    """The real weight (N, K) in `dtype` of an FP8 weight and its block (or per-channel, per-tensor)
    scales, in plain torch on any device: what a quantized FP8 linear computes before F.linear
    (models/quantized.py). The fp8_gemm pass folds the pair into metainfer::fp8_linear."""
    return _fp8_gemm.dequantize(weight, scale_inv, block_n, block_k, dtype)


@_fake(fp8_dequantize)
def _(weight, scale_inv, block_n, block_k, dtype):
    return weight.new_empty(weight.shape, dtype=dtype)


@_op("int4_linear")
def int4_linear(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], perm: Optional[Tensor],
                bias: Optional[Tensor], group: int) -> Tensor:
    """x @ dequant(qweight)^T (+ bias) from packed 4-bit weights with a scale (and a zero point,
    else 8) per row and group of K, x's columns read through `perm` (act-order) when given: see
    metainfer.kernels.int4_gemm."""
    if not x.is_contiguous() and (x.dim() > 1 and x.stride(-1) != 1 or not _rows_viewable(x)):
        x = x.contiguous()
    if kernels.use_triton(x):
        return _int4_gemm.launch(x, qweight, scales, zeros, perm, bias, group)
    return _int4_gemm.cpu_forward(x, qweight, scales, zeros, perm, bias, group).contiguous()


@_fake(int4_linear)
def _(x, qweight, scales, zeros, perm, bias, group):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@_op("int4_dequantize")
def int4_dequantize(qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], group: int, dtype: torch.dtype) -> Tensor:
    """The real weight (N, K) in `dtype` of a packed 4-bit weight (metainfer.kernels.int4_gemm's
    layout), in plain torch on any device: what a quantized linear computes before F.linear
    (models/quantized.py). The int4_gemm pass folds the pair into metainfer::int4_linear."""
    return _int4_gemm.dequantize(qweight, scales, zeros, group, dtype)


@_fake(int4_dequantize)
def _(qweight, scales, zeros, group, dtype):
    return qweight.new_empty((qweight.shape[0], qweight.shape[1] * _int4_gemm.PACK), dtype=dtype)


@_op("moe_experts")
def moe_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                s_gate: Optional[Tensor], s_up: Optional[Tensor], s_down: Optional[Tensor],
                block_n: int, block_k: int) -> Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with SwiGLU experts as one grouped
    GEMM, see metainfer.kernels.moe (FP8 weights when the scales are given)."""
    args = (x, topk_ids, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down, block_n, block_k)
    if kernels.use_triton(x):
        return _moe.launch(*args)  # the launcher looks its config row up once per signature
    return _moe.cpu_forward(*args).contiguous()


@_fake(moe_experts)
def _(x, topk_ids, topk_weights, w_gate, w_up, w_down, s_gate, s_up, s_down, block_n, block_k):
    return x.new_empty(x.shape)


@_op("sparse_attention")
def sparse_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, mask: Optional[Tensor], scale: float,
                     causal: bool, causal_offset: int, zero_empty_rows: bool, unselected_fill: float) -> Tensor:
    """Attention over the keys `indices` selects per query (DSA top-k), see
    metainfer.kernels.sparse_attention. `unselected_fill` -inf: unselected keys are dropped;
    a finite value: they carry that additive mask, as a dense mask with finfo.min has it."""
    args = (q, k, v, indices, mask, scale, causal, causal_offset, zero_empty_rows)
    fill = (q, k, v, indices, mask, scale, causal, causal_offset, unselected_fill)
    if kernels.use_triton(q):  # the launcher looks its config row up once per signature
        out = _sparse_attention.launch(*args)
        if unselected_fill != float("-inf"):  # on the device: no read-back in the step
            out = _sparse_attention.launch_unselected_rows(out, *fill)
        return out
    out = _sparse_attention.cpu_forward(*args).contiguous()
    if unselected_fill != float("-inf"):
        out = _sparse_attention.fix_unselected_rows(out, *fill)
    return out


@_fake(sparse_attention)
def _(q, k, v, indices, mask, scale, causal, causal_offset, zero_empty_rows, unselected_fill):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


@_op("mla_decode")
def mla_decode(q_latent: Tensor, q_pe: Tensor, ckv: Tensor, kpe: Tensor, indices: Optional[Tensor],
               mask: Optional[Tensor], scale: float, causal: bool, causal_offset: int,
               zero_empty_rows: bool) -> Tensor:
    """MLA attention over the latent cache in the absorbed form, see metainfer.kernels.mla_decode."""
    args = (q_latent, q_pe, ckv, kpe, indices, mask, scale, causal, causal_offset, zero_empty_rows)
    if kernels.use_triton(q_latent):
        return _mla_decode.launch(*args)  # the launcher looks its config row up once per signature
    return _mla_decode.cpu_forward(*args).contiguous()


@_fake(mla_decode)
def _(q_latent, q_pe, ckv, kpe, indices, mask, scale, causal, causal_offset, zero_empty_rows):
    return q_latent.new_empty(q_latent.shape)


@_op("paged_attention")
def paged_attention(q: Tensor, k: Tensor, v: Tensor, write_index: Optional[Tensor], read_index: Optional[Tensor],
                    cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, layer: int, scale: float,
                    window: int = 0, softcap: float = 0.0, sentinel: int = -1) -> Tensor:
    """One layer of a serving step, see metainfer.kernels.paged_attention. With write_index,
    the new keys and values k, v (Tq, Hkv, D) are written into the KV pool at write_index and
    q (Tq, Hq, D) attends to each request's keys read in place at read_index (write_index when
    nothing is cached); without, k and v already hold every request's keys in cu_k order.
    The pool is the serving step's (kernels/kv_pool.py), written as a collective writes its
    peers' memory: a side effect outside the arguments, ordered by the data flow of layers.
    `window` > 0: each query sees its last `window` positions; `softcap` > 0: scores capped.
    `sentinel` >= 0: the layer's pool is a ring buffer (transformers' sliding-window layers): the
    read index lists each request's cached rows then `sentinel` for each new token, and the rows
    are read before the new keys are written (they may overwrite rows the step still reads)."""
    if write_index is not None and sentinel >= 0:
        k_pool, v_pool = kv_pool.layer_views(layer)
        new = (read_index == sentinel)[:, None, None]
        k_all = k_pool.index_select(0, read_index).masked_scatter_(new, k.to(k_pool.dtype))
        v_all = v_pool.index_select(0, read_index).masked_scatter_(new, v.to(v_pool.dtype))
        k_pool.index_copy_(0, write_index, k.to(k_pool.dtype))
        v_pool.index_copy_(0, write_index, v.to(v_pool.dtype))
        k_pool, v_pool, key_index = k_all, v_all, None  # every request's keys in cu_k order
    elif write_index is None:
        k_pool, v_pool, key_index = k, v, None
    else:
        k_pool, v_pool = kv_pool.layer_views(layer)
        k_pool.index_copy_(0, write_index, k.to(k_pool.dtype))
        v_pool.index_copy_(0, write_index, v.to(v_pool.dtype))
        key_index = read_index if read_index is not None and read_index.numel() else write_index
    args = (q, k_pool, v_pool, key_index, cu_q, cu_k, max_q, max_k, scale)
    if kernels.use_triton(q):
        return _paged_attention.launch(*args, window, softcap)  # config looked up once per signature
    return _paged_attention.cpu_forward(*args, plans=kv_pool.step_plans(), window=window, softcap=softcap)


@_fake(paged_attention)
def _(q, k, v, write_index, read_index, cu_q, cu_k, max_q, max_k, layer, scale, window=0, softcap=0.0, sentinel=-1):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@_op("paged_latents")
def paged_latents(latent: Tensor, rotated_key: Tensor, write_index: Tensor, read_index: Tensor,
                  layer: int) -> tuple[Tensor, Tensor]:
    """One MLA layer's cache step: its new latents (Tq, R) and rotated keys (Tq, P) written into
    the serving step's pool at write_index, and every request's (cached + new) read back at
    read_index, in cu_k order (the new ones as they are when nothing is cached). As
    paged_attention, the pool is reached through kernels/kv_pool.py."""
    latent_pool, rotated_pool = kv_pool.layer_views(layer)
    latent_pool.index_copy_(0, write_index, latent.to(latent_pool.dtype))
    rotated_pool.index_copy_(0, write_index, rotated_key.to(rotated_pool.dtype))
    if read_index.numel() == 0:
        return latent.clone(), rotated_key.clone()
    return latent_pool.index_select(0, read_index), rotated_pool.index_select(0, read_index)


@_fake(paged_latents)
def _(latent, rotated_key, write_index, read_index, layer):
    rows = read_index.shape[0] if read_index.shape[0] != 0 else latent.shape[0]
    return latent.new_empty((rows, latent.shape[1])), rotated_key.new_empty((rows, rotated_key.shape[1]))
