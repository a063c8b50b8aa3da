"""Overload and limits on a real server: the bounded waiting queue (503 + Retry-After), the
per-request timeout (504, blocks freed) and a client that leaves during a long prefill.

Two servers for the module. `limits`: 2 seats in the running batch, 2 waiting places and a
4-token step budget (a 1500-token prompt takes ~375 steps of prefill). `timeouts`: 2 seats and
a 10 s request timeout. Every test leaves its engine idle, with no KV block held. Bounds are
loose: the machine these run on may be busy and slow (0.5 s per step has been seen).
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import metric_values, start_server, wait_idle

TIMEOUT_S = 10.0
LIMIT_FLAGS = [
    "--max-model-len", "2048", "--max-num-seqs", "2", "--max-waiting-requests", "2",
    "--max-num-batched-tokens", "4",
]  # fmt: skip
TIMEOUT_FLAGS = ["--max-model-len", "2048", "--max-num-seqs", "2", "--request-timeout", "10"]
RUNNING, WAITING = ("impasto:num_requests_running", ()), ("impasto:num_requests_waiting", ())
KV, GENERATED = ("impasto:kv_cache_usage_perc", ()), ("impasto:generation_tokens_total", ())
ABORTED = ("impasto:request_success_total", (("finished_reason", "abort"),))
QUEUE_FULL = ("impasto:request_rejected_total", (("reason", "queue_full"),))
TIMEOUTS = ("impasto:request_timeout_total", ())
LONG = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True}


@pytest.fixture(scope="module")
def limits(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("limits"), api_key=None, extra=LIMIT_FLAGS)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def timeouts(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("timeouts"), api_key=None, extra=TIMEOUT_FLAGS)
    try:  # a first request warms the engine up: the timed ones then start promptly
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        yield srv
    finally:
        srv.stop()


def _raw_post(server, body: dict) -> socket.socket:
    """Send a request on a bare socket and read nothing: closing the socket is a client that
    leaves, at a moment the test chooses."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(head.encode() + data)
    return sock


def _hang_up(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _wait_for(server, cond, what: str, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metric_values(server)
        if cond(m):
            return m
        assert time.monotonic() < deadline, f"never {what}: {m}"
        time.sleep(0.1)


def _open_stream(server, body: dict) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(timeout=120)
    req = client.build_request("POST", server.url + "/v1/completions", json=body | {"stream": True})
    return client, client.send(req, stream=True)


def _check_error(r: httpx.Response, status: int, err_type: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == err_type, err
    return err


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_during_prefill_frees_blocks(limits, stream):
    """A client leaves while its 1500-token prompt is in chunked prefill (4 tokens a step):
    the request is aborted before any token is generated and its blocks are freed."""
    before = wait_idle(limits)
    body = {"prompt": list(range(1000, 2500)), "max_tokens": 4, "stream": stream}
    sock = _raw_post(limits, body)
    try:
        mid = _wait_for(limits, lambda m: m[RUNNING] == 1 and m[KV] > 0, "in prefill")
        assert mid[GENERATED] == before[GENERATED]  # no first token yet: still prefilling
    finally:
        _hang_up(sock)
    t0 = time.monotonic()
    after = wait_idle(limits, timeout_s=10)
    freed_s = time.monotonic() - t0
    assert after[GENERATED] == before[GENERATED]  # aborted mid-prefill, nothing generated
    assert after[ABORTED] - before.get(ABORTED, 0) == 1
    print(f"\nprefill disconnect (stream={stream}): KV usage {mid[KV]:.4f} -> 0 "
          f"in {freed_s:.2f} s")  # fmt: skip


def test_waiting_queue_bound(limits):
    """2 running, then waiting requests up to the bound of 2; a request with n choices takes n
    places; past the bound the answer is a 503 with Retry-After and OpenAI's error body,
    streaming or not, and the refusals are counted."""
    before = wait_idle(limits)
    socks = [_raw_post(limits, LONG), _raw_post(limits, LONG)]
    try:
        _wait_for(limits, lambda m: m[RUNNING] == 2, "2 running")
        socks.append(_raw_post(limits, {"prompt": "hi", "max_tokens": 5}))
        _wait_for(limits, lambda m: m[RUNNING] == 2 and m[WAITING] == 1, "1 waiting")

        t0 = time.monotonic()  # one place left: n=2 does not fit
        r = httpx.post(limits.url + "/v1/completions", json={"prompt": "hi", "n": 2}, timeout=60)
        refused_s = time.monotonic() - t0
        err = _check_error(r, 503, "ServiceUnavailableError")
        assert r.headers["retry-after"] == "1"
        assert "waiting queue is full" in err["message"] and "2 slots" in err["message"]

        socks.append(_raw_post(limits, {"prompt": "hi", "max_tokens": 5}))  # n=1 fits
        _wait_for(limits, lambda m: m[WAITING] == 2, "2 waiting")
        client, resp = _open_stream(limits, {"prompt": "hi", "max_tokens": 5})
        try:
            resp.read()
            err = _check_error(resp, 503, "ServiceUnavailableError")  # before any SSE event
            assert resp.headers["retry-after"] == "1"
        finally:
            resp.close()
            client.close()
        m = metric_values(limits)
        assert m[QUEUE_FULL] - before.get(QUEUE_FULL, 0) == 2
        assert (m[RUNNING], m[WAITING]) == (2, 2)  # the refusals changed nothing
    finally:
        for sock in socks:
            _hang_up(sock)
    after = wait_idle(limits, timeout_s=30)
    assert after[ABORTED] - before.get(ABORTED, 0) == 4
    print(f"\nqueue bound: 2 running + 2 waiting held; 2/2 over-limit requests got 503 "
          f"(the first after {refused_s:.2f} s)")  # fmt: skip


def test_request_timeout(timeouts):
    """Past --request-timeout: a running stream gets a 504 error event then [DONE], a running
    and a queued non-streaming request get a 504 body; all are aborted in the engine (no
    block held after) and counted."""
    before = wait_idle(timeouts)
    pool = ThreadPoolExecutor(2)
    t0 = time.monotonic()
    try:
        client, resp = _open_stream(timeouts, LONG)
        assert resp.status_code == 200
        posts = [
            pool.submit(httpx.post, timeouts.url + "/v1/completions", json=LONG, timeout=120)
            for _ in range(2)  # one takes the second seat, one waits
        ]
        lines = [line for line in resp.iter_lines() if line]
        stream_s = time.monotonic() - t0
        resp.close()
        client.close()
        errors = [json.loads(line[6:]) for line in lines if line.startswith('data: {"error"')]
        assert len(errors) == 1 and errors[0]["error"]["code"] == 504, lines[-3:]
        assert lines[-1] == "data: [DONE]"
        assert lines[0].startswith('data: {"id"')  # it was streaming tokens at the deadline
        for f in posts:
            r = f.result(timeout=60)
            err = _check_error(r, 504, "TimeoutError")
            assert f"timed out after {TIMEOUT_S:g} s" in err["message"]
        posts_s = time.monotonic() - t0
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    assert TIMEOUT_S - 0.5 < stream_s < TIMEOUT_S + 10, stream_s
    assert posts_s < TIMEOUT_S + 10, posts_s
    after = wait_idle(timeouts, timeout_s=15)  # aborted in the engine: no block held
    assert after[TIMEOUTS] - before.get(TIMEOUTS, 0) == 3
    assert after[ABORTED] - before.get(ABORTED, 0) == 3
    print(f"\nrequest timeout {TIMEOUT_S:g} s: stream ended at {stream_s:.2f} s, "
          f"3/3 requests 504 by {posts_s:.2f} s")  # fmt: skip
