"""The diffusion sampler's CPU kernels (`diffusion_ops.cpp`) against the eager PyTorch path."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from impasto import kernels
from impasto.worker.diffusion.sampler import GRID, denoise_rows

HAVE_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
ops = kernels.load() if HAVE_COMPILER else None
pytestmark = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler for the CPU kernels")


@pytest.mark.parametrize("cap", [30.0, 1.0])
def test_softcap_matches_tanh_within_a_few_ulp(cap):
    x = torch.cat([torch.linspace(-40 * cap, 40 * cap, 100_003), torch.tensor([0.0, -0.0])])
    got = x.clone()[None]
    ops.softcap_(got, cap)
    want = cap * torch.tanh(x.double() / cap)
    rel = (got[0].double() - want).abs() / want.abs().clamp(min=1e-30)
    assert float(rel.max()) < 4 * torch.finfo(torch.float32).eps
    nan = torch.tensor([[float("nan"), 1.0]])
    ops.softcap_(nan, cap)
    assert nan[0, 0].isnan() and not nan[0, 1].isnan()


def _rows(seed: int, rows: int, vocab: int, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * sharp


@pytest.mark.parametrize("vocab", [1, 7, 50, 257, 32003])
@pytest.mark.parametrize("sharp", [0.5, 4.0, 40.0])
def test_denoise_rows_matches_eager(vocab, sharp):
    rows = 24
    logits = _rows(vocab, rows, vocab, sharp)
    g = torch.Generator().manual_seed(1)
    scale = GRID / torch.empty(rows).uniform_(0.3, 1.0, generator=g)
    u = torch.rand(rows, generator=g)
    probs_e, ent_e, sample_e, argmax_e = denoise_rows(logits.clone(), scale, u, None)
    buf = logits.clone()
    probs_k, ent_k, sample_k, argmax_k = denoise_rows(buf, scale, u, ops)
    assert probs_k.data_ptr() == buf.data_ptr()  # in place
    assert torch.equal(argmax_k, argmax_e)
    assert torch.equal(sample_k, sample_e)
    torch.testing.assert_close(probs_k, probs_e, atol=1e-7, rtol=2e-5)
    torch.testing.assert_close(ent_k, ent_e, atol=5e-5, rtol=1e-5)


def test_argmax_is_the_first_maximum_and_rows_are_independent():
    vocab = 1000
    logits = torch.zeros(5, vocab)
    for r, cols in enumerate([[3, 700], [999, 8, 9], [15, 16, 17, 900], [0, 511], [256, 255]]):
        logits[r, cols] = 2.0  # ties at the maximum, across and within SIMD lanes
    scale, u = torch.full((5,), GRID), torch.rand(5)
    _, _, _, argmax = denoise_rows(logits.clone(), scale, u, ops)
    assert argmax.tolist() == [3, 8, 15, 0, 255]
    # a row's results do not depend on the rows around it (strided view of a wider buffer)
    wide = torch.randn(7, vocab + 5)
    view = wide[:, 2 : 2 + vocab]
    alone = [
        denoise_rows(view[r : r + 1].clone(), scale[r : r + 1], u[r : r + 1], ops) for r in range(5)
    ]
    together = denoise_rows(view[:5], scale, u, ops)
    for r, one in enumerate(alone):
        for a, b in zip(one, together, strict=True):
            assert torch.equal(a[0], b[r])


@pytest.mark.parametrize("path", ["eager", "kernel"])
def test_samples_stay_in_the_support(path):
    """Tokens whose probability underflows are never drawn, whatever the uniform."""
    vocab, rows = 4099, 64
    logits = torch.full((rows, vocab), -1e4)
    g = torch.Generator().manual_seed(3)
    support = torch.randint(0, vocab, (rows, 3), generator=g)
    logits.scatter_(1, support, torch.randn(rows, 3, generator=g))
    u = torch.cat([torch.zeros(4), torch.full((4,), 1 - 2**-24), torch.rand(rows - 8)])
    _, _, sample, _ = denoise_rows(
        logits, torch.full((rows,), GRID), u, ops if path == "kernel" else None
    )
    assert (support == sample[:, None]).any(1).all()
