"""Imports run one way: the user-facing API, CLI and report and the distributed runtime at the
top; then the passes and the lowering; then the hardware model (targets, cost, simulator,
planner). Read from the source with `ast`, every import counted (module level or inside a
function). A new top-level module of metainfer/ counts as the top layer until it is listed
below."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
HARDWARE_MODEL = {"targets", "cost", "simulate", "fxops", "shapes", "planner"}
MIDDLE = {"passes", "lowering", "kernels"}  # installed as metainfer.passes etc.
LEAVES = {"kernels", "models"}  # Triton kernels and model configs: anyone may read them


def _modules():
    for top in ("metainfer", *MIDDLE):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[0] != "metainfer":
                parts.insert(0, "metainfer")
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1].startswith("__"):
        return "root"  # the package itself (importing any of its modules runs it): its version
    if parts[1] in MIDDLE:
        return parts[1]
    if parts[1] in LEAVES:
        return "leaf"
    return "model" if parts[1] in HARDWARE_MODEL else "top"


def _imports(module: str, path: pathlib.Path) -> set[str]:
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            out |= {name} | {f"{name}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    # only modules of this package; "metainfer.passes.x.Name" -> its module
    return {".".join(n.split(".")[:3]) if _layer(n) in MIDDLE | {"leaf"} else ".".join(n.split(".")[:2])
            for n in out if n.startswith("metainfer.")}


ALLOWED = {  # layer -> the layers its modules may import
    "passes": {"root", "passes", "kernels", "model", "leaf"},  # not lowering: it depends on passes
    "lowering": {"root", "lowering", "passes", "kernels", "model", "leaf"},
    "kernels": {"root", "kernels", "leaf"},
    "model": {"root", "model", "kernels", "leaf"},  # cost asks kernels which CPU path an op takes
}


def test_imports_run_one_way():
    wrong = []
    for module, path in _modules():
        mine = _layer(module)
        for name in _imports(module, path):
            theirs = _layer(name)
            if mine in ALLOWED and theirs not in ALLOWED[mine]:
                wrong.append(f"{module} ({mine}) imports {name} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_no_two_layers_import_each_other():
    """No pair of layers in both directions (passes <-> lowering was one until the op registry,
    kernel configs, the serving pool and symmetric memory moved to kernels/)."""
    edges = set()
    for module, path in _modules():
        mine = _layer(module)
        edges |= {(mine, _layer(name)) for name in _imports(module, path)}
    # the package root re-exports the top layer's API (metainfer.optimize) and everything imports
    # the root: that pair is the package itself, not two layers
    both = {tuple(sorted(e)) for e in edges if e[0] != e[1] and (e[1], e[0]) in edges} - {("root", "top")}
    assert not both, sorted(both)


def test_the_check_sees_an_upward_import(tmp_path):
    """The rule can fail: a pass importing the API layer is caught."""
    fake = tmp_path / "p.py"
    fake.write_text("def f():\n    from metainfer.api import optimize\n")
    names = _imports("metainfer.passes.p", fake)
    assert names == {"metainfer.api"} and _layer("metainfer.api") not in ALLOWED["passes"]
