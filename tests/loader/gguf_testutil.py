"""Helpers for building tiny GGUF files in tests.

K-quant quantizers are written here from the block layout (gguf's python package only
dequantizes them); each returns the packed bytes and the float values they decode to, so the
loader's dequantization is checked against an independent reading of the format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from transformers import Gemma3TextConfig, LlamaConfig, PretrainedConfig

QK_K = 256


def tiny_config(
    cls: type[PretrainedConfig] = LlamaConfig,
    *,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    head_dim: int = 64,
    **overrides: Any,
) -> PretrainedConfig:
    """A tiny config of `cls` to write GGUF files from: 2 layers, 4 query and 2 KV heads, a
    64-token vocabulary, 128 positions, default rope. Gemma 3 gets 8 layers, a 16-token
    sliding window and its two ropes (global and local layers). `overrides` (any field) win."""
    kwargs: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if cls is Gemma3TextConfig:
        kwargs.update(
            num_hidden_layers=8,
            sliding_window=16,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    kwargs.update(overrides)
    return cls(**kwargs)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def quantize_q4_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, n] (n % 256 == 0) -> (bytes [rows, n/256*144], decoded values [rows, n])."""
    rows = x.shape[0]
    blocks = x.reshape(-1, 8, 32).astype(np.float32)  # [nb, sub-block, 32]
    lo = np.minimum(blocks.min(-1), 0)
    scale = (blocks.max(-1) - lo) / 15
    mins = -lo
    d = _f16(scale.max(-1) / 63)  # [nb]
    dmin = _f16(mins.max(-1) / 63)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(_safe_div(scale, d32)), 0, 63).astype(np.uint8)  # [nb, 8]
    m = np.clip(np.ceil(_safe_div(mins, dmin32)), 0, 63).astype(np.uint8)
    eff_scale, eff_min = d32 * sc, dmin32 * m
    q = np.clip(np.round(_safe_div(blocks + eff_min[..., None], eff_scale[..., None])), 0, 15)
    q = q.astype(np.uint8)
    decoded = eff_scale[..., None] * q - eff_min[..., None]
    scales = np.zeros((len(blocks), 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    pairs = q.reshape(-1, 4, 2, 32)  # chunk of 64 = (low nibbles 32, high nibbles 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    packed = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1
    )
    return packed.reshape(rows, -1), decoded.reshape(x.shape).astype(np.float32)


def quantize_q6_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, n] (n % 256 == 0) -> (bytes [rows, n/256*210], decoded values [rows, n])."""
    rows = x.shape[0]
    blocks = x.reshape(-1, 16, 16).astype(np.float32)  # [nb, sub-block, 16]
    scale = np.abs(blocks).max(-1) / 31
    d = _f16(scale.max(-1) / 127)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(_safe_div(scale, d32)), 0, 127).astype(np.int8)  # [nb, 16]
    eff = d32 * sc
    q = np.clip(np.round(_safe_div(blocks, eff[..., None])) + 32, 0, 63).astype(np.uint8)
    decoded = eff[..., None] * (q.astype(np.float32) - 32)
    q = q.reshape(-1, 2, 4, 32)  # element = 128 * half + 32 * quarter + l
    ql = (q[:, :, 0:2] & 0xF) | ((q[:, :, 2:4] & 0xF) << 4)  # [nb, half, 2, 32]
    qh = sum(((q[:, :, k] >> 4) & 3) << (2 * k) for k in range(4)).astype(np.uint8)
    packed = np.concatenate(
        [
            ql.reshape(-1, 128),
            qh.reshape(-1, 64),
            sc.view(np.uint8),
            d.view(np.uint8).reshape(-1, 2),
        ],
        axis=1,
    )
    return packed.reshape(rows, -1), decoded.reshape(x.shape).astype(np.float32)


def encode(x: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(data to write, float values the reader should decode) for one tensor and type."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == Q.F32:
        return x, x
    if qtype == Q.F16:
        return x.astype(np.float16), x.astype(np.float16).astype(np.float32)
    if qtype == Q.Q4_K:
        return quantize_q4_k(x)
    if qtype == Q.Q6_K:
        return quantize_q6_k(x)
    data = gguf.quants.quantize(x, qtype)
    return data, gguf.quants.dequantize(data, qtype)


def permute_qk_like_converter(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The converter's layout change: per head, rows (i, i + d/2) become rows (2i, 2i + 1)."""
    n = w.shape[0]
    return w.reshape(n_heads, 2, n // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


# Gemma 3's four norms per layer: its pre-MLP norm is `ffn_norm`, like Llama's second norm.
_TO_GGUF_BY_ARCH = {
    "gemma3": {
        **_TO_GGUF,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}


def hf_to_gguf_name(name: str, arch: str = "llama") -> str:
    module, suffix = name.rsplit(".", 1)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if module in top:
        return f"{top[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF_BY_ARCH.get(arch, _TO_GGUF)[rest]}.{suffix}"


def converter_shift(arch: str, name: str) -> float:
    """What llama.cpp's converter adds to a tensor: 1 to Gemma's zero-centred norm weights."""
    return 1.0 if arch == "gemma3" and name.endswith("norm.weight") else 0.0


def write_gguf(
    path: Path,
    arch: str,
    config: Any,
    state_dict: dict[str, torch.Tensor],
    qtypes: dict[str, Q] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    extra_kv: dict[str, Any] | None = None,
    tied: bool | None = None,
) -> dict[str, np.ndarray]:
    """Write an HF state dict as a GGUF the way the converter would; return the decoded
    values (HF layout) each tensor should read back as."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    if arch == "gemma3":  # the global layers' base; the local one (10000) is implied
        w.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        w.add_sliding_window(config.sliding_window)
        if config.final_logit_softcapping:
            w.add_final_logit_softcapping(config.final_logit_softcapping)
    else:
        w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in (extra_kv or {}).items():
        getattr(w, f"add_{key}")(value)
    expected: dict[str, np.ndarray] = {}
    tied = config.tie_word_embeddings if tied is None else tied
    for name, tensor in state_dict.items():
        if tied and name == "lm_head.weight":
            continue
        qtype = (qtypes or {}).get(name, Q.F32)
        shift = converter_shift(arch, name)
        array = tensor.detach().float().numpy() + np.float32(shift)  # float32, as converted
        data, expected[name] = encode(array, qtype)
        expected[name] = expected[name] - np.float32(shift)  # what a reader must undo
        proj = name.split(".")[-2]
        if arch == "llama" and proj in ("q_proj", "k_proj"):
            heads = config.num_attention_heads if proj == "q_proj" else config.num_key_value_heads
            # quantization is per row, so it commutes with the row permutation: the expected
            # (HF order) values stay those of the unpermuted tensor
            data, _ = encode(permute_qk_like_converter(array, heads), qtype)
        raw_dtype = qtype if data.dtype == np.uint8 else None
        w.add_tensor(hf_to_gguf_name(name, arch), data, raw_dtype=raw_dtype)
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected
