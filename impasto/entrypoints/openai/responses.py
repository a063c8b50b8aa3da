"""How a generation endpoint answers: start its runs, then stream them as SSE or collect them.

Both endpoints (completions, chat completions) differ only in how a choice is rendered; the
life cycle is shared here:
- a client that disconnects before the first token, or while a response is being collected,
  gets nothing (499) and its runs are aborted;
- a failure before the 200 is sent propagates (mapped to an HTTP error by the app);
- once a stream is handed off, a failure becomes an in-band `data: {"error": ...}` chunk, and
  every stream ends with `data: [DONE]`.
Invariant: every run is closed exactly once (`close_runs`), whichever way the request ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from impasto.engine import ipc
from impasto.entrypoints.openai.errors import APIError, as_api_error, error_body
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
    stream = merged(start_runs(state, runs))
    handed_off = False
    try:
        ok, first = await race_disconnect(raw, anext(stream, None))
        if not ok:
            return Response(status_code=499)
        if events is not None:
            handed_off = True  # the stream accounts for its runs from here
            body = sse_events(runs, stream, first, events)
            return StreamingResponse(body, media_type="text/event-stream")
        ok, _ = await race_disconnect(raw, _collect(runs, stream, first))
        if not ok:
            return Response(status_code=499)
    except Exception as e:
        close_runs(runs, as_api_error(e))
        raise
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
    runs: list[PromptRun], stream: AsyncIterator, first: Item, events: EventStream
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
            item = await anext(stream, None)
        if opts is not None and opts.include_usage:
            yield sse({**head, "choices": [], "usage": usage_of(runs).model_dump()})
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
        err = as_api_error(e)
        close_runs(runs, err)
        yield sse(error_body(err.message, err.status, err.param))
    finally:
        close_runs(runs, None)
        await stream.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"
