"""One graph: metainfer's passes see the same graph under the Inductor lowering, the aot_eager
lowering and `testing.capture_graph` (each runs Inductor's own graph passes up to the slot
where the pass manager runs), so what the tests prove is what production compiles."""

import pytest
import torch

import metainfer
from metainfer.passes import Pass, PassResult
from metainfer.testing import capture_graph, tiny_hf_model


class Snapshot(Pass):
    """(records the ops of each graph it is given; changes nothing)"""

    name = "snapshot"

    def __init__(self):
        self.graphs = []

    def run(self, graph, ctx):
        self.graphs.append(_ops(graph))
        return PassResult(modified=False)


def _ops(graph) -> list[str]:
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


DEEPSEEK = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                n_shared_experts=1, first_k_dense_replace=1)


@pytest.mark.parametrize("arch,config", [("Llama", {}), ("DeepseekV3", DEEPSEEK)])
def test_the_passes_see_one_graph_under_every_lowering(arch, config, tmp_path):
    model = tiny_hf_model(arch, attn="eager", layers=2, **config)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    seen = {}
    for lowering in ("inductor", "aot_eager"):
        torch._dynamo.reset()
        snap = Snapshot()
        opt = metainfer.optimize(model, "cpu", passes=[snap], lowering=lowering, cache_dir=str(tmp_path / lowering))
        with torch.no_grad():
            opt(ids)
        seen[lowering] = snap.graphs
    torch._dynamo.reset()
    gm, _ = capture_graph(model, ids)
    assert len(seen["inductor"]) == 1 and seen["aot_eager"] == seen["inductor"]
    assert _ops(gm.graph) == seen["inductor"][0]
