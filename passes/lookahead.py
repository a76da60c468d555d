"""Deciding with the rest of the pipeline in view.

Communication passes interact: a rewrite that pays on its own can take away what a later
pass would have done better (sequence parallelism's reduce-scatters leave pipeline_collectives
no all-reduce to chunk and give the overlap scheduler less to hide). A pass that changes the
collectives makes its rewrite on a copy (`trial`) and compares `predicted_step` of both: the
step after the later communication passes of this pipeline have run on a copy, which the
manager prices (`PassContext.price`); no pass builds a pipeline of its own.
"""

from __future__ import annotations

import torch

from .base import PassContext

COMMUNICATION_PASSES = ("sequence_parallel", "two_batch_overlap", "pipeline_collectives", "select_collectives",
                        "overlap_collectives")


def copy_graph(graph: torch.fx.Graph, node_map: "dict | None" = None) -> torch.fx.Graph:
    """A copy of `graph`; `node_map`, if given, is filled with each node's copy."""
    g = torch.fx.Graph()
    g.output(g.graph_copy(graph, {} if node_map is None else node_map))
    return g


def in_lookahead(ctx: PassContext) -> bool:
    """Whether the pass runs on a copy, pricing an earlier pass's choice: it exchanges nothing
    between ranks."""
    return ctx.lookahead


def later_passes(ctx: PassContext) -> list:
    """This pipeline's communication passes after the running one."""
    return [p for p in ctx.later if p.name in COMMUNICATION_PASSES]


def predicted_step(graph: torch.fx.Graph, ctx: PassContext) -> float:
    """The one estimate every communication pass decides by: the cost model's step for `graph`
    as this pipeline will leave it, priced by the manager running the pass (the later
    communication passes run on a copy, each deciding as it would in the pipeline, then the
    simulator). Outside a manager: the simulator on `graph` as it is."""
    if ctx.price is not None:
        return ctx.price(graph)
    from metainfer.hardware.simulate import simulate

    return simulate(graph, ctx.target).step_seconds


def after_later(ctx: PassContext) -> str:
    """For a decision's figures: which later passes the predicted steps include."""
    names = [p.name for p in later_passes(ctx)]
    return f" (after {', '.join(names)})" if names else ""


def trial(graph: torch.fx.Graph, rewrite) -> torch.fx.Graph:
    """A copy of `graph` with `rewrite(copy, node_map)` applied (node_map: original node ->
    its copy) and dead code dropped: an alternative to price before committing to it."""
    node_map: dict = {}
    g = copy_graph(graph, node_map)
    rewrite(g, node_map)
    g.eliminate_dead_code()
    return g
