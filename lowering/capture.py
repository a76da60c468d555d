"""The graph metainfer's passes see outside Inductor (the aot_eager lowering, analyze(),
testing.capture_graph): a Dynamo graph through AOTAutograd with Inductor's decompositions.

- Data-dependent output shapes (`nonzero`, `torch.where(cond)`) are captured, not graph
  breaks: DeepSeek's reference MoE loop gathers each expert's tokens that way, and
  `fuse_moe` needs the whole loop in one graph.
- Float constants (eps, attention scales) stay Python numbers in the graph.
"""

from __future__ import annotations

import torch

DYNAMO_CONFIG = dict(specialize_float=True, capture_dynamic_output_shape_ops=True)


def post_grad(gm: torch.fx.GraphModule, example_inputs: list, on_graph):
    """AOTAutograd over a Dynamo graph with Inductor's decompositions, giving the functional
    ATen graph metainfer's passes see; `on_graph(fx_gm)` gets it (views already reshapes, as
    Inductor's post-grad passes make them) and returns what runs in its place (None: the graph
    itself). Shared by the aot_eager lowering, analyze() and testing.capture_graph. Inductor's
    own joint-graph and post-grad pattern passes do not run here, while under the Inductor
    lowering the passes see the graph after them (issue 17's "one graph" is not done yet)."""
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
