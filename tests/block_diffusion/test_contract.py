"""The block-diffusion contract around the decoder: block size 1 with token shift is AR greedy
decoding; loading of the published configurations; bad requests are refused at admission."""

from __future__ import annotations

import json

import pytest
import torch

from impasto.config.block_diffusion import BlockDiffusionConfig, UnmaskingParams
from impasto.errors import InvalidParameterError
from impasto.loader.hf import read_hf_config
from impasto.sampling_params import SamplingParams
from impasto.testing.block_diffusion import build_block_checkpoint, load_reference_model

from .conftest import make_llm


@torch.inference_mode()
def _ar_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_token_shift_with_block_size_1_is_ar_greedy(tmp_path):
    path = build_block_checkpoint(tmp_path / "m", "llama", 1)
    model = load_reference_model(path)
    prompts = [[5, 6, 7], [9] * 17, list(range(20, 52))]
    llm = make_llm(path, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o, p in zip(outs, prompts, strict=True):
        assert list(o.outputs[0].token_ids) == _ar_greedy(model, p, 12)


@pytest.mark.parametrize(
    ("arch", "model_type", "extra", "expect"),
    [
        ("SDARForCausalLM", "sdar", {"block_size": 4, "mask_token_id": 151669}, (4, 151669, False)),
        ("Fast_dLLM_QwenForCausalLM", "Fast_dLLM_Qwen", {"bd_size": 32}, (32, 151665, True)),
        ("A2DQwen3LMHeadModel", "a2d-qwen3", {}, (32, None, False)),
    ],
)
def test_published_configs_resolve(tmp_path, arch, model_type, extra, expect):
    base = {"qwen3": "qwen3", "sdar": "qwen3", "fast_dllm_qwen": "qwen2", "a2d-qwen3": "qwen3"}
    data = {"architectures": [arch], "model_type": model_type, "vocab_size": 151936,
            "auto_map": {"AutoConfig": "configuration.X"}, **extra}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(data))
    config = read_hf_config(tmp_path)
    assert config.model_type == base[model_type.lower()]
    block, mask, shift = expect
    if mask is None:  # A2D: the mask token is the tokenizer's
        with pytest.raises(InvalidParameterError, match="mask_token_id"):
            BlockDiffusionConfig.resolve(None, config, tmp_path)
        cfg = BlockDiffusionConfig.resolve(None, config, tmp_path, tokenizer_mask_id=151669)
        mask = 151669
    else:
        cfg = BlockDiffusionConfig.resolve(None, config, tmp_path)
    assert (cfg.block_size, cfg.mask_token_id, cfg.token_shift) == (block, mask, shift)


def test_unmasking_parameters_are_checked():
    p = UnmaskingParams()
    assert p.override({"dllm_threshold": 0.7}, 4).threshold == 0.7
    with pytest.raises(InvalidParameterError) as e:
        p.override({"block_size": 8}, 4)
    assert e.value.param == "block_size"
    with pytest.raises(InvalidParameterError) as e:
        p.override({"steps": 3}, 4)
    assert e.value.param == "steps"
    with pytest.raises(InvalidParameterError) as e:
        p.override({"algorithm": "nope"}, 4)
    assert e.value.param == "algorithm"


def test_bad_requests_are_refused_at_admission(checkpoints):
    llm = make_llm(checkpoints[("sdar", 4)])
    prompt = {"prompt_token_ids": [5, 6, 7]}
    bad = [
        (dict(extra_args={"block_size": 8}), "block_size"),
        (dict(extra_args={"threshold": 2.0}), "threshold"),
        (dict(logprobs=2), "logprobs"),
        (dict(min_p=0.1), "min_p"),
    ]
    for kwargs, param in bad:
        with pytest.raises(InvalidParameterError) as e:
            llm.generate([prompt], SamplingParams(max_tokens=4, **kwargs), use_tqdm=False)
        assert e.value.param == param, kwargs
    # Good ones still run after the refusals.
    out = llm.generate([prompt], SamplingParams(max_tokens=4, extra_args={"block_size": 4}))
    assert len(out[0].outputs[0].token_ids) == 4


def test_extra_args_on_an_ar_model_are_refused(tmp_path):
    from tests.entrypoints.conftest import build_checkpoint

    llm = make_llm(build_checkpoint(tmp_path / "ar", "llama"))
    with pytest.raises(InvalidParameterError) as e:
        llm.generate([{"prompt_token_ids": [5]}], SamplingParams(extra_args={"threshold": 0.5}))
    assert e.value.param == "extra_args"
