"""Hand-made logits through the pure tensor ops: masks, penalties, bias, seeds."""

from __future__ import annotations

import math

import torch

from impasto.worker import sampling_ops as ops

NEG = float("-inf")


def test_top_k_keeps_k_largest_and_ties() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 2.0, 2.0, 0.0, 3.0]])
    out = ops.apply_top_k_top_p(logits, torch.tensor([2, 2]), None)
    assert out[0].tolist() == [NEG, 5.0, NEG, 4.0, NEG]
    # Row 1: 2nd largest is 2.0, held by two tokens: both kept (value threshold).
    assert out[1].tolist() == [NEG, 2.0, 2.0, NEG, 3.0]


def test_top_k_disabled_values() -> None:
    logits = torch.randn(3, 6)
    out = ops.apply_top_k_top_p(logits, torch.tensor([0, 6, 100]), None)
    assert torch.equal(out, logits)


def test_top_p_hand_made() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.05, 0.5, 0.15, 0.3], [0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    out = ops.apply_top_k_top_p(logits, None, torch.tensor([0.7, 0.85, 0.4]))
    keep = torch.isfinite(out)
    # p=0.7: 0.5 + 0.3 reaches it -> {1, 3}. p=0.85: + 0.15 -> {1, 2, 3}. p=0.4: {1}.
    assert keep.tolist() == [
        [False, True, False, True],
        [False, True, True, True],
        [False, True, False, False],
    ]
    assert torch.equal(out[keep], logits[keep])  # kept logits unchanged


def test_top_p_one_is_identity_and_top1_always_kept() -> None:
    logits = torch.tensor([[0.0, -30.0, -60.0, 2.0]])
    assert torch.equal(ops.apply_top_k_top_p(logits, None, torch.tensor([1.0])), logits)
    out = ops.apply_top_k_top_p(logits, None, torch.tensor([1e-6]))
    assert torch.isfinite(out).tolist() == [[False, False, False, True]]


def test_top_k_then_top_p_renormalises_after_k() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # After top-k=2 the mass is {0.4/0.7, 0.3/0.7} = {0.571, 0.429}: p=0.5 keeps only token 0
    # (without renormalising, 0.4 < 0.5 would keep token 1 too); p=0.65 keeps both.
    out = ops.apply_top_k_top_p(probs.log(), torch.tensor([2]), torch.tensor([0.5]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]
    out = ops.apply_top_k_top_p(probs.log(), torch.tensor([2]), torch.tensor([0.65]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]


def test_min_p_hand_made() -> None:
    probs = torch.tensor([[0.5, 0.2, 0.05, 0.25], [0.5, 0.2, 0.05, 0.25]])
    out = ops.apply_min_p(probs.log(), torch.tensor([0.45, 0.0]))
    # threshold 0.45 * 0.5 = 0.225: keeps 0.5 and 0.25. min_p 0 keeps all.
    assert torch.isfinite(out).tolist() == [[True, False, False, True], [True] * 4]


def test_penalties_hand_made() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    out_ids = ops.pad_token_ids([[0, 0, 1]], "cpu")
    counts = ops.token_counts(out_ids, 5)
    assert counts.tolist() == [[2.0, 1.0, 0.0, 0.0, 0.0]]
    prompt_mask = ops.token_counts(ops.pad_token_ids([[3]], "cpu"), 5) > 0
    rep = ops.apply_penalties(
        logits, counts, prompt_mask, torch.zeros(1), torch.zeros(1), torch.tensor([2.0])
    )
    # Tokens 0, 1 (output) and 3 (prompt) penalised: positive / 2, negative * 2.
    assert rep.tolist() == [[1.0, -4.0, 1.0, -2.0, 0.5]]
    freq_pres = ops.apply_penalties(
        logits, counts, None, torch.tensor([0.5]), torch.tensor([0.25]), torch.ones(1)
    )
    # token 0: 2 - 0.25*2 - 0.5 = 1.0; token 1: -2 - 0.25 - 0.5 = -2.75; others unchanged.
    assert freq_pres.tolist() == [[1.0, -2.75, 1.0, -1.0, 0.5]]


def test_logit_bias_and_banned() -> None:
    logits = torch.zeros(3, 4)
    out = ops.apply_logit_bias(logits, [{1: 5.0, 3: -100.0}, None, {0: 1.5}])
    assert out.tolist() == [[0, 5, 0, -100], [0, 0, 0, 0], [1.5, 0, 0, 0]]
    assert logits.abs().sum() == 0  # out of place
    banned = ops.apply_banned_tokens(logits, [[], [2, 3], [0]])
    assert torch.isinf(banned).tolist() == [
        [False] * 4,
        [False, False, True, True],
        [True, False, False, False],
    ]


def test_derive_seed_depends_on_all_keys() -> None:
    base = ops.derive_seed(7, 100)
    assert base == ops.derive_seed(7, 100)
    assert (
        len({base, ops.derive_seed(8, 100), ops.derive_seed(7, 101), ops.derive_seed(7, 100, 1)})
        == 4
    )
    assert 0 <= ops.derive_seed(-1, 2**70) < 2**64


def test_seeded_noise_independent_of_batch() -> None:
    g = torch.Generator().manual_seed(0)
    a = ops.exponential_noise((3, 50), [None, 11, 12], [5, 9, 9], g, torch.device("cpu"))
    b = ops.exponential_noise((2, 50), [12, 11], [9, 9], None, torch.device("cpu"))
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[1], a[2])
    assert (a > 0).all()


def test_exponential_noise_mean() -> None:
    g = torch.Generator().manual_seed(1)
    q = ops.exponential_noise((64, 1000), [None] * 64, [0] * 64, g, torch.device("cpu"))
    assert math.isclose(q.mean().item(), 1.0, abs_tol=0.02)
