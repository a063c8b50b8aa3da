"""Structured-output constraints -> llguidance grammars, checked at admission, compiled once.

llguidance (a Rust grammar engine, no dependencies, fast on CPU; see docs/structured_outputs.md
for the comparison with xgrammar) turns a JSON schema, regex, choice list or Lark / GBNF
grammar into a matcher that yields, at each position, the bitmask of the tokens that keep the
output inside the language, and consumes (and rolls back) tokens.

- `grammar_text` is the pure translation of a request's `StructuredOutputsParams` (no
  tokenizer); `check` validates it (syntax and schema) and raises `InvalidParameterError`
  naming `structured_outputs`, so the admission path refuses a bad schema before enqueueing.
- `GrammarCompiler` owns the tokenizer's llguidance view (the model's vocabulary width, its
  stop ids as EOS) and a bounded cache of compiled matchers keyed by the constraint's canonical
  text: a schema that many requests share compiles once; each request gets a copy.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import any_to_lark

from impasto.errors import InvalidParameterError

if TYPE_CHECKING:  # a TypedDict of the stubs only
    from llguidance._lib import JsonCompileOptions
from impasto.structured_outputs import PARAM, StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (each a template that requests copy)


def _close_objects(schema: Any) -> Any:
    """`disable_additional_properties`: every object schema that does not say otherwise gets
    `additionalProperties: false` (a copy; the request's schema is left as it was)."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (raises InvalidParameterError if it cannot even
    be translated, e.g. a GBNF grammar that does not parse)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        if params.disable_additional_properties:
            schema = _close_objects(copy.deepcopy(schema))
        options: JsonCompileOptions = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise InvalidParameterError(PARAM, f"{PARAM}.json is not a valid schema: {e}") from None
    if kind == "regex":
        assert params.regex is not None
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        assert params.choice is not None
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    assert params.grammar is not None
    try:
        lark = any_to_lark(params.grammar)  # GBNF / EBNF (`::=` rules) or Lark as it is
    except Exception as e:  # noqa: BLE001 - the converter raises its own parse errors
        raise InvalidParameterError(PARAM, f"{PARAM}.grammar does not parse: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check(params: StructuredOutputsParams) -> str:
    """Translate and validate a constraint (no tokenizer needed); returns the grammar text."""
    grammar = grammar_text(params)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidParameterError(
            PARAM, f"{PARAM}.{params.kind} is invalid: {messages[0] if messages else '?'}"
        )
    return grammar


class GrammarCompiler:
    """Compiles constraints into matchers over one tokenizer. Thread-safe (compiles may run on
    a worker thread while the step loop copies cached matchers)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        # EOS, for the grammar, is any of the model's stop ids: once the constraint is
        # satisfied (and nothing more may follow) these are the only tokens allowed.
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(set(stop_token_ids))
        )
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one request (at the start of its output). A constraint that
        fails to compile raises InvalidParameterError."""
        key = params.spec_text()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.deep_copy()
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise InvalidParameterError(
                PARAM, f"{PARAM}.{params.kind} is invalid: {matcher.get_error()}"
            )
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher.deep_copy()
