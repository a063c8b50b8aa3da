"""The one admission path: a prompt and its `SamplingParams` become an `EngineRequest`, or an
`InvalidParameterError` naming what is wrong.

Invariants:
- a prompt is tokenized once and checked once, here: the offline `LLM` runs this in-process
  before anything is enqueued; the server runs it in the API process, and the engine process
  takes the resulting `EngineRequest` as it is (it crosses the process boundary typed, once);
- everything that can be wrong with a request is found here, never in the step loop:
  prompt length and token ids (ints, in the vocabulary), text that is not valid Unicode or too
  long to fit in the context whatever it tokenizes to (refused before tokenizing it, so one
  huge prompt cannot stall the caller), every sampling parameter against the model
  (vocabulary, `max_logprobs`), the priority (64-bit), and what the model kind cannot honour
  (a diffusion model refuses every sampling parameter outside `DIFFUSION_SUPPORTED`, so a new
  parameter is refused there until the canvas sampler learns it);
- the engine-filled fields of the params (EOS, the model's stop ids) are set here.
"""

from __future__ import annotations

import operator
import time
from typing import Any

import msgspec

from impasto import limits
from impasto.config.block_diffusion import BlockDiffusionConfig
from impasto.config.model import ModelConfig
from impasto.engine.structured import grammar
from impasto.errors import InvalidParameterError
from impasto.param_checks import is_valid_text, show
from impasto.sampling_params import SamplingParams

PromptType = str | list[int] | dict

# Sampling parameters the diffusion canvas sampler honours (its temperature follows the
# denoising schedule: `temperature` must stay at its default of 1.0).
DIFFUSION_SUPPORTED = frozenset(
    {
        "seed",
        "truncate_prompt_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "max_tokens",
        "min_tokens",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "detokenize",
    }
)

# Masked block diffusion samples each slot's candidate like an AR token (temperature, top-k,
# top-p, seeded per position) and takes its unmasking parameters in `extra_args`.
BLOCK_DIFFUSION_SUPPORTED = DIFFUSION_SUPPORTED | {"temperature", "top_k", "top_p", "extra_args"}


class EngineRequest(msgspec.Struct, kw_only=True):
    """A request that passed admission: what the engine needs, nothing to re-check."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0


class InputProcessor:
    """Tokenizes and validates requests against one model. `tokenizer` may be None
    (`skip_tokenizer_init`): token-id prompts only. A non-zero `priority` is refused unless the
    scheduler orders by it (`priority_scheduling`), as in vLLM: never silently ignored."""

    def __init__(
        self, model: ModelConfig, tokenizer: Any | None, priority_scheduling: bool = False
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.priority_scheduling = priority_scheduling
        self._max_token_chars: int | None = None

    def tokenize(
        self, prompt: PromptType, truncating: bool = False
    ) -> tuple[str | None, list[int]]:
        """(text, token ids). `truncating`: the request keeps only its last tokens
        (`truncate_prompt_tokens`), so text too long for the context is not refused."""
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data"):
                raise InvalidParameterError(
                    "multi_modal_data", "multi-modal inputs (images) are not supported: text only."
                )
            if prompt.get("prompt_token_ids") is not None:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise InvalidParameterError("prompt", f"must be a string, got {show(text)}")
                return text, _token_ids(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise InvalidParameterError(
                    "prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'."
                )
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameterError(
                    "prompt", "text prompts need a tokenizer (skip_tokenizer_init is set)."
                )
            self.check_text(prompt, truncating=truncating)
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, list):
            return None, _token_ids(prompt)
        raise InvalidParameterError("prompt", f"unsupported prompt type {type(prompt).__name__}")

    def check_text(self, text: str, param: str = "prompt", truncating: bool = False) -> None:
        """Refuse text before tokenizing it: lone surrogates (no tokenizer takes them), and,
        unless the request truncates its prompt, text too long to fit in the context whatever
        it tokenizes to (more characters than `max_model_len` of the vocabulary's longest
        tokens hold), which would otherwise cost a tokenization of up to the whole body before
        the length check refuses it."""
        if not is_valid_text(text):
            raise InvalidParameterError(
                param, f"{param} must be valid Unicode text (it holds a lone surrogate)."
            )
        if truncating:
            return
        m = self.model
        per_token = self.max_token_chars
        if per_token and len(text) > m.max_model_len * per_token:
            raise InvalidParameterError(
                "input_tokens",
                f"This model's maximum context length is {m.max_model_len} tokens. However, "
                f"your request has {len(text)} characters of input, more than {m.max_model_len} "
                f"tokens can hold (at most {per_token} characters each). Please reduce the "
                "length of the input.",
            )

    @property
    def max_token_chars(self) -> int:
        """Characters the longest vocabulary entry stands for, at most (0: unknown). A vocabulary
        entry is at least as long as the text it decodes to: byte-level BPE spells each byte as
        one character, SentencePiece a space as one character and a byte as `<0xNN>`."""
        if self._max_token_chars is None:
            vocab = getattr(self.tokenizer, "get_vocab", None)
            try:
                entries = vocab() if vocab is not None else {}
            except Exception:  # noqa: BLE001 - no vocabulary to bound with: no length pre-check
                entries = {}
            self._max_token_chars = max((len(str(t)) for t in entries), default=0)
        return self._max_token_chars

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        max_tokens_fit: bool = False,
    ) -> EngineRequest:
        """Admit one request. `max_tokens_fit`: refuse a `max_tokens` that does not fit in the
        context after the prompt (the OpenAI server's rule) instead of capping at it."""
        keep = params.truncate_prompt_tokens if isinstance(params, SamplingParams) else None
        text, ids = self.tokenize(prompt, truncating=keep is not None)
        if keep is not None:  # the last `keep` tokens (-1: as many as leave room for one more)
            ids = ids[-(self.model.max_model_len - 1 if keep == -1 else keep) :]
        self.check_prompt(ids)
        self.check_params(params, len(ids), max_tokens_fit)
        if type(priority) is not int or not limits.INT64_MIN <= priority <= limits.INT64_MAX:
            raise InvalidParameterError(
                "priority", f"priority must be a signed 64-bit integer, got {show(priority)}"
            )
        if priority != 0 and not self.priority_scheduling:
            raise InvalidParameterError(
                "priority",
                f"Got priority {priority} but priority scheduling is not enabled "
                "(scheduling_policy='priority', --scheduling-policy priority).",
            )
        m = self.model
        params.update_from_tokenizer(self.tokenizer, m.eos_token_id, set(m.extra_stop_token_ids))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        return EngineRequest(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            arrival_time=arrival,
            priority=priority,
        )

    # -- checks ---------------------------------------------------------------------------------
    def check_prompt(self, ids: list[int]) -> None:
        m = self.model
        if not ids:
            raise InvalidParameterError(
                "prompt", "The prompt is empty: at least one token is needed."
            )
        if len(ids) >= m.max_model_len:
            raise InvalidParameterError(
                "input_tokens",
                f"This model's maximum context length is {m.max_model_len} tokens. However, your "
                f"request has {len(ids)} input tokens. Please reduce the length of the input.",
            )
        bad = [t for t in ids if not 0 <= t < m.vocab_size]
        if bad:
            raise InvalidParameterError(
                "prompt", f"Token id {show(bad[0])} is out of vocabulary (size {m.vocab_size})."
            )
        if m.image_token_id is not None and m.image_token_id in ids:
            raise InvalidParameterError(
                "prompt", "image inputs are not supported: this engine serves text only."
            )

    def check_params(self, params: SamplingParams, prompt_len: int, max_tokens_fit: bool) -> None:
        m = self.model
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError(
                "sampling_params", f"expected SamplingParams, got {type(params).__name__}"
            )
        params.verify_for_model(m.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            # -1 asks for the whole vocabulary: allowed only up to the cap, as in vLLM.
            wanted = m.vocab_size if value == -1 else value
            if m.max_logprobs >= 0 and wanted is not None and wanted > m.max_logprobs:
                raise InvalidParameterError(
                    name,
                    f"Requested {name} of {wanted}{' (-1: the whole vocabulary)' * (value == -1)}"
                    f", which is greater than max allowed: {m.max_logprobs}",
                )
        limit, max_tokens = m.max_model_len, params.max_tokens
        if max_tokens_fit and max_tokens is not None and prompt_len + max_tokens > limit:
            raise InvalidParameterError(
                "max_tokens",
                f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. "
                f"This model's maximum context length is {limit} tokens and your request has "
                f"{prompt_len} input tokens ({params.max_tokens} > {limit} - {prompt_len}).",
            )
        if m.block_diffusion is not None:
            self._check_block_diffusion(params, m.block_diffusion)
        elif m.is_diffusion:
            self._check_diffusion(params)
        elif params.extra_args:
            raise InvalidParameterError(
                "extra_args",
                f"extra_args {sorted(params.extra_args)} are not read by this model "
                "(only block-diffusion models take extra arguments: their unmasking parameters).",
            )
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise InvalidParameterError(
                    "structured_outputs",
                    "structured outputs need a tokenizer (skip_tokenizer_init).",
                )
            grammar.check(params.structured_outputs)  # a bad schema / grammar: refused here

    @staticmethod
    def _check_block_diffusion(params: SamplingParams, config: BlockDiffusionConfig) -> None:
        """Masked block diffusion samples its candidates with temperature / top-k / top-p and
        reads its unmasking parameters from `extra_args` (another block size: refused)."""
        for name in params.non_default_fields():
            if name not in BLOCK_DIFFUSION_SUPPORTED:
                raise InvalidParameterError(
                    name,
                    f"{name} must be left at its default (got {getattr(params, name)!r}): "
                    "not supported by block-diffusion models",
                )
        if params.min_p:
            raise InvalidParameterError("min_p", "min_p is not supported by block diffusion")
        config.unmasking.override(params.extra_args, config.block_size)

    @staticmethod
    def _check_diffusion(params: SamplingParams) -> None:
        for name in params.non_default_fields():
            if name not in DIFFUSION_SUPPORTED:
                value = getattr(params, name)
                why = (
                    "must be 1.0: the temperature follows the denoising schedule "
                    "(set t_min / t_max in diffusion_config)"
                    if name == "temperature"
                    else f"must be left at its default (got {value!r})"
                )
                raise InvalidParameterError(
                    name, f"{name} {why} (not supported by diffusion models)"
                )


def _token_ids(ids: object) -> list[int]:
    """A prompt of token ids as a list of Python ints (numpy integers are taken; bools, floats
    and strings are not). Their range is `check_prompt`'s."""
    error = InvalidParameterError(
        "prompt", f"prompt token ids must be a sequence of integers, got {show(ids)}"
    )
    if isinstance(ids, (str, bytes, dict)):
        raise error
    try:
        items = list(ids)  # type: ignore[call-overload]
        if any(isinstance(t, bool) or type(t).__name__ == "bool_" for t in items):
            raise error
        return [operator.index(t) for t in items]
    except TypeError:
        raise error from None
