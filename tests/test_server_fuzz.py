"""The server under API fuzzing: schemathesis draws requests from the server's own OpenAPI
schema (metainfer.server.schema), valid ones and ones that break it, and sends them to a real
`metainfer serve` process. After every request: no 5xx, every error in OpenAI's shape, the
answer conforms to the schema (status, content type, body), nothing left running, no KV block
held, and the server alive. The default tier draws FUZZ_EXAMPLES requests per operation; the
`fuzz` tier (`pytest -m fuzz tests/test_server_fuzz.py`) draws FUZZ_LONG_EXAMPLES."""

from __future__ import annotations

import signal
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.specs.openapi import checks  # noqa: E402

from metainfer.testing import ServerProcess, tiny_model_folder  # noqa: E402

KEY = "fuzz-key"
FUZZ_EXAMPLES, FUZZ_LONG_EXAMPLES = 25, 400
# answers conform to the schema, nothing is a 5xx, and a body the schema rules out is refused (4xx)
CHECKS = [checks.status_code_conformance, checks.content_type_conformance, checks.response_schema_conformance,
          checks.negative_data_rejection, schemathesis.checks.not_a_server_error]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    folder = tiny_model_folder(tmp_path_factory.mktemp("tiny-llama"))
    s = ServerProcess(folder, tmp_path_factory.mktemp("server"), "--api-key", KEY, "--max-running", "4",
                      "--max-queue", "4", "--num-blocks", "64", "--request-timeout", "60", key=KEY)
    yield s
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0, s.tail()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def _after(case, response, server):
    """The invariants every answer keeps, whatever was sent."""
    assert response.status_code < 500, response.text
    content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis: each header a list
    if response.status_code >= 400 and content_type.startswith("application/json"):
        error = response.json().get("error")
        assert isinstance(error, dict), f"{case.method} {case.path} {response.status_code}: {response.text}"
        assert isinstance(error["message"], str) and error["message"] and "type" in error and "param" in error
    if case.path.startswith("/v1/") and case.method == "POST":
        deadline = time.monotonic() + 10
        while True:  # the request's sequences are out of the engine and their KV blocks back in the pool
            m = server.metrics()
            if m["metainfer_requests_running"] == 0 and m['metainfer_kv_blocks{state="used"}'] == 0:
                break
            assert time.monotonic() < deadline, f"left running after {case.body!r}: {m}"
            time.sleep(0.05)
    assert server.proc.poll() is None, server.tail()


def _fuzz(case, fuzz_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    response = case.call(headers=headers, timeout=120)
    case.validate_response(response, checks=CHECKS, headers=headers)
    _after(case, response, fuzz_server)


@schema.parametrize()
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_the_api_under_fuzzing(case, fuzz_server):
    _fuzz(case, fuzz_server)


@pytest.mark.fuzz
@schema.parametrize()
@settings(max_examples=FUZZ_LONG_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_under_long_fuzzing(case, fuzz_server):
    _fuzz(case, fuzz_server)
