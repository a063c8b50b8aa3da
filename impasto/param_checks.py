"""The checks of request values that need no model: what an error may echo of a bad value,
whether text is valid Unicode, logit-bias keys, structured-output parameters. Pure Python.

Every failure is an `InvalidParameterError` naming the parameter, raised at admission; an error
message echoes at most `limits.MAX_ECHO_CHARS` of the value it refuses (`show`).
"""

from __future__ import annotations

import json

import msgspec

from impasto import limits
from impasto.errors import InvalidParameterError
from impasto.structured_outputs import StructuredOutputsParams


def bad_param(param: str, msg: str) -> InvalidParameterError:
    """The error for parameter `param`, its message starting with the name."""
    return InvalidParameterError(param, f"{param} {msg}")


def show(value: object) -> str:
    """`repr(value)` cut to `limits.MAX_ECHO_CHARS`: what an error message may echo."""
    try:
        text = repr(value)
    except ValueError:  # an int too large to print
        return f"<{type(value).__name__} too large to show>"
    cap = limits.MAX_ECHO_CHARS
    return text if len(text) <= cap else text[:cap] + "..."


def is_valid_text(text: str) -> bool:
    """Whether `text` is valid Unicode: no lone surrogate (which JSON's "\\ud800" escape can
    smuggle in, and which no tokenizer or UTF-8 encoder accepts)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def holds_invalid_text(value: object) -> bool:
    """Whether a JSON-shaped value (strings, lists, dicts) holds a string that is not valid
    Unicode anywhere in it; objects of other types are skipped."""
    if isinstance(value, str):
        return not is_valid_text(value)
    if isinstance(value, (list, tuple, dict)):
        text = json.dumps(value, ensure_ascii=False, default=lambda _: None)
        return not is_valid_text(text)
    return False


_MAX_KEY_CHARS = 24  # a token id as a JSON key: 64-bit ids have at most 20 digits


def normalize_logit_bias(bias: object) -> dict[int | str, float] | None:
    """OpenAI clients send JSON, whose keys are strings: accept "123" as token id 123."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise bad_param("logit_bias", f"must be a dict of token id -> bias, got {show(bias)}.")
    if len(bias) > limits.MAX_LOGIT_BIAS_ENTRIES:
        raise bad_param(
            "logit_bias",
            f"may have at most {limits.MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}.",
        )
    out: dict[int | str, float] = {}  # int keys only, typed as the field is
    for key, value in bias.items():
        if isinstance(key, bool):
            key = None
        elif isinstance(key, str):
            digits = key.strip().removeprefix("-")
            ok = digits.isascii() and digits.isdigit() and len(digits) <= _MAX_KEY_CHARS
            key = int(key) if ok else None
        if not isinstance(key, int):
            raise bad_param(
                "logit_bias", "contains key(s) that cannot be converted to integer token IDs."
            )
        out[key] = value
    return out


def structured_outputs_param(value: object) -> StructuredOutputsParams | None:
    """A `StructuredOutputsParams`, or its fields as a dict (converted, with its checks)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        try:
            return msgspec.convert(value, StructuredOutputsParams, strict=True)
        except msgspec.ValidationError as e:
            cause = e.__cause__ or e.__context__
            if isinstance(cause, InvalidParameterError):
                raise cause from None
            raise bad_param("structured_outputs", f"is invalid: {e}") from None
    raise bad_param("structured_outputs", f"must be a StructuredOutputsParams, got {show(value)}.")
