"""vLLM request fields impasto does not implement: refused by name, never silently ignored.

Request bodies accept unknown fields (OpenAI clients send provider extras), so a field vLLM
understands and impasto does not would otherwise be dropped without a word: a JSON schema that
constrains nothing, a tool the model never sees. Every such field is listed here with the value
that asks for nothing (null, false, an empty list, OpenAI's "text" / "none" / "auto" choices); a
request that sets one to anything else gets a 400 naming it: "'X' is not supported". Clients
that send the defaults explicitly keep working.

Invariant: a field leaves this list in the commit that implements it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from impasto.entrypoints.openai.errors import APIError

IsNoOp = Callable[[Any], bool]


def _unset(value: Any) -> bool:
    return value is None


def _off(value: Any) -> bool:
    return value is None or value is False


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _one_of(*allowed: Any) -> IsNoOp:
    return lambda value: value is None or value in allowed


# Fields of both /v1/completions and /v1/chat/completions.
SAMPLING: dict[str, IsNoOp] = {
    # Structured outputs run on llguidance: another backend is not silently swapped in.
    "guided_decoding_backend": _one_of("auto", "llguidance", "guidance"),
    "structural_tag": _unset,
    "use_beam_search": _off,
    "length_penalty": _one_of(1, 1.0),
    "logits_processors": _empty,
    "cache_salt": _unset,
    "kv_transfer_params": _unset,
    "mm_processor_kwargs": _empty,
}
CHAT: dict[str, IsNoOp] = {
    **SAMPLING,
    "functions": _empty,
    "function_call": _one_of("none", "auto"),
    "documents": _empty,
    "reasoning_effort": _unset,
}
MESSAGE: dict[str, IsNoOp] = {
    "function_call": _unset,
}


def reject_unsupported(
    fields: Mapping[str, Any] | None, table: Mapping[str, IsNoOp], where: str = ""
) -> None:
    """Raise a 400 for the first field of `fields` (a request's extras) that `table` lists
    and that is set to something other than its no-op value."""
    for name, value in (fields or {}).items():
        is_noop = table.get(name)
        if is_noop is not None and not is_noop(value):
            raise APIError(f"'{name}' is not supported.", 400, f"{where}{name}")
