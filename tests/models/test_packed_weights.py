"""CPU bf16 weight prepacking: bit-identical results, tied heads kept apart, fp32 untouched."""

from __future__ import annotations

import pytest
import torch

from impasto.loader.hf import load_hf_model
from impasto.models.layers import ReplicatedLinear
from impasto.models.layers.packed import cpu_supports_packing, packed_linear, plain_linear
from impasto.worker.device_prep import prepack_linear_weights
from tests.models.checkpoints import build_checkpoint
from tests.models.harness import PagedRunner, run_greedy
from tests.models.test_models_vs_hf import PROMPTS

pytestmark = pytest.mark.skipif(
    not cpu_supports_packing(), reason="this CPU has no oneDNN bf16 weight packing"
)


@pytest.mark.parametrize("rows", [0, 1, 3, 17, 130])
def test_packed_linear_is_bit_identical(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 2 * 64, generator=g).to(torch.bfloat16)[:, ::2]  # strided input
    layer = ReplicatedLinear(64, 96, bias=True).to(torch.bfloat16)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    assert layer.linear is plain_linear
    assert prepack_linear_weights(layer) == 1
    assert layer.weight.is_mkldnn and layer.linear is packed_linear
    assert torch.equal(layer(x), torch.nn.functional.linear(x, w, b))
    assert prepack_linear_weights(layer) == 0  # idempotent


@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_matches_plain_exactly(tmp_path, tied):
    path = build_checkpoint(tmp_path, "llama", tie_word_embeddings=tied)
    results = []
    for pack in (False, True):
        model, _ = load_hf_model(path, dtype=torch.bfloat16)
        if pack:
            # Every projection and the LM head; the embedding keeps its plain lookup table.
            assert prepack_linear_weights(model) == 4 * 2 + 1
            assert not model.model.embed_tokens.weight.is_mkldnn
        results.append(run_greedy(PagedRunner(model, dtype=torch.bfloat16), PROMPTS, 6, chunk=4))
    (plain_tokens, plain_logits), (packed_tokens, packed_logits) = results
    assert plain_tokens == packed_tokens
    for a, b in zip(plain_logits, packed_logits, strict=True):
        assert torch.equal(a, b)


def test_fp32_and_disabled_are_left_alone(tmp_path, monkeypatch):
    path = build_checkpoint(tmp_path, "llama")
    model, _ = load_hf_model(path, dtype=torch.float32)
    assert prepack_linear_weights(model) == 0
    monkeypatch.setenv("IMPASTO_CPU_PACKED_WEIGHTS", "0")
    model, _ = load_hf_model(path, dtype=torch.bfloat16)
    assert prepack_linear_weights(model) == 0
