"""How metainfer captures a model: the Dynamo settings and the model-side switches that keep
a forward in one graph, so the passes can see whole patterns.

- Data-dependent output shapes (`nonzero`, `torch.where(cond)`) are captured, not graph
  breaks: DeepSeek's reference MoE loop gathers each expert's tokens that way, and
  `fuse_moe` needs the whole loop in one graph.
- Float constants (eps, attention scales) stay Python numbers in the graph.
- Hugging Face MoE models whose experts run transformers' eager loop (a Python loop over the
  experts that received tokens: one graph break per expert) are captured through
  transformers' own `grouped_mm` experts implementation, the same function written with
  sort + grouped GEMMs; the model is switched back after each call.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch

DYNAMO_CONFIG = dict(specialize_float=True, capture_dynamic_output_shape_ops=True)

_HAS_EXPERTS: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()

HF_EXPERTS_NOTE = ("capture: transformers' eager experts loop breaks the graph once per expert; its experts "
                   "were captured through transformers' grouped_mm implementation (the same function)")


def hf_eager_experts(model: torch.nn.Module) -> bool:
    """Whether `model` is a transformers model whose MoE experts run the eager loop."""
    tf = sys.modules.get("transformers")
    if tf is None or not isinstance(model, tf.PreTrainedModel):
        return False
    if getattr(model.config, "_experts_implementation", None) != "eager":
        return False
    if model not in _HAS_EXPERTS:  # scanned once per model, not on every call
        _HAS_EXPERTS[model] = any(hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate") for m in model.modules())
    return _HAS_EXPERTS[model]


def post_grad(gm: torch.fx.GraphModule, example_inputs: list, on_graph):
    """AOTAutograd over a Dynamo graph with Inductor's decompositions, giving the functional
    ATen graph metainfer's passes see; `on_graph(fx_gm)` gets it (views already reshapes, as
    Inductor's post-grad passes make them) and returns what runs in its place (None: the graph
    itself). Shared by the aot_eager lowering, analyze() and testing.capture_graph."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    def fw_compiler(fx_gm: torch.fx.GraphModule, inputs):
        # views become reshapes, so a rewritten node whose output strides differ (metainfer
        # ops return contiguous tensors) stays valid
        view_to_reshape(fx_gm)
        run = on_graph(fx_gm)
        return make_boxed_func(fx_gm.forward if run is None else run)

    return aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler, decompositions=select_decomp_table())


@contextlib.contextmanager
def capturable(model: torch.nn.Module):
    """Inside the block the model's forward can be captured as one graph; yields the notes
    (what was switched) for the report."""
    notes = []
    switched = hf_eager_experts(model)
    if switched:
        model.set_experts_implementation("grouped_mm")
        notes.append(HF_EXPERTS_NOTE)
    try:
        with torch._dynamo.config.patch(**DYNAMO_CONFIG):
            yield notes
    finally:
        if switched:
            model.set_experts_implementation("eager")
