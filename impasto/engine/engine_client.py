"""The API process's handle on the engine process: spawn it, stream deltas, detect its death.

Invariants:
- `generate()` ends in exactly one of: a delta with `finished`, `EngineRequestError` (the
  engine refused or failed this request) or `EngineDeadError`. It never waits on a dead engine:
  the process sentinel is watched by the event loop, and its death fails every pending stream.
- Leaving `generate()` early (client disconnect, cancellation, a timeout) aborts the request in
  the engine, which frees its KV blocks.
- `died` is set once, when the engine process is found dead (never on a requested shutdown):
  the server watches it to answer 503 on /health and then exit non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from itertools import count
from typing import Any

import zmq
import zmq.asyncio

from impasto.config.engine_args import EngineArgs
from impasto.config.model import ModelConfig
from impasto.engine import ipc
from impasto.engine.launcher import EngineLauncher, EngineSpec, make_launcher, transport_of
from impasto.engine.processor import EngineRequest

logger = logging.getLogger("impasto")


class EngineDeadError(RuntimeError):
    def __init__(self, detail: str = "") -> None:
        super().__init__(f"The engine process is dead{': ' + detail if detail else ''}.")


class EngineRequestError(Exception):
    def __init__(self, err: ipc.RequestError) -> None:
        super().__init__(err.message)
        self.status, self.param, self.message = err.status, err.param, err.message
        self.reason = err.reason  # "queue_full" | "shutting_down" for a 503


def _merge(first: ipc.RequestDelta, rest: list[ipc.RequestDelta]) -> ipc.RequestDelta:
    """Fold consecutive deltas of one request into one (a slow reader gets bigger chunks)."""
    if not rest:
        return first
    by_index: dict[int, ipc.CompletionDelta] = {}
    for d in [first, *rest]:
        for c in d.completions:
            acc = by_index.get(c.index)
            if acc is None:
                by_index[c.index] = ipc.CompletionDelta(
                    c.index, c.text, list(c.token_ids), c.logprobs and list(c.logprobs),
                    c.cumulative_logprob, c.finish_reason, c.stop_reason,
                )  # fmt: skip
                continue
            acc.text += c.text
            acc.token_ids += c.token_ids
            if c.logprobs is not None:
                acc.logprobs = (acc.logprobs or []) + c.logprobs
            acc.cumulative_logprob = c.cumulative_logprob
            acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
    last = rest[-1]
    comps = sorted(by_index.values(), key=lambda c: c.index)
    return ipc.RequestDelta(
        first.request_id, comps, last.finished, last.num_prompt_tokens, last.num_cached_tokens
    )


class AsyncEngineClient:
    def __init__(
        self,
        args: EngineArgs,
        log_level: str = "info",
        *,
        cpus: tuple[int, ...] | None = None,
        index: int = 0,
        num_engines: int = 1,
        host: str | None = None,
    ) -> None:
        self.args = args
        self.log_level = log_level
        self.cpus = cpus  # the engine process is pinned to these cores (None: not pinned)
        self.index, self.num_engines = index, num_engines  # its place among DP engines
        # The front end's address for engines elsewhere (tcp transport); None: the launcher's
        # (for Ray, this node's IP as the cluster knows it).
        self.host = host
        self.errored = False
        self.dead_reason = ""
        self.model_config: ModelConfig | None = None  # from the engine's Ready message
        self.engine_pid: int | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._utility: dict[int, asyncio.Future] = {}
        self._call_ids = count()
        self._tmp = tempfile.mkdtemp(prefix="impasto-ipc-")
        self._launcher: EngineLauncher | None = None
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self.died = asyncio.Event()  # set by `_mark_dead`

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self, timeout_s: float = 900.0) -> None:
        """Start the engine process and wait until its model is loaded (or it failed)."""
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._out = self._actx.socket(zmq.PULL)
        for sock in (self._in, self._out):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        in_addr, out_addr = self._bind(self._in, "input"), self._bind(self._out, "output")
        spec = EngineSpec(
            self.args, in_addr, out_addr, self.log_level, self.cpus, self.index, self.num_engines
        )
        self._launcher = launcher = make_launcher(spec)
        launcher.start()
        self.engine_pid = launcher.pid
        exited = asyncio.create_task(launcher.wait_exit(), name=f"engine-{self.index}-exit")
        deadline = time.monotonic() + timeout_s
        while True:
            if await self._out.poll(200):
                msg = ipc.decode_output(await self._out.recv())
                if isinstance(msg, ipc.Ready):
                    break
                if isinstance(msg, ipc.StartupFailed):
                    exited.cancel()
                    await self.shutdown()
                    raise RuntimeError(f"engine startup failed: {msg.message}")
            elif exited.done():
                await self.shutdown()
                raise RuntimeError(f"the engine process exited during startup ({exited.result()})")
            elif time.monotonic() > deadline:
                exited.cancel()
                await self.shutdown()
                raise RuntimeError(f"the engine did not start within {timeout_s:.0f} s")
        self.model_config = msg.model
        self.engine_pid = msg.pid  # a Ray actor's process is only known once it runs
        self._tasks.append(asyncio.create_task(self._watch_exit(exited), name="engine-watch"))
        self._tasks.append(asyncio.create_task(self._output_loop(), name="engine-outputs"))

    def _bind(self, sock: zmq.Socket, name: str) -> str:
        """Bind a front-end socket; the address the engine connects to."""
        if transport_of(self.args) == "tcp":  # the engine may run on another machine
            if self.host is None:
                from impasto.engine.ray_launcher import front_end_host  # the only tcp backend

                self.host = front_end_host()
            sock.bind(f"tcp://{self.host}:*")
        else:
            sock.bind(f"ipc://{self._tmp}/{name}")
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        return endpoint.decode()

    async def _watch_exit(self, exited: asyncio.Task) -> None:
        reason = await exited
        if not self._closed:
            self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        if self.errored:
            return
        self.errored, self.dead_reason = True, reason
        self.died.set()
        logger.error("engine process died unexpectedly (%s); failing in-flight requests", reason)
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(reason))
        for fut in self._utility.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Drain and stop the engine process; kill it if it does not stop in time."""
        if self._closed:
            return
        self._closed = True
        launcher = self._launcher
        if launcher is not None:
            if launcher.is_alive():
                try:
                    self._in.send(ipc.encode(ipc.Shutdown()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            await launcher.stop(timeout_s)  # a dead engine too: its launcher frees its resources
        for task in self._tasks:
            task.cancel()
        for sock in (getattr(self, "_in", None), getattr(self, "_out", None)):
            if sock is not None:
                sock.close(0)
        shutil.rmtree(self._tmp, ignore_errors=True)

    # -- outputs ------------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            msg = ipc.decode_output(await self._out.recv())
            if isinstance(msg, ipc.Outputs):
                # Errors first: a refused prompt of a multi-prompt request then fails it before
                # the others' first deltas (a request never has both in one message).
                for err in msg.errors:
                    q = self._queues.get(err.request_id)
                    if q is not None:
                        q.put_nowait(EngineRequestError(err))
                for delta in msg.deltas:
                    q = self._queues.get(delta.request_id)
                    if q is not None:
                        q.put_nowait(delta)
            elif isinstance(msg, ipc.UtilityResult):
                fut = self._utility.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg.result)

    def _send(self, msg: ipc.EngineInput) -> None:
        if self.errored:
            raise EngineDeadError(self.dead_reason)
        try:
            self._in.send(ipc.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach the engine: {e}") from e

    # -- requests -----------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len if self.model_config else 0

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size if self.model_config else 0

    @property
    def model_path(self) -> str:
        return self.model_config.model_path if self.model_config else ""

    async def generate(self, request: EngineRequest) -> AsyncIterator[ipc.RequestDelta]:
        """Stream the deltas of an admitted request until it finishes."""
        request_id = request.request_id
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use.")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        finished = False
        try:
            self._send(ipc.AddRequest(request))
            while not finished:
                items = [await q.get()]
                while not q.empty():
                    items.append(q.get_nowait())
                for item in items:
                    if isinstance(item, Exception):
                        finished = True  # nothing to abort: the engine dropped it (or died)
                        raise item
                delta = _merge(items[0], items[1:])
                finished = delta.finished
                yield delta
        finally:
            self._queues.pop(request_id, None)
            if not finished and not self.errored:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        try:
            self._send(ipc.Abort([request_id]))
        except EngineDeadError:
            pass

    async def call_utility(self, method: str, timeout_s: float = 10.0) -> dict[str, Any]:
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._utility[call_id] = fut
        try:
            self._send(ipc.UtilityCall(call_id, method))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._utility.pop(call_id, None)

    @property
    def is_alive(self) -> bool:
        return not self.errored and self._launcher is not None and self._launcher.is_alive()
