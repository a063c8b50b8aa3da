"""Messages between the API process and the engine process (msgspec, msgpack over ZMQ).

Two one-way channels: the API process PUSHes `EngineInput` messages, the engine process PUSHes
`EngineOutput` messages back. Outputs are *deltas*: each `CompletionDelta` carries only the text,
token ids and logprobs produced since the previous message for that completion, so a long
generation costs O(tokens) on the wire, not O(tokens^2).
"""

from __future__ import annotations

from typing import Any

import msgspec

# One logprob entry: (token_id, logprob, rank, decoded_token); entries of a position are sorted
# by rank, the sampled token included (it may rank below the top-k).
LogprobEntry = tuple[int, float, int, str | None]


# -- API process -> engine process -----------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    params: dict[str, Any]  # SamplingParams keyword arguments, already validated by the API
    priority: int = 0


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True):
    call_id: int
    method: str  # "metrics" | "state"


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


class RequestError(msgspec.Struct):
    """A request that was refused (status 400, `param` set) or failed in the engine (500)."""

    request_id: str
    message: str
    status: int = 400
    param: str | None = None


class Outputs(msgspec.Struct, tag=True):
    deltas: list[RequestDelta]
    errors: list[RequestError] = []


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    result: dict[str, Any]


class Ready(msgspec.Struct, tag=True):
    pid: int
    max_model_len: int
    vocab_size: int
    model_path: str


class StartupFailed(msgspec.Struct, tag=True):
    message: str


EngineOutput = Outputs | UtilityResult | Ready | StartupFailed

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(EngineInput)
_output_decoder = msgspec.msgpack.Decoder(EngineOutput)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> EngineInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> EngineOutput:
    return _output_decoder.decode(data)
