"""Load held: a live server under sustained concurrency, then past its bounded waiting queue.

Phase 1 ("sustained"): N streaming completions at concurrency C against the default model;
every one must succeed. Phase 2 ("overload"): a server with `--max-waiting-requests W` gets
far more concurrent requests than it seats plus W; the extra ones must be refused with 503 and
`Retry-After` (never another 5xx, never a hang), the rest must succeed, and the server must be
healthy afterwards. Prints one table row per phase: requests/s, output tokens/s, the status
codes seen, and the KV blocks in use once idle (0 = nothing leaked).

    python benchmarks/load_held.py                      # defaults below
    python benchmarks/load_held.py --num-requests 400 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Phase:
    name: str
    statuses: collections.Counter = field(default_factory=collections.Counter)
    retry_after: int = 0  # 503s that carried Retry-After
    tokens: int = 0
    seconds: float = 0.0
    max_latency: float = 0.0
    blocks_in_use: float = -1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], log) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "impasto.entrypoints.cli", "serve", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            import urllib.request

            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("server did not become healthy")


async def _one(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int, phase: Phase):
    body = {
        "prompt": f"Request {i}: write a short note about the colour number {i}.",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as resp:
        status = resp.status
        if status == 503 and resp.headers.get("Retry-After"):
            phase.retry_after += 1
        text = await resp.text()
    if status == 200:
        for line in text.splitlines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    status = 599  # an error inside a stream: counted apart
                elif chunk.get("usage"):
                    phase.tokens += chunk["usage"]["completion_tokens"]
    phase.statuses[status] += 1
    phase.max_latency = max(phase.max_latency, time.perf_counter() - start)


async def run_phase(url: str, phase: Phase, n: int, concurrency: int, max_tokens: int) -> None:
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=900)

    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def guarded(i: int) -> None:
            async with sem:
                await _one(session, url, i, max_tokens, phase)

        start = time.perf_counter()
        await asyncio.gather(*(guarded(i) for i in range(n)))
        phase.seconds = time.perf_counter() - start
        await asyncio.sleep(1.0)  # the engine's gauges refresh after its last step
        async with session.get(url + "/health") as r:
            assert r.status == 200, f"unhealthy after {phase.name}: {r.status}"
        async with session.get(url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith("impasto:kv_cache_usage_perc"):
                    phase.blocks_in_use = float(line.split()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--overload-requests", type=int, default=256)
    p.add_argument("--overload-concurrency", type=int, default=128)
    p.add_argument("--max-waiting-requests", type=int, default=16)
    args = p.parse_args()
    base = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "512"]
    phases = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra, n, conc in (
            ("sustained", [], args.num_requests, args.concurrency),
            (
                "overload",
                ["--max-waiting-requests", str(args.max_waiting_requests)],
                args.overload_requests,
                args.overload_concurrency,
            ),
        ):
            log = open(os.path.join(tmp, f"{name}.log"), "wb")  # noqa: SIM115
            proc, url = start_server(base + extra, log)
            phase = Phase(name)
            try:
                asyncio.run(run_phase(url, phase, n, conc, args.max_tokens))
            finally:
                proc.terminate()
                proc.wait(60)
                log.close()
            phases.append((phase, n, conc))
    print(
        "| phase | requests | concurrency | req/s | output tok/s | statuses | 503 with "
        "Retry-After | slowest (s) | KV in use when idle |\n|---|---|---|---|---|---|---|---|---|"
    )
    bad = 0
    for phase, n, conc in phases:
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(phase.statuses.items()))
        ok = phase.statuses[200]
        print(
            f"| {phase.name} | {n} | {conc} | {ok / phase.seconds:.2f} | "
            f"{phase.tokens / phase.seconds:.1f} | {codes} | {phase.retry_after} | "
            f"{phase.max_latency:.1f} | {phase.blocks_in_use:.3f} |"
        )
        allowed = {200} if phase.name == "sustained" else {200, 503}
        bad += sum(v for k, v in phase.statuses.items() if k not in allowed)
        bad += phase.blocks_in_use != 0.0
        if phase.name == "overload":
            bad += phase.retry_after != phase.statuses[503]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
