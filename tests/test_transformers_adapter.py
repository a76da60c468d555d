"""Every touch of transformers' private API is in models/transformers_adapter.py, which refuses
a transformers release it was not tested with."""

import ast
import pathlib
import re
import warnings

import pytest
import transformers

from metainfer.models import transformers_adapter as hf
from metainfer.testing import defined_names

ROOT = pathlib.Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "models" / "transformers_adapter.py"
PACKAGE = [p for folder in ("metainfer", "passes", "lowering", "kernels", "models")
           for p in sorted((ROOT / folder).rglob("*.py"))]


def _transformers_private_names() -> set[str]:
    """Private names transformers defines (functions, attributes it sets, module names) in the
    modules metainfer drives: configs, models, caches, generation and continuous batching."""
    src = pathlib.Path(transformers.__file__).parent
    files = [*(src / "generation").rglob("*.py"), src / "modeling_utils.py", src / "configuration_utils.py",
             src / "cache_utils.py", src / "masking_utils.py"]
    names = set()
    for f in files:
        names |= set(re.findall(r"(?:\bdef |\bself\.|^\s*)(_[a-z]\w*)\b", f.read_text(), re.M))
    return names


def _ours(paths) -> set[str]:
    """Names metainfer itself defines (so `self._cache` of ours is not transformers')."""
    return {name for path in paths for name in defined_names(ast.parse(path.read_text()))}


def _reaches(path: pathlib.Path, theirs: set[str]) -> list[str]:
    """`obj._name`, getattr(obj, "_name") or `from transformers... import _name` of a name in
    `theirs`, and imports of transformers' continuous-batching internals."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = None
        if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant)):
            name = node.args[1].value
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
            if (node.module or "").startswith("transformers.generation.continuous_batching"):
                out.append(f"{path.name}:{node.lineno} imports {node.module}")
            out += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if a.name in theirs]
        if name in theirs:
            out.append(f"{path.name}:{node.lineno} {name}")
    return out


def test_no_module_but_the_adapter_reaches_transformers_private_names():
    theirs = _transformers_private_names() - _ours(PACKAGE)
    assert "_new_tokens_limit" in theirs and "_create_batch_processor" in theirs  # the scan sees them
    wrong = [r for path in PACKAGE if path != ADAPTER for r in _reaches(path, theirs)]
    assert not wrong, "\n".join(wrong)
    assert _reaches(ADAPTER, theirs), "the adapter's own reaches are seen"


def test_the_scan_sees_a_private_reach(tmp_path):
    fake = tmp_path / "engine_hook.py"
    fake.write_text("def f(state, manager):\n    manager._create_batch_processor = None\n"
                    "    return state._new_tokens_limit, getattr(state, '_eos_token_ids')\n")
    found = _reaches(fake, {"_new_tokens_limit", "_create_batch_processor", "_eos_token_ids"})
    assert len(found) == 3, found


def test_the_installed_version_is_a_tested_one_and_pyproject_asks_for_those():
    assert ".".join(transformers.__version__.split(".")[:2]) in hf.TESTED_VERSIONS
    pins = set(re.findall(r'"transformers([^"]*)"', (ROOT / "pyproject.toml").read_text()))
    lo, hi = hf.TESTED_VERSIONS[0], hf.TESTED_VERSIONS[-1]
    assert pins == {f">={lo},<{hi.split('.')[0]}.{int(hi.split('.')[1]) + 1}"}, pins


@pytest.mark.parametrize("version", ["4.57.1", "5.23.0", "6.0.0"])
def test_an_untested_version_is_refused_naming_the_tested_ones(version):
    with pytest.raises(hf.TransformersVersionError) as e:
        hf.check_version(version)
    words = str(e.value)
    assert f"transformers {version} is installed" in words and "5.24, 5.25" in words
    assert "transformers>=5.24,<5.26" in words and hf.UNTESTED_ENV in words
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        hf.check_version(version, allow_untested=True)
    assert any("running anyway" in str(w.message) for w in seen)
    hf.check_version("5.25.3")  # a patch release of a tested one


def test_child_request_ids_follow_the_engines_naming():
    """The ids the engine gives a request's extra sequences (transformers 5.25:
    continuous_batching/continuous_api.py, f"{request_id}__child#{i}" for i below the children)."""
    assert hf.child_request_ids("r", 3) == ["r", "r__child#0", "r__child#1"]
    assert hf.child_request_ids("r", 1) == ["r"]
