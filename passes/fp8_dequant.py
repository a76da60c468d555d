"""Recognise "dequantise an FP8 block-quantised weight" in a post-grad graph, with proof.

The fallback every FP8 port writes is W = (w.float() * S).to(dtype), where S expands the
block scales `scale_inv` (ceil(N/bn), ceil(K/bk)) to (N, K) (repeat_interleave, expand +
reshape, slicing off the padding of partial blocks; the exact ops vary). `find_dequant(W)`
accepts W only if
- its structure is convert(mul(convert(w, float32), S)) with w a float8 tensor and S computed
  from one float32 tensor by data-independent shape ops only (views, expands, copies,
  slices), so S[n, k] = scale_inv[f(n, k)] for some index map f;
- f is the block map (n // bn, k // bk): shape ops gather, so evaluating them once on a
  scale tensor of distinct values determines f exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from . import base
from .matching import CONVERT_OPS, Node, aten, dtype, is_op, peel, shape, uncast

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
# data-independent gathers: the value at each output position is one input element
_SHAPE_OPS = (aten.alias, aten.unsqueeze, aten.expand, aten.clone, aten.reshape, aten.view, aten._unsafe_view,
              aten.slice, aten.squeeze, aten.permute, aten.repeat_interleave, aten.repeat,
              aten.index_select)


class NotDequant(base.NearMiss):
    """An FP8 weight is dequantised in a way this analysis cannot prove; the message says how."""


@dataclass
class Dequant:
    weight: Node  # the float8 (N, K) tensor (possibly select(stacked, 0, e))
    scale: Node  # its float32 block scales (ceil(N/bn), ceil(K/bk))
    block_n: int
    block_k: int
    out: Node  # the dequantised weight
    nodes: set[Node] = field(default_factory=set)  # out and everything computing it from weight/scale


def find_dequant(out: Node) -> Dequant | None:
    """The proof that `out` is a block-scaled FP8 weight dequantised, None if `out` is not
    computed from a float8 tensor at all; NotDequant if it is, in a form not proven."""
    s_out = shape(out)
    if s_out is None or len(s_out) != 2 or dtype(out) not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if is_op(out, torch.ops.metainfer.fp8_dequantize):  # an op of fixed meaning: the proof is its name
        w, scale, bn, bk = out.args[:4]
        return Dequant(weight=w, scale=scale, block_n=bn, block_k=bk, out=out, nodes={out})
    nodes = set()
    n = out
    while is_op(n, *CONVERT_OPS):
        # only casts to float dtypes at least as wide as the result: a narrowing or integer
        # cast in between would round or overflow the dequantised weight
        inner = dtype(n.args[0])
        if not (inner is not None and inner.is_floating_point and inner not in FP8_DTYPES
                and inner.itemsize >= dtype(out).itemsize):
            return None
        nodes.add(n)
        n = n.args[0]
    if not is_op(n, aten.mul) or not all(isinstance(a, Node) for a in n.args[:2]):
        return None
    mul = n
    nodes.add(mul)
    a, b = mul.args[0], mul.args[1]
    for w_side, s_side in ((a, b), (b, a)):
        w = uncast(w_side)
        if dtype(w) in FP8_DTYPES:
            break
    else:
        return None
    if dtype(mul) != torch.float32 or not (is_op(w_side, *CONVERT_OPS) and w_side.args[0] is w
                                           and dtype(w_side) == torch.float32):
        raise NotDequant("the FP8 weight is not upcast to float32 once before the scale multiply")
    nodes.add(w_side)
    N, K = s_out
    if not (isinstance(N, int) and isinstance(K, int)) or tuple(shape(w)) != (N, K):
        raise NotDequant(f"FP8 weight {list(shape(w))} is not the (N, K) = {[N, K]} the GEMM reads")
    scale, chain = _scale_source(s_side)
    nodes.update(chain)
    bn, bk = _block_map(scale, chain, s_side, N, K)
    return Dequant(weight=w, scale=scale, block_n=bn, block_k=bk, out=out, nodes=nodes)


def _scale_source(s: Node) -> tuple[Node, list[Node]]:
    """Walk the shape-op chain down to the float32 2-D scale tensor it expands."""
    s, chain = peel(s, _SHAPE_OPS)
    for v in chain:
        if any(isinstance(a, Node) for a in list(v.args[1:]) + list(v.kwargs.values())):
            raise NotDequant(f"{v.name} expands the scales with a tensor-dependent argument")
    if dtype(s) != torch.float32 or shape(s) is None or len(shape(s)) != 2:
        raise NotDequant(f"the scales ({s.name}, {dtype(s)} {list(shape(s) or [])}) are not a float32 2-D tensor "
                         "expanded by shape ops")
    if not all(isinstance(d, int) for d in shape(s)):
        raise NotDequant("the scale tensor has a symbolic shape")
    return s, chain


def _replay(chain: list[Node], top: Node, value: torch.Tensor) -> torch.Tensor:
    env = {}
    for n in reversed(chain):
        src = env.get(n.args[0], value)
        env[n] = n.target(src, *n.args[1:], **n.kwargs)
    return env[top] if chain else value


_PROVEN: dict[tuple, "tuple[int, int] | str"] = {}  # chain signature -> block map, or why it is not one


def _signature(chain: list[Node], nb: int, kb: int, N: int, K: int) -> tuple | None:
    """What `_block_map`'s result depends on: the shape ops and their constant arguments."""
    try:
        sig = tuple((str(n.target), repr(n.args[1:]), repr(sorted(n.kwargs.items()))) for n in reversed(chain))
    except Exception:
        return None
    return sig, nb, kb, N, K


def _block_map(scale: Node, chain: list[Node], top: Node, N: int, K: int) -> tuple[int, int]:
    """The (bn, bk) block map of the expansion, proven by evaluating it once per distinct
    expansion (every layer of a model repeats the same few)."""
    nb, kb = shape(scale)
    key = _signature(chain, nb, kb, N, K)
    if key is not None and key in _PROVEN:
        found = _PROVEN[key]
        if isinstance(found, str):
            raise NotDequant(found)
        return found
    try:
        found = _evaluate_block_map(chain, top, nb, kb, N, K)
    except NotDequant as e:
        if key is not None:
            _PROVEN[key] = str(e)
        raise
    if key is not None:
        _PROVEN[key] = found
    return found


def _evaluate_block_map(chain: list[Node], top: Node, nb: int, kb: int, N: int, K: int) -> tuple[int, int]:
    with unset_fake_temporarily():  # real tensors, also when the pass runs under a fake mode
        probe = torch.arange(1, nb * kb + 1, dtype=torch.float32).view(nb, kb)  # distinct, exact in fp32
        try:
            expanded = _replay(chain, top, probe)
        except Exception as e:  # an op that cannot run on a plain tensor: not provable here
            raise NotDequant(f"could not evaluate the scale expansion: {type(e).__name__}: {e}") from e
        if tuple(expanded.shape) != (N, K):
            raise NotDequant(f"the expanded scales have shape {list(expanded.shape)}, the weight {[N, K]}")
        for bn in _candidates(N, nb):
            for bk in _candidates(K, kb):
                rows = torch.arange(N) // bn
                cols = torch.arange(K) // bk
                if torch.equal(expanded, probe[rows[:, None], cols[None, :]]):
                    return bn, bk
    raise NotDequant(f"scales {[nb, kb]} are not expanded as power-of-two blocks over a [{N}, {K}] weight")


def _candidates(n: int, nblocks: int) -> list[int]:
    """Block sizes (powers of two >= 16) that give `nblocks` blocks over `n`."""
    out, b = [], 16
    while b < 2 * max(n, 16):
        if -(-n // b) == nblocks:
            out.append(b)
        b *= 2
    return out[:1] if nblocks == 1 else out  # one block: every size >= n is the same map
