"""How an engine process is started, watched and stopped: one interface for local processes
and for Ray actors (`ray_launcher.py`), so the client and the data-parallel front end never
care where an engine runs.

Invariants:
- `start` returns once the engine is running its entry point (it has not necessarily loaded
  its model: the engine's `Ready` message says that);
- `wait_exit` resolves exactly when the engine is gone, with a description of how it ended
  (exit code or signal, or the actor's death); it never resolves while the engine runs;
- `stop` leaves no engine behind: after the grace period it terminates, then kills.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from dataclasses import dataclass
from typing import Protocol

from impasto.config.engine_args import EngineArgs


@dataclass(frozen=True)
class EngineSpec:
    """What an engine process needs to start: its arguments, the front end's sockets (the
    engine connects; the front end binds), and where it may run."""

    args: EngineArgs
    input_addr: str
    output_addr: str
    log_level: str = "info"
    cpus: tuple[int, ...] | None = None  # pinned to these cores (None: wherever the OS puts it)
    index: int = 0  # its place among data-parallel engines (names, logs, metrics)
    num_engines: int = 1  # how many data-parallel engines the front end starts


class EngineLauncher(Protocol):
    pid: int | None

    def start(self) -> None: ...

    def is_alive(self) -> bool: ...

    async def wait_exit(self) -> str: ...

    async def stop(self, timeout_s: float) -> None: ...


class ProcessLauncher:
    """A local engine process (multiprocessing, spawn: no state inherited from the API process)."""

    # Sockets the engine connects to: Unix-domain sockets in a private folder.
    transport = "ipc"

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.pid: int | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None

    def start(self) -> None:
        from impasto.engine.engine_process import run_engine_process

        s = self.spec
        mp = multiprocessing.get_context("spawn")
        self._proc = mp.Process(
            target=run_engine_process,
            args=(s.args, s.input_addr, s.output_addr, os.getpid(), s.log_level, s.cpus),
            name=f"impasto-engine-{s.index}",
            daemon=True,
        )
        self._proc.start()
        self.pid = self._proc.pid

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    async def wait_exit(self) -> str:
        proc = self._proc
        assert proc is not None, "start() first"
        loop = asyncio.get_running_loop()
        gone = loop.create_future()

        def _exited() -> None:
            if not gone.done():
                gone.set_result(None)

        loop.add_reader(proc.sentinel, _exited)
        try:
            await gone
        finally:
            loop.remove_reader(proc.sentinel)
        # The sentinel closes a moment before the process can be reaped: wait for its status
        # (bounded; microseconds in practice) so the description names the signal or code.
        proc.join(0.5)
        return f"exit code {proc.exitcode}"

    async def stop(self, timeout_s: float) -> None:
        """Wait for the engine to leave (it was told to), then terminate, then kill."""
        proc = self._proc
        if proc is None:
            return
        deadline = time.monotonic() + timeout_s
        while proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.is_alive():
            proc.terminate()
            proc.join(3)
        if proc.is_alive():
            proc.kill()
            proc.join(3)


def make_launcher(spec: EngineSpec) -> EngineLauncher:
    if spec.args.parallel_config().backend == "ray":
        from impasto.engine.ray_launcher import RayLauncher  # Ray is an optional extra

        return RayLauncher(spec)
    return ProcessLauncher(spec)


def transport_of(args: EngineArgs) -> str:
    """ "ipc" (local Unix sockets) or "tcp" (engines that may run on another machine)."""
    return "tcp" if args.parallel_config().backend == "ray" else "ipc"
