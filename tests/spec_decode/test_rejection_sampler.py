"""The rejection sampler alone: committed tokens follow the target's distribution exactly, for
deterministic drafts (q one-hot), drawn drafts (any q), placeholders; greedy is argmax."""

from __future__ import annotations

import numpy as np
import torch

from impasto.sampling_params import SamplingParams
from impasto.worker.sampler import Sampler, SamplingMetadata
from impasto.worker.spec_decode import RejectionSampler

V = 6
P0 = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1, 0.0])  # position 0 (token 5 impossible)
P1 = torch.tensor([0.25, 0.05, 0.1, 0.2, 0.3, 0.1])  # position 1
Q0 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.1, 0.2])  # a poor draft, even proposing token 5
Q1 = torch.tensor([0.1, 0.5, 0.1, 0.1, 0.1, 0.1])


def tv_threshold(p: np.ndarray, n: int, quantile: float = 0.999) -> float:
    """The `quantile` of the total-variation distance between p and n samples drawn from p."""
    rng = np.random.default_rng(0)
    p = p.astype(np.float64) / p.astype(np.float64).sum()
    draws = rng.multinomial(n, p, size=2000) / n
    return float(np.quantile(0.5 * np.abs(draws - p).sum(axis=1), quantile))


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    p = p.astype(np.float64) / p.astype(np.float64).sum()
    return float(0.5 * np.abs(counts / counts.sum() - p).sum())


def _run(n: int, drafts: np.ndarray, q: torch.Tensor | None, temperature: float = 1.0):
    """n requests with 2 drafts each (rows: P0, P1, bonus P0) -> committed tokens per request."""
    logits = torch.stack([P0, P1, P0]).clamp_min(1e-30).log().repeat(n, 1)  # [3n, V]
    params = [SamplingParams(temperature=temperature)] * (3 * n)
    gen = torch.Generator().manual_seed(1234)
    meta = SamplingMetadata.from_params(
        params, [[]] * (3 * n), [[]] * (3 * n), [0, 1, 2] * n, "cpu", gen
    )
    plan = [(3 * i, 2) for i in range(n)]
    qs = [q] * n
    out, accepted = RejectionSampler(Sampler())(logits, meta, plan, drafts.tolist(), qs)
    tokens = out.sampled_token_ids.view(n, 3).tolist()  # [n, 3]
    return [row[: a + 1] for row, a in zip(tokens, accepted, strict=True)]


def _check(committed: list[list[int]], n: int) -> None:
    first = np.bincount([c[0] for c in committed], minlength=V)
    assert tv(first, P0.numpy()) < tv_threshold(P0.numpy(), n)
    second = [c[1] for c in committed if len(c) > 1]
    assert len(second) > n // 10
    counts = np.bincount(second, minlength=V)
    assert tv(counts, P1.numpy()) < tv_threshold(P1.numpy(), len(second))


def test_deterministic_drafts_keep_the_target_distribution():
    n = 20000
    rng = np.random.default_rng(0)
    drafts = np.stack([rng.integers(0, V, n), rng.integers(0, V, n)], axis=1)  # any drafts
    _check(_run(n, drafts, None), n)


def test_drawn_drafts_keep_the_target_distribution():
    n = 20000
    rng = np.random.default_rng(1)
    d0 = rng.choice(V, n, p=Q0.numpy() / Q0.sum().item())
    d1 = rng.choice(V, n, p=Q1.numpy() / Q1.sum().item())
    _check(_run(n, np.stack([d0, d1], axis=1), torch.stack([Q0, Q1])), n)


def test_draft_equal_to_target_is_always_accepted():
    n = 2000
    rng = np.random.default_rng(2)
    d0 = rng.choice(V, n, p=P0.numpy())
    d1 = rng.choice(V, n, p=P1.numpy())
    committed = _run(n, np.stack([d0, d1], axis=1), torch.stack([P0, P1]))
    assert all(len(c) == 3 for c in committed)


def test_placeholders_always_rejected_and_greedy_is_argmax():
    n = 500
    drafts = np.full((n, 2), -1)
    committed = _run(n, drafts, None)
    assert all(len(c) == 1 for c in committed)
    greedy = _run(4, np.array([[1, 0], [1, 4], [2, 0], [-1, -1]]), None, temperature=0.0)
    assert greedy == [[1, 4], [1, 4, 1], [1], [1]]  # argmax: 1 at position 0, 4 at 1
