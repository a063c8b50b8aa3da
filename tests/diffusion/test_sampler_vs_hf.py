"""The canvas sampler against transformers' DiffusionGemma generation utilities, on the same
logits and the same noise."""

from __future__ import annotations

import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria,
)

from impasto import kernels
from impasto.config.diffusion import DiffusionConfig
from impasto.worker.diffusion.sampler import (
    GRID,
    CanvasState,
    DiffusionSampler,
    entropy,
    entropy_bound_accept,
    random_canvas,
    snap,
)

V, L = 50, 24


@pytest.fixture(params=["eager", "kernel"])
def ops(request):
    """The sampler's per-position pass: eager PyTorch, or the CPU kernel."""
    if request.param == "eager":
        return None
    ops = kernels.load()
    if ops is None:
        pytest.skip("CPU kernels unavailable")
    return ops


def _logits(seed: int, sharp: float = 4.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, V, generator=g) * sharp


@pytest.mark.parametrize("n", [1, 7, 48])
def test_temperature_schedule(n):
    cfg = DiffusionConfig(max_denoising_steps=n, t_min=0.3, t_max=0.9)
    hf = LinearTemperatureScheduleLogitsProcessor(0.3, 0.9, n)
    logits = _logits(0)
    for step in range(n):  # HF counts the remaining steps: n, n-1, ..., 1
        want = hf(None, logits, cur_step=n - step)
        torch.testing.assert_close(logits / cfg.temperature(step), want)


@pytest.mark.parametrize("bound", [0.01, 0.1, 1.0, 10.0])
@pytest.mark.parametrize("sharp", [1.0, 6.0, 20.0])
def test_entropy_bound_acceptance_and_renoise(bound, sharp):
    logits = _logits(1, sharp)
    current = torch.randint(0, V, (L,), generator=torch.Generator().manual_seed(2))
    sampled = torch.randint(0, V, (L,), generator=torch.Generator().manual_seed(3))
    noise = random_canvas(V, L, seed=7, start=11, step=0)

    hf = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=bound), L, V, 48)
    accepted_hf = hf.accept_canvas(current[None], sampled[None], logits[None], 1)
    hf.initialize_canvas = lambda batch_size, device: noise[None]  # the same noise
    renoised_hf = hf.renoise_canvas(accepted_hf, 1)[0]

    mask = entropy_bound_accept(entropy(logits), bound)
    assert torch.equal(mask, hf.accepted_token_mask[0])
    assert torch.equal(torch.where(mask, sampled, noise), renoised_hf)


def test_sampler_step_matches_hf_pipeline(ops):
    """One full step: processed logits, acceptance, renoise (same sample and noise)."""
    cfg = DiffusionConfig(canvas_length=L, max_denoising_steps=10, entropy_bound=1.0)
    sampler = DiffusionSampler(cfg, V, ops)
    raw = _logits(4, 8.0)
    state = CanvasState(start=5, tokens=random_canvas(V, L, 3, 5, -1), step=2)
    res = sampler.step(raw, state, L, seed=3)

    processed = LinearTemperatureScheduleLogitsProcessor(cfg.t_min, cfg.t_max, 10)(
        None, raw, cur_step=10 - 2
    )
    # decisions use the processed logits snapped to a fine grid (batch-invariance guard)
    snapped = snap(raw.clone(), torch.full((L,), GRID / cfg.temperature(2)))
    torch.testing.assert_close(snapped, processed, atol=0.5 / GRID, rtol=0)
    processed = snapped
    torch.testing.assert_close(res.probs, torch.softmax(processed, -1), atol=1e-6, rtol=1e-5)
    hf = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=1.0), L, V, 10)
    accepted = hf.accept_canvas(state.tokens[None], res.sampled[None], processed[None], 8)
    noise = random_canvas(V, L, 3, 5, 2)
    hf.initialize_canvas = lambda batch_size, device: noise[None]
    assert torch.equal(hf.renoise_canvas(accepted, 8)[0], res.canvas)
    assert torch.equal(res.argmax, processed.argmax(-1))


def test_sampling_follows_the_softmax(ops):
    """The canvas draws follow softmax(processed), like HF's multinomial."""
    cfg = DiffusionConfig(canvas_length=1, max_denoising_steps=1, t_min=0.5, t_max=1.0)
    sampler = DiffusionSampler(cfg, 4, ops)
    raw = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    counts = torch.zeros(4)
    for start in range(2000):
        state = CanvasState(start=start, tokens=torch.zeros(1, dtype=torch.long))
        counts[int(sampler.step(raw, state, 1, seed=0).sampled[0])] += 1
    want = torch.softmax(raw[0] / cfg.temperature(0), -1)
    torch.testing.assert_close(counts / counts.sum(), want, atol=0.035, rtol=0)


@pytest.mark.parametrize("threshold", [0, 1, 2])
def test_convergence_matches_stable_and_confident(threshold):
    cfg = DiffusionConfig(
        canvas_length=L,
        max_denoising_steps=100,
        stability_threshold=threshold,
        confidence_threshold=0.5,
    )
    sampler = DiffusionSampler(cfg, V)
    hf = StableAndConfidentStoppingCriteria(threshold, 0.5)
    history: list[torch.Tensor] = []
    g = torch.Generator().manual_seed(5)
    base = torch.randn(L, V, generator=g) * 30  # confident
    for i in range(12):
        # argmax canvases: changing, then repeated, then changing again
        logits = base if 3 <= i < 9 else base + torch.randn(L, V, generator=g) * 40
        if i >= 10:
            logits = logits * 0.01  # not confident
        am = logits.argmax(-1)
        want = bool(hf(am[None], logits[None])[0])
        got = sampler.stable(history, am) and float(entropy(logits).mean()) < 0.5
        assert got == want, i


def test_step_cap_converges_and_clipped_canvas_pads(ops):
    cfg = DiffusionConfig(canvas_length=L, max_denoising_steps=3, stability_threshold=1)
    sampler = DiffusionSampler(cfg, V, ops)
    state = CanvasState(start=0, tokens=random_canvas(V, L, 0, 0, -1))
    valid = 9
    for step in range(3):
        state.step = step
        res = sampler.step(_logits(step, 0.1)[:valid], state, valid, seed=0)
        assert res.converged == (step == 2)
        assert not res.accepted[valid:].any()  # padding is never accepted
        assert (res.argmax[valid:] == 0).all()
