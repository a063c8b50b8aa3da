"""How a generation endpoint answers: start its runs, then stream them as SSE or collect them.

Both endpoints (completions, chat completions) differ only in how a choice is rendered; the
life cycle is shared here:
- a client that disconnects before the first token, or while a response is being collected,
  gets nothing (499) and its runs are aborted;
- a failure before the 200 is sent propagates (mapped to an HTTP error by the app);
- once a stream is handed off, a failure becomes an in-band `data: {"error": ...}` chunk, and
  every stream ends with `data: [DONE]`;
- with a request timeout (`--request-timeout`), every wait on the engine is bounded by one
  deadline from the request's arrival: past it the runs are aborted in the engine (their KV
  blocks freed) and the client gets a 504 (before the stream starts) or a 504 error chunk.
Invariant: every run is closed exactly once (`close_runs`), whichever way the request ends.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from impasto.engine import ipc
from impasto.engine.engine_client import EngineRequestError
from impasto.entrypoints.openai.errors import APIError, as_api_error, error_body
from impasto.entrypoints.openai.metrics import ServerMetrics
from impasto.entrypoints.openai.serving import (
    PromptRun,
    ServerState,
    close_runs,
    merged,
    race_disconnect,
    start_runs,
    usage_of,
)

Item = tuple[int, ipc.RequestDelta] | None  # (run index, delta); None: every run is done
# (run index, run with the delta applied, delta) -> the chunk's choices (none: skip the chunk)
ChoiceChunks = Callable[[int, PromptRun, ipc.RequestDelta], list[dict[str, Any]]]

ENGINE_FAILED = "Internal server error: the engine failed this request."
T = TypeVar("T")


@dataclass
class Deadline:
    """The request timeout of one request: `at` is a `time.monotonic()` instant (None: none)."""

    at: float | None
    timeout_s: float | None
    metrics: ServerMetrics

    @classmethod
    def of(cls, state: ServerState, runs: list[PromptRun]) -> Deadline:
        timeout = state.request_timeout_s
        at = None if timeout is None else min(r.timer.arrival for r in runs) + timeout
        return cls(at, timeout, state.metrics)

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`, cancelled at the deadline (a cancelled engine stream aborts its
        request); then raise a 504 `APIError` and count the timeout."""
        if self.at is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, max(self.at - time.monotonic(), 0.0))
        except TimeoutError:
            if time.monotonic() < self.at:  # not ours: raised by the awaitable itself
                raise
            self.metrics.timeouts.inc()
            message = f"The request timed out after {self.timeout_s:g} s and was aborted."
            raise APIError(message, 504) from None


def _failure(state: ServerState, exc: Exception) -> APIError:
    """The client's view of a failure; refusals by the waiting-queue bound are counted."""
    if isinstance(exc, EngineRequestError) and exc.reason == "queue_full":
        state.metrics.rejected_request("queue_full")
    return as_api_error(exc)


@dataclass
class EventStream:
    """What an endpoint's SSE chunks look like: the fields every chunk carries (`head`), the
    request's `stream_options`, how a delta's choices render, and chunks sent first."""

    head: dict[str, Any]
    options: Any
    choices: ChoiceChunks
    prelude: list[dict[str, Any]] = field(default_factory=list)


async def respond(
    state: ServerState,
    raw: Request,
    runs: list[PromptRun],
    events: EventStream | None,
) -> Response | None:
    """Start `runs`; return the response to send now (499, or the SSE stream when `events` is
    given), or None once every run has been collected into `runs`."""
    deadline = Deadline.of(state, runs)
    stream = merged(start_runs(state, runs))
    handed_off = False
    try:
        ok, first = await race_disconnect(raw, deadline.wait(anext(stream, None)))
        if not ok:
            return Response(status_code=499)
        if events is not None:
            handed_off = True  # the stream accounts for its runs from here
            body = sse_events(state, runs, stream, first, events, deadline)
            return StreamingResponse(body, media_type="text/event-stream")
        ok, _ = await race_disconnect(raw, deadline.wait(_collect(runs, stream, first)))
        if not ok:
            return Response(status_code=499)
    except Exception as e:
        err = _failure(state, e)
        close_runs(runs, err)
        if err is e:
            raise
        raise err from e
    finally:
        if not handed_off:
            close_runs(runs, None)
    return None


async def _collect(runs: list[PromptRun], stream: AsyncIterator, first: Item) -> None:
    item = first
    while item is not None:
        i, delta = item
        runs[i].apply(delta)
        item = await anext(stream, None)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def sse_events(
    state: ServerState,
    runs: list[PromptRun],
    stream: AsyncIterator,
    first: Item,
    events: EventStream,
    deadline: Deadline,
) -> AsyncIterator[str]:
    """The SSE body: the prelude chunks, one chunk per delta that renders choices, the usage
    chunk when asked, an error chunk if anything fails, then `[DONE]`."""
    head, opts = events.head, events.options
    try:
        for chunk in events.prelude:
            yield sse({**head, **chunk})
        item = first
        while item is not None:
            i, delta = item
            run = runs[i]
            run.apply(delta)
            if any(c.finish_reason == "error" for c in delta.completions):
                raise APIError(ENGINE_FAILED, 500)
            out = events.choices(i, run, delta)
            if out:
                chunk = {**head, "choices": out}
                if opts is not None and opts.continuous_usage_stats:
                    chunk["usage"] = usage_of(runs).model_dump()
                yield sse(chunk)
            item = await deadline.wait(anext(stream, None))
        if opts is not None and opts.include_usage:
            yield sse({**head, "choices": [], "usage": usage_of(runs).model_dump()})
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
        err = _failure(state, e)
        close_runs(runs, err)
        yield sse(error_body(err.message, err.status, err.param))
    finally:
        close_runs(runs, None)
        await stream.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"
