"""The request fields that ask for structured outputs, as one `structured_outputs` value.

vLLM takes a constraint three ways: OpenAI's `response_format` (`json_object`, or
`json_schema` with its `schema`), vLLM's `structured_outputs` object (`json`, `regex`,
`choice`, `grammar`, `json_object` and the whitespace / additional-properties options), and the
older top-level `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` /
`guided_json_object` (with `guided_whitespace_pattern`). A request may use one of them; two
constraints at once are refused (400), as is a `response_format` type impasto does not know.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from impasto.errors import InvalidParameterError

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_json_object": "json_object",
}


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidParameterError("response_format", "response_format must be an object.")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidParameterError(
                "response_format", "response_format.json_schema must be an object."
            )
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, (Mapping, bool)):
            raise InvalidParameterError(
                "response_format", "response_format.json_schema.schema must be a JSON schema."
            )
        return {"json": schema}
    raise InvalidParameterError(
        "response_format",
        f"response_format type {kind!r} is not supported (text, json_object, json_schema).",
    )


def structured_outputs_of(fields: Mapping[str, Any]) -> dict[str, Any] | None:
    """The request's constraint as `StructuredOutputsParams` fields (None: unconstrained).
    `fields` holds the request's declared and extra fields."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = _response_format(fields.get("response_format"))
    if rf is not None:
        found.append(("response_format", rf))
    so = fields.get("structured_outputs")
    if so is not None:
        if not isinstance(so, Mapping):
            raise InvalidParameterError(
                "structured_outputs", "structured_outputs must be an object."
            )
        found.append(("structured_outputs", dict(so)))
    guided = {
        key: fields[name]
        for name, key in _GUIDED.items()
        if fields.get(name) is not None and fields.get(name) is not False
    }
    if guided:
        found.append((next(n for n in _GUIDED if fields.get(n) not in (None, False)), guided))
    if len(found) > 1:
        raise InvalidParameterError(
            found[1][0], f"{found[0][0]} and {found[1][0]} both constrain the output: use one."
        )
    pattern = fields.get("guided_whitespace_pattern")
    if not found:
        if pattern is not None:
            raise InvalidParameterError(
                "guided_whitespace_pattern", "guided_whitespace_pattern needs a JSON constraint."
            )
        return None
    _, spec = found[0]
    if pattern is not None:
        spec.setdefault("whitespace_pattern", pattern)
    return spec
