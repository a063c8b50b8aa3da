"""What completions and chat completions share: admission checks, sampling parameters,
logprob formatting, stream plumbing and client-disconnect handling.

Invariant: everything a request can get wrong is found by the engine's one admission path
(`InputProcessor`, run here in the API process) before the engine process sees it, and raised
as `InvalidParameterError`, which the app maps to a 400 with its `param` in one place. The caps
are `impasto.limits`; error messages echo at most `limits.MAX_ECHO_CHARS` of a request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from impasto import limits
from impasto.engine import ipc
from impasto.engine.dp_client import DataParallelEngineClient
from impasto.engine.engine_client import AsyncEngineClient
from impasto.engine.processor import EngineRequest, InputProcessor
from impasto.entrypoints.openai.errors import APIError
from impasto.entrypoints.openai.logprobs import TokenText
from impasto.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from impasto.entrypoints.openai.protocol import SamplingFields, UsageInfo
from impasto.entrypoints.openai.reasoning_parsers import ReasoningParser
from impasto.entrypoints.openai.structured import structured_outputs_of
from impasto.entrypoints.openai.tool_parsers import ToolParser
from impasto.errors import InvalidParameterError
from impasto.param_checks import show
from impasto.sampling_params import SamplingParams

logger = logging.getLogger("impasto")

# Request fields an endpoint maps itself (different names or meaning per endpoint).
_ENDPOINT_FIELDS = frozenset(
    {"max_tokens", "logprobs", "prompt_logprobs", "detokenize", "structured_outputs"}
)


@dataclass
class ServerState:
    client: AsyncEngineClient | DataParallelEngineClient
    tokenizer: Any
    served_model_names: list[str]
    metrics: ServerMetrics
    max_n: int = limits.MAX_N
    request_timeout_s: float | None = None  # generation requests are aborted past it (504)
    priority_scheduling: bool = False  # the engine's policy is "priority"
    trust_request_chat_template: bool = False  # requests may carry a chat_template
    enable_auto_tool_choice: bool = False  # tool_choice "auto" is parsed by `tool_parser`
    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None
    log_requests: bool = False  # --enable-log-requests: one log line per admitted request
    processor: InputProcessor = field(init=False)

    def __post_init__(self) -> None:
        assert self.client.model_config is not None, "the engine has not started"
        self.processor = InputProcessor(
            self.client.model_config, self.tokenizer, self.priority_scheduling
        )

    @property
    def generation_defaults(self) -> dict[str, Any]:
        assert self.client.model_config is not None
        return self.client.model_config.generation_defaults

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(f"The model {show(model)} does not exist.", 404, "model")

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise InvalidParameterError("n", f"n must be at most {self.max_n}, got {show(n)}.")

    def check_text(self, text: str, param: str = "prompt", truncating: bool = False) -> None:
        """The admission path's check of a text before it is tokenized here, as an APIError
        (also raised outside the generation endpoints' error mapping, e.g. by /tokenize)."""
        try:
            self.processor.check_text(text, param, truncating)
        except InvalidParameterError as e:
            raise APIError(e.message, 400, e.param) from None

    def check_stream_options(self, req: SamplingFields) -> None:
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options needs stream=true.", 400, "stream_options")

    def sampling_params(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        constraint: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams: every sampling field it sets (declared or passed as an
        extra, as `extra_body` does) goes through, type-checked by SamplingParams itself."""
        self.check_n(req.n)
        values: dict[str, Any] = {}
        given = {**dict(req), **(req.model_extra or {})}
        for name in SamplingParams.user_fields():
            if name not in _ENDPOINT_FIELDS and given.get(name) is not None:
                values[name] = given[name]
        # The model's generation defaults fill what the request leaves unset.
        for name, value in self.generation_defaults.items():
            if name != "max_tokens" and given.get(name) is None:
                values[name] = value
        if given.get("vllm_xargs") is not None:  # vLLM's HTTP spelling of extra_args
            values["extra_args"] = given["vllm_xargs"]
        values["logprobs"] = logprobs
        values["max_tokens"] = max_tokens
        values["prompt_logprobs"] = prompt_logprobs
        constraint = constraint or structured_outputs_of(given)  # a tool choice's, or asked
        if constraint is not None:
            values["structured_outputs"] = constraint
        return SamplingParams.from_fields(values)

    def admit(
        self, request_id: str, ids: list[int], params: SamplingParams, priority: int
    ) -> EngineRequest:
        """The admission path (the engine's own): an unset max_tokens means the rest of the
        context (at most the model's default `max_new_tokens`, if it has one), and one that
        does not fit is a 400 (OpenAI's rule)."""
        if params.max_tokens is None:
            room = max(self.client.max_model_len - len(ids), 1)
            params.max_tokens = min(room, self.generation_defaults.get("max_tokens", room))
        request = self.processor.process(
            request_id,
            {"prompt_token_ids": ids},
            params,
            priority=priority,
            max_tokens_fit=True,
        )
        if self.log_requests:
            logger.info(
                "request %s: %d prompt tokens, params %s",
                request_id,
                len(request.prompt_token_ids),
                {f: getattr(params, f) for f in params.non_default_fields()},
            )
        return request

    def token_text(self, req: SamplingFields) -> TokenText:
        """How this request shows tokens in logprobs (`return_tokens_as_token_ids`)."""
        return TokenText(self.tokenizer, bool(req.return_tokens_as_token_ids))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Choice:
    """Accumulated output of one choice (a completion of one prompt)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[ipc.LogprobEntry]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: ipc.CompletionDelta) -> None:
        self.text += c.text
        self.token_ids += c.token_ids
        if c.logprobs:
            self.logprobs += c.logprobs
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


@dataclass
class PromptRun:
    """One prompt in flight: its engine stream, choices and timing."""

    request: EngineRequest
    timer: RequestTimer
    choices: list[Choice] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False
    # `prompt_logprobs`: one entry per prompt position (the first None), once it has come.
    prompt_logprobs: list[list[ipc.LogprobEntry] | None] | None = None

    def apply(self, delta: ipc.RequestDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if any(c.token_ids for c in delta.completions):
            self.timer.on_tokens()
        for c in delta.completions:
            self.choices[c.index].add(c)
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:
            self.finished = True
            reasons = [c.finish_reason or "abort" for c in self.choices]
            reason = "error" if "error" in reasons else reasons[0]
            self.timer.on_finish(reason, sum(len(c.token_ids) for c in self.choices))

    def close(self, reason: str | None = "abort") -> None:
        """End a run that did not finish in the engine: counted as `reason` (None: refused
        at admission, not counted)."""
        if not self.finished:
            self.finished = True
            if reason is not None:
                self.timer.on_finish(reason, sum(len(c.token_ids) for c in self.choices))


def close_runs(runs: list[PromptRun], exc: BaseException | None) -> None:
    """Account for runs left unfinished: a client that left or a timeout (abort), an engine
    failure (error), or a request refused at admission (4xx, 503: not counted)."""
    status = getattr(exc, "status", 500) if isinstance(exc, Exception) else None
    if status is None or status == 504:
        reason: str | None = "abort"
    else:
        reason = "error" if status >= 500 and status != 503 else None
    for r in runs:
        r.close(reason)


def usage_of(runs: list[PromptRun]) -> UsageInfo:
    prompt = sum(len(r.request.prompt_token_ids) for r in runs)
    completion = sum(len(c.token_ids) for r in runs for c in r.choices)
    cached = sum(r.num_cached_tokens for r in runs)
    details = {"cached_tokens": cached} if cached else None
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )


def start_runs(state: ServerState, runs: list[PromptRun]) -> list[AsyncIterator]:
    return [state.client.generate(r.request) for r in runs]


async def merged(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, ipc.RequestDelta]]:
    """Interleave several engine streams as deltas arrive: (stream index, delta)."""
    if len(gens) == 1:
        try:
            async for d in gens[0]:
                yield 0, d
        finally:
            await gens[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator) -> None:
        try:
            async for d in gen:
                await queue.put((i, d))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()  # type: ignore[attr-defined]


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(request: Request, awaitable: Any) -> tuple[bool, Any]:
    """Await `awaitable` unless the client disconnects first: (True, result) or (False, None).
    On disconnect the awaitable is cancelled (a cancelled engine stream aborts its request)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()
