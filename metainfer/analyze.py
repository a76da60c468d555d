"""metainfer.analyze(): what optimize() would do to a model on a target, and how fast the
simulator predicts it runs there, without compiling or running anything.

The model may live on the `meta` device (built without allocating its weights, e.g.
`models.build("llama3-70b", device="meta")` or a Hugging Face model created under
`torch.device("meta")`), so real-size models are analysed on a laptop. The graphs are
captured as optimize() captures them (Dynamo, AOTAutograd with Inductor's decompositions),
the target's pipeline runs on them, and the report holds each pass's decisions and the
predicted time before and after it; nothing is lowered. Calling the captured graphs returns
empty `meta` tensors of the right shapes, which is all Dynamo needs to go on.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from metainfer.runtime.model_capture import capturable, translate
from metainfer.passes import PassManager, resolve
from metainfer.passes.options import resolve as resolve_options
from metainfer.lowering.section import GraphSection
from metainfer.report import Report


def analyze(model: torch.nn.Module, target="pcie8", *, example_inputs, passes: Iterable | None = None,
            disable: Iterable[str] = (), pass_options: dict | None = None, ranks: int | None = None,
            tensor_parallel: int | None = None, expert_parallel: bool | None = None) -> Report:
    """The report optimize(model, target, example_inputs=...) would give, with the simulator's
    predictions, from capture and passes alone: nothing is compiled or run, and the model and
    inputs may be on the `meta` device.

    ranks: analyse rank 0 of a job over the target's `ranks` devices from this one process
        (torch's fake process group): the model is sharded in place as optimize() would shard
        it inside the job (degrees from the planner, or `tensor_parallel` / `expert_parallel`),
        and the graph holds that rank's shapes and collectives."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if any(m.training for m in model.modules()):
        raise ValueError("model is in training mode; call model.eval() before metainfer.analyze")
    from metainfer.api import resolve_target

    t = resolve_target(target)
    if ranks is None:
        if tensor_parallel is not None or expert_parallel is not None:
            raise ValueError("tensor_parallel / expert_parallel need ranks= (the job analysed)")
        return _analyze(model, t, example_inputs, passes, disable, pass_options, [])
    if ranks != t.num_devices:
        raise ValueError(f"ranks={ranks!r}: target {t.name!r} has {t.num_devices} devices; analyse one rank of a "
                         "job over all of them")
    from metainfer.parallel import distributed

    with distributed.fake_job(ranks):
        t, notes = distributed.prepare(model, t, emulate=False, expert_parallel_on=expert_parallel,
                                       tensor_parallel=tensor_parallel)
        notes = [f"analysed as rank 0 of {ranks} in one process (torch's fake process group)"] + notes
        return _analyze(model, t, example_inputs, passes, disable, pass_options, notes)


def _analyze(model, t, example_inputs, passes, disable, pass_options, job_notes: list[str]) -> Report:
    from metainfer.api import _as_args

    chosen, disabled, explicit = resolve(t, passes, disable)
    report = Report(t, [p.name for p in chosen], notes=["analysis only: graphs captured and passed, "
                                                        "not compiled or run; times are the simulator's predictions"]
                    + job_notes)
    args, kwargs = _as_args(example_inputs)
    if _is_hf(model) and "use_cache" not in kwargs:
        # a KV cache transformers creates inside forward holds real (non-fake) empty tensors,
        # which Dynamo cannot trace on `meta`; one forward without a cache has the same layers
        kwargs["use_cache"] = False
        report.notes.append("analysis: Hugging Face model called with use_cache=False (no KV cache built)")
    backend = _AnalysisBackend(report, chosen, disabled, explicit, pass_options)
    with torch.no_grad(), capturable(model) as notes, torch._dynamo.config.patch(
            recompile_limit=1 << 20, accumulated_recompile_limit=1 << 20):
        try:
            torch.compile(model.forward, backend=backend, dynamic=False)(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:
            raise translate(e, model, args, kwargs, report.target.name) from e
    report.notes.extend(n for n in notes if n not in report.notes)
    if not report.sections:
        raise RuntimeError("torch.compile did not hand any graph to metainfer.analyze")
    return report


def _is_hf(model) -> bool:
    import sys

    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


class _AnalysisBackend:
    def __init__(self, report: Report, passes, disabled, explicit: bool, options):
        self.report, self.passes, self.disabled, self.explicit = report, passes, disabled, explicit
        self.options = dict(options or {})
        resolve_options(report.target, self.options, passes)  # a bad option fails before any capture

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        from metainfer.lowering.capture import post_grad
        from metainfer.lowering.backend import graph_input_labels

        section = GraphSection(index=len(self.report.sections), inputs=graph_input_labels(gm, example_inputs),
                               lowering="none (analysis)")

        def run_passes(fx_gm: torch.fx.GraphModule):
            manager = PassManager(self.passes, self.report.target, disabled=self.disabled, explicit=self.explicit,
                                  options=self.options, graph_index=section.index)
            manager(fx_gm.graph)
            section.records, section.schedule = manager.records, manager.schedule
            section.simulation_error = manager.simulation_error
            self.report.sections.append(section)
            return _empty_outputs(fx_gm)

        return post_grad(gm, example_inputs, run_passes)


def _concrete(x) -> int:
    from metainfer.hardware.cost import size_hint

    return int(size_hint(x))


def _empty_outputs(gm: torch.fx.GraphModule):
    """A stand-in for the compiled graph: meta tensors with the outputs' shapes and strides."""
    outs = gm.graph.output_node().args[0]

    def make(v):
        if isinstance(v, torch.fx.Node):
            v = v.meta.get("val")
        if isinstance(v, torch.Tensor):
            return torch.empty_strided([_concrete(s) for s in v.shape], [_concrete(s) for s in v.stride()],
                                       dtype=v.dtype, device="meta")
        if isinstance(v, torch.SymInt):
            return _concrete(v)
        return v

    def run(*args):
        return [make(o) for o in outs]

    return run
