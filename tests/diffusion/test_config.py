"""diffusion_config resolution and validation; the dense (no-MoE) layer variant."""

from __future__ import annotations

import json

import pytest
import torch

from impasto.engine.diffusion_config import DiffusionConfig, validate_diffusion_params
from impasto.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion
from impasto.sampling_params import SamplingParams

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


def test_supported_params_pass():
    validate_diffusion_params(SamplingParams(max_tokens=5, seed=3, stop=["x"], min_tokens=2))


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
