"""`SamplingParams`: vLLM's field names and validation, pure Python.

Every invalid value raises `InvalidParameterError` naming the parameter, at construction, so a
bad request is refused at admission and never reaches the step loop: wrong types, NaN, values
out of range and anything over a cap of `impasto.limits` (integers within 64 bits, list and map
sizes, string lengths, text that is not valid Unicode). Error messages echo at most
`MAX_ECHO_CHARS` of a bad value. Checks that need the model
(token ids within the vocabulary, words to token ids) are `verify_for_model` and
`update_from_tokenizer`, run once by the admission path (`engine/processor.py`). The checks
that are not about one field (what an error may echo, Unicode validity, logit-bias keys,
structured-output parameters) live in `param_checks`, shared with the admission path.

It is a msgspec `Struct`: it crosses the API / engine process boundary as it is, typed, once.
Adding a sampling parameter means a field and its check here and its effect in the sampler:
the OpenAI layer passes every user field of this struct through (`from_fields`), and model kinds
that cannot honour a parameter refuse any non-default value of it (`non_default_fields`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from enum import IntEnum
from typing import Any, cast

import msgspec

from impasto import limits
from impasto.errors import InvalidParameterError
from impasto.param_checks import (
    bad_param,
    holds_invalid_text,
    is_valid_text,
    normalize_logit_bias,
    show,
    structured_outputs_param,
)
from impasto.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # JSON keys are strings: "123" is accepted as token id 123 (normalised to int).
    logit_bias: dict[int | str, float] | None = None
    detokenize: bool = True
    allowed_token_ids: list[int] | None = None  # sample only among these ids
    bad_words: list[str] | None = None  # words never generated (as any of their tokenizations)
    # Keep only the last k prompt tokens (-1: as many as the context allows); applied at
    # admission, before the length check.
    truncate_prompt_tokens: int | None = None
    # The output must match a JSON schema, regex, choice or grammar (structured_outputs.py).
    structured_outputs: StructuredOutputsParams | None = None
    # Model-specific arguments (vLLM's name; `vllm_xargs` over HTTP): flat string keys with
    # scalar values, checked at admission against what the model reads (block-diffusion
    # models: their unmasking parameters); any other model refuses them.
    extra_args: dict[str, Any] | None = None
    # Filled in by the engine from the tokenizer / generation config, not by users
    # (`ENGINE_FIELDS`).
    eos_token_id: int | None = None
    all_stop_token_ids: set[int] = msgspec.field(default_factory=set)
    bad_words_token_ids: list[list[int]] | None = None  # `bad_words`, tokenized at admission

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise bad_param("stop", f"must be a string or a list of strings, got {self.stop!r}.")
        if not isinstance(self.stop_token_ids, (list, tuple, set, type(None))):
            raise bad_param(
                "stop_token_ids", f"must be a list of integers, got {self.stop_token_ids!r}."
            )
        self.stop_token_ids = list(self.stop_token_ids or [])
        if type(self.top_k) is int and self.top_k == -1:
            self.top_k = 0
        self.logit_bias = normalize_logit_bias(self.logit_bias)
        self.structured_outputs = structured_outputs_param(self.structured_outputs)
        self._validate()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other random-sampling knobs have no effect; normalise them so
            # batches can take the exact-argmax path.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        # A union, not an assignment: decoding in the engine process runs this again, after the
        # engine filled in the model's stop ids.
        self.all_stop_token_ids = set(self.stop_token_ids) | set(self.all_stop_token_ids)

    # -- validation ---------------------------------------------------------------------------
    def _validate(self) -> None:
        bad = bad_param

        def check_num(name: str, value: object, kind: type) -> None:
            ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
            if not ok or isinstance(value, bool):
                raise bad(name, f"must be a {kind.__name__}, got {show(value)}.")
            in_range = not isinstance(value, int) or limits.INT64_MIN <= value <= limits.INT64_MAX
            if kind is int and not in_range:
                raise bad(name, f"must fit in a signed 64-bit integer, got {show(value)}.")

        def check_bool(name: str) -> None:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be a bool, got {show(getattr(self, name))}.")

        def check_size(name: str, values: list | dict, cap: int) -> None:
            if len(values) > cap:
                raise bad(name, f"may have at most {cap} entries, got {len(values)}.")

        def check_text(name: str, text: object, what: str) -> None:
            blank = not isinstance(text, str) or not (text.strip() if what == "word" else text)
            if blank:
                raise bad(name, f"must contain only non-empty strings, got {show(text)}.")
            assert isinstance(text, str)
            if len(text) > limits.MAX_TEXT_PARAM_CHARS:
                raise bad(
                    name,
                    f"entries may have at most {limits.MAX_TEXT_PARAM_CHARS} characters, "
                    f"got one of {len(text)}.",
                )
            if not is_valid_text(text):
                raise bad(name, f"must be valid Unicode text (no lone surrogate): {show(text)}.")

        k = self.truncate_prompt_tokens
        if k is not None:
            check_num("truncate_prompt_tokens", k, int)
            if k != -1 and k < 1:
                raise bad("truncate_prompt_tokens", f"must be -1 or at least 1, got {show(k)}.")

        def check_token_ids(name: str, ids: list, cap: int) -> None:
            check_size(name, ids, cap)
            for t in ids:
                if type(t) is not int or not 0 <= t <= limits.INT64_MAX:
                    raise bad(name, f"must contain non-negative integers, got {show(t)}.")

        check_num("n", self.n, int)
        if not 1 <= self.n <= limits.MAX_N:
            raise bad("n", f"must be in [1, {limits.MAX_N}], got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check_num(name, value, float)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {show(value)}.")
        check_num("repetition_penalty", self.repetition_penalty, float)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad(
                "repetition_penalty", f"must be in (0, 2], got {show(self.repetition_penalty)}."
            )
        check_num("temperature", self.temperature, float)
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {show(self.temperature)}.")
        check_num("top_p", self.top_p, float)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {show(self.top_p)}.")
        check_num("top_k", self.top_k, int)
        if self.top_k < 0:
            raise bad("top_k", f"must be -1 (disable), or at least 1, got {self.top_k}.")
        check_num("min_p", self.min_p, float)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {show(self.min_p)}.")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise bad("seed", f"must be an int, got {show(self.seed)}.")
            if not limits.SEED_MIN <= self.seed <= limits.SEED_MAX:
                raise bad("seed", f"must fit in 64 bits, got {show(self.seed)}.")
        if self.max_tokens is not None:
            check_num("max_tokens", self.max_tokens, int)
            if self.max_tokens < 1:
                raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        check_num("min_tokens", self.min_tokens, int)
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                check_num(name, value, int)
                if value < 0 and value != -1:
                    raise bad(name, f"must be >= 0 (or -1 for the whole vocab), got {value}.")
        assert isinstance(self.stop, list)
        check_size("stop", self.stop, limits.MAX_STOP_STRINGS)
        if self.extra_args is not None:
            scalars = (str, int, float, bool)
            if not isinstance(self.extra_args, dict) or not all(
                isinstance(k, str) and isinstance(v, scalars) for k, v in self.extra_args.items()
            ):
                raise bad(
                    "extra_args",
                    f"must map strings to scalar values, got {show(self.extra_args)}.",
                )
            check_size("extra_args", self.extra_args, 64)
        for s in self.stop:
            check_text("stop", s, "string")
        check_token_ids("stop_token_ids", self.stop_token_ids or [], limits.MAX_STOP_TOKEN_IDS)
        for name in (
            "ignore_eos",
            "detokenize",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            check_bool(name)
        if self.stop and not self.detokenize:
            raise bad("stop", "strings are only supported when detokenize is True.")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids:
                raise bad("allowed_token_ids", "must be a non-empty list of token ids.")
            check_token_ids("allowed_token_ids", ids, limits.MAX_ALLOWED_TOKEN_IDS)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list):
                raise bad("bad_words", f"must be a list of strings, got {show(self.bad_words)}.")
            check_size("bad_words", self.bad_words, limits.MAX_BAD_WORDS)
            for w in self.bad_words:
                check_text("bad_words", w, "word")
        lo, hi = limits.LOGIT_BIAS_MIN, limits.LOGIT_BIAS_MAX
        for k, v in (self.logit_bias_ids or {}).items():
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not 0 <= k <= limits.INT64_MAX
            ):
                raise bad("logit_bias", "must map token ids (int >= 0) to biases (float).")
            if not lo <= v <= hi:
                raise bad("logit_bias", f"biases must be in [{lo:g}, {hi:g}], got {show(v)}.")

    # -- derived ------------------------------------------------------------------------------
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def logit_bias_ids(self) -> dict[int, float] | None:
        """`logit_bias` with its keys as token ids (normalised at construction)."""
        return cast("dict[int, float] | None", self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def update_from_tokenizer(
        self, tokenizer: Any | None, eos_token_id: int | None, extra_stop_ids: set[int]
    ) -> None:
        """Fill in what depends on the model (run once, at admission): the EOS id, the model's
        other end-of-turn ids as stops (unless ignore_eos), and anything given as text that
        the sampler needs as token ids (`tokenizer` is None with skip_tokenizer_init)."""
        self.eos_token_id = eos_token_id
        if not self.ignore_eos:
            self.all_stop_token_ids = set(self.stop_token_ids or []) | set(extra_stop_ids)
        if self.bad_words:
            if tokenizer is None:
                raise bad_param("bad_words", "needs a tokenizer (skip_tokenizer_init is set).")
            self.bad_words_token_ids = _tokenize_bad_words(tokenizer, self.bad_words)

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    # -- admission ------------------------------------------------------------------------------
    @classmethod
    def user_fields(cls) -> tuple[str, ...]:
        """The fields a request may set (everything but what the engine fills in)."""
        return tuple(f for f in cls.__struct_fields__ if f not in ENGINE_FIELDS)

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> SamplingParams:
        """Build from JSON-shaped values (an HTTP body), with type checks: a value of the wrong
        type is an `InvalidParameterError` naming its field, like any other bad value."""
        unknown = sorted(set(values) - set(cls.user_fields()))
        if unknown:
            raise bad_param(unknown[0], "is not a sampling parameter.")
        for name, value in values.items():
            if holds_invalid_text(value):  # msgspec cannot even report such a value
                raise bad_param(name, "must be valid Unicode text (it holds a lone surrogate).")
        try:
            return msgspec.convert(dict(values), cls, strict=True)
        except msgspec.ValidationError as e:
            cause = e.__cause__ or e.__context__
            if isinstance(cause, InvalidParameterError):  # raised by __post_init__
                raise cause from None
            message = str(e)
            where = message.partition("`$.")[2]  # "... - at `$.top_k`" names the field
            param = where.split("`")[0].split(".")[0].split("[")[0] or None
            raise InvalidParameterError(param, f"{param}: {message}") from None

    def non_default_fields(self) -> list[str]:
        """User fields whose value differs from the default (what a restricted model kind must
        refuse unless it supports them)."""
        default = _DEFAULT
        return [f for f in self.user_fields() if getattr(self, f) != getattr(default, f)]

    def verify_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: every token id a parameter names is in the vocabulary."""
        bad = [t for t in self.stop_token_ids or [] if t >= vocab_size]
        if bad:
            raise bad_param(
                "stop_token_ids", f"contains token id(s) {show(bad)} out of vocabulary."
            )
        for key in self.logit_bias_ids or {}:
            if key >= vocab_size:
                raise bad_param("logit_bias", f"token id {show(key)} is out of vocabulary.")
        bad = [t for t in self.allowed_token_ids or [] if t >= vocab_size]
        if bad:
            raise bad_param(
                "allowed_token_ids", f"contains token id(s) {show(bad)} out of vocabulary."
            )


def _tokenize_bad_words(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each word as it tokenizes at the start of a text and after a space (most tokenizers
    fold a leading space into the first token), without duplicates."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


# What the engine fills in; never taken from a request.
ENGINE_FIELDS = frozenset({"eos_token_id", "all_stop_token_ids", "bad_words_token_ids"})
_DEFAULT = SamplingParams()
