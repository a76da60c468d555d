"""Lowering: the Dynamo/Inductor backend, metainfer's custom ops, per-target kernel configs.

`ops` registers torch.ops.metainfer.*; `backend` holds the Dynamo backend (imported on
demand: it pulls in the passes, which themselves insert these ops).
"""

from . import kernel_configs, ops, symm_mem  # noqa: F401

__all__ = ["kernel_configs", "ops"]
