"""The grammar-bitmask kernel (`apply_token_bitmask_`) and its eager fallback equal llguidance's
own reference (`llguidance.torch.apply_token_bitmask_inplace`) bit for bit: float32 and
bfloat16 logits, vocabularies that are not a multiple of 32, logits wider than the mask."""

from __future__ import annotations

import pytest
import torch
from llguidance.torch import apply_token_bitmask_inplace

from impasto import kernels
from impasto.worker import token_masks


def _case(rows: int, vocab: int, mask_vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    words = (mask_vocab + 31) // 32
    bits = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64)
    bitmask = bits.to(torch.int32)
    bitmask[:, ::5] = -1  # all allowed
    bitmask[:, 1::7] = 0  # none allowed
    return logits, bitmask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64, 64), (3, 1000, 1000), (16, 4099, 4090), (2, 97, 97)])
@pytest.mark.parametrize("eager", [False, True], ids=["kernel", "eager"])
def test_bitmask_equals_llguidance(monkeypatch, dtype, shape, eager):
    if eager:
        monkeypatch.setattr(kernels, "load", lambda: None)
    elif kernels.load() is None:
        pytest.skip("no C++ compiler: the kernel is not built")
    rows, vocab, mask_vocab = shape
    logits, bitmask = _case(rows, vocab, mask_vocab, seed=vocab)
    expected = logits.to(dtype)
    apply_token_bitmask_inplace(expected, bitmask)
    got = logits.to(dtype)
    token_masks.apply_bitmask_(got, bitmask)
    assert torch.equal(got, expected)
