"""The graph metainfer's passes see: a Dynamo graph through AOTAutograd with Inductor's
decompositions, then Inductor's own graph passes up to the slot where Inductor runs the pass
manager (its post-grad custom post pass). Under the Inductor lowering Inductor does this
itself; the aot_eager lowering, analyze() and testing.capture_graph do it here, so every
path sees one graph.

- Data-dependent output shapes (`nonzero`, `torch.where(cond)`) are captured, not graph
  breaks: DeepSeek's reference MoE loop gathers each expert's tokens that way, and
  `fuse_moe` needs the whole loop in one graph.
- Float constants (eps, attention scales) stay Python numbers in the graph.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

DYNAMO_CONFIG = dict(specialize_float=True, capture_dynamic_output_shape_ops=True)


def post_grad(gm: torch.fx.GraphModule, example_inputs: list, at_slot):
    """AOTAutograd over a Dynamo graph with Inductor's decompositions, then Inductor's own graph
    passes (its joint-graph passes, views made reshapes, its post-grad passes), with
    `at_slot(fx_gm)` run where Inductor runs metainfer's pass manager (its post-grad custom
    post pass): the graph the passes see is the one they see under Inductor. `at_slot` may
    rewrite the graph in place and returns what runs in its place (None: the graph itself,
    after Inductor's remaining post-grad passes). Shared by the aot_eager lowering, analyze()
    and testing.capture_graph."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.fx_passes.post_grad import post_grad_passes, view_to_reshape
    from torch._inductor.virtualized import V

    def fw_compiler(fx_gm: torch.fx.GraphModule, inputs):
        device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), None)
        slot = _Slot(at_slot)
        # constant folding evaluates tensors; meta ones hold no values (analyze() on a real-size
        # model), and the folder then removes most of the graph as no-ops
        folding = inductor_config.joint_graph_constant_folding and getattr(device, "type", None) != "meta"
        with V.set_fake_mode(torch._guards.detect_fake_mode(inputs)), \
                inductor_config.patch(joint_graph_constant_folding=folding):
            fx_gm = joint_graph_passes(fx_gm, device)
            view_to_reshape(fx_gm)  # Inductor's first post-grad step, before its passes
            with inductor_config.patch(post_grad_custom_pre_pass=None, post_grad_custom_post_pass=slot):
                post_grad_passes(fx_gm, is_inference=True)
        fx_gm.recompile()
        return make_boxed_func(fx_gm.forward if slot.result is None else slot.result)

    return aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler, decompositions=select_decomp_table())


class _Slot(CustomGraphPass):
    """Inductor's post-grad custom post pass, running `fn` on the graph's module."""

    def __init__(self, fn):
        self.fn, self.result = fn, None

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.result = self.fn(graph.owning_module)

    def uuid(self) -> None:  # nothing here is cached by Inductor
        return None
