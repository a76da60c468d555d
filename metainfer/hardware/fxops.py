"""Naming the ops of an FX graph of ATen: the vocabulary the cost model, the simulator and
the passes share (each used to spell it its own way)."""

from __future__ import annotations

import torch

# ops that alias their input (views, size reads, getitem): no kernel, no bytes of their own
VIEW_NAMES = {"view", "reshape", "_unsafe_view", "permute", "expand", "slice", "select", "unsqueeze", "squeeze", "t",
              "transpose", "alias", "detach", "as_strided", "split", "split_with_sizes", "unbind", "sym_size",
              "sym_numel", "sym_stride", "getitem"}


def op_name(node: torch.fx.Node) -> tuple[str, str]:
    """(namespace, op name) of a call_function node: ("aten", "mm"), ("metainfer", "attention"),
    ("python", "getitem") for a Python callable."""
    packet = getattr(node.target, "overloadpacket", None)
    name = getattr(packet, "__name__", getattr(node.target, "__name__", str(node.target)))
    ns = getattr(packet, "_qualified_op_name", "aten::x").split("::")[0] if packet is not None else "python"
    return ns, name


def spec_of(node: torch.fx.Node):
    """The declaration (kernels/spec.py OpSpec) of the metainfer op a node calls; None for any
    other node."""
    ns, name = op_name(node)
    if ns != "metainfer":
        return None
    from metainfer.kernels import spec  # (loads the kernel files: only where a metainfer op is met)

    return spec.spec_for(name)


def is_c10d(node: object) -> bool:
    """A functional collective of torch.distributed, or its wait: what a sharded graph holds."""
    packet = getattr(getattr(node, "target", None), "overloadpacket", None)
    return packet is not None and getattr(packet, "_qualified_op_name", "").startswith("_c10d_functional::")
