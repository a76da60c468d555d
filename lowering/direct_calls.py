"""Inductor's wrapper calls metainfer's ops as plain Python functions, not through the dispatcher.

Inductor emits an opaque op as `buf = torch.ops.metainfer.<op>.default(...)`: every call then
goes through the dispatcher, which parses each argument against the op's schema, boxes it,
and converts it back to a Python object for the implementation (~3 us a call for attention's
ten arguments, measured by bench/launch_overhead.py; a decode step pays it per op per layer).
The implementation is a Python function (kernels/ops.py keeps each one as `ops.direct.<op>`),
so the wrapper may call it directly: same arguments, same outputs, the same size/stride
asserts after it. Registered through Inductor's per-op extern-kernel codegen table; a torch
without that table keeps the dispatcher (correct, slower).
"""

from __future__ import annotations

import copy

from metainfer.kernels import ops

_IMPORT = "from metainfer.kernels.ops import direct as metainfer_direct"


def _registry():
    try:
        from torch._inductor.codegen.custom_extern_kernel_codegen import (CUSTOM_EXTERN_KERNEL_CODEGEN,
                                                                           CustomCodegen)
    except ImportError:  # older torch: no per-op codegen table
        return None, None
    return CUSTOM_EXTERN_KERNEL_CODEGEN, CustomCodegen


def _direct_call(name: str):
    def codegen(node, writeline) -> None:
        from torch._inductor.codegen.wrapper import ExternKernelAllocLine
        from torch._inductor.virtualized import V

        wrapper = V.graph.wrapper_code
        wrapper.add_import_once(_IMPORT)
        # the line calls its node's python_kernel_name: a shallow copy names the plain function, the
        # IR node itself keeps the op's name (a second codegen of it finds this table again)
        call = copy.copy(node)
        call.python_kernel_name = f"metainfer_direct.{name}"
        writeline(ExternKernelAllocLine(wrapper, call))

    return codegen


def register() -> list[str]:
    """Route every op of kernels/ops.py that Inductor would call through the dispatcher to its
    plain function; the op names registered (none on a torch without the table)."""
    table, CustomCodegen = _registry()
    if table is None:
        return []
    names = sorted(vars(ops.direct))
    for name in names:
        table[f"torch.ops.metainfer.{name}.default"] = CustomCodegen(python=_direct_call(name))
    return names


REGISTERED = register()
