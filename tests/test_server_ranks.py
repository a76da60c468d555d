"""`metainfer serve --ranks 2` as a client sees it: one endpoint over two CPU ranks of this
machine (rank 0 serves HTTP and drives the engine; rank 1 follows), the model sharded tensor-
parallel over both. Expected tokens come from one process's `opt.generate_batch` (greedy), not
from the server.

Default tier: HF Llama tiny, streamed and whole completions equal to one process's tokens, the
degrees in /v1/models and /metrics, SIGTERM draining both ranks (exit 0, nothing left behind).
Slow tier (`pytest -m slow`): the other model kinds (more ranks than KV heads; MoE with MLA and
experts spread; Qwen3-MoE), each with a cancelled stream and a bad request mixed in; and the
faults (a rank killed, stopped, raising, or failing to start).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
psutil = pytest.importorskip("psutil")

from metainfer.testing import ServerProcess

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [40, 41]]
MAX_TOKENS = 12
FAULT_LIMIT_S = 5.0  # the bound: clients get their errors within this


def one_process_tokens(name: str, prompts, max_tokens: int) -> list[list[int]]:
    """Greedy tokens of one process's generate_batch on the benchmark model `name` (EOS 2)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    import metainfer
    from metainfer import servebench

    opt = metainfer.optimize(servebench.build_model(name), "cpu", lowering="aot_eager")
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=2, pad_token_id=0)
    out = opt.generate_batch(prompts, generation_config=gen,
                             continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=256))
    return [list(o.generated_tokens) for o in out.values()]


def start(name: str, tmp, *args, env=None) -> ServerProcess:
    return ServerProcess(name, tmp, "--ranks", "2", "--num-blocks", "64", "--grace", "20", *args, env=env)


def stream(server: ServerProcess, prompt, max_tokens: int = MAX_TOKENS, close_after: int | None = None,
           ids: list | None = None) -> dict:
    """A streamed greedy completion: its token ids (also appended to `ids` as they come) and how
    it ended."""
    body = {"model": server_model(server), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    ids, end = [] if ids is None else ids, None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": json.loads(r.read())}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"status": "error", "ids": ids, "error": event["error"]["message"]}
            if event["choices"]:
                ids += event["choices"][0]["token_ids"]
                end = event["choices"][0]["finish_reason"] or end
            if close_after is not None and len(ids) >= close_after:
                return {"status": "closed", "ids": ids}
    return {"status": 200, "ids": ids, "finish": end}


def server_model(server) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]


def leftovers(server: ServerProcess, shm_before: set) -> list[str]:
    time.sleep(0.3)
    alive = [p for p in server.rank_pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    # a segment is named after the process that made it: only this server's count here (another
    # test's job may run beside this one)
    mine = {f"metainfer-{p}-" for p in server.rank_pids}
    shm = [n for n in set(os.listdir("/dev/shm")) - shm_before if any(n.startswith(m) for m in mine)]
    return [f"ranks alive: {alive}"] * bool(alive) + [f"/dev/shm: {shm}"] * bool(shm)


# ---- default tier: HF Llama tiny on two ranks ------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    shm_before = set(os.listdir("/dev/shm"))
    s = start("hf-llama-tiny", tmp_path_factory.mktemp("ranks"))
    yield s, shm_before
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=60)


def test_two_ranks_stream_one_process_tokens(llama):
    server, _ = llama
    expected = one_process_tokens("hf-llama-tiny", PROMPTS, MAX_TOKENS)
    got: list = [None] * len(PROMPTS)

    def run(i):
        got[i] = stream(server, PROMPTS[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [g["ids"] for g in got] == expected, server.tail()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    whole = client.completions.create(model=server_model(server), prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].model_extra["token_ids"] == expected[1]


def test_the_degrees_are_said(llama):
    server, _ = llama
    parallel = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["parallel"]
    assert parallel["ranks"] == parallel["tensor_parallel"] == 2 and parallel["exchange"] == "shm", parallel
    assert parallel["why"].startswith("degrees: tp2"), parallel
    metrics = server.metrics()
    assert metrics['metainfer_parallel_degree{kind="tp"}'] == 2
    assert metrics["metainfer_rank_exchange_steps"] > 0


def test_sigterm_drains_every_rank(llama):
    """The last test of the module: a stream in flight finishes, both ranks exit, status 0."""
    server, shm_before = llama
    out = {}
    reader = threading.Thread(target=lambda: out.update(stream(server, [5, 6, 7], max_tokens=40)))
    reader.start()
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGTERM)
    reader.join(timeout=120)
    assert server.proc.wait(timeout=90) == 0, server.tail()
    assert out["status"] == 200 and out["finish"] in ("stop", "length"), out
    assert len(server.rank_pids) == 2  # rank 0 and the rank it spawned, both gone now
    assert leftovers(server, shm_before) == []


# ---- slow tier: the model kinds, with a cancellation and a bad request mixed in ----------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-llama-tiny-kv1", "hf-deepseek-v3-tiny", "hf-qwen3-moe-tiny"])
def test_model_kinds_serve_one_process_tokens(name, tmp_path):
    expected = one_process_tokens(name, PROMPTS, MAX_TOKENS)
    server = start(name, tmp_path)
    try:
        got: dict = {}
        jobs = {i: (lambda i=i: stream(server, PROMPTS[i])) for i in range(len(PROMPTS))}
        jobs["cancelled"] = lambda: stream(server, [20, 21, 22], max_tokens=200, close_after=3)
        jobs["bad"] = lambda: stream(server, [1, 2, 999])  # outside the vocabulary
        threads = [threading.Thread(target=lambda k=k, f=f: got.update({k: f()})) for k, f in jobs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert [got[i]["ids"] for i in range(len(PROMPTS))] == expected, server.tail()
        assert got["cancelled"]["status"] == "closed"
        assert got["bad"]["status"] == 400 and got["bad"]["body"]["error"]["param"] == "prompt"
        parallel = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["parallel"]
        if name != "hf-llama-tiny-kv1":
            assert parallel["expert_parallel"], parallel  # the planner spreads the experts at tp2
        deadline = time.monotonic() + 30  # the cancelled request's blocks come back
        while server.metrics()['metainfer_kv_blocks{state="used"}'] > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.metrics()['metainfer_kv_blocks{state="used"}'] == 0
    finally:
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=90) == 0, server.tail()


# ---- slow tier: faults ------------------------------------------------------------------------

def _streams_in_flight(server, n=3):
    """n streams of 400 tokens, returned once each has its first tokens."""
    clients = [{"ids": []} for _ in range(n)]

    def run(c, i):
        c.update(stream(server, [5 + i, 6, 7], max_tokens=400, ids=c["ids"]))
        c["at"] = time.monotonic()

    threads = [threading.Thread(target=run, args=(c, i)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(len(c["ids"]) >= 4 for c in clients):
        assert time.monotonic() < deadline and all(t.is_alive() for t in threads), clients
        time.sleep(0.02)
    return clients, threads


@pytest.mark.slow
@pytest.mark.parametrize("fault,rank", [("kill", 1), ("stop", 1), ("raise", 1), ("hang", 1), ("raise", 0)])
def test_a_failing_rank_fails_every_request_naming_it(fault, rank, tmp_path):
    """Killed (SIGKILL), stopped (SIGSTOP: no heartbeat), raising in its engine loop, or stuck in
    it while the process answers (its loop stalls past --step-timeout; the injected hang stops it
    at the top of a loop iteration, one iteration behind rank 0, which waits for it)."""
    shm_before = set(os.listdir("/dev/shm"))
    env = {"METAINFER_SERVE_FAULT": f"{fault}@{rank}"} if fault in ("raise", "hang") else None
    server = start("hf-llama-tiny", tmp_path, "--step-timeout", "2", env=env)
    try:
        victim = server.rank_pids[rank]
        clients, threads = _streams_in_flight(server)
        hit = time.monotonic()
        os.kill(victim, {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}.get(fault, signal.SIGUSR2))
        for t in threads:
            t.join(timeout=60)
        for c in clients:  # an error event mid-stream, naming the rank, within the bound
            assert c["status"] == "error" and f"rank {rank} " in c["error"], c
            assert c["at"] - hit < FAULT_LIMIT_S, c
        assert server.proc.wait(timeout=60) == 1
        assert f"metainfer: error: the server failed: rank {rank}" in server.tail(None)
        assert leftovers(server, shm_before) == []
    finally:
        for p in server.rank_pids:
            if psutil.pid_exists(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.slow
def test_a_rank_that_cannot_start_is_named(tmp_path):
    server = ServerProcess("hf-llama-tiny", tmp_path, "--ranks", "2", env={"METAINFER_SERVE_FAULT": "start@1"},
                           wait=False)
    assert server.proc.wait(timeout=300) == 1
    assert "the server could not start: rank 1 could not start: RuntimeError: injected fault" in server.tail(None)
