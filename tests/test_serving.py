"""Serving through transformers' continuous batching engine with metainfer as its compiler:
greedy tokens equal to the plain engine's, one graph per step, bounded compiles, bad
requests failing alone, the streaming manager, capacity from the target."""

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import metainfer
from metainfer.runtime import capacity, serving
from metainfer.testing import tiny_hf_model

DEEPSEEK = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                n_shared_experts=1, first_k_dense_replace=1)
GREEDY = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=-1, pad_token_id=0)
SMALL = dict(num_blocks=32, page_size=16, max_batch_tokens=64)  # chunked prefill, mixed steps


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def tokens(results):
    return [r.generated_tokens for r in results.values()]


def finished(manager, ids) -> list[list[int]]:
    """The generated tokens of the requests `ids`, in that order, once each has finished."""
    got = {}
    while len(got) < len(ids):
        r = manager.get_result(timeout=30)
        assert r is not None, "the engine stopped"
        assert r.error is None, r.error
        if r.is_finished():
            got[r.request_id] = r.generated_tokens
    return [got[i] for i in ids]


_SLOW = pytest.mark.slow  # the eager forms: same engine path as sdpa's, attention fused from another form
# (tests/test_pass_attention.py covers that form)


@pytest.mark.parametrize("arch, attn, extra", [("Llama", "sdpa", {}), pytest.param("Llama", "eager", {}, marks=_SLOW),
                                               pytest.param("Qwen2", "sdpa", {}, marks=_SLOW),  # Llama's path
                                               pytest.param("Qwen2", "eager", {}, marks=_SLOW),
                                               pytest.param("DeepseekV3", "eager", DEEPSEEK, marks=_SLOW),
                                               ("DeepseekV3", "sdpa", DEEPSEEK)])
def test_greedy_tokens_equal_the_plain_engine(arch, attn, extra):
    torch._dynamo.reset()  # transformers' forward wrappers are shared code: start from no compiled graph
    model = tiny_hf_model(arch, attn=attn, **extra)
    reqs = prompts((5, 17, 33, 9, 64, 2))
    plain = model.generate_batch(reqs, generation_config=GREEDY,
                                 continuous_batching_config=ContinuousBatchingConfig(**SMALL))
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager", serve_compile="always")
    out = opt.generate_batch(reqs, generation_config=GREEDY, continuous_batching_config=ContinuousBatchingConfig(**SMALL))
    assert all(r.error is None and len(r.generated_tokens) == 6 for r in out.values())
    assert tokens(out) == tokens(plain)
    report = opt.report
    assert not report.graph_breaks, "the cache update is traced: one graph per step"
    # one graph for steps of several tokens (prefill chunks after nothing or after cached keys, mixed,
    # decode steps of several requests), one for steps of one token (the last request decoding alone)
    assert len(report.sections) == 2 and {s.phase for s in report.sections} == {"prefill", "decode"}, report.compiles()
    assert opt.serving_compile.eager_steps == 0, "every step ran the graph"
    assert any("paged_attention over the engine's KV pool" in n for n in report.notes)
    assert model.config._attn_implementation == attn, "the model's attention is restored"
    # the same steps eagerly: the model's forward with metainfer's attention and cache update, no graph
    eager = metainfer.optimize(model, "cpu", lowering="aot_eager", serve_compile="never")
    out = eager.generate_batch(reqs, generation_config=GREEDY, continuous_batching_config=ContinuousBatchingConfig(**SMALL))
    assert tokens(out) == tokens(plain)
    assert not eager.report.sections and eager.serving_compile.eager_steps > 0


def test_bad_requests_fail_alone():
    model = tiny_hf_model("Llama", layers=1, max_position_embeddings=64)
    good = prompts((7, 12))
    cfg = ContinuousBatchingConfig(**SMALL)  # 32 blocks x 16 tokens = 512 tokens of pool
    gen = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=-1, pad_token_id=0)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    reqs = [good[0], [], [1, 128, 2], [5] * 65, "hello", good[1]]
    out = opt.generate_batch(reqs, generation_config=gen, continuous_batching_config=cfg, progress_bar=True)
    errors = [r.error for r in out.values()]
    assert errors[0] is None and errors[-1] is None
    assert errors[1] == "prompt is empty"
    assert errors[2] == "prompt[1] = 128 is not a token id: the model's vocabulary is 128 ids (0..127)"
    assert errors[3] == "prompt of 65 tokens is longer than the model's 64 positions"
    assert "list of integer token ids" in errors[4]
    plain = model.generate_batch(good, generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(**SMALL))
    assert [list(out.values())[i].generated_tokens for i in (0, 5)] == tokens(plain)
    huge = opt.generate_batch([good[0]], generation_config=GenerationConfig(do_sample=False, max_new_tokens=40,
                                                                            eos_token_id=-1, pad_token_id=0),
                              continuous_batching_config=ContinuousBatchingConfig(num_blocks=2, page_size=16))
    (only,) = huge.values()
    assert only.error == ("prompt of 7 tokens + 40 new needs 48 tokens of KV pool (3 blocks of 16); the pool "
                          "holds 32")


def test_the_streaming_manager():
    model = tiny_hf_model("Llama", layers=1)
    original = model.config._attn_implementation
    reqs = prompts((9, 20, 4))
    plain = model.generate_batch(reqs, generation_config=GREEDY, continuous_batching_config=ContinuousBatchingConfig(**SMALL))
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager", serve_compile="always")
    with opt.init_continuous_batching(generation_config=GREEDY,
                                      continuous_batching_config=ContinuousBatchingConfig(**SMALL)) as manager:
        ids = [manager.add_request(r) for r in reqs]
        with pytest.raises(ValueError, match="request refused: prompt is empty"):
            manager.add_request([])
        got = finished(manager, ids)
    assert got == tokens(plain)
    assert opt.report.sections, "the manager's steps ran metainfer's graphs"
    assert model.config._attn_implementation == original


def test_a_sampling_manager_draws_with_metainfers_sampler():
    """A sampling engine takes metainfer's sampler: a request at temperature 0, or with top-k 1,
    gets the plain greedy engine's tokens; one that samples gets tokens of the vocabulary."""
    from metainfer.runtime.sampling import Sampler

    model = tiny_hf_model("Llama", layers=1)
    reqs = prompts((9, 20, 4))
    plain = model.generate_batch(reqs, generation_config=GREEDY, continuous_batching_config=ContinuousBatchingConfig(**SMALL))
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager", serve_compile="always")
    sampled = GenerationConfig(do_sample=True, temperature=0.8, top_p=0.9, max_new_tokens=6, eos_token_id=-1,
                               pad_token_id=0)
    with opt.init_continuous_batching(generation_config=sampled,
                                      continuous_batching_config=ContinuousBatchingConfig(**SMALL)) as manager:
        assert isinstance(manager.logit_processor, Sampler)
        greedy = [manager.add_request(r, temperature=0.0) for r in reqs]
        top1 = [manager.add_request(r, top_k=1) for r in reqs]
        drawn = [manager.add_request(r) for r in reqs]  # the config's temperature and top-p
        got = finished(manager, greedy + top1 + drawn)
    assert got[:3] == tokens(plain) and got[3:6] == tokens(plain)
    assert all(len(t) == 6 and all(0 <= i < model.config.vocab_size for i in t) for t in got[6:])
    assert any("sampling by metainfer's sampler" in n for n in opt.report.notes)


def test_capacity_comes_from_the_target_the_machine_and_the_workload():
    model = tiny_hf_model("Llama", layers=1)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    reqs = prompts((10, 40, 25))
    cap = capacity.choose_capacity(opt, [len(r) + 20 for r in reqs], page_size=16, max_batch_tokens=256)
    # every request whole at once: ceil(30/16) + ceil(60/16) + ceil(45/16) = 2 + 4 + 3, plus one spare
    assert cap.num_blocks == 10 and "what the 3 requests can hold at once" in cap.why
    # unknown workload, by hand: 1 layer x (K + V) x 2 kv heads x head_dim 16 x float32 = 256 B a token in
    # the pool, and as much again read back at a step's attention peak (one layer's keys and values);
    # activations at 256 batch tokens: 256 x 4 B x (4 x 64 hidden + 2 x 4 heads x (16 + 16) + 3 x 128
    # intermediate) = 917,504 B, plus the engine's 1024 logits rows x (64 hidden x 4 B + 128 vocab x 4 B)
    kv_block = (256 + 256) * 16
    activations = 256 * 4 * (4 * 64 + 2 * 4 * 32 + 3 * 128) + 1024 * (64 * 4 + 128 * 4)
    machine = capacity.choose_capacity(opt, None, page_size=16, max_batch_tokens=256, available=(64 * 2**20, "test"))
    assert machine.num_blocks == (64 * 2**20 // 2 - activations) // kv_block == 3888
    assert "the machine's available memory (0.1 GiB, test; 50% of it)" in machine.why
    # a machine with more memory than the target claims: the target's figure after the weights
    weights = sum(p.numel() * 4 for p in model.parameters())
    target = capacity.choose_capacity(opt, None, page_size=16, max_batch_tokens=256, available=(2**50, "test"))
    usable = opt.target.device.memory_bytes * 0.9
    assert target.num_blocks == int((usable - weights - activations) // kv_block)
    assert target.why.split(": ", 1)[1].startswith("target cpu's memory (24 GiB x 90%)")
    out = opt.generate_batch(reqs, generation_config=GREEDY, continuous_batching_config=ContinuousBatchingConfig(
        page_size=16, max_batch_tokens=256))  # 6 new tokens: 1 + 3 + 2 blocks, plus one spare
    assert all(r.error is None for r in out.values())
    assert any(n.startswith("serving capacity: KV pool 7 blocks x 16 tokens") for n in opt.report.notes)


def test_a_target_claiming_more_memory_than_the_machine_has_gets_a_pool_that_fits(tmp_path):
    import dataclasses

    model = tiny_hf_model("Llama", layers=1)
    cpu = metainfer.hardware.targets.get("cpu")
    huge = dataclasses.replace(cpu, name="cpu-64tib", device=dataclasses.replace(cpu.device, memory_bytes=2.0**46))
    opt = metainfer.optimize(model, huge, lowering="aot_eager")
    cap = capacity.choose_capacity(opt, None, page_size=256, max_batch_tokens=8192)
    with open("/proc/meminfo") as f:  # read after: the pool must fit what is available now
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert cap.num_blocks * 256 * (256 + 256) <= available, cap.why  # the pool and what a step reads back of it
    assert "the machine's available memory" in cap.why and "(the target would allow" in cap.why


def test_serving_compiles_once_it_pays(tmp_path, monkeypatch):
    """serve_compile='auto': a short batch never waits on a compile (no graph); the compile's
    cost is measured and kept in the cache; given work enough, the graph compiles after the
    first eager step and serves the rest."""
    from metainfer.runtime import serve_compile

    model = tiny_hf_model("Llama", layers=1)
    reqs = prompts((5, 17, 33, 9))
    plain = tokens(model.generate_batch(reqs, generation_config=GREEDY,
                                        continuous_batching_config=ContinuousBatchingConfig(**SMALL)))
    short = metainfer.optimize(model, "cpu", lowering="aot_eager", cache_dir=tmp_path)
    assert tokens(short.generate_batch(reqs, generation_config=GREEDY,
                                       continuous_batching_config=ContinuousBatchingConfig(**SMALL))) == plain
    assert not short.report.sections, "a short batch is served eagerly"
    assert "steps of several tokens: not yet" in short.report.notes[-1]
    assert "measured on the project's dev VM" in short.report.notes[-1]
    # a compile measured once is what the next prediction uses (this process or the next)
    always = metainfer.optimize(model, "cpu", lowering="aot_eager", cache_dir=tmp_path, serve_compile="always")
    always.generate_batch(reqs, generation_config=GREEDY, continuous_batching_config=ContinuousBatchingConfig(**SMALL))
    auto = metainfer.optimize(model, "cpu", lowering="aot_eager", cache_dir=tmp_path)
    seconds, source = auto.serving_compile.predicted_compile_seconds()
    assert source.startswith("measured") and seconds > 0
    monkeypatch.setattr(serve_compile, "BUDGET", 1e6)  # every compile pays: the switch after the first step
    out = auto.generate_batch(reqs, generation_config=GREEDY, continuous_batching_config=ContinuousBatchingConfig(**SMALL))
    assert tokens(out) == plain
    # each step shape (several tokens; one token, if a request decoded alone) ran eagerly once, then compiled
    shapes = auto.serving_compile.compiled
    assert len(auto.report.sections) == len(shapes) == auto.serving_compile.eager_steps >= 1
    assert "steps of several tokens: compiled after 1 eager steps: predicted compile" in auto.report.notes[-1]


def test_the_compile_rule_by_hand(tmp_path):
    """Compile iff predicted seconds <= 20% of (eager seconds so far + remaining tokens at the
    measured eager rate): 1.0 s for 100 tokens, compile predicted 0.5 s: pays from 150 tokens on."""
    from metainfer.runtime.serve_compile import ServingCompile

    opt = metainfer.optimize(tiny_hf_model("Llama", layers=1), "cpu", lowering="aot_eager", cache_dir=tmp_path)
    policy = ServingCompile(opt)
    policy.predicted_compile_seconds = lambda: (0.5, "given")
    assert not policy.use_compiled(100, 10_000), "nothing measured yet: the first step runs eagerly"
    policy.ran(1.0, 100, compiled=False, compiled_now=False, warm=False)
    assert not policy.use_compiled(100, 149)
    assert policy.use_compiled(100, 150)
    assert not policy.use_compiled(1, 10**9), "steps of one token are another graph, measured apart"
    assert not ServingCompile(opt, "never").use_compiled(8, 10**9) and ServingCompile(opt, "always").use_compiled(8)
    with pytest.raises(ValueError, match="serve_compile must be one of auto, always, never"):
        metainfer.optimize(opt.model, "cpu", serve_compile="sometimes")


def test_the_attention_refuses_to_run_outside_a_serving_step():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="runs only inside metainfer's serving steps"):
        serving.paged_attention_forward(None, q, q, q, None, scaling=1.0)
    with pytest.raises(RuntimeError, match="no KV pool is active on this thread"):
        torch.ops.metainfer.paged_attention(q[0], q[0], q[0], torch.zeros(4, dtype=torch.long), None,
                                            torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4, 0, 1.0)


def test_inductor_lowering_serves_the_same_tokens():
    model = tiny_hf_model("Llama", layers=1)
    reqs = prompts((6, 30))
    plain = model.generate_batch(reqs, generation_config=GREEDY, continuous_batching_config=ContinuousBatchingConfig(**SMALL))
    opt = metainfer.optimize(model, "cpu", serve_compile="always")
    out = opt.generate_batch(reqs, generation_config=GREEDY, continuous_batching_config=ContinuousBatchingConfig(**SMALL))
    assert tokens(out) == tokens(plain)
    assert len(opt.report.sections) == 1 and opt.report.sections[0].lowering == "inductor"


def test_benchmark_harness_compares_variants_on_a_workload(tmp_path):
    from metainfer import servebench

    w = servebench.Workload.synthetic(5, prompt=(4, 30), output=3, prefix_groups=2, prefix_tokens=20,
                                      arrival_rate=200.0, seed=3)
    path = tmp_path / "w.json"
    path.write_text(__import__("json").dumps(w.to_dict()))
    again = servebench.Workload.load(path)
    assert again == w and again.staggered
    prompts = w.prompts(128)
    assert prompts[0][:20] == prompts[2][:20] != prompts[1][:20], "a prefix group shares its first 20 tokens"
    model = servebench.build_model("hf-llama-tiny")
    rows = servebench.run(model, w, variants=("hf-generate", "cb", "cb+metainfer"), progress=False,
                          cb_config=dict(num_blocks=16, page_size=16, max_batch_tokens=64), lowering="aot_eager")
    by = {r.variant: r for r in rows}
    assert by["cb+metainfer"].same_tokens == 5 and by["cb"].same_tokens == 5
    assert by["cb+metainfer"].output_tokens == 15 and by["cb+metainfer"].input_tokens == sum(map(len, prompts))
    assert by["cb+metainfer"].ttft_s > 0 and by["cb+metainfer"].graphs >= 1
    text = servebench.table(rows)
    assert "cb+metainfer" in text and "vs cb" in text
    with pytest.raises(ValueError, match="not a workload"):
        path.write_text('{"requests": [{"prompt": 3}]}')
        servebench.Workload.load(path)


def test_the_benchmark_leaves_out_rounds_the_machine_swung_through():
    """Issue 51: with a noise guard, a measured round whose yardstick readings left the band is
    served again, and kept out of the row's median when it never held still (scripted readings:
    round 1's every try reads 50% slow; round 2 is steady)."""
    from metainfer import servebench
    from metainfer.hardware import noise

    class Scripted(noise.Yardstick):
        def __init__(self, readings):
            super().__init__(warm=0, tries=2)
            self._script = [(r, r) for r in readings]
            self._job = object()

        def _read(self):
            return self._script.pop(0)

    guard = Scripted([1.0] * 3)
    guard.readings += [guard._read() for _ in range(3)]
    guard._script = [(r, r) for r in (1.0, 1.5, 1.0, 1.5, 1.0, 1.0)]  # round 1: two tries, both swung; round 2: still
    w = servebench.Workload.synthetic(2, prompt=(4, 8), output=2, seed=3)
    rows = servebench.run(servebench.build_model("hf-llama-tiny"), w, variants=("cb",), progress=False, rounds=3,
                          cb_config=dict(num_blocks=8, page_size=16, max_batch_tokens=64), guard=guard)
    row = rows[0]
    assert row.unstable_rounds == 1 and len(row.rounds) == 1 and guard.summary()["rows_remeasured"] == 1
    assert "1 measured round(s) left out: the machine swung outside the noise band" in row.notes
    assert guard.unstable == ["cb round 1"] and not guard._script


def test_every_way_in_checks_the_request_first():
    """add_request and add_requests refuse a request that cannot be served before anything is
    queued (the engine's own add_requests would fail every request in flight on one bad id);
    prompt + new tokens past the model's positions is refused by generate_batch alone and by
    generate() before it starts."""
    model = tiny_hf_model("Llama", layers=1, max_position_embeddings=64)
    good = prompts((7, 12, 5))
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    plain = tokens(model.generate_batch(good, generation_config=GREEDY,
                                        continuous_batching_config=ContinuousBatchingConfig(**SMALL)))
    with opt.init_continuous_batching(generation_config=GREEDY,
                                      continuous_batching_config=ContinuousBatchingConfig(**SMALL)) as manager:
        with pytest.raises(ValueError, match=r"none queued: input 1: prompt\[1\] = 300 is not a token id"):
            manager.add_requests([good[0], [5, 300]])
        with pytest.raises(ValueError, match="input 0: prompt of 60 tokens \\+ 6 new reaches position 66, past "
                                             "the model's 64 positions"):
            manager.add_requests([[3] * 60])
        got = finished(manager, manager.add_requests(good))
    assert got == plain, "nothing of the refused calls was queued"
    out = opt.generate_batch([good[0], [3] * 60], generation_config=GREEDY)
    assert [r.error for r in out.values()] == [None, "prompt of 60 tokens + 6 new reaches position 66, past the "
                                                     "model's 64 positions"]
    with pytest.raises(ValueError, match="generating to position 70 \\(10 prompt tokens \\+ 60 new\\) passes the "
                                         "model's max_position_embeddings \\(64\\)"):
        opt.generate(torch.tensor([good[0] + [3, 4, 5]]), max_new_tokens=60)


def test_a_cancelled_request_ends_with_a_result_and_frees_its_blocks():
    """A request cancelled mid-stream ends with a result marked "cancelled" (the plain engine
    delivers none), and its blocks go back to the pool: a request that needs them is served."""
    model = tiny_hf_model("Llama", layers=1, max_position_embeddings=1024)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    long = GenerationConfig(do_sample=False, max_new_tokens=200, eos_token_id=-1, pad_token_id=0)
    pool = ContinuousBatchingConfig(num_blocks=32, page_size=16, max_batch_tokens=512, allow_block_sharing=False)
    with opt.init_continuous_batching(generation_config=long, continuous_batching_config=pool) as manager:
        gone = manager.add_request(prompts((300,), seed=1)[0], streaming=True)  # 19 of the 32 blocks, and more
        while not (r := manager.get_result(timeout=30)).generated_tokens:
            pass
        manager.cancel_request(gone)
        big = manager.add_request(prompts((400,), seed=2)[0], max_new_tokens=6)  # 26 blocks: only once freed
        results = {}
        while len(results) < 2:
            r = manager.get_result(timeout=30)
            assert r is not None, "the engine stopped, the cancelled request never ended, or its blocks were kept"
            if r.is_finished():
                results[r.request_id] = r
    assert results[gone].error == "cancelled" and 0 < len(results[gone].generated_tokens) < 200
    assert results[big].error is None and len(results[big].generated_tokens) == 6


def test_the_pool_size_given_is_the_one_planned_admitted_and_reported():
    model = tiny_hf_model("Llama", layers=1)
    opt = metainfer.optimize(model, "cpu", lowering="aot_eager")
    cfg = ContinuousBatchingConfig(num_blocks=4, page_size=16)  # 64 tokens of pool, batch tokens left open
    out = opt.generate_batch([prompts((10,))[0], prompts((70,))[0]], generation_config=GREEDY,
                             continuous_batching_config=cfg)
    assert [r.error for r in out.values()] == [None, "prompt of 70 tokens + 6 new needs 80 tokens of KV pool (5 "
                                                     "blocks of 16); the pool holds 64"]
    assert ("serving capacity: KV pool 4 blocks x 16 tokens, as given; max_batch_tokens 8192 (the engine's "
            "default)") in opt.report.notes
    with pytest.raises(ValueError, match="a KV pool of 1000000000 blocks x 16 tokens does not fit: the machine's"):
        opt.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(num_blocks=10**9, page_size=16))
    with opt.init_continuous_batching(generation_config=GREEDY, continuous_batching_config=cfg) as manager:
        assert manager.capacity.num_blocks == 4
        manager.add_request(prompts((10,))[0])
        while not (r := manager.get_result(timeout=30)).is_finished():
            pass
    notes = [n.split(":")[0] for n in opt.report.notes]
    assert {"serving capacity", "serving run", "serving compile"} <= set(notes), "the manager's notes too"


# the slow tier: GPT-NeoX fails the plain engine as StableLM does, Gemma 3's ring buffers are Gemma 2's
@pytest.mark.parametrize("arch, attn, extra", [
    ("StableLm", "sdpa", {}), pytest.param("GPTNeoX", "sdpa", dict(num_key_value_heads=4), marks=_SLOW),
    pytest.param("Gemma3Text", "sdpa", dict(sliding_window=8, head_dim=16), marks=_SLOW),
    ("Gemma2", "eager", dict(sliding_window=8, head_dim=16))])
def test_architectures_the_plain_engine_cannot_serve(arch, attn, extra):
    """StableLM's layers do not pass the step's arguments down to the cache update, GPT-NeoX
    calls it without them (the plain engine fails on both, transformers 5.25); Gemma 3 has
    sliding-window layers (a ring buffer per request), Gemma 2 those and soft-capped scores.
    metainfer serves them through its paged attention, eagerly and compiled, with greedy
    tokens equal to the model's own generate()."""
    model = tiny_hf_model(arch, attn=attn, **extra)
    reqs = prompts((5, 17, 33, 9, 2))
    ref = [model.generate(torch.tensor([r]), generation_config=GREEDY)[0, len(r):].tolist() for r in reqs]
    for mode in ("never", "always"):
        opt = metainfer.optimize(model, "cpu", lowering="aot_eager", serve_compile=mode)
        out = opt.generate_batch(reqs, generation_config=GREEDY, continuous_batching_config=ContinuousBatchingConfig(**SMALL))
        assert tokens(out) == ref, mode
        assert any("paged_attention over the engine's KV pool" in n for n in opt.report.notes)
        assert len(opt.report.sections) <= (2 if mode == "always" else 0), opt.report.compiles()
    with opt.init_continuous_batching(generation_config=GREEDY,
                                      continuous_batching_config=ContinuousBatchingConfig(**SMALL)) as manager:
        got = finished(manager, manager.add_requests(reqs))
    assert got == ref
