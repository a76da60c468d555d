"""Imports run one way, and the folders are the layers. From the top down:

    metainfer/*.py        the user-facing top: API, CLI, report, verification, analysis, calibration
    metainfer/server/     the HTTP server: OpenAI protocol, the engine seen from the event loop, metrics
    metainfer/runtime/    what runs when an optimized model is called: input guard, serving, speculation
    metainfer/parallel/   the multi-rank runtime: sharding, distributed setup, local rank launcher
    lowering/             the Dynamo/Inductor backend
    passes/               the graph passes and their manager
    metainfer/hardware/   targets, cost model, simulator, shapes, planner
    models/               reference models and configs (an FP8 model quantises with a kernel's helper)
    kernels/              Triton kernels, the op registry, kernel configs

A module may import its own layer and any layer below it, never one above; read from the
source with `ast`, every import counted (module level or inside a function). A layer is a
folder: a new module is placed by where it is saved, not by a list in this file."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# metainfer.passes etc. are installed from top-level folders (pyproject's package-dir)
INSTALLED_FROM = {"passes": "passes", "lowering": "lowering", "kernels": "kernels", "models": "models"}
ORDER = ["top", "server", "runtime", "parallel", "lowering", "passes", "hardware", "models", "kernels"]
# parallel and lowering sit side by side: each depends on passes, neither on the other
SIDE_BY_SIDE = {("parallel", "lowering"), ("lowering", "parallel")}


def _modules():
    for path in sorted((ROOT / "metainfer").rglob("*.py")):
        yield _name(path.relative_to(ROOT).parts), path
    for folder in INSTALLED_FROM.values():
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield _name(("metainfer",) + path.relative_to(ROOT).parts), path


def _name(parts) -> str:
    parts = list(parts)
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    """The layer of a module, from its folder (metainfer.<folder>.x) or, directly in
    metainfer/, the top; the package itself (which importing any of its modules runs) is root."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1].startswith("__"):
        return "root"
    if parts[1] in INSTALLED_FROM or parts[1] in ORDER:
        return parts[1]
    return "top"


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
    return {n for n in out if n == "metainfer" or n.startswith("metainfer.")}


def _may_import(mine: str, theirs: str) -> bool:
    if mine == theirs or theirs == "root" or mine in ("root", "top"):
        return True
    if theirs == "top":
        return False
    return (mine, theirs) not in SIDE_BY_SIDE and ORDER.index(theirs) > ORDER.index(mine)


def _edges():
    for module, path in _modules():
        for name in _imports(module, path):
            yield module, _layer(module), name, _layer(name)


def test_every_module_is_in_a_layer():
    layers = {_layer(m) for m, _ in _modules()}
    assert layers <= set(ORDER) | {"root"}, layers
    assert set(ORDER) <= layers, set(ORDER) - layers  # a renamed folder must be renamed here too


def test_imports_run_one_way():
    wrong = [f"{m} ({mine}) imports {n} ({theirs})" for m, mine, n, theirs in _edges()
             if not _may_import(mine, theirs)]
    assert not wrong, "\n".join(wrong)


def test_no_two_layers_import_each_other():
    """No pair of layers in both directions. The package root is not a layer: importing any
    module runs it, and it re-exports the API (lazily) and the target registry."""
    edges = {(mine, theirs) for _, mine, _, theirs in _edges() if mine != theirs and "root" not in (mine, theirs)}
    both = {tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges}
    assert not both, sorted(both)


def test_the_root_loads_only_the_target_registry():
    """`import metainfer` (and `metainfer --help`) loads the target registry and nothing else
    of the package: the rest is imported on first use."""
    eager = {name for node in ast.parse((ROOT / "metainfer" / "__init__.py").read_text()).body
             if isinstance(node, ast.ImportFrom) and node.level for name in
             [".".join(filter(None, [node.module, a.name])) for a in node.names]}
    assert eager == {"hardware.targets"}, eager


def test_the_check_sees_an_upward_import(tmp_path):
    """The rule can fail: a pass importing the API layer, or the hardware model importing the
    runtime, is caught."""
    fake = tmp_path / "p.py"
    fake.write_text("def f():\n    from metainfer.api import optimize\n    from metainfer.runtime import serving\n")
    names = _imports("metainfer.passes.p", fake)
    assert names == {"metainfer.api", "metainfer.api.optimize", "metainfer.runtime", "metainfer.runtime.serving"}
    assert not _may_import("passes", _layer("metainfer.api"))
    assert not _may_import("hardware", _layer("metainfer.runtime.serving"))
    assert _may_import("runtime", _layer("metainfer.hardware.planner"))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_definitions(tree: ast.AST) -> set[str]:
    """The private names a module defines (metainfer.testing.defined_names)."""
    from metainfer.testing import defined_names

    return {n for n in defined_names(tree) if _private(n)}


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_reaches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every private attribute read or set on something other than self/cls
    or another package (`torch._check`), and every private name imported from a metainfer module."""
    foreign = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
               for a in node.names if not a.name.startswith("metainfer")}
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr)
                and _root_name(node.value) not in {"self", "cls"} | foreign):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("metainfer")):
            out += [(node.lineno, a.name) for a in node.names if _private(a.name)]
    return out


def _cross_layer_private(modules) -> list[str]:
    trees = [(module, _layer(module), ast.parse(path.read_text())) for module, path in modules]
    owners: dict[str, set[str]] = {}
    for _, layer, tree in trees:
        for name in _private_definitions(tree):
            owners.setdefault(name, set()).add(layer)
    wrong = []
    for module, layer, tree in trees:
        for line, name in _private_reaches(tree):
            theirs = owners.get(name, set())
            if theirs and layer not in theirs:  # names no layer of ours defines are torch's, transformers'
                wrong.append(f"{module}:{line} reaches {name} of {'/'.join(sorted(theirs))}")
    return wrong


def test_no_layer_reaches_another_layers_private_attributes():
    """A layer uses another through its public names: a private attribute (`opt._backend`) is
    its own layer's business. Read from the source: `x._name` where only other layers define
    `_name`, or `from ... import _name` of theirs."""
    wrong = _cross_layer_private(_modules())
    assert not wrong, "\n".join(wrong)


def test_the_private_check_sees_a_reach(tmp_path):
    """The rule can fail: the runtime reading a private attribute the API layer sets."""
    top, runtime = tmp_path / "api.py", tmp_path / "serving.py"
    top.write_text("class M:\n    def __init__(self):\n        self._backend = 1\n")
    runtime.write_text("def f(opt):\n    return opt._backend, opt.public\n")
    wrong = _cross_layer_private([("metainfer.api", top), ("metainfer.runtime.serving", runtime)])
    assert wrong == ["metainfer.runtime.serving:2 reaches _backend of top"], wrong
