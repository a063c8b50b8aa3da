"""Grammar token masks of one step, and how they reach the logits.

The engine's structured-output manager fills one bitmask row per sampling row of a constrained
request: row 0 for the position after its committed tokens, row j for the position after its
first j drafts (a speculative verification samples 1 + K rows). Bit `t % 32` of word `t // 32`
set means token t is allowed. The runner sets every disallowed logit to -inf before anything
else of sampling (so greedy, sampling, rejection sampling and logprobs all see the
constrained distribution, as vLLM does); rows of unconstrained requests are left untouched.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from impasto import kernels


@dataclass
class TokenMasks:
    bitmask: torch.Tensor  # [R, ceil(V / 32)] int32 on the CPU
    first_row: dict[str, int]  # request id -> its row 0 in `bitmask`


def resolve(masks: TokenMasks | Future[TokenMasks] | None) -> TokenMasks | None:
    """The masks, waiting for them if they are still being filled."""
    return masks.result() if isinstance(masks, Future) else masks


def apply_token_masks(
    logits: torch.Tensor,
    masks: TokenMasks,
    req_ids: list[str],
    plan: list[tuple[int, int, int]],
) -> None:
    """In place: for each `(batch index, first logits row, rows)` of the sampling plan whose
    request is constrained, mask its logits rows with its bitmask rows."""
    dst: list[int] = []
    src: list[int] = []
    for b, first, k in plan:
        row0 = masks.first_row.get(req_ids[b])
        if row0 is not None:
            dst.extend(range(first, first + k))
            src.extend(range(row0, row0 + k))
    if not dst:
        return
    # One mask row per logits row; unconstrained rows allow everything (all bits set).
    full = torch.full((logits.shape[0], masks.bitmask.shape[1]), -1, dtype=torch.int32)
    full[torch.tensor(dst)] = masks.bitmask[torch.tensor(src)]
    apply_bitmask_(logits, full)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits `[N, V]` (in place), bitmask `[N, W]` int32: refused tokens become -inf."""
    ops = kernels.load() if logits.device.type == "cpu" else None
    if (
        ops is not None
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.stride(-1) == 1
    ):
        ops.apply_token_bitmask_(logits, bitmask)
        return
    assert sys.byteorder == "little"  # bit k of an int32 word is bit k % 8 of byte k // 8
    n, v = logits.shape
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # [N, 32W]
    allowed = torch.zeros((n, v), dtype=torch.bool)
    width = min(v, bits.shape[1])
    allowed[:, :width] = torch.from_numpy(bits[:, :width]).bool()
    logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
