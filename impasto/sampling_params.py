"""`SamplingParams`: vLLM's field names and validation, pure Python.

Every invalid value raises `ValueError` naming the parameter, at construction, so a bad request
is refused at admission and never reaches the step loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

_GREEDY_EPS = 1e-5


def _bad(param: str, msg: str) -> ValueError:
    err = ValueError(f"{param} {msg}")
    err.param = param  # type: ignore[attr-defined]
    return err


def _normalize_logit_bias(bias: object) -> dict[int, float] | None:
    """OpenAI clients send JSON, whose keys are strings: accept "123" as token id 123."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise _bad("logit_bias", f"must be a dict of token id -> bias, got {bias!r}.")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, bool):
            key = None
        elif isinstance(key, str):
            key = int(key) if key.strip().lstrip("-").isdigit() else None
        if not isinstance(key, int):
            raise _bad(
                "logit_bias", "contains key(s) that cannot be converted to integer token IDs."
            )
        out[key] = value
    return out


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
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
    logit_bias: dict[int, float] | None = None
    detokenize: bool = True
    # Filled in by the engine from the tokenizer / generation config, not by users.
    eos_token_id: int | None = field(default=None, repr=False)
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise _bad("stop", f"must be a string or a list of strings, got {self.stop!r}.")
        if not isinstance(self.stop_token_ids, (list, tuple, set, type(None))):
            raise _bad(
                "stop_token_ids", f"must be a list of integers, got {self.stop_token_ids!r}."
            )
        self.stop_token_ids = list(self.stop_token_ids or [])
        if type(self.top_k) is int and self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        self._validate()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other random-sampling knobs have no effect; normalise them so
            # batches can take the exact-argmax path.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    # -- validation ---------------------------------------------------------------------------
    def _validate(self) -> None:
        bad = _bad

        def check_num(name: str, value: object, kind: type) -> None:
            ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
            if not ok or isinstance(value, bool):
                raise bad(name, f"must be a {kind.__name__}, got {value!r}.")

        check_num("n", self.n, int)
        if self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check_num(name, value, float)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {value}.")
        check_num("repetition_penalty", self.repetition_penalty, float)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}.")
        check_num("temperature", self.temperature, float)
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}.")
        check_num("top_p", self.top_p, float)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        check_num("top_k", self.top_k, int)
        if self.top_k < 0:
            raise bad("top_k", f"must be -1 (disable), or at least 1, got {self.top_k}.")
        check_num("min_p", self.min_p, float)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.seed is not None:
            check_num("seed", self.seed, int)
            if not -(2**63) <= self.seed < 2**64:
                raise bad("seed", f"must fit in 64 bits, got {self.seed}.")
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
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", f"must contain only non-empty strings, got {s!r}.")
        for t in self.stop_token_ids or []:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise bad("stop_token_ids", f"must contain non-negative integers, got {t!r}.")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", f"must be a bool, got {self.ignore_eos!r}.")
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", f"must be a bool, got {self.detokenize!r}.")
        if self.stop and not self.detokenize:
            raise bad("stop", "strings are only supported when detokenize is True.")
        if self.logit_bias is not None:
            for k, v in self.logit_bias.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or k < 0:
                    raise bad("logit_bias", "must map token ids (int >= 0) to biases (float).")
                if not -100.0 <= v <= 100.0:
                    raise bad("logit_bias", f"biases must be in [-100, 100], got {v}.")

    # -- derived ------------------------------------------------------------------------------
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

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

    def update_from_tokenizer(self, eos_token_id: int | None, extra_stop_ids: set[int]) -> None:
        """Set the EOS id, and (unless ignore_eos) the model's other end-of-turn ids as stops."""
        self.eos_token_id = eos_token_id
        if not self.ignore_eos:
            self.all_stop_token_ids = set(self.stop_token_ids or []) | set(extra_stop_ids)

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)
