"""A real `impasto serve` (default model) on a free localhost port, shared by the tests.

Invariants: every wait is bounded; the server process (and with it the engine process) is
stopped with SIGTERM and, failing that, killed, whatever the tests did.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from impasto.bench.server_process import free_port, stop_server, wait_healthy

API_KEY = "test-key"
STARTUP_TIMEOUT_S = 180.0
SERVER_FLAGS = [
    "--max-model-len", "512", "--max-num-seqs", "128", "--dtype", "float32",
    "--disable-uvicorn-access-log", "--log-level", "warning",
]  # fmt: skip


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pid(self) -> int:
        m = re.search(r"engine process pid (\d+)", self.log())
        assert m, self.log()
        return int(m.group(1))

    def openai(self, **kw):
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw
        )

    def async_openai(self, **kw):
        import openai

        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw
        )

    def stop(self, timeout_s: float = 30.0) -> int | None:
        return stop_server(self.proc, timeout_s)


def start_server(
    tmp: Path,
    api_key: str | None = API_KEY,
    extra: list[str] = (),
    env: dict[str, str] | None = None,
    scheme: str = "http",
) -> Server:
    """Start a server; `env` adds environment variables (IMPASTO_API_KEY is cleared unless
    given there, so the tests see only the keys they pass)."""
    port = free_port()
    log_path = tmp / f"server-{port}.log"
    cmd = [sys.executable, "-m", "impasto.entrypoints.cli", "serve", "--port", str(port)]
    cmd += SERVER_FLAGS + list(extra)
    if api_key:
        cmd += ["--api-key", api_key]
    base = {k: v for k, v in os.environ.items() if k != "IMPASTO_API_KEY"}
    env = dict(base, PYTHONUNBUFFERED="1", **(env or {}))
    log = open(log_path, "wb")  # noqa: SIM115 - the child writes it; closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log_path, api_key, scheme)
    try:
        healthy = wait_healthy(proc, server.url, STARTUP_TIMEOUT_S, verify=scheme == "http")
    except RuntimeError as e:
        raise RuntimeError(f"{e}:\n{server.log()}") from None
    if not healthy:
        server.stop()
        raise RuntimeError(f"server did not start in {STARTUP_TIMEOUT_S} s:\n{server.log()}")
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    srv = start_server(tmp_path_factory.mktemp("server"))
    try:
        yield srv
    finally:
        srv.stop()


def metric_values(server: Server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (name, sorted labels), via prometheus' own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def wait_idle(server: Server, timeout_s: float = 30.0) -> dict:
    """Wait until nothing runs or waits and no KV block is held; return the metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metric_values(server)
        idle = (
            m[("impasto:num_requests_running", ())] == 0
            and m[("impasto:num_requests_waiting", ())] == 0
            and m[("impasto:kv_cache_usage_perc", ())] == 0
        )
        if idle:
            return m
        assert time.monotonic() < deadline, f"engine not idle: {m}"
        time.sleep(0.2)
