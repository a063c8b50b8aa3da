"""What completions and chat completions share: admission checks, sampling parameters,
logprob formatting, stream plumbing and client-disconnect handling.

Invariant: everything a request can get wrong is checked here, before the engine sees it, and
raised as `APIError(400, param)`; the engine's own admission checks are a second line.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from impasto.engine import ipc
from impasto.engine.engine_client import AsyncEngineClient
from impasto.entrypoints.openai.errors import APIError
from impasto.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from impasto.entrypoints.openai.protocol import SamplingFields, UsageInfo
from impasto.sampling_params import SamplingParams

_PARAM_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "logit_bias",
)  # fmt: skip
_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI reports this floor


@dataclass
class ServerState:
    client: AsyncEngineClient
    tokenizer: Any
    served_model_names: list[str]
    metrics: ServerMetrics
    max_logprobs: int = 20
    max_n: int = 128

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(f"The model `{model}` does not exist.", 404, "model")

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        limit = self.client.max_model_len
        if not ids:
            raise APIError("The prompt is empty: at least one token is needed.", 400, param)
        if len(ids) >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {len(ids)} input tokens. Please reduce the length of the input messages.",
                400,
                "input_tokens",
            )
        vocab = self.client.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"Token id {bad[0]} is out of vocabulary (size {vocab}).", 400, param)

    def sampling_params(
        self, req: SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_len: int
    ) -> dict[str, Any]:
        """Validated SamplingParams keyword arguments for one prompt."""
        kw: dict[str, Any] = {}
        for name in _PARAM_FIELDS:
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        if req.n > self.max_n:
            raise APIError(f"n must be at most {self.max_n}, got {req.n}.", 400, "n")
        if logprobs is not None and logprobs > self.max_logprobs:
            raise APIError(
                f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
                f"{self.max_logprobs}",
                400,
                "logprobs",
            )
        kw["logprobs"] = logprobs
        kw["max_tokens"] = max_tokens
        try:
            SamplingParams(**kw)
        except (ValueError, TypeError) as e:
            raise APIError(str(e), 400, getattr(e, "param", None)) from e
        limit = self.client.max_model_len
        if max_tokens is None:
            kw["max_tokens"] = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise APIError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {limit} tokens and your request has "
                f"{prompt_len} input tokens ({max_tokens} > {limit} - {prompt_len}).",
                400,
                "max_tokens",
            )
        vocab = self.client.vocab_size
        bad = [t for t in req.stop_token_ids or [] if t >= vocab]
        if bad:
            raise APIError(
                f"token id(s) {bad} in stop_token_ids are out of vocabulary.", 400, "stop_token_ids"
            )
        for key in req.logit_bias or {}:
            if key.strip().lstrip("-").isdigit() and int(key) >= vocab:
                msg = f"token id {key} in logit_bias is out of vocabulary."
                raise APIError(msg, 400, "logit_bias")
        return kw

    def token_str(self, token_id: int, decoded: str | None) -> str:
        if decoded is not None:
            return decoded
        if self.tokenizer is not None:
            return self.tokenizer.decode([token_id])
        return str(token_id)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def clamp_logprob(lp: float) -> float:
    return lp if lp > _MIN_LOGPROB else _MIN_LOGPROB


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

    request_id: str
    prompt_ids: list[int]
    params: dict[str, Any]
    timer: RequestTimer
    choices: list[Choice] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False

    def apply(self, delta: ipc.RequestDelta) -> None:
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
    """Account for runs left unfinished: a client that left (abort), an engine failure
    (error), or a request refused by the engine's admission checks (not counted)."""
    status = getattr(exc, "status", 500) if isinstance(exc, Exception) else None
    reason = "abort" if status is None else ("error" if status >= 500 else None)
    for r in runs:
        r.close(reason)


def usage_of(runs: list[PromptRun]) -> UsageInfo:
    prompt = sum(len(r.prompt_ids) for r in runs)
    completion = sum(len(c.token_ids) for r in runs for c in r.choices)
    cached = sum(r.num_cached_tokens for r in runs)
    details = {"cached_tokens": cached} if cached else None
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )


def start_runs(state: ServerState, runs: list[PromptRun], priority: int) -> list[AsyncIterator]:
    return [
        state.client.generate(r.request_id, r.prompt_ids, None, r.params, priority) for r in runs
    ]


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
