"""POST /v1/chat/completions: the model's chat template, one engine request with `n` choices.

Streams send a role chunk per choice first, then content deltas, one chunk with each choice's
finish_reason, an optional usage chunk, and always `data: [DONE]`.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from impasto.engine import ipc
from impasto.entrypoints.openai import unsupported
from impasto.entrypoints.openai.chat_output import ChatReaders, ChoiceStream, finish_reason, render
from impasto.entrypoints.openai.errors import APIError
from impasto.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs
from impasto.entrypoints.openai.metrics import RequestTimer
from impasto.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
)
from impasto.entrypoints.openai.responses import ENGINE_FAILED, ChoiceChunks, EventStream, respond
from impasto.entrypoints.openai.serving import (
    Choice,
    PromptRun,
    ServerState,
    new_id,
    usage_of,
)
from impasto.entrypoints.openai.structured import structured_outputs_of
from impasto.entrypoints.openai.tools import history_message, plan_tools
from impasto.entrypoints.openai.unsupported import reject_unsupported
from impasto.errors import InvalidParameterError
from impasto.loader.tokenizer import apply_chat_template


def _content(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError("only text content parts are supported.", 400, "messages")
        parts.append(part["text"])
    return "\n".join(parts)


def chat_prompt_ids(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    truncating: bool = False,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    if state.tokenizer is None:
        raise APIError("chat needs a tokenizer.", 400, "messages")
    conv = [history_message(i, m, _content(m)) for i, m in enumerate(messages)]
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    if continue_final_message:
        kwargs["continue_final_message"] = True
        add_generation_prompt = False
    try:
        text = apply_chat_template(
            state.tokenizer, conv, add_generation_prompt, chat_template, **kwargs
        )
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors are the request's fault
        # The template's own message (e.g. "roles must alternate"), never the exception type.
        raise APIError(f"chat template error: {e}", 400, "messages") from e
    state.check_text(text, "messages", truncating)
    # The template already carries the special tokens.
    return state.tokenizer(text, add_special_tokens=False).input_ids


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, raw: Request
) -> Response:
    state.check_model(req.model)
    reject_unsupported(req.model_extra, unsupported.CHAT)
    for i, message in enumerate(req.messages):
        reject_unsupported(message.model_extra, unsupported.MESSAGE, f"messages[{i}].")
    state.check_stream_options(req)
    if req.chat_template is not None and not state.trust_request_chat_template:
        raise APIError(
            "'chat_template' in a request needs a server started with "
            "--trust-request-chat-template.",
            400,
            "chat_template",
        )
    given = {**dict(req), **(req.model_extra or {})}
    plan = plan_tools(
        req.tools,
        req.tool_choice,
        req.parallel_tool_calls,
        state.enable_auto_tool_choice,
        other_constraint=structured_outputs_of(given) is not None,
    )
    readers = ChatReaders(plan, state.reasoning_parser, state.tool_parser)
    ids = chat_prompt_ids(
        state,
        req.messages,
        req.add_generation_prompt,
        req.continue_final_message,
        req.chat_template_kwargs,
        truncating=req.truncate_prompt_tokens is not None,
        chat_template=req.chat_template,
        tools=plan.tools,
    )
    # max_completion_tokens is the current name, max_tokens the deprecated one.
    max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = req.max_tokens
    top_n = req.top_logprobs or 0
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs=true.", 400, "top_logprobs")
    logprobs = top_n if req.logprobs else None
    base_id = new_id("chatcmpl")
    try:
        params = state.sampling_params(
            req, max_tokens, logprobs, req.prompt_logprobs, constraint=plan.constraint
        )
        request = state.admit(base_id, ids, params, req.priority)
    except InvalidParameterError as e:
        if e.param != "logprobs":
            raise
        raise InvalidParameterError("top_logprobs", e.message) from None  # chat's name for it
    timer = RequestTimer(state.metrics, len(request.prompt_token_ids))
    run = PromptRun(request, timer, [Choice(j) for j in range(req.n)])
    events = None
    if req.stream:
        head = {"id": base_id, "object": "chat.completion.chunk", "created": int(time.time())}
        head["model"] = state.model_name
        roles = [
            {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            for c in run.choices
        ]
        prelude: list[dict[str, Any]] = [{"choices": [{**r, "finish_reason": None} for r in roles]}]
        if req.return_token_ids:
            prelude[0]["prompt_token_ids"] = run.request.prompt_token_ids
        chunks = _choice_chunks(state, req, readers)
        events = EventStream(head, req.stream_options, chunks, prelude)
    response = await respond(state, raw, [run], events)
    if response is not None:
        return response
    text_of = state.token_text(req)
    choices = []
    for c in run.choices:
        if c.finish_reason == "error":
            raise APIError(ENGINE_FAILED, 500)
        lp = chat_logprobs(text_of, c.token_ids, c.logprobs, top_n) if req.logprobs else None
        out = render(readers, c.text)
        choices.append(
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(**out.message()),
                logprobs=lp,
                finish_reason=finish_reason(readers, out.tool_calls, c.finish_reason),
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if req.return_token_ids else None,
            )
        )
    prompt_ids = run.request.prompt_token_ids
    body = ChatCompletionResponse(
        id=base_id,
        model=state.model_name,
        choices=choices,
        usage=usage_of([run]),
        prompt_logprobs=None
        if req.prompt_logprobs is None
        else prompt_logprobs(text_of, run.prompt_logprobs, prompt_ids, req.prompt_logprobs),
        prompt_token_ids=prompt_ids if req.return_token_ids else None,
    )
    return JSONResponse(body.model_dump())


def _choice_chunks(
    state: ServerState, req: ChatCompletionRequest, readers: ChatReaders
) -> ChoiceChunks:
    top_n = req.top_logprobs or 0
    text_of = state.token_text(req)
    streams: dict[int, ChoiceStream] = {}

    def chunks(i: int, run: PromptRun, delta: ipc.RequestDelta) -> list[dict[str, Any]]:
        out = []
        for c in delta.completions:
            stream = streams.setdefault(c.index, ChoiceStream(readers))
            parts = stream.feed(c.text) if c.text else []
            if c.finish_reason is not None:
                parts += stream.finish()
            message = _merged(parts)
            wants_ids = req.return_token_ids and c.token_ids
            if (
                not message
                and c.finish_reason is None
                and not (req.logprobs and c.token_ids)
                and not wants_ids
            ):
                continue
            choice = run.choices[c.index]
            lp = None
            if req.logprobs:
                start = len(choice.token_ids) - len(c.token_ids)
                positions = choice.logprobs[start:]
                lp = chat_logprobs(text_of, c.token_ids, positions, top_n).model_dump()
            chunk: dict[str, Any] = {
                "index": c.index,
                "delta": message,
                "logprobs": lp,
                "finish_reason": finish_reason(readers, stream.calls, c.finish_reason),
                "stop_reason": c.stop_reason,
            }
            if req.return_token_ids:
                chunk["token_ids"] = c.token_ids
            out.append(chunk)
        return out

    return chunks


def _merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The deltas of one step as one chunk delta: texts joined, tool-call entries listed."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key == "tool_calls":
                out.setdefault(key, []).extend(value)
            else:
                out[key] = out.get(key, "") + value
    return out
