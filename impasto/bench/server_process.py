"""Starting and stopping a local OpenAI-compatible server process (benchmarks and tests).

Invariant: every wait is bounded, and a stopped server is gone: SIGTERM first (impasto and vLLM
drain and exit), a kill when that does not end it in time.
"""

from __future__ import annotations

import signal
import subprocess
import time

import httpx

from impasto.core.ports import free_port

__all__ = ["free_port", "stop_server", "wait_healthy"]


def wait_healthy(
    proc: subprocess.Popen, url: str, timeout_s: float, poll_s: float = 0.3, verify: bool = True
) -> bool:
    """Wait until `url`/health answers 200: True; False on timeout. Raises RuntimeError when
    the process exits first. `verify=False`: accept a self-signed certificate (https)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited during startup (code {proc.returncode})")
        try:
            if httpx.get(f"{url}/health", timeout=2, verify=verify).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    return False


def stop_server(proc: subprocess.Popen, timeout_s: float = 30.0) -> int | None:
    """SIGTERM, then a kill after `timeout_s`; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode
