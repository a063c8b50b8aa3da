"""`impasto serve --data-parallel-size 2` on the default model: requests sharing a prefix
land on the engine that caches it (seen in the per-engine prefix-cache metrics), and killing
one engine under load fails only the requests it held while the other serves on."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest

from tests.server.conftest import Server, metric_values, start_server

SYSTEM = (
    "You are a careful assistant for a paint shop. Answer in one short sentence, name the "
    "colour, and never mention prices. Customers ask about oils, acrylics and brushes. "
)


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory) -> Server:
    srv = start_server(
        tmp_path_factory.mktemp("dp-server"),
        api_key=None,
        extra=["--data-parallel-size", "2", "--dtype", "bfloat16"],
    )
    try:
        yield srv
    finally:
        srv.stop()


def engine_pids(server: Server) -> list[int]:
    m = re.search(r"engine process pid ([\d, ]+)\)", server.log())
    assert m, server.log()
    return [int(p) for p in m.group(1).split(", ")]


def by_engine(server: Server, name: str) -> dict[str, float]:
    return {
        dict(labels)["engine"]: v
        for (n, labels), v in metric_values(server).items()
        if n == name and "engine" in dict(labels)
    }


def complete(server: Server, prompt: str, max_tokens: int = 4, timeout: float = 120) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=timeout)
    return {"status": r.status_code, **r.json()}


def test_metrics_are_labelled_per_engine(dp_server):
    alive = by_engine(dp_server, "impasto:engine_alive")
    assert alive == {"0": 1.0, "1": 1.0}
    assert set(by_engine(dp_server, "impasto:num_requests_running")) == {"0", "1"}


def test_shared_prefix_goes_to_the_engine_that_caches_it(dp_server):
    routed0 = by_engine(dp_server, "impasto:router_requests_total")
    hits0 = by_engine(dp_server, "impasto:prefix_cache_hits_total")
    for q in ("Which blue is warmest?", "What cleans oil brushes?", "Is gesso needed?"):
        assert complete(dp_server, SYSTEM + q)["status"] == 200
    routed = by_engine(dp_server, "impasto:router_requests_total")
    hits = by_engine(dp_server, "impasto:prefix_cache_hits_total")
    new = {e: routed[e] - routed0.get(e, 0) for e in routed}
    (engine,) = [e for e, n in new.items() if n]  # all three on one engine
    assert new[engine] == 3
    assert hits[engine] - hits0.get(engine, 0) >= 2 * 32  # two repeats of the shared prompt
    other = "1" if engine == "0" else "0"
    assert hits.get(other, 0) == hits0.get(other, 0)


def kill_engine_under_load(server, num_requests: int, max_tokens: int) -> list[int]:
    """Send `num_requests` different prompts at once (the router spreads them), SIGKILL engine
    1 once it runs one of them, and return the HTTP statuses (shared with the Ray tests)."""

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"Story number {i}: once upon a time", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        r = await client.post(server.url + "/v1/completions", json=body, timeout=180)
        return r.status_code

    async def run() -> list[int]:
        async with httpx.AsyncClient() as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(num_requests)]
            deadline = time.monotonic() + 60
            while by_engine(server, "impasto:num_requests_running").get("1", 0) == 0:
                assert time.monotonic() < deadline, "engine 1 never got a request"
                await asyncio.sleep(0.1)
            os.kill(engine_pids(server)[1], signal.SIGKILL)  # a process, or a Ray actor's
            return await asyncio.gather(*tasks)

    return asyncio.run(run())


def test_killing_one_engine_fails_only_its_requests(dp_server):
    statuses = kill_engine_under_load(dp_server, 6, 200)
    assert statuses.count(200) >= 1 and len([s for s in statuses if s != 200]) >= 1, statuses
    assert all(s in (200, 500, 503) for s in statuses), statuses
    # The survivor serves on; the dead engine is reported and never chosen again.
    assert httpx.get(dp_server.url + "/health", timeout=10).status_code == 200
    for q in ("a", "b", "c"):
        assert complete(dp_server, SYSTEM + q)["status"] == 200
    assert by_engine(dp_server, "impasto:engine_alive") == {"0": 1.0, "1": 0.0}
    assert dp_server.proc.poll() is None
