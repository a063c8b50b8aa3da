"""GGUF loading: dequantization per type, name mapping, q/k permutation, configs, rope."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_testutil import permute_qk_like_converter, tiny_config, write_gguf
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen3Config,
)

from impasto.loader.gguf_loader import (
    gguf_name_to_hf,
    gguf_to_hf_config,
    iter_gguf_raw,
    iter_gguf_weights,
    load_gguf_state_dict,
    unpermute_qk_rows,
)

# max |error| / max |x| allowed for a roundtrip through each type
TOLERANCE = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 8e-3,
    Q.Q8_0: 1e-2,
    Q.Q4_0: 0.15,
    Q.Q4_1: 0.1,
    Q.Q4_K: 0.1,
    Q.Q6_K: 0.03,
}


def random_state_dict(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config)
    # norms are initialised to ones; randomise everything so permutations are visible
    return {k: torch.randn_like(v) for k, v in hf.state_dict().items()}


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_dequantize_roundtrip(tmp_path: Path, qtype: Q) -> None:
    config = tiny_config()
    sd = random_state_dict(config)
    qtypes = {k: qtype for k, v in sd.items() if v.ndim == 2}
    expected = write_gguf(tmp_path / "m.gguf", "llama", config, sd, qtypes)
    got = load_gguf_state_dict(tmp_path / "m.gguf")
    assert set(got) == set(sd)
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32 and tensor.shape == sd[name].shape, name
        # exact against the independently decoded values (HF row order)
        torch.testing.assert_close(tensor, torch.from_numpy(expected[name]), rtol=0, atol=0)
        ref = sd[name].float()
        err = (tensor - ref).abs().max().item()
        assert err <= TOLERANCE[qtypes.get(name, Q.F32)] * ref.abs().max().item() + 1e-7, name
    raw = {w.name: w for w in iter_gguf_raw(tmp_path / "m.gguf")}
    assert raw["model.layers.0.mlp.up_proj.weight"].qtype == qtype
    assert raw["model.layers.0.mlp.up_proj.weight"].shape == (512, 256)


def test_bf16_output_dtype(tmp_path: Path) -> None:
    config = tiny_config()
    sd = random_state_dict(config)
    write_gguf(
        tmp_path / "m.gguf",
        "llama",
        config,
        sd,
        {k: Q.Q8_0 for k in sd if k.endswith("proj.weight")},
    )
    fp32 = load_gguf_state_dict(tmp_path / "m.gguf")
    for name, tensor in iter_gguf_weights(tmp_path / "m.gguf", dtype=torch.bfloat16):
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, fp32[name].to(torch.bfloat16))


def test_llama_qk_permutation_is_inverted_exactly(tmp_path: Path) -> None:
    config = tiny_config(attention_bias=True)
    sd = random_state_dict(config, seed=1)
    assert "model.layers.0.self_attn.q_proj.bias" in sd
    write_gguf(tmp_path / "m.gguf", "llama", config, sd)
    got = load_gguf_state_dict(tmp_path / "m.gguf")
    assert set(got) == set(sd)
    for name in sd:
        assert torch.equal(got[name], sd[name]), name
    # and the permutation is not a no-op, so the test would catch a missing inverse
    q = sd["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(permute_qk_like_converter(q, 4), q)


def test_unpermute_inverts_on_packed_rows() -> None:
    rows = np.arange(8 * 6, dtype=np.uint8).reshape(8, 6)  # 2 heads of dim 4, 6 bytes a row
    assert np.array_equal(unpermute_qk_rows(permute_qk_like_converter(rows, 2), 2), rows)


@pytest.mark.parametrize("cls,arch", [(Qwen2Config, "qwen2"), (Qwen3Config, "qwen3")])
def test_qwen_tensors_are_not_permuted(tmp_path: Path, cls: type, arch: str) -> None:
    config = tiny_config(cls, tie_word_embeddings=True)
    sd = random_state_dict(config, seed=2)
    write_gguf(tmp_path / "m.gguf", arch, config, sd)
    got = load_gguf_state_dict(tmp_path / "m.gguf")
    assert "lm_head.weight" not in got  # tied: the model reuses the embedding
    assert set(got) == set(sd) - {"lm_head.weight"}
    for name, tensor in got.items():
        assert torch.equal(tensor, sd[name]), name
    if arch == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in got
    else:
        assert "model.layers.1.self_attn.v_proj.bias" in got
    hf = gguf_to_hf_config(tmp_path / "m.gguf")
    assert hf.model_type == cls.model_type  # a plain PretrainedConfig: see test_gguf_config
    assert hf.architectures == [cls.__name__.replace("Config", "ForCausalLM")]
    assert hf.tie_word_embeddings is True and hf.head_dim == 64


def test_config_fields(tmp_path: Path) -> None:
    config = tiny_config()
    write_gguf(tmp_path / "m.gguf", "llama", config, random_state_dict(config))
    hf = gguf_to_hf_config(tmp_path / "m.gguf")
    assert hf.model_type == "llama" and hf.architectures == ["LlamaForCausalLM"]
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
    ):
        assert getattr(hf, key) == getattr(config, key), key
    assert math.isclose(hf.rms_norm_eps, config.rms_norm_eps, rel_tol=1e-6)
    assert hf.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert hf.attention_bias is False


def test_rope_scaling_metadata(tmp_path: Path) -> None:
    config = tiny_config()
    kv = {
        "rope_scaling_type": gguf.RopeScalingType.YARN,
        "rope_scaling_factor": 4.0,
        "rope_scaling_orig_ctx_len": 32,
    }
    write_gguf(tmp_path / "m.gguf", "llama", config, random_state_dict(config), extra_kv=kv)
    rope = gguf_to_hf_config(tmp_path / "m.gguf").rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0
    assert rope["original_max_position_embeddings"] == 32 and rope["rope_theta"] == 10000.0


def test_llama3_rope_recovered_from_rope_freqs(tmp_path: Path) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = tiny_config(rope_parameters=rope, max_position_embeddings=131072)
    base = tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    divisors = (plain / scaled.double()).float().numpy()
    write_gguf(
        tmp_path / "m.gguf",
        "llama",
        base,
        random_state_dict(config),
        extra_tensors={"rope_freqs.weight": divisors},
    )
    got = gguf_to_hf_config(tmp_path / "m.gguf").rope_parameters
    assert got["rope_type"] == "llama3"
    for key, value in rope.items():
        if isinstance(value, str):  # pytest >= 9.2's approx refuses non-numbers
            assert got[key] == value, key
        else:
            assert got[key] == pytest.approx(value, rel=1e-4), key
    # the non-parameter tensor is not yielded as a weight
    assert "rope_freqs.weight" not in dict(iter_gguf_weights(tmp_path / "m.gguf"))


def test_name_mapping() -> None:
    assert gguf_name_to_hf("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_name_to_hf("output.weight") == "lm_head.weight"
    assert gguf_name_to_hf("output_norm.weight") == "model.norm.weight"
    assert gguf_name_to_hf("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert gguf_name_to_hf("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    assert gguf_name_to_hf("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert (
        gguf_name_to_hf("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    for bad in ("blk.0.ffn_gate_exps.weight", "foo.weight", "blk.x.attn_q.weight", "output.scale"):
        with pytest.raises(ValueError, match="unknown GGUF tensor"):
            gguf_name_to_hf(bad)


def test_unknown_tensor_is_an_error(tmp_path: Path) -> None:
    config = tiny_config()
    write_gguf(
        tmp_path / "m.gguf",
        "llama",
        config,
        random_state_dict(config),
        extra_tensors={"blk.0.ffn_gate_inp.weight": np.zeros((2, 4), np.float32)},
    )
    with pytest.raises(ValueError, match="blk.0.ffn_gate_inp.weight"):
        load_gguf_state_dict(tmp_path / "m.gguf")


def test_unsupported_architecture(tmp_path: Path) -> None:
    config = tiny_config()
    write_gguf(tmp_path / "m.gguf", "gemma", config, {})
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        gguf_to_hf_config(tmp_path / "m.gguf")


def test_loaded_weights_run_in_transformers(tmp_path: Path) -> None:
    """End to end: GGUF weights loaded into the HF model give the original logits."""
    config = tiny_config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    write_gguf(tmp_path / "m.gguf", "llama", config, model.state_dict())
    clone = LlamaForCausalLM(gguf_to_hf_config(tmp_path / "m.gguf")).eval()
    clone.load_state_dict(load_gguf_state_dict(tmp_path / "m.gguf"), strict=True)
    ids = torch.randint(0, config.vocab_size, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(clone(ids).logits, model(ids).logits, rtol=0, atol=0)
