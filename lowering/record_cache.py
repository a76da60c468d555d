"""What the passes did to a graph, cached beside Inductor's compiled-graph cache.

When Inductor serves a compiled graph from its FX graph cache the passes never run, yet
the report must still say what they did. Records are stored per (pipeline uuid, Dynamo
graph, input shapes/dtypes, versions) under the metainfer cache directory:
METAINFER_CACHE_DIR, else ~/.cache/metainfer.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from metainfer.passes.manager import PassRecord

FORMAT = "1"


def cache_dir() -> Path:
    d = os.environ.get("METAINFER_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "metainfer"


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"T({x.dtype},{tuple(x.shape)},{tuple(x.stride())},{x.device.type})"
    return f"{type(x).__name__}({x!r})"


def key(pipeline_uuid: str, gm: torch.fx.GraphModule, example_inputs) -> str:
    h = hashlib.sha256()
    for part in (FORMAT, torch.__version__, pipeline_uuid, gm.code, *map(_describe, example_inputs)):
        h.update(str(part).encode())
        h.update(b"\0")
    return h.hexdigest()


def _path(k: str) -> Path:
    return cache_dir() / "records" / f"{k}.json"


def load(k: str) -> list[PassRecord] | None:
    try:
        data = json.loads(_path(k).read_text())
        return [PassRecord.from_dict(d) for d in data]
    except (OSError, ValueError, TypeError):
        return None


def store(k: str, records: list[PassRecord]) -> None:
    p = _path(k)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps([r.to_dict(with_graphs=True) for r in records]))
        tmp.replace(p)
    except OSError:
        pass  # a read-only home only costs a recompile on the next cache hit


def clear() -> int:
    """Remove every cached record; returns how many files were removed."""
    d = cache_dir() / "records"
    n = 0
    if d.is_dir():
        for f in d.glob("*.json"):
            f.unlink(missing_ok=True)
            n += 1
    return n
