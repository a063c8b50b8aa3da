"""Client disconnects, an abort storm, engine-process death (SIGKILL) under load, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

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


def _timed_post(url: str, body: dict) -> tuple[httpx.Response, float]:
    r = httpx.post(url, json=body, timeout=120)
    return r, time.monotonic()


def _timed_rest(lines) -> tuple[list[str], float]:
    rest = [line for line in lines if line]
    return rest, time.monotonic()


def test_engine_sigkill_under_load(tmp_path):
    """SIGKILL the engine process with 3 streaming and 3 non-streaming requests in flight:
    /health answers 503 within 5 s, every request ends with an error within 10 s (streams: an
    error event then [DONE]; the others: a 500 with an OpenAI error body), new requests get a
    503 at once, and the server exits by itself, non-zero, after ~2 s of 503s."""
    srv = start_server(tmp_path, api_key=None)
    pool = ThreadPoolExecutor(8)
    streams = []
    try:
        for _ in range(3):
            client, resp = _open_stream(srv, max_tokens=450)
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")
            streams.append((client, resp, lines))
        body = {"prompt": "Tell me a long story.", "max_tokens": 450}
        body |= {"ignore_eos": True, "temperature": 0}
        posts = [pool.submit(_timed_post, srv.url + "/v1/completions", body) for _ in range(3)]
        deadline = time.monotonic() + 120
        while metric_values(srv)[("impasto:num_requests_running", ())] < 6:
            assert time.monotonic() < deadline, "the 6 requests never ran together"
            assert not any(f.done() for f in posts), [f.result() for f in posts if f.done()]
            time.sleep(0.1)

        os.kill(srv.engine_pid(), signal.SIGKILL)
        t_kill = time.monotonic()
        stream_ends = [pool.submit(_timed_rest, lines) for _, _, lines in streams]
        while httpx.get(srv.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() - t_kill < 5, "/health still 200 5 s after the kill"
            time.sleep(0.05)
        to_503 = time.monotonic() - t_kill
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503, r.text
        assert time.monotonic() - t0 < 2  # refused at once, not queued on a dead engine

        ends = []
        for f in stream_ends:
            rest, t_end = f.result(timeout=30)
            assert any(line.startswith('data: {"error"') for line in rest), rest[-3:]
            assert rest[-1] == "data: [DONE]", rest[-3:]
            ends.append(t_end - t_kill)
        for f in posts:
            r, t_end = f.result(timeout=30)
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == 500
            assert "engine process is dead" in err["message"]
            ends.append(t_end - t_kill)
        assert len(ends) == 6 and max(ends) < 10, ends

        code = srv.proc.wait(timeout=60)  # by itself: no signal sent to the server
        to_exit = time.monotonic() - t_kill
        assert code == 3, (code, srv.log()[-2000:])
        assert to_exit >= 1.5, to_exit  # /health kept answering 503 for the grace period
        assert "exiting with status 3" in srv.log()
        print(
            f"\nSIGKILL under load: 503 after {to_503:.2f} s; 6/6 in-flight requests failed, "
            f"the last after {max(ends):.2f} s; server exited with {code} after {to_exit:.2f} s"
        )
    finally:
        for client, resp, _ in streams:
            resp.close()
            client.close()
        pool.shutdown(wait=False, cancel_futures=True)
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
