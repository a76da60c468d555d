"""metainfer.load: a local Hugging Face model folder, quantized checkpoints kept quantized."""

from __future__ import annotations

from pathlib import Path

import torch


def load(folder: "str | Path", target=None, *, dtype: torch.dtype | None = None, device: "str | None" = None,
         attn: str = "sdpa"):
    """The causal LM in `folder` (config.json and safetensors), its FP8 / int4 linears held in their
    stored precision by metainfer's quantized layers (see metainfer.models.checkpoint for the
    formats). `target` (a name, TOML path or Target) places it: on a CUDA target's GPU (this
    process's LOCAL_RANK), else on the CPU; `device` overrides. `dtype`: the unquantized tensors'
    (default: the config's). Then `metainfer.optimize(model, target)` turns the dequantise +
    linear forms into metainfer::fp8_linear / int4_linear."""
    import os

    from metainfer.models.checkpoint import load as load_checkpoint

    from .hardware import targets

    if device is None:
        kind = targets.get(target).device.kind if target is not None else "cpu"
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if kind == "cuda" else "cpu"
    return load_checkpoint(folder, dtype=dtype, device=device, attn=attn)
