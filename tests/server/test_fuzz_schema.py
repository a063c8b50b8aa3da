"""Schema-driven fuzzing of the HTTP API (schemathesis) against a live server.

Every operation of the server's own /openapi.json gets requests generated from its schema, both
valid ones (positive mode) and ones that break it (negative mode: wrong types, missing fields,
bodies that are not JSON objects). Each answer must be a non-5xx within a per-request timeout;
a 4xx must carry OpenAI's error body; after the run the server is healthy and generates.

The server has a small context (`--max-model-len 32`), so generated requests are refused or
finish in a few tokens. The suite runs a small, fixed set of examples (derandomized, so CI is
repeatable); `IMPASTO_FUZZ_EXAMPLES=N` runs a random campaign of N examples per operation and
mode, e.g.:

    IMPASTO_FUZZ_EXAMPLES=1000 pytest -s tests/server/test_fuzz_schema.py
"""

from __future__ import annotations

import os
import time
from collections import Counter

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.server.conftest import API_KEY, start_server

CAMPAIGN = int(os.environ.get("IMPASTO_FUZZ_EXAMPLES", "0"))
REQUEST_TIMEOUT_S = 60.0
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
# (operation, examples per mode in the suite): generation endpoints cost a model step.
OPERATIONS = {
    "POST /v1/completions": 25,
    "POST /v1/chat/completions": 25,
    "POST /tokenize": 20,
    "POST /detokenize": 20,
    "GET /health": 3,
    "GET /ping": 3,
    "GET /version": 3,
    "GET /v1/models": 3,
    "GET /metrics": 3,
    "GET /": 3,
}
SERVER_ARGS = ["--max-model-len", "32", "--max-num-seqs", "16"]

# (operation, mode) -> Counter of status codes, for the summary.
STATUSES: dict[tuple[str, str], Counter] = {}


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("fuzz"), API_KEY, SERVER_ARGS)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    url = fuzz_server.url + "/openapi.json"
    raw = httpx.get(url, headers=fuzz_server.headers, timeout=30).json()
    return schemathesis.openapi.from_dict(raw)


def _check(label: str, response: requests.Response) -> None:
    status = response.status_code
    assert status < 500, f"{label}: {status} {response.text[:1000]}"
    if status >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["code"] == status and err["message"], err


def test_every_operation_is_fuzzed(api_schema):
    labels = {op.ok().label for op in api_schema.get_all_operations()}
    assert labels == set(OPERATIONS), "a new endpoint needs a row in OPERATIONS"


def _fuzz(server, operation, mode, examples: int, seen: Counter) -> None:
    session = requests.Session()
    headers = dict(server.headers)

    @settings(
        max_examples=examples,
        derandomize=not CAMPAIGN,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case) -> None:
        response = case.call(
            base_url=server.url, session=session, headers=headers, timeout=REQUEST_TIMEOUT_S
        )
        seen[response.status_code] += 1
        _check(operation.label, response)

    fuzz()


@pytest.mark.parametrize("label", list(OPERATIONS))
def test_schema_fuzz(fuzz_server, api_schema, label):
    operation = api_schema.find_operation_by_label(label)
    modes = [POSITIVE, NEGATIVE] if operation.body else [POSITIVE]
    for mode in modes:
        seen = STATUSES.setdefault((label, mode.value), Counter())
        _fuzz(fuzz_server, operation, mode, CAMPAIGN or OPERATIONS[label], seen)
    assert httpx.get(fuzz_server.url + "/health", timeout=30).status_code == 200


def test_healthy_after_fuzzing(fuzz_server):
    """The summary (cases and statuses per operation and mode), then health and a real request."""
    total = Counter()
    for (label, mode), seen in sorted(STATUSES.items()):
        total.update(seen)
        print(f"fuzz {label} [{mode}]: {sum(seen.values())} cases, statuses {dict(seen)}")
    print(f"fuzz total: {sum(total.values())} cases, statuses {dict(total)}")
    assert not [s for s in total if s >= 500]
    deadline = time.monotonic() + 60
    while httpx.get(fuzz_server.url + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "server not healthy after fuzzing"
        time.sleep(0.5)
    body = {"prompt": "Paint is", "max_tokens": 3, "temperature": 0}
    r = httpx.post(fuzz_server.url + "/v1/completions", json=body, headers=fuzz_server.headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    log = fuzz_server.log()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]
