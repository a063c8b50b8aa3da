"""diffusion_config resolution and validation; the dense (no-MoE) layer variant."""

from __future__ import annotations

import json

import pytest
import torch

from impasto.config.diffusion import DiffusionConfig
from impasto.config.model import ModelConfig
from impasto.engine.processor import InputProcessor
from impasto.errors import InvalidParameterError
from impasto.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from impasto.sampling_params import SamplingParams
from impasto.structured_outputs import StructuredOutputsParams

from .checkpoints import make_config
from .harness import OneRequest


class _Cfg:
    canvas_length = 64


def test_defaults_generation_config_then_engine_argument(tmp_path):
    assert DiffusionConfig.resolve(None, object(), None) == DiffusionConfig()
    gen = {"max_denoising_steps": 20, "t_min": 0.2, "t_max": None}
    gen["sampler_config"] = {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.5}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    cfg = DiffusionConfig.resolve({"max_denoising_steps": 8}, _Cfg(), tmp_path)
    assert (cfg.canvas_length, cfg.max_denoising_steps, cfg.t_min, cfg.t_max) == (64, 8, 0.2, 0.8)
    assert cfg.entropy_bound == 0.5


@pytest.mark.parametrize(
    "bad",
    [
        {"canvas_length": 0},
        {"max_denoising_steps": 0},
        {"t_min": 0.9, "t_max": 0.5},
        {"entropy_bound": 0.0},
        {"stability_threshold": -1},
        {"confidence_threshold": 0},
        {"unknown_knob": 1},
    ],
)
def test_bad_diffusion_config_is_refused(bad):
    with pytest.raises(ValueError, match="diffusion_config"):
        DiffusionConfig.resolve(bad, _Cfg(), None)


def test_temperature_schedule_endpoints():
    cfg = DiffusionConfig(max_denoising_steps=4, t_min=0.4, t_max=0.8)
    assert [round(cfg.temperature(s), 6) for s in range(4)] == [0.8, 0.7, 0.6, 0.5]


def _diffusion_processor() -> InputProcessor:
    model = ModelConfig("m", "float32", max_model_len=64, vocab_size=100, is_diffusion=True)
    return InputProcessor(model, tokenizer=None)


def test_supported_params_pass():
    params = SamplingParams(max_tokens=5, seed=3, stop=["x"], min_tokens=2)
    _diffusion_processor().process("r", [1, 2, 3], params)


@pytest.mark.parametrize(
    "param, value",
    [
        ("n", 2),
        ("temperature", 0.5),
        ("top_p", 0.9),
        ("top_k", 5),
        ("min_p", 0.1),
        ("presence_penalty", 0.5),
        ("repetition_penalty", 1.2),
        ("logit_bias", {3: 1.0}),
        ("logprobs", 1),
        ("prompt_logprobs", 0),
        ("structured_outputs", StructuredOutputsParams(regex="[a-z]+")),
    ],
)
def test_unsupported_params_are_refused_at_admission(param, value):
    with pytest.raises(InvalidParameterError, match="not supported by diffusion") as e:
        _diffusion_processor().process("r", [1, 2, 3], SamplingParams(**{param: value}))
    assert e.value.param == param


def test_dense_variant_runs_both_modes():
    """Checkpoints without experts: each layer has the dense MLP only."""
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(make_config(num_experts=None, top_k_experts=None))
    for p in model.parameters():
        p.data.normal_(0.0, 0.1)
    assert not hasattr(model.layers[0], "experts")
    req = OneRequest(model.eval())
    req.encode(list(range(3, 20)))
    a = req.denoise(list(range(16)))
    b = req.denoise(list(range(16)))
    assert a.shape == (16, 160) and torch.equal(a, b) and req.num_computed == 17
