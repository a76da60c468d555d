"""Quantized linear layers as a checkpoint keeps them: the weight stays packed in memory and the
forward is what any device can run, dequantise then F.linear, so eager runs anywhere and Dynamo
captures a form metainfer's passes turn into one kernel (passes/int4_gemm.py).

    layer = Int4Linear.from_linear(nn.Linear(4096, 4096), group=128, symmetric=False)
    quantize_linears(model, group=128)        # every nn.Linear but the embeddings and lm_head, in place

The packed layout is metainfer.kernels.int4_gemm's (loaders convert GPTQ, AWQ and compressed-
tensors checkpoints to it); the dequantisation is `metainfer::int4_dequantize`, an op whose body
is plain torch: Dynamo sees one node whose meaning is fixed, which the pass can prove it replaces
exactly (a traced chain of shifts, masks and gathers could not be told from one that differs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metainfer.kernels import int4_gemm


class Int4Linear(nn.Module):
    """y = x @ W^T + b with W (out_features, in_features) kept as 4-bit values packed eight to an
    int32 (`qweight`), a scale per output row and group of `group` inputs (`scales`), zero points
    (`zeros`, uint8; None: symmetric, 8), and for an act-order checkpoint the permutation its
    input columns are read through (`perm`)."""

    def __init__(self, in_features: int, out_features: int, group: int, bias: bool = False, zeros: bool = True,
                 act_order: bool = False, scale_dtype: torch.dtype = torch.float16):
        super().__init__()
        if in_features % int4_gemm.PACK:
            raise ValueError(f"in_features {in_features} is not a multiple of {int4_gemm.PACK} (packed int32 words)")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        G = int4_gemm.groups(in_features, group)
        self.register_buffer("qweight", torch.zeros(out_features, in_features // int4_gemm.PACK, dtype=torch.int32))
        self.register_buffer("scales", torch.ones(out_features, G, dtype=scale_dtype))
        self.register_buffer("zeros", torch.full((out_features, G), 8, dtype=torch.uint8) if zeros else None)
        self.register_buffer("perm", torch.arange(in_features, dtype=torch.int32) if act_order else None)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int, symmetric: bool = True,
                    scale_dtype: torch.dtype = torch.float16) -> "Int4Linear":
        """`linear` quantised round-to-nearest per group (int4_gemm.quantize_weight)."""
        q, s, z = int4_gemm.quantize_weight(linear.weight.detach(), group, symmetric=symmetric, scale_dtype=scale_dtype)
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    zeros=not symmetric, scale_dtype=scale_dtype)
        layer.qweight.copy_(q)
        layer.scales.copy_(s)
        if z is not None:
            layer.zeros.copy_(z)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return layer.to(linear.weight.device).train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        w = torch.ops.metainfer.int4_dequantize(self.qweight, self.scales, self.zeros, self.group, x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros, self.perm)
                   if t is not None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
                f"zeros={self.zeros is not None}, act_order={self.perm is not None}, bias={self.bias is not None}")


def quantize_linears(model: nn.Module, group: int, symmetric: bool = True, skip=("lm_head",)) -> int:
    """Replace every nn.Linear of `model` (but those whose name ends in one of `skip`) by its
    Int4Linear, in place; returns how many."""
    import metainfer.kernels.ops  # noqa: F401  (registers metainfer::int4_dequantize)

    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not name.endswith(tuple(skip)) and m.in_features % int4_gemm.PACK == 0]
    for name, linear in targets:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                Int4Linear.from_linear(linear, group, symmetric=symmetric))
    return len(targets)
