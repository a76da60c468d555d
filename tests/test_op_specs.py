"""Every op registered in the `metainfer` namespace has one complete declaration in its kernel
file (kernels/spec.py): a FLOP formula the cost model prices it by, its layout over the batch
and the tokens, and, where a Triton kernel runs it, that kernel with its config rows and
ahead-of-time cases. The ops are taken from the dispatcher, not from the declarations."""

import math
import pathlib
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from metainfer import kernels
from metainfer.hardware import cost, targets
from metainfer.kernels import configs, ops, spec  # ops: registers every op
from metainfer.lowering import aot


def registered_ops() -> list[str]:
    return sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("metainfer::"))


OPS = registered_ops()
PEAK_KEYS = ("fp32", "bf16", "fp16", "fp8")


def test_the_dispatcher_and_the_declarations_name_the_same_ops():
    assert len(OPS) >= 19 and set(ops.__all__) < set(OPS)  # and the shm_* / symm_mem collectives
    assert sorted(s.name for s in spec.specs()) == OPS


def _fake_call(name):
    """The op's example arguments as fake tensors, and its outputs from its fake."""
    declared = spec.spec_for(name)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in declared.example()]
        out = getattr(torch.ops.metainfer, name).default(*args)
    return args, list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("name", OPS)
def test_the_flop_formula_gives_finite_non_negative_numbers(name):
    declared = spec.spec_for(name)  # (its kind and collective are checked when it is declared)
    args, outs = _fake_call(name)
    flops, key = declared.flops(args, outs)
    assert math.isfinite(flops) and flops >= 0
    assert key is None or key in PEAK_KEYS
    if declared.cpu_work is not None:
        extra = declared.cpu_work(args, {})
        assert extra is None or all(math.isfinite(v) and v >= 0 for v in extra)
    if declared.experts is not None:
        assert 1 <= declared.experts(args) < math.inf


@pytest.mark.parametrize("name", OPS)
def test_the_cost_model_prices_the_op_from_its_declaration(name):
    """One call in a graph, as a pass leaves it, priced on a CPU and on a GPU target."""
    args, outs = _fake_call(name)
    graph = torch.fx.Graph()
    nodes = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            p = graph.placeholder(f"a{i}")
            p.meta["val"] = a
            nodes.append(p)
        else:
            nodes.append(a)
    call = graph.call_function(getattr(torch.ops.metainfer, name).default, tuple(nodes))
    call.meta["val"] = outs[0] if len(outs) == 1 else tuple(outs)
    declared = spec.spec_for(name)
    for target in ("cpu", "pcie8"):
        c = cost.op_cost(call, targets.get(target))
        assert all(math.isfinite(v) and v >= 0 for v in (c.flops, c.bytes, c.seconds)), (target, c)
        assert c.bytes > 0
        # the FLOPs it declares are the ones priced (a CPU path of its own may do other work)
        if declared.flops is not spec.by_bytes and not (target == "cpu" and declared.cpu_work):
            assert c.flops == declared.flops(args, outs)[0]
        assert c.priced_by_bytes == (declared.flops is spec.by_bytes)


def _tensor_arguments(name) -> set[int]:
    schema = getattr(torch.ops.metainfer, name).default._schema
    return {i for i, a in enumerate(schema.arguments) if "Tensor" in str(a.type)}


@pytest.mark.parametrize("name", OPS)
def test_the_layout_is_declared_and_names_tensor_arguments(name):
    layout = spec.spec_for(name).layout
    assert isinstance(layout, spec.Layout)
    assert layout.kind in (spec.ROWS, spec.BROADCAST, spec.BATCH_FIRST, spec.OPAQUE)
    named = set(layout.args) | ({layout.mask} if layout.mask is not None else set())
    assert named <= _tensor_arguments(name)
    assert bool(layout.args) == (layout.kind != spec.OPAQUE)
    assert not layout.token_wise or layout.kind == spec.ROWS


def test_the_config_table_holds_the_declared_kernels_and_every_triton_file_declares_one():
    declared = tuple(k.name for k in spec.kernel_specs())  # (configs.KERNELS and the AOT table list these)
    assert {s.kernel.name for s in spec.specs() if s.kernel} <= set(declared)
    folder = pathlib.Path(kernels.__file__).parent
    triton_files = {p.stem for p in folder.glob("*.py")
                    if not p.stem.startswith("_") and re.search(r"^@triton\.jit", p.read_text(), re.M)}
    assert triton_files == set(declared)
    for k in spec.kernel_specs():
        configs.config_for_arch(k.name, "interpreter")
        configs.config_for_arch(k.name, "sm_90", head_dim=128, dtype=torch.bfloat16)
        cases = k.aot_cases()
        assert cases and all(isinstance(case, str) and callable(call) for case, call in cases)


@pytest.mark.skipif(not kernels.INTERPRETED, reason="records the interpreted kernels' launches")
@pytest.mark.parametrize("name", OPS)
def test_the_declared_kernel_is_the_one_the_op_launches(name):
    """Run on its example with the Triton kernels recorded, not run (lowering/aot.py): an op
    that declares a kernel launches it; one that declares none launches nothing (an op that
    cannot run here, needing a serving step's pool, a process group or a GPU, is not checked)."""
    declared = spec.spec_for(name)
    op = getattr(torch.ops.metainfer, name).default
    with kernels.interpret(True), aot._recording(89, names_only=True) as launches:
        try:
            op(*declared.example())
        except Exception:  # noqa: BLE001
            if declared.kernel is not None:
                raise
            return
    modules = {launched.split(".")[0] for launched in launches}
    if declared.kernel is None:
        assert not modules
    else:
        assert declared.kernel.name in modules, modules
