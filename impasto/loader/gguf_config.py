"""Transformers configs for GGUF files without importing transformers' per-architecture classes.

Importing any `transformers.models.*` config class (`LlamaConfig`, `Qwen2Config`, ...) pulls
in transformers' model-loading machinery (`core_model_loading`, accelerate,
`torch.distributed.tensor`, sympy): about 95 MiB and half a second in every engine process.
`build_config` returns the same config from the base class alone (`PretrainedConfig`, about
20 MiB, which the tokenizer needs anyway).

Invariants:
- for each architecture of `ARCHITECTURES` and keyword arguments that are fields of its
  transformers class (or of the base class), `build_config(arch, **kwargs)` has the same
  instance attributes, with the same values, as that class's `(**kwargs)` (so `==` holds, and
  `to_dict()` agrees, `model_type` included): the class's field defaults, what its
  `__post_init__` derives (head_dim, kv heads, sliding-window fields, layer_types) and its rope
  standardization (complete rope dicts: `rope_type`, `rope_theta`, and
  `original_max_position_embeddings` for the scaled types). Legacy rope keywords
  (`rope_theta`, `rope_scaling`, ...) are refused, not converted;
- the tables are the fields of the locked transformers (5.25, requirements/lock.txt);
  tests/loader/test_gguf_config.py compares them with the installed classes' dataclass fields
  and builds every architecture both ways, so a release that changes them fails there;
- this module imports nothing from `transformers.models`, and neither may the rest of the GGUF
  path (the same tests check `sys.modules` in a fresh interpreter).
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig


class GGUFTextConfig(PretrainedConfig):
    """The base of the configs built here: a plain `PretrainedConfig` whose class names its
    `model_type` (which `to_dict()` reads from the class)."""

    model_type = ""


class LlamaGGUFConfig(GGUFTextConfig):
    model_type = "llama"


class Qwen2GGUFConfig(GGUFTextConfig):
    model_type = "qwen2"


class Qwen3GGUFConfig(GGUFTextConfig):
    model_type = "qwen3"


class Gemma3TextGGUFConfig(GGUFTextConfig):
    model_type = "gemma3_text"

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        if getattr(self, "use_bidirectional_attention", False):  # the window as configured
            output["sliding_window"] = (self.sliding_window - 1) * 2
        return output


# Each class's fields and defaults, as its dataclass declares them (the base class's own
# fields, architectures and dtype among them, are filled in by PretrainedConfig itself).
_LLAMA: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=None,
    hidden_act="silu",
    max_position_embeddings=2048,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    use_cache=True,
    pad_token_id=None,
    bos_token_id=1,
    eos_token_id=2,
    pretraining_tp=1,
    tie_word_embeddings=False,
    rope_parameters=None,
    attention_bias=False,
    attention_dropout=0.0,
    mlp_bias=False,
    head_dim=None,
)
_QWEN2: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    hidden_act="silu",
    max_position_embeddings=32768,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    use_cache=True,
    tie_word_embeddings=False,
    rope_parameters=None,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=28,
    layer_types=None,
    attention_dropout=0.0,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
_QWEN3: dict[str, Any] = dict(_QWEN2, head_dim=128, attention_bias=False)
_GEMMA3_TEXT: dict[str, Any] = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    use_cache=True,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=True,
    rope_parameters=None,
    attention_bias=False,
    attention_dropout=0.0,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    layer_types=None,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
    use_bidirectional_attention=False,
)

# GGUF `general.architecture` -> (class built, its field defaults, transformers class it mirrors)
ARCHITECTURES: dict[str, tuple[type[GGUFTextConfig], dict[str, Any], str]] = {
    "llama": (LlamaGGUFConfig, _LLAMA, "LlamaConfig"),
    "qwen2": (Qwen2GGUFConfig, _QWEN2, "Qwen2Config"),
    "qwen3": (Qwen3GGUFConfig, _QWEN3, "Qwen3Config"),
    "gemma3": (Gemma3TextGGUFConfig, _GEMMA3_TEXT, "Gemma3TextConfig"),
}

_DEFAULT_THETA = 10_000.0
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_GEMMA3_SLIDING_PATTERN = 6
_SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")
# Keys the classes convert into rope_parameters (old config.json files); not accepted here.
_LEGACY_ROPE_KEYS = frozenset(
    {"rope_scaling", "rope_theta", "rope_local_base_freq", "partial_rotary_factor"}
)


def _standard_rope(params: dict[str, Any], theta: float, max_positions: int) -> dict[str, Any]:
    """One rope dict as transformers standardizes it: a type, a base, and the pretraining
    length of the scaled types."""
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", theta)
    if params["rope_type"] in _SCALED_ROPE_TYPES:
        params.setdefault("original_max_position_embeddings", max_positions)
    return params


def _rope_parameters(arch: str, values: dict[str, Any]) -> dict[str, Any]:
    """`rope_parameters` as the class's rope conversion leaves it: flat for one rope, nested by
    the layer types that occur for Gemma 3's two (global and local layers)."""
    rope = values["rope_parameters"]
    max_positions = values["max_position_embeddings"]
    if arch != "gemma3":
        return _standard_rope(rope or {}, _DEFAULT_THETA, max_positions)
    if rope is None:
        rope = {key: {"rope_type": "default"} for key in _GEMMA3_THETA}
    for key, theta in _GEMMA3_THETA.items():
        if rope.get(key) is None:
            rope[key] = {"rope_type": "default"}
        rope[key].setdefault("rope_theta", theta)
    for key in dict.fromkeys(values["layer_types"]):  # only the types that occur
        if key in rope and rope[key] is not None:
            _standard_rope(rope[key], _DEFAULT_THETA, max_positions)
    return rope


def _post_init(arch: str, values: dict[str, Any]) -> dict[str, Any]:
    """What the class's `__post_init__` derives from its fields (before the base class's)."""
    if values.get("head_dim", "absent") is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    n_layers = values["num_hidden_layers"]
    if arch in ("qwen2", "qwen3"):
        window = values["sliding_window"] if values["use_sliding_window"] else None
        values["sliding_window"] = window
        if values["layer_types"] is None:
            values["layer_types"] = [
                "sliding_attention"
                if window is not None and i >= values["max_window_layers"]
                else "full_attention"
                for i in range(n_layers)
            ]
    if arch == "gemma3":
        if values["use_bidirectional_attention"]:
            values["sliding_window"] = values["sliding_window"] // 2 + 1
        pattern = values.get("sliding_window_pattern", _GEMMA3_SLIDING_PATTERN)  # also kept
        values["_sliding_window_pattern"] = pattern
        if values["layer_types"] is None:
            values["layer_types"] = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(n_layers)
            ]
    values["rope_parameters"] = _rope_parameters(arch, values)
    return values


def build_config(arch: str, **kwargs: Any) -> PretrainedConfig:
    """The config `arch`'s transformers class builds from `kwargs` (see the module's
    invariants), as a `GGUFTextConfig`; `kwargs` is not modified."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"no GGUF config for architecture {arch!r}")
    if legacy := sorted(_LEGACY_ROPE_KEYS.intersection(kwargs)):
        raise ValueError(f"pass rope settings in rope_parameters, not as {legacy}")
    cls, defaults, _ = ARCHITECTURES[arch]
    values = _post_init(arch, {**copy.deepcopy(defaults), **copy.deepcopy(kwargs)})
    config = cls(**values)
    for key in defaults.keys() - config.__dict__.keys():
        # fields the base class drops from its keyword arguments (use_cache: a generation
        # parameter there), kept by the classes that declare them
        setattr(config, key, values[key])
    return config
