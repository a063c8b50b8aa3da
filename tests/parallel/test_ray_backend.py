"""`impasto serve --data-parallel-size 2 --distributed-executor-backend ray` on a local Ray
cluster (one node, loopback only) and the default model: the two engines run as Ray actors;
greedy and seeded completions equal a single-engine server's; /metrics labels both engines;
killing one engine's actor process fails only the requests it held while the other serves on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

pytest.importorskip("ray", reason="the ray backend needs Ray (pip install 'impasto[ray]')")

from impasto.bench.server_process import free_port  # noqa: E402
from impasto.engine.ray_launcher import _is_loopback, describe_death  # noqa: E402
from tests.parallel.test_dp_server import (  # noqa: E402
    by_engine,
    engine_pids,
    kill_engine_under_load,
)
from tests.server.conftest import Server, start_server  # noqa: E402

pytestmark = pytest.mark.slow

# Ray on loopback only: with a 127.0.0.1 node address and this flag (a single-node cluster),
# Ray neither replaces the address by the machine's own nor listens beyond it.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
START_TIMEOUT_S = 90
# Round robin: the sequential requests of the tests alternate engines, so both are compared.
RAY_SERVER_FLAGS = ["-dp", "2", "--distributed-executor-backend", "ray"]
RAY_SERVER_FLAGS += ["--data-parallel-routing", "round_robin"]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Three primary colours are",
    "Oil paint dries by",
]
REQUESTS = [  # (prompt, sampling) pairs: greedy and seeded
    *[(p, {"temperature": 0}) for p in PROMPTS],
    *[(p, {"temperature": 0.9, "top_p": 0.9, "seed": 7 + i}) for i, p in enumerate(PROMPTS)],
]
MAX_TOKENS = 12


def _ray_cli() -> list[str]:
    """The `ray` command of this interpreter's environment (a virtualenv need not be on PATH)."""
    exe = Path(sys.executable).parent / "ray"
    return [str(exe)] if exe.exists() else [shutil.which("ray") or "ray"]


def _ray(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*_ray_cli(), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@dataclass
class Cluster:
    address: str
    temp_dir: str  # in the command line of each of its processes

    def processes(self) -> list[psutil.Process]:
        """The cluster's processes and their children (the workers: our engine actors)."""
        procs = []
        for proc in psutil.process_iter(["cmdline"]):
            if any(self.temp_dir in arg for arg in proc.info["cmdline"] or []):
                procs += [proc, *proc.children(recursive=True)]
        return procs


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node on 127.0.0.1 (2 CPUs, no dashboard), its address; always stopped."""
    env = dict(os.environ, **RAY_ENV)
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths
    try:
        started = _ray(
            "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
            "--num-cpus", "2", "--include-dashboard=false", "--disable-usage-stats",
            "--temp-dir", temp_dir, env=env, timeout=START_TIMEOUT_S,
        )  # fmt: skip
        assert started.returncode == 0, started.stdout + started.stderr
        yield Cluster(f"127.0.0.1:{port}", temp_dir)
    finally:
        _ray("stop", "--force", env=env, timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tmp_path_factory) -> Server:
    srv = start_server(
        tmp_path_factory.mktemp("ray-server"),
        api_key=None,
        extra=RAY_SERVER_FLAGS,
        env=dict(RAY_ENV, RAY_ADDRESS=ray_cluster.address),
    )
    try:
        yield srv
    finally:
        srv.stop()


def complete(server: Server, prompt: str, sampling: dict, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, **sampling}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"text": choice["text"], "finish_reason": choice["finish_reason"]}


def test_loopback_and_death_descriptions():
    assert _is_loopback("127.0.0.1:6379") and _is_loopback("localhost:1")
    assert not _is_loopback("10.1.2.3:6379") and not _is_loopback("ray://head:10001")
    text = (
        "The actor died unexpectedly before finishing this task.\n\tpid: 12\n"
        "The actor is dead because its worker process has died. Worker exit type: "
        "SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error "
        "code 2. End of file. Some common causes include: ..."
    )
    assert describe_death(RuntimeError(text)) == (
        "Ray actor died: exit type SYSTEM_ERROR; Worker unexpectedly exits with a "
        "connection error code 2"
    )
    assert describe_death(RuntimeError("gone\nmore")) == "Ray actor died: gone"


def test_engines_are_ray_actors(ray_server):
    pids = engine_pids(ray_server)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    # Ray workers, not children of the server: their parent is the node's raylet.
    for pid in pids:
        parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        assert int(parent) != ray_server.proc.pid


def test_everything_listens_on_loopback_only(ray_cluster, ray_server):
    """The Ray processes, the engines and the front end (HTTP and its ZMQ sockets, bound on
    the node address Ray reports) listen on 127.0.0.1 only."""
    procs = [psutil.Process(ray_server.proc.pid), *ray_cluster.processes()]
    pids = {p.pid for p in procs}
    assert set(engine_pids(ray_server)) <= pids
    listening = [
        (c.pid, c.laddr.ip)
        for c in psutil.net_connections(kind="inet")
        if c.pid in pids and c.status == psutil.CONN_LISTEN
    ]
    assert listening, "no listening socket found"
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for _, ip in listening), listening
    # The front end's engine sockets (tcp for this backend) are among them.
    assert sum(pid == ray_server.proc.pid for pid, _ in listening) >= 1 + 2 * 2


def test_outputs_equal_one_engine(ray_server, tmp_path):
    got = [complete(ray_server, p, s) for p, s in REQUESTS]
    # The reference: one engine, a local process, through the same HTTP path.
    single = start_server(tmp_path, api_key=None)
    try:
        want = [complete(single, p, s) for p, s in REQUESTS]
    finally:
        single.stop()
    assert got == want


def test_metrics_are_labelled_per_engine(ray_server):
    assert by_engine(ray_server, "impasto:engine_alive") == {"0": 1.0, "1": 1.0}
    assert set(by_engine(ray_server, "impasto:num_requests_running")) == {"0", "1"}
    routed = by_engine(ray_server, "impasto:router_requests_total")
    assert routed["0"] >= len(REQUESTS) // 2 and routed["1"] >= len(REQUESTS) // 2


def test_killing_one_actor_fails_only_its_requests(ray_server):
    statuses = kill_engine_under_load(ray_server, 4, 48)
    assert statuses.count(200) >= 1 and any(s != 200 for s in statuses), statuses
    assert all(s in (200, 500, 503) for s in statuses), statuses
    assert "Ray actor died" in ray_server.log()
    assert httpx.get(ray_server.url + "/health", timeout=10).status_code == 200
    for p in PROMPTS[:2]:
        complete(ray_server, p, {"temperature": 0}, max_tokens=4)
    assert by_engine(ray_server, "impasto:engine_alive") == {"0": 1.0, "1": 0.0}
    assert ray_server.proc.poll() is None
