"""Graph passes over the post-grad ATen graph; one file per pass.

Each pass has a `name`, a one-line docstring `before -> after`, the device kinds it applies
to, and `run(graph, ctx) -> PassResult`. `PassManager` runs a pipeline and records what each
pass did; `pipeline.default_pipeline(target)` is the order used when none is given.
The ops the passes insert (torch.ops.metainfer.*) are registered once, here, by
metainfer.kernels.ops.
"""

from metainfer.kernels import ops as _ops  # noqa: F401  (registers torch.ops.metainfer.*)

from .base import FunctionPass, Pass, PassContext, PassResult, get_pass, pass_names, register
from .manager import PassError, PassManager, PassRecord, graph_text
from . import fp8_gemm, int4_gemm, fuse_attention, fuse_geglu, fuse_moe, fuse_rmsnorm, fuse_rope, fuse_swiglu, mla_decode, mla_prefill, sparse_mla  # noqa: F401  (register the passes)
from . import share_act_quant  # noqa: F401
from . import overlap_collectives, pipeline_collectives, select_collectives, sequence_parallel, two_batch_overlap  # noqa: F401
from .pipeline import default_pipeline, resolve

__all__ = ["Pass", "FunctionPass", "PassContext", "PassResult", "PassManager", "PassRecord", "PassError",
           "register", "get_pass", "pass_names", "default_pipeline", "resolve", "graph_text"]
