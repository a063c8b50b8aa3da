"""The one admission path: a prompt and its `SamplingParams` become an `EngineRequest`, or an
`InvalidParameterError` naming what is wrong.

Invariants:
- a prompt is tokenized once and checked once, here: the offline `LLM` runs this in-process
  before anything is enqueued; the server runs it in the API process, and the engine process
  takes the resulting `EngineRequest` as it is (it crosses the process boundary typed, once);
- everything that can be wrong with a request is found here, never in the step loop:
  prompt length and token ids, every sampling parameter against the model (vocabulary,
  `max_logprobs`), and what the model kind cannot honour (a diffusion model refuses every
  sampling parameter outside `DIFFUSION_SUPPORTED`, so a new parameter is refused there until
  the canvas sampler learns it);
- the engine-filled fields of the params (EOS, the model's stop ids) are set here.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from impasto.config.model import ModelConfig
from impasto.errors import InvalidParameterError
from impasto.sampling_params import SamplingParams

PromptType = str | list[int] | dict

# Sampling parameters the diffusion canvas sampler honours (its temperature follows the
# denoising schedule: `temperature` must stay at its default of 1.0).
DIFFUSION_SUPPORTED = frozenset(
    {
        "seed",
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
    (`skip_tokenizer_init`): token-id prompts only."""

    def __init__(self, model: ModelConfig, tokenizer: Any | None) -> None:
        self.model = model
        self.tokenizer = tokenizer

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data"):
                raise InvalidParameterError(
                    "multi_modal_data", "multi-modal inputs (images) are not supported: text only."
                )
            if prompt.get("prompt_token_ids") is not None:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
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
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise InvalidParameterError("prompt", f"unsupported prompt type {type(prompt).__name__}")

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
        text, ids = self.tokenize(prompt)
        self.check_prompt(ids)
        self.check_params(params, len(ids), max_tokens_fit)
        if type(priority) is not int:
            raise InvalidParameterError("priority", f"priority must be an integer: {priority!r}")
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
                "prompt", f"Token id {bad[0]} is out of vocabulary (size {m.vocab_size})."
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
        if m.is_diffusion:
            self._check_diffusion(params)

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
