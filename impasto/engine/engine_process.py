"""The engine loop in its own process, driven by messages from the API process over ZMQ.

Invariants:
- Nothing a request does can end the loop: admission errors become `RequestError(400)`, a full
  waiting queue `RequestError(503, reason="queue_full")`, a step that raises fails the requests
  in flight (500) and the loop goes on.
- A 500's message is generic with an error id; the details (traceback) are logged here under
  that id, never sent to the API process's clients.
- Every request the loop accepted gets exactly one terminal message (a delta with `finished`,
  or an error), unless the API process aborted it first.
- Requests arrive admitted (`EngineRequest`): nothing is re-tokenized or re-validated here;
  the engine's deltas are forwarded as they are (`ipc.to_wire`), no diffing.
- The process exits when told to (after draining), or when its parent process is gone; and
  with status 1 when the engine is dead (`EngineDeadError`: a step hung past the watchdog's
  grace), after failing every request in flight, so a supervisor can restart the server.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
import uuid

import zmq

from impasto.config.engine_args import EngineArgs
from impasto.engine import ipc
from impasto.engine.step_watchdog import EngineDeadError
from impasto.errors import InvalidParameterError, QueueFullError

logger = logging.getLogger("impasto")

_IDLE_POLL_MS = 500  # how often an idle loop checks that its parent is alive
_TERM = {"requested": False}  # set by SIGTERM: drain like a Shutdown message


class EngineLoop:
    def __init__(self, engine, pull: zmq.Socket, push: zmq.Socket, parent_pid: int | None) -> None:
        self.engine = engine
        self.pull, self.push = pull, push
        self.parent_pid = parent_pid
        self.streams: set[str] = set()  # requests accepted and not finished or aborted
        self.errors: list[ipc.RequestError] = []
        self.draining = False

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while True:
            busy = self.engine.has_unfinished_requests()
            self.draining = self.draining or _TERM["requested"]
            if self.draining and not busy and not self.streams:
                return
            if (
                self.parent_pid is not None and os.getppid() != self.parent_pid
            ):  # orphaned: nobody can read our outputs
                logger.warning("engine: the API process is gone, exiting")
                return
            if poller.poll(0 if busy else _IDLE_POLL_MS):
                self._drain_inputs()
                if self.errors:  # refusals (queue full, ...) go out now, not after a step
                    self.push.send(ipc.encode(ipc.Outputs([], self.errors)))
                    self.errors = []
            deltas = self._step() if self.engine.has_unfinished_requests() else []
            if deltas or self.errors:
                self.push.send(ipc.encode(ipc.Outputs(deltas, self.errors)))
                self.errors = []

    # -- inputs -------------------------------------------------------------------------------
    def _drain_inputs(self) -> None:
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = ipc.decode_input(data)
            if isinstance(msg, ipc.AddRequest):
                self._add(msg)
            elif isinstance(msg, ipc.Abort):
                self._abort(msg.request_ids)
            elif isinstance(msg, ipc.UtilityCall):
                try:
                    result = self._utility(msg.method)
                except Exception as e:  # noqa: BLE001 - a diagnostic call never ends the loop
                    logger.error(
                        "engine: utility %s failed\n%s", msg.method, traceback.format_exc()
                    )
                    result = {"error": f"{type(e).__name__}: {e}"}
                self.push.send(ipc.encode(ipc.UtilityResult(msg.call_id, result)))
            elif isinstance(msg, ipc.Shutdown):
                self.draining = True

    def _add(self, msg: ipc.AddRequest) -> None:
        rid = msg.request.request_id
        if self.draining:
            refusal = ipc.RequestError(
                rid, "The engine is shutting down.", 503, reason="shutting_down"
            )
            self.errors.append(refusal)
            return
        try:
            self.engine.add_engine_request(msg.request)
        except InvalidParameterError as e:  # e.g. a request id already in use
            self.errors.append(ipc.RequestError(rid, str(e), 400, e.param))
            return
        except QueueFullError as e:
            self.errors.append(ipc.RequestError(rid, e.message, 503, reason="queue_full"))
            return
        except Exception:  # noqa: BLE001 - an engine bug refuses this request only
            message = _internal_error("add_request failed")
            self.errors.append(ipc.RequestError(rid, message, 500))
            return
        self.streams.add(rid)

    def _abort(self, request_ids: list[str]) -> None:
        known = [rid for rid in request_ids if rid in self.streams]
        self.streams.difference_update(known)
        if known:
            try:
                self.engine.abort_request(known)
            except Exception:  # noqa: BLE001
                logger.error("engine: abort failed\n%s", traceback.format_exc())

    def _utility(self, method: str) -> dict:
        engine = self.engine
        sched = engine.scheduler
        # Refresh the gauges: after aborts the engine may not have stepped since.
        engine.metrics.observe_scheduler(sched.make_stats())
        if method == "metrics":
            return {
                "metrics": [
                    [m.name, m.value, m.kind, m.documentation] for m in engine.get_metrics()
                ]
            }
        if method in ("reset_prefix_cache", "reset_prefix_cache_running"):
            return {"reset": engine.reset_prefix_cache(method == "reset_prefix_cache_running")}
        kv = sched.kv_cache_manager
        return {
            "num_unfinished_requests": sched.get_num_unfinished_requests(),
            "num_free_blocks": kv.num_free_blocks,
            "num_blocks": sched.config.num_blocks,
            "num_streams": len(self.streams),
        }

    # -- the step -----------------------------------------------------------------------------
    def _step(self) -> list[ipc.RequestDelta]:
        try:
            outputs = self.engine.step()
        except EngineDeadError as e:  # fail what is in flight, then the process exits
            logger.error("engine: %s; exiting", e)
            self._fail_all(str(e))  # says what happened; no internals
            self.push.send(ipc.encode(ipc.Outputs([], self.errors)))
            raise
        except Exception:  # noqa: BLE001 - fail what is in flight, keep the loop
            self._fail_all(_internal_error("step failed"))
            return []
        deltas = []
        for out in outputs:
            if out.request_id not in self.streams:  # aborted by the API process meanwhile
                continue
            deltas.append(ipc.to_wire(out))
            if out.finished:
                self.streams.discard(out.request_id)
        return deltas

    def _fail_all(self, message: str) -> None:
        ids = list(self.streams)
        self.errors += [ipc.RequestError(rid, message, 500) for rid in ids]
        self.streams.clear()
        try:
            self.engine.abort_request(ids)
        except Exception:  # noqa: BLE001
            logger.error("engine: abort after a failed step failed\n%s", traceback.format_exc())


def _internal_error(what: str) -> str:
    """Log the exception being handled under a fresh error id; return the client's message."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("engine: %s (error id %s)\n%s", what, error_id, traceback.format_exc())
    return f"Internal server error: the engine failed this request (error id {error_id})."


def run_engine_process(
    args: EngineArgs,
    input_addr: str,
    output_addr: str,
    parent_pid: int | None,
    log_level: str,
    cpus: tuple[int, ...] | None = None,
    install_signals: bool = True,
) -> None:
    """Entry point of the engine process (spawned, or a Ray actor's thread).

    `parent_pid`: exit when this process is no longer our parent (None: another supervisor,
    e.g. Ray, owns our lifetime). `cpus`: pin the process (and so torch's threads) to them.
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)  # before torch starts its thread pool
    if install_signals:
        # Ctrl-C reaches the whole process group: the API process decides when we stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: _TERM.update(requested=True))
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    pull.connect(input_addr)
    push.connect(output_addr)
    try:
        from impasto.engine.engine import LLMEngine

        engine = LLMEngine(args)
    except Exception as e:  # noqa: BLE001 - reported to the API process, which exits
        logger.error("engine: startup failed\n%s", traceback.format_exc())
        push.send(ipc.encode(ipc.StartupFailed(f"{type(e).__name__}: {e}")))
        push.close()
        ctx.term()
        return
    ready = ipc.Ready(os.getpid(), engine.config.model)
    push.send(ipc.encode(ready))
    try:
        EngineLoop(engine, pull, push, parent_pid).run()
    except EngineDeadError:
        logger.error("engine: dead\n%s", traceback.format_exc())
        # The hung step's thread cannot be stopped: leave at once, non-zero, and let the API
        # process (and its supervisor) see the death.
        push.close(linger=1000)
        os._exit(1)
    engine.close()  # tensor-parallel ranks (they also end with this process)
    pull.close()
    push.close()
    ctx.term()
