"""Gemma 3 GGUF files as llama.cpp's converter writes them: config from the metadata, names,
the +1 folded into norm weights undone, and token-exact greedy decoding against transformers
on the HF checkpoint the file was written from."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_testutil import write_gguf
from transformers import Gemma3TextConfig

from impasto.loader.gguf_loader import (
    converter_shift,
    gguf_name_to_hf,
    gguf_to_hf_config,
    iter_gguf_raw,
    iter_gguf_weights,
    load_gguf_state_dict,
)
from impasto.loader.hf import iter_safetensors
from impasto.loader.model_loader import load_config, load_model
from tests.models.checkpoints import build_checkpoint, hf_greedy, hf_model
from tests.models.harness import PagedRunner, run_greedy
from tests.models.test_models_vs_hf import MAX_NEW, PROMPTS

# What the converter can express: every 6th layer global (8 layers: 5 local, 1 global, 2 local),
# query_pre_attn_scalar = head_dim, local rotary base 10000 without scaling. The window is
# shorter than the longer prompts; head_dim != hidden / heads; grouped-query attention.
CONFIG = dict(
    num_hidden_layers=8,
    head_dim=32,
    query_pre_attn_scalar=32,
    sliding_window=6,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
)
LINEAR_ROPE = {"rope_scaling_type": gguf.RopeScalingType.LINEAR, "rope_scaling_factor": 2.0}


def convert(folder: Path, out: Path, **extra_kv: object) -> Path:
    """An HF Gemma 3 checkpoint folder -> a float32 GGUF in the converter's conventions."""
    config = Gemma3TextConfig.from_pretrained(folder)
    write_gguf(out, "gemma3", config, dict(iter_safetensors(folder)), extra_kv=extra_kv)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3", **CONFIG)


@pytest.fixture(scope="module")
def gguf_file(checkpoint: Path, tmp_path_factory) -> Path:
    return convert(checkpoint, tmp_path_factory.mktemp("gguf") / "m.gguf", **LINEAR_ROPE)


def test_config_from_metadata(checkpoint: Path, gguf_file: Path) -> None:
    ours, ref = gguf_to_hf_config(gguf_file), Gemma3TextConfig.from_pretrained(checkpoint)
    assert ours.model_type == "gemma3_text" and ours.architectures == ["Gemma3ForCausalLM"]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "layer_types",
        "sliding_window",
        "query_pre_attn_scalar",
        "rope_parameters",
        "final_logit_softcapping",
        "hidden_activation",
        "attention_bias",
    ):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert ours.layer_types.count("full_attention") == 1


def test_norms_are_shifted_back_and_names_mapped(checkpoint: Path, gguf_file: Path) -> None:
    hf = dict(iter_safetensors(checkpoint))
    raw = {w.name: w for w in iter_gguf_raw(gguf_file)}
    got = load_gguf_state_dict(gguf_file)
    assert set(got) == set(hf) - {"lm_head.weight"}  # tied: no head in the file
    norms = [n for n in got if n.endswith("norm.weight")]
    assert len(norms) == 8 * 6 + 1  # four per layer, q and k, the final one
    for name, tensor in got.items():
        if name in norms:
            stored = torch.from_numpy(np.array(raw[name].data))
            assert torch.equal(stored, hf[name] + 1)  # as the converter wrote it
            assert torch.equal(tensor + 1, hf[name] + 1)  # what the model multiplies by
        else:
            assert torch.equal(tensor, hf[name]), name
    # bf16 weights: shifted back in float32, then rounded once
    for name, tensor in iter_gguf_weights(gguf_file, dtype=torch.bfloat16):
        assert torch.equal(tensor, got[name].to(torch.bfloat16)), name


def test_name_maps_differ_from_llama() -> None:
    assert gguf_name_to_hf("blk.2.ffn_norm.weight", "gemma3") == (
        "model.layers.2.pre_feedforward_layernorm.weight"
    )
    assert gguf_name_to_hf("blk.2.post_attention_norm.weight", "gemma3") == (
        "model.layers.2.post_attention_layernorm.weight"
    )
    assert gguf_name_to_hf("blk.2.post_ffw_norm.weight", "gemma3") == (
        "model.layers.2.post_feedforward_layernorm.weight"
    )
    llama = gguf_name_to_hf("blk.2.ffn_norm.weight")
    assert llama == "model.layers.2.post_attention_layernorm.weight"
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        gguf_name_to_hf("blk.2.post_ffw_norm.weight", "llama")
    assert converter_shift("gemma3", "model.layers.0.self_attn.q_norm.weight") == 1.0
    assert converter_shift("gemma3", "model.layers.0.self_attn.q_proj.weight") == 0.0
    assert converter_shift("qwen3", "model.layers.0.self_attn.q_norm.weight") == 0.0


def test_greedy_from_gguf_matches_transformers(checkpoint: Path, gguf_file: Path) -> None:
    config = load_config(gguf_file)
    model = load_model(gguf_file, config, torch.float32)
    outs, prompt_logits = run_greedy(PagedRunner(model, num_blocks=64), PROMPTS, MAX_NEW, chunk=5)
    ref = hf_model(checkpoint)
    for prompt, out, logits in zip(PROMPTS, outs, prompt_logits, strict=True):
        assert out == hf_greedy(ref, prompt, MAX_NEW), f"prompt {prompt}"
        with torch.inference_mode():
            expect = ref(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, expect, atol=1e-4, rtol=1e-4)


def test_softcap_and_no_window(tmp_path: Path) -> None:
    """Optional keys: final soft-capping is read; no sliding window makes every layer global."""
    ckpt = build_checkpoint(
        tmp_path / "hf",
        "gemma3",
        **dict(CONFIG, final_logit_softcapping=30.0, tie_word_embeddings=False),
    )
    config = gguf_to_hf_config(convert(ckpt, tmp_path / "m.gguf"))
    assert config.final_logit_softcapping == 30.0 and config.tie_word_embeddings is False
    assert config.rope_parameters["full_attention"] == {"rope_type": "default", "rope_theta": 1e6}

    base = Gemma3TextConfig.from_pretrained(ckpt)
    base.sliding_window = 0  # the converter writes 0 for sliding_window_pattern == 1
    write_gguf(tmp_path / "full.gguf", "gemma3", base, {})
    config = gguf_to_hf_config(tmp_path / "full.gguf")
    assert config.layer_types == ["full_attention"] * 8 and config.sliding_window is None


def test_27b_scales_scores_by_hidden_over_heads(tmp_path: Path) -> None:
    """llama.cpp (after gemma_pytorch) knows the 27B by its 62 layers: its query_pre_attn_scalar
    is hidden / heads (168), not head_dim (128); every other size uses head_dim."""
    shape = dict(hidden_size=5376, num_attention_heads=32, head_dim=128, sliding_window=1024)
    for layers, scalar in ((62, 168), (48, 128)):
        config = Gemma3TextConfig(**shape, num_hidden_layers=layers, vocab_size=16)
        write_gguf(tmp_path / f"{layers}.gguf", "gemma3", config, {})
        got = gguf_to_hf_config(tmp_path / f"{layers}.gguf")
        assert got.query_pre_attn_scalar == scalar
        assert got.layer_types == config.layer_types  # every 6th layer global
