"""Read GGUF checkpoints as Hugging Face configs and HF-named tensors.

Invariants of what this module yields:
- configs are those of transformers' per-architecture classes, built by gguf_config without
  importing them (nothing here imports `transformers.models`);
- names are HF parameter names (`model.layers.N.self_attn.q_proj.weight`, ...);
- shapes are torch order (GGUF stores `ne`, innermost first, so shapes are reversed);
- rows of llama q/k projections are back in HF layout (the converter interleaves them per head
  for its rotary kernel; qwen2/qwen3/gemma3 are written unpermuted);
- `iter_gguf_weights` yields HF values: where the converter stored something else (gemma3 norm
  weights with +1 folded in, `converter_shift`), it is undone on the float32 tensor. Raw
  weights (`iter_gguf_raw`) are as stored;
- no `lm_head.weight` is yielded for tied checkpoints (`config.tie_word_embeddings` is True);
- with `packed=True`, 2-D tensors of a type the kernels compute on (`PACKABLE_TYPES`: Q4_0,
  Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) are yielded as `QuantizedTensor`s whose blocks are
  read-only views of the mapped file (no copy, nothing read at load); other quantized types are
  dequantized, with one log line naming them.
"""

from __future__ import annotations

import logging
import math
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from transformers import PretrainedConfig

from impasto.loader.gguf_config import build_config
from impasto.loader.gguf_file import GGUFFile
from impasto.models.layers.quantized import PACKABLE_TYPES, QuantizedTensor

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Architectures whose converter interleaves q/k rows (rotary pairs (i, i + d/2) -> (2i, 2i + 1)).
_PERMUTED_QK = frozenset({"llama"})

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",  # HF Llama names its pre-MLP norm so
}
# Per-architecture differences from _PER_LAYER: Gemma 3 has norms after attention and after
# the MLP too, so its `ffn_norm` is the pre-MLP norm and the post norms have their own names.
_PER_LAYER_BY_ARCH: dict[str, dict[str, str]] = {
    "gemma3": {
        **_PER_LAYER,
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# Tensors that are not parameters: llama3 rope factors are folded into the config instead.
_NON_PARAMETERS = frozenset({"rope_freqs.weight"})
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


@lru_cache(maxsize=4)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def release_gguf_readers() -> None:
    """Drop cached readers once loading is done: each maps its file, and the pages touched
    while dequantizing (the whole file, ~100 MB for a small model) stay resident until then."""
    _cached_reader.cache_clear()


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """A (cached) read-only reader: config, tokenizer and weights read the same parse."""
    p = Path(path).expanduser().resolve()
    st = p.stat()
    return _cached_reader(str(p), st.st_mtime_ns, st.st_size)


def gguf_metadata(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """The value of a metadata key (str, number, bool or list), or `default` when absent."""
    return reader.metadata.get(key, default)


def gguf_architecture(reader: GGUFFile) -> str:
    arch = gguf_metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {supported}")
    return arch


def gguf_name_to_hf(name: str, arch: str = "llama") -> str:
    """Map a GGUF tensor name of an `arch` file to its HF parameter name; unknown names raise
    ValueError."""
    if m := _BLOCK_RE.match(name):
        layer, kind, suffix = m.groups()
        per_layer = _PER_LAYER_BY_ARCH.get(arch, _PER_LAYER)
        if kind in per_layer:
            return f"model.layers.{layer}.{per_layer[kind]}.{suffix}"
    elif (m := _TOP_RE.match(name)) and m.group(1) in _TOP_LEVEL:
        return f"{_TOP_LEVEL[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"unknown GGUF tensor name {name!r}: no HF parameter mapping")


def _fit_llama3_rope(factors: np.ndarray, theta: float, dim: int, orig_ctx: int) -> dict[str, Any]:
    """Recover llama3 rope parameters from the per-frequency divisors stored in `rope_freqs`.

    In the llama3 rule the divisor is 1 for short wavelengths, `factor` for long ones and
    1 / ((1 - s) / factor + s) in between, with s = (orig_ctx / wavelen - low) / (high - low)
    linear in 1 / wavelen. Only orig_ctx/low and orig_ctx/high matter, so orig_ctx is free.
    """
    f = factors.astype(np.float64)
    factor = float(f.max())
    x = orig_ctx * (theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)) / (2 * math.pi)
    mid = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
    if x.shape != f.shape or mid.sum() < 2:
        raise NotImplementedError("cannot infer llama3 rope scaling from this rope_freqs tensor")
    s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
    a, b = np.polyfit(x[mid], s, 1)  # s = a * x + b, a = 1 / (high - low), b = -low * a
    low = -b / a
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": round(float(low), 4),
        "high_freq_factor": round(float(low + 1 / a), 4),
        "original_max_position_embeddings": orig_ctx,
    }


def _rope_parameters(reader: GGUFFile, arch: str, head_dim: int) -> dict[str, Any]:
    theta = float(gguf_metadata(reader, f"{arch}.rope.freq_base", 10000.0))
    rope_dim = gguf_metadata(reader, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise NotImplementedError(f"partial rotary (rope dim {rope_dim} != head dim {head_dim})")
    kind = gguf_metadata(reader, f"{arch}.rope.scaling.type", "none")
    factor = gguf_metadata(reader, f"{arch}.rope.scaling.factor")
    orig_ctx = gguf_metadata(reader, f"{arch}.rope.scaling.original_context_length")
    params: dict[str, Any] = {"rope_type": "default"}
    if kind == "linear" and factor is not None:
        params = {"rope_type": "linear", "factor": float(factor)}
    elif kind == "yarn" and factor is not None:
        params = {"rope_type": "yarn", "factor": float(factor)}
        if orig_ctx is not None:
            params["original_max_position_embeddings"] = int(orig_ctx)
        for key in ("beta_fast", "beta_slow"):
            value = gguf_metadata(reader, f"{arch}.rope.scaling.yarn_{key}")
            if value is not None:
                params[key] = float(value)
    elif kind not in ("none", "linear", "yarn"):
        raise NotImplementedError(f"GGUF rope scaling type {kind!r} is not supported")
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is not None and params["rope_type"] == "default":
        factors = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(-1)
        params = _fit_llama3_rope(factors, theta, head_dim, int(orig_ctx or 8192))
    params["rope_theta"] = theta
    return params


# llama.cpp's reading of gemma3 files, which carry no key for these: with a sliding window
# stored, every 6th layer is global and the others local; local layers rotate with base 10000
# and no scaling; scores are scaled by head_dim ** -0.5, except in the 62-layer 27B, where
# query_pre_attn_scalar is hidden / heads (168), as in the HF configs.
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62


def _gemma3_kwargs(reader: GGUFFile, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The Gemma 3 fields on top of the common ones (`kwargs`, whose rope is the global one)."""
    meta = lambda key, default=None: gguf_metadata(reader, f"gemma3.{key}", default)
    n_layers, head_dim = kwargs["num_hidden_layers"], kwargs["head_dim"]
    window = int(meta("attention.sliding_window", 0) or 0)  # 0 / absent: every layer global
    local = window > 0
    layer_types = [
        "sliding_attention" if local and (i + 1) % _GEMMA3_GLOBAL_EVERY else "full_attention"
        for i in range(n_layers)
    ]
    # a local base is honoured if a file states one (the converter writes none for gemma3)
    local_rope = {
        "rope_type": "default",
        "rope_theta": float(meta("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)),
    }
    if n_layers == _GEMMA3_27B_LAYERS:
        scalar = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    else:
        scalar = head_dim
    softcap = meta("final_logit_softcapping")
    return dict(
        kwargs,
        rope_parameters={
            "full_attention": kwargs["rope_parameters"],
            "sliding_attention": local_rope,
        },
        layer_types=layer_types,
        sliding_window=window if local else None,
        query_pre_attn_scalar=scalar,
        final_logit_softcapping=float(softcap) if softcap else None,
        hidden_activation="gelu_pytorch_tanh",
    )


def gguf_to_hf_config_kwargs(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """(architecture, the keyword arguments of its transformers config) of a llama / qwen2 /
    qwen3 / gemma3 GGUF file."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    meta = lambda key, default=None: gguf_metadata(reader, f"{arch}.{key}", default)
    names = {t.name: t for t in reader.tensors}
    hidden = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // n_heads))
    embed = names.get("token_embd.weight")
    vocab = int(embed.shape[1]) if embed is not None else meta("vocab_size")
    if vocab is None:
        vocab = len(gguf_metadata(reader, "tokenizer.ggml.tokens", []))
    kwargs: dict[str, Any] = dict(
        architectures=[_HF_ARCHITECTURES[arch]],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(meta("context_length", 2048)),
        rope_parameters=_rope_parameters(reader, arch, head_dim),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=gguf_metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_metadata(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=gguf_metadata(reader, "tokenizer.ggml.padding_token_id"),
    )
    if arch in ("llama", "qwen3", "gemma3"):  # qwen2 always has q/k/v biases, no switch
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "llama":
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in names
    if arch == "gemma3":
        kwargs = _gemma3_kwargs(reader, kwargs)
    return arch, kwargs


def gguf_to_hf_config(path: str | os.PathLike[str]) -> PretrainedConfig:
    """The transformers config of a llama / qwen2 / qwen3 / gemma3 GGUF file: the one the
    architecture's transformers class builds, without importing that class (gguf_config)."""
    arch, kwargs = gguf_to_hf_config_kwargs(path)
    return build_config(arch, **kwargs)


@dataclass(frozen=True)
class GGUFWeight:
    """One tensor as stored, renamed to HF: `data` is raw rows (packed blocks for quantized
    types, one row per output feature) already in HF row order; `shape` is the torch shape."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


def unpermute_qk_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the converter's per-head rotary interleave along axis 0 (any trailing dims/bytes)."""
    n = rows.shape[0]
    # [n_heads, head_dim/2, 2, ...] -> [n_heads, 2, head_dim/2, ...] -> [n, ...]
    return (
        rows.reshape(n_heads, n // n_heads // 2, 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def iter_gguf_raw(path: str | os.PathLike[str]) -> Iterator[GGUFWeight]:
    """Tensors as stored (not dequantized), HF-named and in HF row order."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    heads = {
        "q_proj": gguf_metadata(reader, f"{arch}.attention.head_count"),
        "k_proj": gguf_metadata(reader, f"{arch}.attention.head_count_kv"),
    }
    heads["k_proj"] = heads["k_proj"] or heads["q_proj"]
    for t in reader.tensors:
        if t.name in _NON_PARAMETERS:
            continue
        name = gguf_name_to_hf(t.name, arch)
        data = np.asarray(t.data)
        proj = name.rsplit(".", 2)[-2]
        if arch in _PERMUTED_QK and proj in heads:
            data = unpermute_qk_rows(data, int(heads[proj]))
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        yield GGUFWeight(name, GGMLQuantizationType(t.tensor_type), shape, data)


def dequantize_weight(weight: GGUFWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize one raw weight to a fresh (writable, file-independent) torch tensor."""
    if weight.qtype == GGMLQuantizationType.F32:
        array = np.array(weight.data, dtype=np.float32)  # copy: the reader's view is a memmap
    else:
        array = dequantize(weight.data, weight.qtype)  # vectorised numpy, float32
    return torch.from_numpy(array).reshape(weight.shape).to(dtype)


# Types that are plain floats, not quantization: dequantizing them is just a cast.
_FLOAT_TYPES = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
)


def converter_shift(arch: str, name: str) -> float:
    """What the converter added to the values of the HF tensor `name` of an `arch` file.

    Gemma's RMSNorm computes x * (1 + w), and llama.cpp's converter stores w' = 1 + w so that
    its kernel computes x * w'. The shift is subtracted from the dequantized float32 tensor,
    before any cast: exactly for every w' >= 0.5 (all but strongly negative w), so the model's
    1 + (w' - 1) is w' itself, the value llama.cpp multiplies by. (Never a packed matrix.)
    """
    if arch == "gemma3" and name.endswith("norm.weight"):
        return 1.0
    return 0.0


def packed_tensor(weight: GGUFWeight) -> QuantizedTensor:
    """The stored blocks as a uint8 tensor sharing the file mapping (never written)."""
    with warnings.catch_warnings():  # the mapping is read-only; nothing writes packed blocks
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(weight.data)
    rows, cols = weight.shape
    return QuantizedTensor(int(weight.qtype), (rows, cols), blocks.view(rows, -1), mapped=True)


def iter_gguf_weights(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, packed: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(HF name, tensor) pairs for every parameter in the GGUF file, HF values: dequantized to
    `dtype`, or, with `packed`, `QuantizedTensor`s for the matrices the kernels compute on."""
    arch = gguf_architecture(open_gguf(path))
    dequantized: dict[str, list[str]] = {}
    for weight in iter_gguf_raw(path):
        shift = converter_shift(arch, weight.name)
        if packed and not shift and weight.qtype in PACKABLE_TYPES and len(weight.shape) == 2:
            yield weight.name, packed_tensor(weight)
            continue
        if packed and weight.qtype not in _FLOAT_TYPES:
            dequantized.setdefault(weight.qtype.name, []).append(weight.name)
        if shift:  # in float32, then cast (see converter_shift)
            yield weight.name, dequantize_weight(weight).sub_(shift).to(dtype)
        else:
            yield weight.name, dequantize_weight(weight, dtype)
    for qtype, names in dequantized.items():
        logger.warning(
            "%d tensors of type %s dequantized to %s at load (no packed kernel for the type): %s",
            len(names), qtype, str(dtype).removeprefix("torch."), ", ".join(names[:8])
            + (", ..." if len(names) > 8 else ""),
        )  # fmt: skip


def load_gguf_state_dict(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    return {name: t for name, t in iter_gguf_weights(path, dtype) if isinstance(t, torch.Tensor)}
