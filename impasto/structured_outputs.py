"""`StructuredOutputsParams`: what a request's output must match, with vLLM's field names.

Exactly one constraint per request: `json` (a JSON schema, as a dict or its text), `regex`,
`choice` (one of the given strings), `grammar` (Lark, or GBNF / EBNF with `::=` rules, as
llama.cpp and xgrammar write them) or `json_object` (any JSON object). The options
(`disable_any_whitespace`, `disable_additional_properties`, `whitespace_pattern`) refine a JSON
constraint. Shape and size are checked here, pure Python, at construction; whether a schema or
grammar compiles is checked against the tokenizer by the admission path
(`engine/structured/grammar.py`), so a bad one is refused before anything is enqueued.

It is a msgspec `Struct` nested in `SamplingParams`: it crosses the process boundary with it.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from impasto.errors import InvalidParameterError

PARAM = "structured_outputs"
# A schema or grammar's text, and the number of choices, are bounded (checked at admission).
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 4096

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        self._check_types()
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameterError(
                PARAM,
                f"{PARAM} must set exactly one of {', '.join(_KINDS)}; "
                f"got {', '.join(given) if given else 'none'}.",
            )
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise InvalidParameterError(PARAM, f"{PARAM}.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidParameterError(PARAM, f"{PARAM}.json must be a JSON schema object.")
        json_options = [
            name
            for name in ("disable_any_whitespace", "disable_additional_properties")
            if getattr(self, name)
        ] + (["whitespace_pattern"] if self.whitespace_pattern is not None else [])
        if json_options and given[0] not in ("json", "json_object"):
            raise InvalidParameterError(
                PARAM,
                f"{PARAM}.{json_options[0]} applies to JSON constraints only, not to {given[0]}.",
            )
        if self.choice is not None and not (0 < len(self.choice) <= MAX_CHOICES):
            raise InvalidParameterError(
                PARAM, f"{PARAM}.choice must hold 1 to {MAX_CHOICES} strings."
            )
        if len(self.spec_text()) > MAX_SPEC_CHARS:
            raise InvalidParameterError(
                PARAM, f"{PARAM}: the {self.kind} is longer than {MAX_SPEC_CHARS} characters."
            )

    def _check_types(self) -> None:
        """Constructed in Python, a Struct does not check its fields' types: do it here."""
        types: dict[str, tuple[type, ...]] = {
            "json": (dict, str, type(None)),
            "regex": (str, type(None)),
            "choice": (list, type(None)),
            "grammar": (str, type(None)),
            "json_object": (bool, type(None)),
            "disable_any_whitespace": (bool,),
            "disable_additional_properties": (bool,),
            "whitespace_pattern": (str, type(None)),
        }
        for name, allowed in types.items():
            value = getattr(self, name)
            ok = isinstance(value, allowed) and not (
                isinstance(value, bool) and bool not in allowed
            )
            if name == "choice" and isinstance(value, list):
                ok = all(isinstance(c, str) for c in value)
            if not ok:
                raise InvalidParameterError(PARAM, f"{PARAM}.{name} has the wrong type.")
        try:
            values = [getattr(self, n) for n in types]
            json.dumps(values, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError):
            raise InvalidParameterError(
                PARAM, f"{PARAM} must hold JSON values and valid Unicode text."
            ) from None

    @property
    def kind(self) -> str:
        """Which constraint this is: one of json, regex, choice, grammar, json_object."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def spec_text(self) -> str:
        """The constraint as one canonical string (with its options): the compile cache's key."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        options = (
            self.disable_any_whitespace,
            self.disable_additional_properties,
            self.whitespace_pattern,
        )
        return json.dumps([self.kind, value, options], sort_keys=True, ensure_ascii=False)
