"""Shared layers against transformers' own implementations / plain formulas."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from impasto.models.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    rope_parameters,
)

ROPES = [
    None,
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
]


@pytest.mark.parametrize("rope", ROPES)
def test_rotary_matches_hf(rope):
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, rope_parameters=rope)
    hf = LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(32, rope_parameters(config))
    pos = torch.tensor([0, 1, 7, 63, 64, 200, 1000])
    q, k = torch.randn(len(pos), 4, 32), torch.randn(len(pos), 2, 32)
    cos, sin = hf(q, pos[None])
    eq, ek = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cs = ours.cos_sin(pos, torch.float32)
    assert torch.equal(ours(q, cs), eq[0].transpose(0, 1))
    assert torch.equal(ours(k, cs), ek[0].transpose(0, 1))


def test_partial_rotary_leaves_the_tail():
    ours = RotaryEmbedding(16, {"rope_theta": 100.0, "partial_rotary_factor": 0.5})
    assert ours.rot_dim == 8
    pos = torch.arange(5)
    x = torch.randn(5, 3, 16)
    out = ours(x, ours.cos_sin(pos, torch.float32))
    assert torch.equal(out[..., 8:], x[..., 8:])
    full = RotaryEmbedding(8, {"rope_theta": 100.0})  # the head part is a plain 8-dim rotary
    assert torch.equal(out[..., :8], full(x[..., :8], full.cos_sin(pos, torch.float32)))


def test_rmsnorm_plain_gemma_and_residual():
    x, res = torch.randn(3, 8), torch.randn(3, 8)
    norm, gemma = RMSNorm(8, 1e-6), RMSNorm(8, 1e-6, gemma=True)
    for n in (norm, gemma):
        n.weight.data.normal_()
    unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), unit * norm.weight)
    torch.testing.assert_close(gemma(x), unit * (1 + gemma.weight))
    y, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(y, norm(x + res))


def test_fused_linear_weight_loaders():
    qkv = QKVParallelLinear(4, 2, num_heads=2, num_kv_heads=1, bias=True)
    parts = {s: torch.randn(n, 4) for s, n in (("q", 4), ("k", 2), ("v", 2))}
    for s, w in parts.items():
        qkv.weight.weight_loader(qkv.weight, w, s)
        qkv.bias.weight_loader(qkv.bias, w[:, 0], s)
    assert torch.equal(qkv.weight, torch.cat([parts["q"], parts["k"], parts["v"]]))
    assert torch.equal(qkv.bias, torch.cat([parts["q"], parts["k"], parts["v"]])[:, 0])
    gate_up = MergedColumnParallelLinear(4, [3, 3])
    g, u = torch.randn(3, 4), torch.randn(3, 4)
    gate_up.weight.weight_loader(gate_up.weight, u, 1)
    gate_up.weight.weight_loader(gate_up.weight, g, 0)
    assert torch.equal(gate_up.weight, torch.cat([g, u]))
    with pytest.raises(ValueError, match="shape"):
        gate_up.weight.weight_loader(gate_up.weight, torch.randn(2, 4), 0)
