"""The default GGUF read by impasto equals what transformers reads from the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from impasto.loader.gguf_loader import gguf_to_hf_config, iter_gguf_weights
from impasto.loader.packaged_models import ensure_default_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="module")
def ref_config(gguf_path: Path) -> PretrainedConfig:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def test_config_matches_transformers(gguf_path: Path, ref_config: PretrainedConfig) -> None:
    ref = ref_config
    ours = gguf_to_hf_config(gguf_path)
    assert ours.model_type == ref.model_type
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "rope_parameters",
        "attention_bias",
        "mlp_bias",
    ):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.architectures == ["LlamaForCausalLM"]


def test_tensors_match_transformers(gguf_path: Path, ref_config: PretrainedConfig) -> None:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers' GGUF path needs a model skeleton for its name map; meta costs no memory
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(ref_config)
    ref = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    ref_tensors = ref["tensors"]
    ours = dict(iter_gguf_weights(gguf_path))
    assert set(ours) == set(ref_tensors)
    assert set(ours) | {"lm_head.weight"} == set(skeleton.state_dict())
    for name, tensor in ours.items():
        expected = torch.as_tensor(ref_tensors[name]).float()
        assert tensor.shape == expected.shape, name
        torch.testing.assert_close(tensor, expected, rtol=1e-6, atol=1e-6, msg=name)


def test_bf16_load(gguf_path: Path) -> None:
    weights = dict(iter_gguf_weights(gguf_path, dtype=torch.bfloat16))
    assert len(weights) == 272
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
