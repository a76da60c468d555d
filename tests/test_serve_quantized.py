"""`metainfer serve --model <int4 folder>`: a GPTQ act-order checkpoint (written by
metainfer.checkpoint_writers) served over HTTP answers the real openai client with the greedy
tokens that in-process `generate` gives on the same folder loaded by metainfer.load, its
graphs running every quantized linear on metainfer::int4_linear (/metrics)."""

import signal

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from metainfer.testing import ServerProcess, tiny_model_folder  # noqa: E402

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny-llama-gptq"), "gptq", group=32, act_order=True,
                             dtype=torch.float32)


def test_an_int4_folder_is_served_with_generates_tokens(folder, tmp_path):
    import metainfer

    model = metainfer.load(folder, dtype=torch.float32)
    expected = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                               eos_token_id=2)[0, len(p):].tolist() for p in PROMPTS]
    server = ServerProcess(folder, tmp_path, "--num-blocks", "64")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        for prompt, want in zip(PROMPTS, expected):
            out = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
            got = out.choices[0].model_extra["token_ids"]
            assert got == want[:len(got)] and (len(got) == 12 or got[-1] == 2)
        matches = server.metrics()
        assert matches['metainfer_pass_matches{pass_name="int4_gemm"}'] >= 14  # every quantized linear, per graph
        assert matches['metainfer_pass_matches{pass_name="fp8_gemm"}'] == 0
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(timeout=60)


def test_an_int4_folder_is_served_over_two_ranks(tmp_path_factory, tmp_path):
    """The same over `--ranks 2`: every rank cuts the int4 linears by their rows / columns (whole
    groups; act-order weights cannot be cut along K, so this folder has none), the row-parallel
    halves all-reduced; the tokens are the single process's."""
    import metainfer

    folder = tiny_model_folder(tmp_path_factory.mktemp("tiny-llama-gptq-tp"), "gptq", group=32, dtype=torch.float32)
    model = metainfer.load(folder, dtype=torch.float32)
    prompt = [5, 6, 7, 8]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0,
                          eos_token_id=2)[0, len(prompt):].tolist()
    server = ServerProcess(folder, tmp_path, "--ranks", "2", "--num-blocks", "64")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=10,
                                        temperature=0)
        got = out.choices[0].model_extra["token_ids"]
        assert got == want[:len(got)] and (len(got) == 10 or got[-1] == 2)
        metrics = server.metrics()
        assert metrics['metainfer_parallel_degree{kind="tp"}'] == 2
        assert metrics['metainfer_pass_matches{pass_name="int4_gemm"}'] >= 14
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(timeout=60)
