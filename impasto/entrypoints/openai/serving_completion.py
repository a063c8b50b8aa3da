"""POST /v1/completions: one engine request per prompt, `n` choices each, streamed or not.

Choice indices are `prompt_index * n + i` (as vLLM). Streams always end with `data: [DONE]`;
a failure after the 200 has been sent becomes a `data: {"error": ...}` chunk.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from impasto import limits
from impasto.engine import ipc
from impasto.entrypoints.openai import unsupported
from impasto.entrypoints.openai.errors import APIError
from impasto.entrypoints.openai.metrics import RequestTimer
from impasto.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from impasto.entrypoints.openai.responses import ENGINE_FAILED, ChoiceChunks, EventStream, respond
from impasto.entrypoints.openai.serving import (
    Choice,
    PromptRun,
    ServerState,
    clamp_logprob,
    new_id,
    usage_of,
)
from impasto.entrypoints.openai.unsupported import reject_unsupported


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
    if len(items) > limits.MAX_PROMPTS_PER_REQUEST:
        raise APIError(
            f"prompt may hold at most {limits.MAX_PROMPTS_PER_REQUEST} prompts, got {len(items)}.",
            400,
            "prompt",
        )
    state.check_n(req.n)
    if len(items) * req.n > limits.MAX_CHOICES_PER_REQUEST:
        raise APIError(
            f"n x the number of prompts may be at most {limits.MAX_CHOICES_PER_REQUEST}, "
            f"got {req.n} x {len(items)}.",
            400,
            "n",
        )
    out = []
    for item in items:
        if isinstance(item, str):
            if state.tokenizer is None:
                raise APIError("text prompts need a tokenizer.", 400, "prompt")
            state.check_text(item, truncating=req.truncate_prompt_tokens is not None)
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
        shown = entries if top_n < 0 else entries[: top_n + 1]  # -1: the whole vocabulary
        top = {state.token_str(e[0], e[3]): clamp_logprob(e[1]) for e in shown}
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(text)
    return lp


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    state.check_model(req.model)
    reject_unsupported(req.model_extra, unsupported.SAMPLING)
    state.check_stream_options(req)
    if req.suffix:
        raise APIError("suffix is not supported.", 400, "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of is not supported (it must equal n).", 400, "best_of")
    base_id = new_id("cmpl")
    runs, texts = [], []
    for i, (text, ids) in enumerate(_prompts(state, req)):
        params = state.sampling_params(req, req.max_tokens, req.logprobs)
        request = state.admit(f"{base_id}-{i}", ids, params, req.priority)
        timer = RequestTimer(state.metrics, len(request.prompt_token_ids))
        run = PromptRun(request, timer, [Choice(j) for j in range(req.n)])
        runs.append(run)
        if req.echo and text is None and state.tokenizer is not None:
            text = state.tokenizer.decode(ids)
        texts.append(text or "")
    events = None
    if req.stream:
        head = {"id": base_id, "object": "text_completion", "created": int(time.time())}
        head["model"] = state.model_name
        events = EventStream(head, req.stream_options, _choice_chunks(state, req, texts))
    response = await respond(state, raw, runs, events)
    if response is not None:
        return response
    choices = []
    for run, text in zip(runs, texts, strict=True):
        for c in run.choices:
            if c.finish_reason == "error":
                raise APIError(ENGINE_FAILED, 500)
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


def _choice_chunks(state: ServerState, req: CompletionRequest, texts: list[str]) -> ChoiceChunks:
    """Renders a delta's choices as stream chunks; the echoed prompt leads each choice's first."""
    echoed: set[tuple[int, int]] = set()

    def chunks(i: int, run: PromptRun, delta: ipc.RequestDelta) -> list[dict[str, Any]]:
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
            out.append(
                {
                    "index": i * req.n + c.index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return out

    return chunks
