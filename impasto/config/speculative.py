"""`speculative_config`, in vLLM's shape, validated when the engine is built.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "/path/to/draft", "num_speculative_tokens": 4}

`method` may be left out when `model` is given (a draft model), or when `model` is "ngram"
(vLLM's older spelling). Unknown keys are errors, not silently ignored. Keys beyond vLLM's:

- `uniform_spec_decode_padding` (bool, default False): pad 1-token admissions to `1 + K`
  placeholder drafts so that decode batches stay uniform (for full CUDA graphs);
- `acceptance_backoff` (bool, default True): per request, shorten or pause drafting when
  recent drafts were mostly rejected (probing again later), and per batch size stop drafting
  where steps with drafts are measured to commit fewer tokens per second than steps without,
  so speculation that does not pay costs little. With it off, every request drafts K tokens
  whenever the proposer has them (deterministic drafting, for tests and measurements).
- `draft_vocab_size` (int, draft models only; default: the whole vocabulary): the draft scores
  only token ids below this, so its LM head reads that many rows (FR-Spec's frequency-ranked
  draft vocabulary; BPE vocabularies number tokens by merge rank, which follows frequency).
  A token outside it is never drafted but is still produced by the target's verification, so
  outputs are unchanged; only the acceptance rate can drop (docs/benchmarks.md, "Quantized
  GGUF files": 0.5B drafting for 1.5B, 32,768 ids, acceptance 0.83 -> 0.80, draft head 4x cheaper).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from impasto.errors import InvalidParameterError

_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "draft_tensor_parallel_size",
    "quantization",
    "uniform_spec_decode_padding",
    "acceptance_backoff",
    "draft_vocab_size",
}
METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 15  # 1 + K query tokens per request stay on the short-query path


def _bad(message: str) -> InvalidParameterError:
    return InvalidParameterError("speculative_config", message)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model"
    num_speculative_tokens: int  # K >= 1
    model: str | None = None  # draft model path (draft_model only)
    prompt_lookup_min: int = 5  # n-gram sizes tried, longest first (vLLM's default: 5..5)
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None  # no drafts while this many requests run
    uniform_spec_decode_padding: bool = False
    acceptance_backoff: bool = True
    draft_vocab_size: int | None = None  # the draft's logits cover token ids [0, this)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots the scheduler reserves past the scheduled tokens: a draft model writes the KV
        of its own drafts d1..d_{K-1} after the bonus token, and the bonus token itself may sit
        one past the verified range, hence K."""
        return self.num_speculative_tokens if self.uses_draft_model else 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise _bad(f"speculative_config must be a dict, got {type(raw).__name__}.")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise _bad(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                f"supported: {', '.join(sorted(_KEYS))}."
            )
        method, model = raw.get("method"), raw.get("model")
        if method is None and model in ("ngram", "[ngram]"):
            method, model = "ngram", None
        elif method is None and model is not None:
            method = "draft_model"
        if method not in METHODS:
            raise _bad(
                f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}."
            )
        k = raw.get("num_speculative_tokens")
        if type(k) is not int or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise _bad(
                "speculative_config: num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}."
            )
        for key in ("draft_tensor_parallel_size",):
            if raw.get(key, 1) != 1:
                raise _bad(f"speculative_config: {key} > 1 is not supported.")
        if raw.get("quantization") is not None:
            raise _bad("speculative_config: quantization of the draft is not supported.")
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if method == "ngram":
            if model is not None:
                raise _bad("speculative_config: method 'ngram' takes no 'model'.")
            lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
            if type(lo) is not int or type(hi) is not int or not 1 <= lo <= hi:
                raise _bad(
                    "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                    f"{raw.get('prompt_lookup_min')!r} and {raw.get('prompt_lookup_max')!r}."
                )
        else:
            if not isinstance(model, str) or not model:
                raise _bad("speculative_config: method 'draft_model' needs a 'model' path.")
            if lo is not None or hi is not None:
                raise _bad(
                    "speculative_config: prompt_lookup_min/max only apply to method 'ngram'."
                )
            lo = hi = 5
        disable = raw.get("disable_by_batch_size")
        if disable is not None and (type(disable) is not int or disable < 2):
            raise _bad(f"speculative_config: disable_by_batch_size must be >= 2, got {disable!r}.")
        vocab = raw.get("draft_vocab_size")
        if vocab is not None:
            if method != "draft_model":
                raise _bad("speculative_config: draft_vocab_size only applies to a draft model.")
            if type(vocab) is not int or vocab < 1:
                raise _bad(
                    f"speculative_config: draft_vocab_size must be an integer >= 1, got {vocab!r}."
                )
        flags: dict[str, Any] = {"draft_vocab_size": vocab}
        for key in ("uniform_spec_decode_padding", "acceptance_backoff"):
            if key in raw:
                if not isinstance(raw[key], bool):
                    raise _bad(f"speculative_config: {key} must be a bool.")
                flags[key] = raw[key]
        return cls(method, k, model, lo, hi, disable, **flags)


def check_target_compat(config: SpeculativeConfig, *, diffusion: bool, max_model_len: int) -> None:
    """Combinations that cannot work, caught when the engine is built."""
    if diffusion:
        raise _bad(
            "speculative_config cannot be combined with diffusion_config: a diffusion model "
            "already decodes a whole canvas per step."
        )
    if config.num_speculative_tokens + 1 >= max_model_len:
        raise _bad(
            f"num_speculative_tokens ({config.num_speculative_tokens}) leaves no room in "
            f"max_model_len ({max_model_len})."
        )


def check_draft_compat(
    target_vocab: int, draft_vocab: int, draft_model: str, draft_vocab_size: int | None = None
) -> None:
    if target_vocab != draft_vocab:
        raise _bad(
            f"The draft model {draft_model!r} has a vocabulary of {draft_vocab} tokens but the "
            f"target has {target_vocab}: the draft must share the target's tokenizer."
        )
    if draft_vocab_size is not None and draft_vocab_size > draft_vocab:
        raise _bad(
            f"speculative_config: draft_vocab_size ({draft_vocab_size}) exceeds the draft "
            f"model's vocabulary ({draft_vocab} tokens)."
        )
