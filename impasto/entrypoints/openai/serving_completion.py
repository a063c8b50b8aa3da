"""POST /v1/completions: one engine request per prompt, `n` choices each, streamed or not.

Choice indices are `prompt_index * n + i` (as vLLM). Streams always end with `data: [DONE]`;
a failure after the 200 has been sent becomes a `data: {"error": ...}` chunk.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from impasto.engine import ipc
from impasto.entrypoints.openai.errors import APIError, as_api_error, error_body
from impasto.entrypoints.openai.metrics import RequestTimer
from impasto.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from impasto.entrypoints.openai.serving import (
    Choice,
    PromptRun,
    ServerState,
    clamp_logprob,
    close_runs,
    merged,
    new_id,
    race_disconnect,
    start_runs,
    usage_of,
)


def _prompts(state: ServerState, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise APIError("The prompt is empty: at least one token is needed.", 400, "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            if state.tokenizer is None:
                raise APIError("text prompts need a tokenizer.", 400, "prompt")
            ids = state.tokenizer(item, add_special_tokens=req.add_special_tokens).input_ids
            out.append((item, ids))
        else:
            out.append((None, list(item)))
    return out


def _logprobs(
    state: ServerState, choice: Choice, start: int, top_n: int, offset: int
) -> CompletionLogprobs:
    lp = CompletionLogprobs()
    for tok, entries in zip(choice.token_ids[start:], choice.logprobs[start:], strict=False):
        sampled = next((e for e in entries if e[0] == tok), None)
        text = state.token_str(tok, sampled[3] if sampled else None)
        lp.tokens.append(text)
        lp.token_logprobs.append(clamp_logprob(sampled[1]) if sampled else None)
        top = {state.token_str(e[0], e[3]): clamp_logprob(e[1]) for e in entries[: top_n + 1]}
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(text)
    return lp


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    state.check_model(req.model)
    if req.suffix:
        raise APIError("suffix is not supported.", 400, "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of is not supported (it must equal n).", 400, "best_of")
    base_id = new_id("cmpl")
    runs, texts = [], []
    for i, (text, ids) in enumerate(_prompts(state, req)):
        state.check_prompt(ids)
        params = state.sampling_params(req, req.max_tokens, req.logprobs, len(ids))
        timer = RequestTimer(state.metrics, len(ids))
        run = PromptRun(f"{base_id}-{i}", ids, params, timer, [Choice(j) for j in range(req.n)])
        runs.append(run)
        if req.echo and text is None and state.tokenizer is not None:
            text = state.tokenizer.decode(ids)
        texts.append(text or "")
    stream = merged(start_runs(state, runs, req.priority))
    handed_off = False
    try:
        ok, first = await race_disconnect(raw, anext(stream, None))
        if not ok:
            return Response(status_code=499)
        if req.stream:
            handed_off = True  # the stream accounts for its runs from here
            return StreamingResponse(
                _stream(state, req, base_id, runs, texts, stream, first),
                media_type="text/event-stream",
            )
        ok, _ = await race_disconnect(raw, _collect(runs, stream, first))
        if not ok:
            return Response(status_code=499)
    except Exception as e:
        close_runs(runs, as_api_error(e))
        raise
    finally:
        if not handed_off:
            close_runs(runs, None)
    choices = []
    for run, text in zip(runs, texts, strict=True):
        for c in run.choices:
            if c.finish_reason == "error":
                raise APIError("Internal server error: the engine failed this request.", 500)
            lp = None
            if req.logprobs is not None:
                lp = _logprobs(state, c, 0, req.logprobs, len(text) if req.echo else 0)
            choices.append(
                CompletionChoice(
                    index=len(choices),
                    text=(text if req.echo else "") + c.text,
                    logprobs=lp,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
    body = CompletionResponse(
        id=base_id, model=state.model_name, choices=choices, usage=usage_of(runs)
    )
    return JSONResponse(body.model_dump(exclude_none=False))


async def _collect(runs: list[PromptRun], stream: AsyncIterator, first) -> None:
    item = first
    while item is not None:
        i, delta = item
        runs[i].apply(delta)
        item = await anext(stream, None)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(
    state: ServerState,
    req: CompletionRequest,
    base_id: str,
    runs: list[PromptRun],
    texts: list[str],
    stream: AsyncIterator,
    first: tuple[int, ipc.RequestDelta] | None,
) -> AsyncIterator[str]:
    created, n = int(time.time()), req.n
    opts = req.stream_options
    head = {"id": base_id, "object": "text_completion", "created": created}
    head["model"] = state.model_name
    echoed: set[int] = set()
    try:
        item = first
        while item is not None:
            i, delta = item
            run = runs[i]
            run.apply(delta)
            out = []
            for c in delta.completions:
                choice = run.choices[c.index]
                text = c.text
                if req.echo and (i, c.index) not in echoed:
                    echoed.add((i, c.index))
                    text = texts[i] + text
                has_lp = req.logprobs is not None and c.token_ids
                if not text and c.finish_reason is None and not has_lp:
                    continue
                lp = None
                if req.logprobs is not None:
                    start = len(choice.token_ids) - len(c.token_ids)
                    offset = len(choice.text) - len(c.text)
                    lp = _logprobs(state, choice, start, req.logprobs, offset).model_dump()
                if c.finish_reason == "error":
                    raise APIError("Internal server error: the engine failed this request.", 500)
                out.append(
                    {
                        "index": i * n + c.index,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
            if out:
                chunk = {**head, "choices": out}
                if opts is not None and opts.continuous_usage_stats:
                    chunk["usage"] = usage_of(runs).model_dump()
                yield _sse(chunk)
            item = await anext(stream, None)
        if opts is not None and opts.include_usage:
            yield _sse({**head, "choices": [], "usage": usage_of(runs).model_dump()})
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
        err = as_api_error(e)
        close_runs(runs, err)
        yield _sse(error_body(err.message, err.status, err.param))
    finally:
        close_runs(runs, None)
        await stream.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"
