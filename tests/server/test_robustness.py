"""Client disconnects, an abort storm, engine-process death and SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx

from tests.server.conftest import metric_values, start_server, wait_idle

MODEL = "SmolLM2-135M-Instruct"
ABORTED = ("impasto:request_success_total", (("finished_reason", "abort"),))


def _open_stream(server, max_tokens: int = 400) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(timeout=60)
    body = {"prompt": "Tell me a long story.", "max_tokens": max_tokens, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    req = client.build_request(
        "POST", server.url + "/v1/completions", json=body, headers=server.headers
    )
    return client, client.send(req, stream=True)


def test_disconnect_mid_stream_frees_blocks(server):
    before = wait_idle(server)
    client, resp = _open_stream(server)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    got = 0
    while got < 3:
        if next(lines).startswith("data: {"):
            got += 1
    running = metric_values(server)
    assert running[("impasto:num_requests_running", ())] == 1
    assert running[("impasto:kv_cache_usage_perc", ())] > 0
    resp.close()
    client.close()
    after = wait_idle(server, timeout_s=20)  # aborted: no block held, nothing running
    assert after.get(ABORTED, 0) - before.get(ABORTED, 0) == 1
    generated = after[("impasto:generation_tokens_total", ())]
    time.sleep(1.0)
    assert metric_values(server)[("impasto:generation_tokens_total", ())] == generated


def test_abort_storm_others_exact(server):
    """100 concurrent streams, 10 cancelled mid-way: the 90 others produce exactly their solo
    greedy tokens, and no block leaks."""
    prompts = [f"Item {i}: the color of the sky is" for i in range(10)]
    client = server.openai()
    kw = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    solo = {p: client.completions.create(prompt=p, **kw).choices[0].text for p in prompts}
    wait_idle(server)

    async def run() -> list[str | None]:
        aclient = server.async_openai(timeout=300)

        async def one(i: int) -> str | None:
            prompt = prompts[i % 10]
            if i % 10 == 3:  # one in ten: a long stream, cancelled after a few chunks
                stream = await aclient.completions.create(
                    prompt=prompt, stream=True, model=MODEL, max_tokens=400,
                    temperature=0, extra_body={"ignore_eos": True},
                )  # fmt: skip
                n = 0
                async for _ in stream:
                    n += 1
                    if n == 1 + i % 3:
                        break
                await stream.close()
                return None
            stream = await aclient.completions.create(prompt=prompt, stream=True, **kw)
            return "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(100))), 300)
        finally:
            await aclient.close()

    results = asyncio.run(run())
    for i, text in enumerate(results):
        if i % 10 != 3:
            assert text == solo[prompts[i % 10]], (i, text)
    wait_idle(server, timeout_s=30)


def test_engine_death_and_sigterm(tmp_path):
    srv = start_server(tmp_path, api_key=None)
    try:
        client, resp = _open_stream(srv, max_tokens=450)
        lines = resp.iter_lines()
        assert next(lines).startswith("data: {")
        os.kill(srv.engine_pid(), signal.SIGKILL)
        t0 = time.monotonic()
        rest = list(lines)  # the stream must end promptly, with an error chunk and [DONE]
        assert time.monotonic() - t0 < 10
        assert any(line.startswith('data: {"error"') for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]" or rest[-2] == "data: [DONE]"
        client.close()
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 500 and r.json()["error"]["code"] == 500
        assert time.monotonic() - t0 < 2  # fails fast
        assert srv.stop(timeout_s=20) == 0  # SIGTERM: clean exit
    finally:
        srv.stop()


def test_sigterm_drains_in_flight(tmp_path):
    srv = start_server(tmp_path, api_key=None)
    try:
        client, resp = _open_stream(srv, max_tokens=12)
        lines = resp.iter_lines()
        assert next(lines).startswith("data: {")
        engine_pid = srv.engine_pid()
        srv.proc.send_signal(signal.SIGTERM)
        rest = list(lines)  # the open stream still completes
        assert rest[-1] == "data: [DONE]" or rest[-2] == "data: [DONE]"
        assert not any('"error"' in line for line in rest)
        assert srv.proc.wait(30) == 0
        client.close()
        time.sleep(0.5)
        try:
            os.kill(engine_pid, 0)
            raise AssertionError("the engine process outlived the server")
        except ProcessLookupError:
            pass
    finally:
        srv.stop()
