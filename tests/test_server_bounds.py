"""Issue 50: what a server holds is bounded by what it admits. The KV pool is sized to
`--max-running` requests of the model's whole context (or less where memory bounds it), not to
half of the host's memory; the capacity note says which bound decided."""

import metainfer
from metainfer import servebench
from metainfer.server.engine import engine_manager


def test_the_pool_holds_what_admission_allows():
    model = servebench.build_model("hf-llama-tiny")
    model.config.max_position_embeddings = 512
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    manager = engine_manager(opt, None, max_running=3)
    cap = manager.capacity
    # 3 requests x 512 positions in pages of 256 tokens: 6 blocks, plus the engine's spare one (by
    # hand), far under the host's memory
    assert cap.page_size == 256 and cap.num_blocks == 7
    assert "what the 3 requests can hold at once" in cap.why
    free = engine_manager(opt, None).capacity  # no admission bound: the machine's memory decides
    assert free.num_blocks > cap.num_blocks and "available memory" in free.why
