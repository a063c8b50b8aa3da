"""Messages between the API process and the engine process (msgspec, msgpack over ZMQ).

Two one-way channels: the API process PUSHes `EngineInput` messages, the engine process PUSHes
`EngineOutput` messages back. A request crosses once, typed, after admission in the API process
(`AddRequest.request` is the `EngineRequest` the admission path produced). Outputs are the
engine's own *deltas*: each `CompletionDelta` carries only the text, token ids and logprobs
produced since the previous message for that completion, so a long generation costs O(tokens)
on the wire, not O(tokens^2).
"""

from __future__ import annotations

from typing import Any

import msgspec

from impasto.config.model import ModelConfig
from impasto.engine.processor import EngineRequest
from impasto.outputs import RequestOutput

# One logprob entry: (token_id, logprob, rank, decoded_token); entries of a position are sorted
# by rank, the sampled token included (it may rank below the top-k).
LogprobEntry = tuple[int, float, int, str | None]


# -- API process -> engine process -----------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    request: EngineRequest  # admitted by the API process: the engine process re-checks nothing


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True):
    call_id: int
    method: str  # "metrics" | "state" | "reset_prefix_cache" | "reset_prefix_cache_running"


class Shutdown(msgspec.Struct, tag=True):
    """Stop admitting, finish what is in flight, then exit."""


EngineInput = AddRequest | Abort | UtilityCall | Shutdown


# -- engine process -> API process -----------------------------------------------------------
class CompletionDelta(msgspec.Struct):
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[list[LogprobEntry]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None


class RequestDelta(msgspec.Struct):
    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    # Once per request (`prompt_logprobs`): one entry per prompt position, the first None.
    prompt_logprobs: list[list[LogprobEntry] | None] | None = None


class RequestError(msgspec.Struct):
    """A request that was refused (status 400, `param` set; 503 when the engine cannot take it
    now) or failed in the engine (500). Messages never carry internals (exception types,
    tracebacks, paths): a 500 names an error id that the engine process logged."""

    request_id: str
    message: str
    status: int = 400
    param: str | None = None
    reason: str | None = None  # "queue_full" | "shutting_down" for a 503


class Outputs(msgspec.Struct, tag=True):
    deltas: list[RequestDelta]
    errors: list[RequestError] = []


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    result: dict[str, Any]


class Ready(msgspec.Struct, tag=True):
    pid: int
    model: ModelConfig  # what the API process's admission path checks requests against


class StartupFailed(msgspec.Struct, tag=True):
    message: str


EngineOutput = Outputs | UtilityResult | Ready | StartupFailed


def to_wire(out: RequestOutput) -> RequestDelta:
    """An engine delta as a message (logprob entries of a position sorted by rank)."""
    comps = [
        CompletionDelta(
            index=c.index,
            text=c.text,
            token_ids=c.token_ids,
            logprobs=None if c.logprobs is None else [_entries(p) for p in c.logprobs],
            cumulative_logprob=c.cumulative_logprob,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in out.outputs
    ]
    prompt_lps = None
    if out.prompt_logprobs is not None:
        prompt_lps = [None if p is None else _entries(p) for p in out.prompt_logprobs]
    return RequestDelta(
        out.request_id,
        comps,
        out.finished,
        len(out.prompt_token_ids),
        out.num_cached_tokens,
        prompt_lps,
    )


def _entries(position: dict) -> list[LogprobEntry]:
    entries = [(t, lp.logprob, lp.rank or 0, lp.decoded_token) for t, lp in position.items()]
    return sorted(entries, key=lambda e: e[2])


_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(EngineInput)
_output_decoder = msgspec.msgpack.Decoder(EngineOutput)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> EngineInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> EngineOutput:
    return _output_decoder.decode(data)
