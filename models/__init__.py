"""Reference models in plain PyTorch ("community day-0" style) and their configs.

    model = metainfer.models.build("llama-tiny")
    inputs = metainfer.models.example_inputs("llama-tiny", batch=2, seq=16)
"""

from __future__ import annotations

import torch

from . import deepseek, llama

_FAMILIES = {**{name: llama for name in llama.CONFIGS}, **{name: deepseek for name in deepseek.CONFIGS}}


def names() -> list[str]:
    return list(_FAMILIES)


def config(name: str):
    if name not in _FAMILIES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(names())}")
    return _FAMILIES[name].CONFIGS[name]


def build(name: str, *, dtype=torch.float32, device="cpu", seed: int = 0, **overrides) -> torch.nn.Module:
    config(name)
    return _FAMILIES[name].build(name, dtype=dtype, device=device, seed=seed, **overrides)


def example_inputs(name: str, batch: int = 1, seq: int = 32, device="cpu", seed: int = 0):
    return _FAMILIES[name].example_inputs(config(name), batch=batch, seq=seq, device=device, seed=seed)


__all__ = ["llama", "deepseek", "names", "config", "build", "example_inputs"]
