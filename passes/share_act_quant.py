"""W8A8 linears reading one input quantise it once: a pass over metainfer's own ops.

In W8A8 mode (pass option fp8_mode="w8a8") each `metainfer::fp8_linear` quantises its input x
to e4m3 itself, per row and per group of block_k features. A layer's q/k/v projections, its
gate and up projections, and MLA's query and KV down-projections each read one x, so the layer
quantised that x two or three times, the same way. This pass quantises it once and hands the
result to every linear:

    y_i = fp8_linear(x, w_i, s_i, b_i, block_n_i, block_k, act_quant=True)      for i in 1..n
 -> (x_fp8, x_scale) = fp8_quantize_activations(x, block_k)
    y_i = fp8_linear_quantized(x, x_fp8, x_scale, w_i, s_i, b_i, block_n_i, block_k)

The outputs are the same bit for bit (the quantisation is one deterministic function of x;
tests/test_kernel_fp8_gemm.py). Linears with another block_k quantise in other groups: each
block_k shared by two or more linears gets a quantisation of its own. It runs after fp8_gemm,
which writes the linears it reads.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from types import SimpleNamespace

import torch
from torch.fx import Node

from .base import MatchPass, NearMiss, register
from .matching import arg, insert_call, is_op, is_reshape, location, order, shape

FP8_LINEAR = torch.ops.metainfer.fp8_linear.default


class NotShared(NearMiss):
    pass


def _w8a8_reader(user: Node, x: Node) -> bool:
    """A W8A8 fp8_linear whose activation input is x."""
    return is_op(user, FP8_LINEAR) and arg(user, 0, "x") is x and arg(user, 6, "act_quant") is True


def _readers(node: Node) -> list[Node]:
    """The W8A8 linears reading `node`, directly or through a reshape of it (each linear of a 3-D
    input reads a 2-D view of its own: equal views of one node are one value)."""
    views = [node] + [u for u in node.users if is_reshape(u) and arg(u, 0, "self") is node]
    return [u for v in views for u in v.users if _w8a8_reader(u, v)]


@register
class ShareActQuant(MatchPass):
    """n W8A8 fp8_linear(x) -> metainfer::fp8_quantize_activations(x) once + n metainfer::fp8_linear_quantized"""

    name = "share_act_quant"
    missed = "activation quantisation not shared"
    misses = (NotShared,)

    def start(self, graph, ctx):
        # positions of the nodes there now: sites only ever compare those (the linears)
        return SimpleNamespace(graph=graph, ctx=ctx, position=order(graph))

    def match(self, node: Node, state) -> dict[tuple, list[Node]] | None:
        """The site is the input x: its W8A8 linear readers by (the shape they read it in, block_k),
        where two or more read it alike."""
        readers = _readers(node)
        if len(readers) < 2:
            return None
        if is_reshape(node) and set(readers) <= set(_readers(arg(node, 0, "self"))):
            return None  # the node it views finds the same readers: one site, reported once
        alike: dict[tuple, list[Node]] = defaultdict(list)
        for u in readers:
            alike[(str(list(shape(arg(u, 0, "x")))), arg(u, 5, "block_k"))].append(u)
        shared = {key: users for key, users in alike.items() if len(users) >= 2}
        if not shared:
            groups = sorted({block_k for _, block_k in alike})
            raise NotShared(f"its {len(readers)} W8A8 linears quantise in different groups "
                            f"({', '.join(map(str, groups))} features) or read different shapes of it")
        return shared

    def rewrite(self, node: Node, site: dict[tuple, list[Node]], state) -> None:
        graph = state.graph
        for (_, block_k), linears in site.items():
            first = min(linears, key=state.position.__getitem__)  # quantise just before the first reader,
            x = arg(first, 0, "x")  # the view it reads, which comes before every later reader
            pair = insert_call(graph, first, torch.ops.metainfer.fp8_quantize_activations.default, (x, block_k))
            x_fp8 = insert_call(graph, first, operator.getitem, (pair, 0))
            x_scale = insert_call(graph, first, operator.getitem, (pair, 1))
            for lin in linears:
                new = insert_call(graph, lin, torch.ops.metainfer.fp8_linear_quantized.default,
                                  (x, x_fp8, x_scale, arg(lin, 1, "weight"), arg(lin, 2, "scale_inv"),
                                   arg(lin, 3, "bias"), arg(lin, 4, "block_n"), block_k))
                lin.replace_all_uses_with(new)
                graph.erase_node(lin)

    def describe(self, node: Node, site: dict[tuple, list[Node]]) -> str:
        parts = [f"{len(linears)} W8A8 linears quantise {node.name} once (groups of {block_k})"
                 for (_, block_k), linears in sorted(site.items(), key=lambda kv: kv[0][1])]
        saved = sum(len(linears) - 1 for linears in site.values())
        return f"{location(node)}: {'; '.join(parts)}: {saved} activation quantisation(s) fewer"
