"""Pass options are declared by the passes that read them, merged once (defaults, the target's
[passes] table, then pass_options=), checked, hashed into the manager's uuid and listed."""

import ast
import pathlib

import pytest
import torch

import metainfer
from metainfer import passes
from metainfer.hardware import targets
from metainfer.passes import PassManager, get_pass
from metainfer.passes.options import MANAGER_OPTIONS, Option, OptionError, declared, resolve
from metainfer.testing import tiny_hf_model

PASSES_DIR = pathlib.Path(passes.__file__).resolve().parent


def _keys_read(path: pathlib.Path) -> set[str]:
    """The option names a module reads: `<...>.options["name"]` or `.options.get("name")`."""
    keys = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "options" and isinstance(node.slice, ast.Constant)):
            keys.add(node.slice.value)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "options"
                and node.args and isinstance(node.args[0], ast.Constant)):
            keys.add(node.args[0].value)
    return keys


def test_every_option_a_pass_reads_is_declared():
    read = {key for path in PASSES_DIR.glob("*.py") for key in _keys_read(path)}
    assert read, "the scan found no option reads: it no longer sees how passes read them"
    assert read <= set(declared()), sorted(read - set(declared()))


def test_each_declaration_belongs_to_one_owner_and_checks_its_default():
    for name, (option, owner) in declared().items():
        assert option.doc and owner, name
        assert option.check(option.default, "default") == option.default, name


def test_the_scan_sees_an_undeclared_read(tmp_path):
    fake = tmp_path / "p.py"
    fake.write_text("def run(g, ctx):\n    return ctx.options['chunks'], ctx.options.get('fp8_mode')\n")
    assert _keys_read(fake) == {"chunks", "fp8_mode"}


def test_defaults_then_the_targets_table_then_pass_options():
    base = targets.get("cpu")
    assert resolve(base, None)["fp8_mode"] == "w8a16"
    import dataclasses

    t = dataclasses.replace(base, pass_options={"fp8_mode": "w8a8", "cost_gates": False})
    merged = resolve(t, {"cost_gates": True})
    assert merged["fp8_mode"] == "w8a8" and merged["cost_gates"] is True
    with pytest.raises(TypeError):
        merged["fp8_mode"] = "w8a16"  # read-only: a pass cannot change what the next one reads


@pytest.mark.parametrize("given, words", [
    ({"fp8mode": "w8a8"}, ["unknown pass option 'fp8mode'", "did you mean 'fp8_mode'", "fp8_mode (fp8_gemm)",
                           "cost_gates (the pass manager)"]),
    ({"fp8_mode": "w4a4"}, ["fp8_mode must be one of ('w8a16', 'w8a8'), got 'w4a4'"]),
    ({"cost_gates": "no"}, ["cost_gates must be true or false, got 'no'"]),
    ({"pipeline_chunks": 3}, ["pipeline_chunks must be one of (1, 2, 4, 8)"]),
    ({"pipeline_chunks": True}, ["pipeline_chunks must be an integer (or unset)"]),
    ({"overlap_memory_bytes": -1}, ["overlap_memory_bytes must be a non-negative number (or unset)"]),
])
def test_a_bad_option_is_refused_by_optimize_before_anything_compiles(given, words):
    m = tiny_hf_model("Llama", "sdpa", layers=1)
    with pytest.raises(OptionError) as e:
        metainfer.optimize(m, "cpu", pass_options=given)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_bad_key_in_the_targets_table_names_the_target():
    import dataclasses

    t = dataclasses.replace(targets.get("cpu"), name="mine", pass_options={"two_batch": True})
    with pytest.raises(OptionError, match=r"target 'mine' \[passes\]: unknown pass option 'two_batch' "
                                          r"\(did you mean 'two_batch_overlap'\?\)"):
        PassManager([get_pass("fuse_rmsnorm")], t)


def test_an_unregistered_pass_may_declare_options():
    class Counting(passes.Pass):
        name = "counting"
        options = (Option("counting_limit", int, 4, "how many to count", minimum=1),)

        def run(self, graph, ctx):
            return passes.PassResult(modified=False, decisions=[str(ctx.options["counting_limit"])])

    t = targets.get("cpu")
    mgr = PassManager([Counting()], t, explicit=True, options={"counting_limit": 7})
    g = torch.fx.Graph()
    g.output(g.placeholder("x"))
    mgr(g)
    assert mgr.records[0].decisions == ["7"]
    with pytest.raises(OptionError, match="counting_limit must be an integer of at least 1"):
        PassManager([Counting()], t, options={"counting_limit": 0})
    with pytest.raises(OptionError, match="declared twice"):
        PassManager([Counting(), type("Other", (Counting,), {"name": "other", "options": (
            Option("counting_limit", int, 5, "another default"),)})()], t)


def test_the_uuid_tracks_the_resolved_options():
    import dataclasses

    t = targets.get("cpu")
    fa = [get_pass("fuse_attention")]
    plain = PassManager(fa, t).uuid()
    assert plain == PassManager(fa, t, options={"fp8_mode": "w8a16"}).uuid()  # the default, spelled out
    assert plain != PassManager(fa, t, options={"fp8_mode": "w8a8"}).uuid()
    # the same value from the target's table or from pass_options is the same pipeline on that target
    tt = dataclasses.replace(t, pass_options={"fp8_mode": "w8a8"})
    assert PassManager(fa, tt).uuid() == PassManager(fa, tt, options={"fp8_mode": "w8a8"}).uuid()


def test_metainfer_passes_lists_every_declared_option(capsys):
    from metainfer.cli import main

    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    for name, (option, _) in declared().items():
        assert f"option {name} ({option.kind.__name__}" in out, name
    assert {o.name for o in MANAGER_OPTIONS} <= set(declared())
