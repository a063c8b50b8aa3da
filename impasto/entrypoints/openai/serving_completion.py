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
from impasto.entrypoints.openai.logprobs import TokenText, completion_logprobs, prompt_logprobs
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


def _echoed_logprobs(
    text_of: TokenText, run: PromptRun, out_ids: list[int], out_positions: list, top_n: int
) -> CompletionLogprobs:
    """Logprobs of the prompt's positions (the first null) followed by the completion's, text
    offsets running on through both (vLLM's `echo` with `logprobs`)."""
    ids = run.request.prompt_token_ids
    lp = completion_logprobs(text_of, ids, run.prompt_logprobs or [None] * len(ids), top_n)
    offset = lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else 0
    rest = completion_logprobs(text_of, out_ids, out_positions, top_n, offset)
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(lp, name).extend(getattr(rest, name))
    return lp


def _prompt_logprobs_wanted(req: CompletionRequest) -> int | None:
    """The engine's prompt_logprobs: the request's own, and the prompt positions that `echo`
    with `logprobs` reports (the larger of the two; -1, the whole vocabulary, wins)."""
    asked = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
    if not asked:
        return None
    return -1 if -1 in asked else max(asked)


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    state.check_model(req.model)
    reject_unsupported(req.model_extra, unsupported.SAMPLING)
    state.check_stream_options(req)
    if req.suffix:
        raise APIError("suffix is not supported.", 400, "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of is not supported (it must equal n).", 400, "best_of")
    # `echo` with `max_tokens: 0` scores the prompt alone (lm-evaluation-harness's
    # loglikelihood requests): one token is generated and dropped, as vLLM does.
    score_only = req.echo and req.max_tokens == 0
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            "max_tokens must be at least 1 (0 scores the prompt alone, with echo=true).",
            400,
            "max_tokens",
        )
    max_tokens = 1 if score_only else req.max_tokens
    base_id = new_id("cmpl")
    runs, texts = [], []
    for i, (text, ids) in enumerate(_prompts(state, req)):
        params = state.sampling_params(req, max_tokens, req.logprobs, _prompt_logprobs_wanted(req))
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
        chunks = _choice_chunks(state, req, texts, score_only)
        events = EventStream(head, req.stream_options, chunks)
    response = await respond(state, raw, runs, events)
    if response is not None:
        return response
    text_of = state.token_text(req)
    choices = []
    for run, text in zip(runs, texts, strict=True):
        for c in run.choices:
            if c.finish_reason == "error":
                raise APIError(ENGINE_FAILED, 500)
            out_ids, out_lps = ([], []) if score_only else (c.token_ids, c.logprobs)
            lp = None
            if req.logprobs is not None and req.echo:
                lp = _echoed_logprobs(text_of, run, out_ids, out_lps, req.logprobs)
            elif req.logprobs is not None:
                lp = completion_logprobs(text_of, out_ids, out_lps, req.logprobs)
            choices.append(
                CompletionChoice(
                    index=len(choices),
                    text=(text if req.echo else "") + ("" if score_only else c.text),
                    logprobs=lp,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=_prompt_field(text_of, req, run),
                    prompt_token_ids=run.request.prompt_token_ids if req.return_token_ids else None,
                    token_ids=out_ids if req.return_token_ids else None,
                )
            )
    usage = usage_of(runs)
    if score_only:  # the token generated to run the step is not part of the answer
        usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
    body = CompletionResponse(id=base_id, model=state.model_name, choices=choices, usage=usage)
    return JSONResponse(body.model_dump(exclude_none=False))


def _prompt_field(text_of: TokenText, req: CompletionRequest, run: PromptRun) -> Any:
    if req.prompt_logprobs is None:
        return None
    return prompt_logprobs(
        text_of, run.prompt_logprobs, run.request.prompt_token_ids, req.prompt_logprobs
    )


def _choice_chunks(
    state: ServerState, req: CompletionRequest, texts: list[str], score_only: bool
) -> ChoiceChunks:
    """Renders a delta's choices as stream chunks; the echoed prompt (with its logprobs, its
    token ids and `prompt_logprobs` when asked) leads each choice's first."""
    echoed: set[tuple[int, int]] = set()
    text_of = state.token_text(req)

    def chunks(i: int, run: PromptRun, delta: ipc.RequestDelta) -> list[dict[str, Any]]:
        out = []
        for c in delta.completions:
            choice = run.choices[c.index]
            first = (i, c.index) not in echoed
            echoed.add((i, c.index))
            new_ids, new_lps = ([], []) if score_only else (c.token_ids, c.logprobs or [])
            text = "" if score_only else c.text
            if req.echo and first:
                text = texts[i] + text
            has_lp = req.logprobs is not None and bool(new_ids)
            opening = first and (
                req.echo or req.return_token_ids or req.prompt_logprobs is not None
            )
            if not text and c.finish_reason is None and not has_lp and not opening:
                continue
            lp = None
            if req.logprobs is not None:
                offset = len(choice.text) - len(c.text)
                if req.echo and first:
                    lp = _echoed_logprobs(text_of, run, new_ids, new_lps, req.logprobs)
                else:
                    start = len(choice.token_ids) - len(c.token_ids)
                    offset += len(texts[i]) if req.echo else 0
                    positions = choice.logprobs[start:] if not score_only else []
                    lp = completion_logprobs(text_of, new_ids, positions, req.logprobs, offset)
            chunk: dict[str, Any] = {
                "index": i * req.n + c.index,
                "text": text,
                "logprobs": None if lp is None else lp.model_dump(),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if req.return_token_ids:
                chunk["token_ids"] = new_ids
                if opening:
                    chunk["prompt_token_ids"] = run.request.prompt_token_ids
            if opening and req.prompt_logprobs is not None:
                chunk["prompt_logprobs"] = _prompt_field(text_of, req, run)
            out.append(chunk)
        return out

    return chunks
