"""Grammar token masks of one step, and how they reach the logits.

The engine's structured-output manager fills one bitmask row per sampling row of a constrained
request: row 0 for the position after its committed tokens, row j for the position after its
first j drafts (a speculative verification samples 1 + K rows). Bit `t % 32` of word `t // 32`
set means token t is allowed. The runner sets every disallowed logit to -inf before anything
else of sampling (so greedy, sampling, rejection sampling and logprobs all see the
constrained distribution, as vLLM does); rows of unconstrained requests are left untouched.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch
from llguidance.torch import apply_token_bitmask_inplace


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
    dst_t = torch.tensor(dst, device=logits.device)
    rows = logits.index_select(0, dst_t)  # [M, V]
    bits = masks.bitmask.index_select(0, torch.tensor(src)).to(logits.device)  # [M, V/32]
    apply_token_bitmask_inplace(rows, bits)
    logits.index_copy_(0, dst_t, rows)
