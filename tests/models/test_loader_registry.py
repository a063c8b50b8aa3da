"""HF safetensors loading (single and sharded), strict weight checks and the registry."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from impasto.loader.hf import iter_safetensors, load_hf_model, safetensors_files
from impasto.models.registry import get_model_class, supported_architectures
from tests.models.checkpoints import build_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen2", tie_word_embeddings=False)


def test_sharded_checkpoint_loads_identically(tiny, tmp_path):
    sharded = build_checkpoint(tmp_path, "qwen2", tie_word_embeddings=False, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(safetensors_files(sharded)) > 1
    a, _ = load_hf_model(tiny)
    b, config = load_hf_model(sharded)
    assert config.architectures == ["Qwen2ForCausalLM"]
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_kv_cache_shapes(tmp_path):
    path = build_checkpoint(tmp_path, "qwen3", head_dim=32, num_key_value_heads=1)
    model, _ = load_hf_model(path)
    assert model.kv_cache_shapes() == [(1, 32), (1, 32)]


def test_strict_loading_reports_missing_and_unexpected(tiny):
    model_cls = get_model_class(["Qwen2ForCausalLM"])
    weights = dict(iter_safetensors(tiny))
    config = load_hf_model(tiny)[1]
    dropped = "model.layers.1.self_attn.k_proj.bias"
    broken = {k: v for k, v in weights.items() if k != dropped}
    broken["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError) as err:
        model_cls(config).load_weights(broken.items())
    assert dropped in str(err.value) and "model.layers.0.mlp.extra.weight" in str(err.value)

    with pytest.raises(ValueError, match="shape"):
        bad = dict(weights, **{"model.norm.weight": torch.zeros(3)})
        model_cls(config).load_weights(bad.items())

    # Tolerated extras: rotary inv_freq buffers.
    extra = dict(weights, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)})
    model_cls(config).load_weights(extra.items())


def test_tied_head_tolerates_duplicate_lm_head(tmp_path):
    path = build_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    weights = dict(iter_safetensors(path))
    model, config = load_hf_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    type(model)(config).load_weights(weights.items())
    # An untied model must get its head.
    config.tie_word_embeddings = False
    weights.pop("lm_head.weight")
    with pytest.raises(ValueError, match="lm_head.weight"):
        type(model)(config).load_weights(weights.items())


def test_registry():
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= (
        set(supported_architectures())
    )
    assert get_model_class(["Foo", "Qwen3ForCausalLM"]).__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])


def test_missing_folder_and_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_hf_model(tmp_path)
    with pytest.raises(FileNotFoundError):
        list(iter_safetensors(tmp_path))
    save_file({"a": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    assert [n for n, _ in iter_safetensors(tmp_path)] == ["a"]


def test_cast_keeps_tied_head_shared(tmp_path):
    model, _ = load_hf_model(build_checkpoint(tmp_path, "llama", tie_word_embeddings=True))
    model.to(torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # never degraded
