"""Where compiled artifacts live, so a second optimize() in a fresh process reuses the first's.

One directory holds everything metainfer's compilations write:

    <root>/inductor/   Inductor's FX graph and AOTAutograd caches, compiled C++/Triton code
                       (metainfer sets TORCHINDUCTOR_CACHE_DIR to it when it compiles, and
                       leaves it there: other torch.compile calls in the process share it)
    <root>/records/    what the passes did to each graph (JSON), for graphs Inductor serves
                       from its cache without running the passes
    <root>/serving/    measured compile times of serving graphs (metainfer.runtime.serve_compile)

<root> is, in order: the `cache_dir=` given to optimize(), $METAINFER_CACHE_DIR, or
~/.cache/metainfer. Inductor's cache stays valid because the PassManager's uuid() is stable
and changes with any pass's source, the pipeline, the options or the target. Records are keyed
by that uuid, the Dynamo graph's code, its inputs' dtypes/shapes/strides (symbols where the graph
has them) and the torch/triton/metainfer versions.
`clear()` (or `metainfer cache clear`) removes all three.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from metainfer.passes.manager import PassRecord

FORMAT = "3"
PARTS = ("records", "inductor", "serving")


def cache_dir(explicit: "str | os.PathLike | None" = None) -> Path:
    """The cache root: `explicit`, else $METAINFER_CACHE_DIR, else ~/.cache/metainfer."""
    if explicit is not None:
        return Path(explicit).expanduser().resolve()
    d = os.environ.get("METAINFER_CACHE_DIR")
    return (Path(d).expanduser() if d else Path.home() / ".cache" / "metainfer").resolve()


def point_inductor_at(root: Path) -> None:
    """Make <root>/inductor Inductor's cache directory (TORCHINDUCTOR_CACHE_DIR) from now on
    in this process. Switching clears Inductor's memoised paths, so it is done only when the
    directory changes, and left in place for the next compile."""
    from torch._inductor.utils import clear_caches

    d = str(root / "inductor")
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != d:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
        clear_caches()


def point_triton_at(root: Path) -> Path | None:
    """On a CUDA GPU, make <root>/triton/<GPU name>-<driver> Triton's cache directory
    (compiled kernels and autotune timings: a timing is only valid for the GPU and driver that
    measured it; Triton's own key adds the kernel source and the config list). None off a GPU."""
    import re

    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    driver = getattr(torch._C, "_cuda_getDriverVersion", lambda: 0)()
    d = root / "triton" / re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{name}-driver{driver}")
    if os.environ.get("TRITON_CACHE_DIR") != str(d):
        os.environ["TRITON_CACHE_DIR"] = str(d)
        try:  # Triton >= 3.3 reads its knobs at access; older ones the variable
            import triton

            triton.knobs.cache.dir = str(d)
        except (ImportError, AttributeError):
            pass
    return d


def _versions() -> tuple[str, ...]:
    import triton

    from metainfer import __version__

    return torch.__version__, triton.__version__, __version__


def key(pipeline_uuid: str, gm: torch.fx.GraphModule, input_specs: list[str]) -> str:
    """The record key: versions, pipeline uuid, the Dynamo graph's code and its inputs'
    dtype/shape/strides (symbols where the graph has them)."""
    h = hashlib.sha256()
    for part in (FORMAT, *_versions(), pipeline_uuid, gm.code, *input_specs):
        h.update(str(part).encode())
        h.update(b"\0")
    return h.hexdigest()


def _path(root: Path, k: str) -> Path:
    return root / "records" / f"{k}.json"


def load(root: Path, k: str) -> list[PassRecord] | None:
    try:
        data = json.loads(_path(root, k).read_text())
        return [PassRecord.from_dict(d) for d in data]
    except (OSError, ValueError, TypeError):
        return None


def store(root: Path, k: str, records: list[PassRecord]) -> None:
    p = _path(root, k)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps([r.to_dict(with_graphs=True) for r in records]))
        tmp.replace(p)
    except OSError:
        pass  # a read-only cache only costs a recompile on the next cache hit


def info(root: "str | os.PathLike | None" = None) -> dict:
    """What the cache holds: its root, and files and bytes per part."""
    r = cache_dir(root)
    out = {"root": str(r)}
    for part in PARTS:
        files = [f for f in (r / part).rglob("*") if f.is_file()] if (r / part).is_dir() else []
        out[part] = {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}
    return out


def clear(root: "str | os.PathLike | None" = None, parts=None) -> int:
    """Remove what metainfer cached under the root (every part by default); returns how many
    files went."""
    parts = PARTS if parts is None else parts
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown cache parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    r = cache_dir(root)
    n = 0
    for part in parts:
        d = r / part
        if d.is_dir():
            n += sum(1 for f in d.rglob("*") if f.is_file())
            shutil.rmtree(d, ignore_errors=True)
    if "inductor" in parts:
        # Inductor's memoised paths point at files just removed
        from torch._inductor.utils import clear_caches

        clear_caches()
    return n
