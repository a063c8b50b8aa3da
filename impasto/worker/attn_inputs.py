"""Flattened-batch attention inputs from the persistent block table (vectorised numpy)."""

from __future__ import annotations

import numpy as np
import torch

from impasto.attention.metadata import AttentionMetadata


def build_attention_metadata(
    block_table: np.ndarray,  # [max_reqs, max_blocks] persistent block table
    rows: np.ndarray,  # [B] persistent-batch rows of the scheduled requests
    start: np.ndarray,  # [B] tokens already in the cache (first query position)
    qlens: np.ndarray,  # [B] query tokens this step
    block_size: int,
    device: torch.device,
) -> tuple[AttentionMetadata, np.ndarray, np.ndarray]:
    """Return the metadata (all requests causal), `req_idx` [T] (the batch index of each
    flattened query token) and `positions` [T] on the host."""
    bs, total = block_size, int(qlens.sum())
    cu = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(qlens, out=cu[1:])
    req_idx = np.repeat(np.arange(len(rows)), qlens)  # [T]
    positions = start[req_idx] + (np.arange(total) - cu[:-1][req_idx])  # [T]
    slots = block_table[rows[req_idx], positions // bs] * bs + positions % bs
    seq_lens = start + qlens
    max_blocks = int(-(-seq_lens.max() // bs))
    meta = AttentionMetadata(
        num_reqs=len(rows),
        num_tokens=total,
        block_size=bs,
        query_lens=qlens.tolist(),
        seq_lens=seq_lens.tolist(),
        causal=[True] * len(rows),
        query_start_loc=torch.from_numpy(cu).to(device),
        seq_lens_t=torch.from_numpy(seq_lens).to(device),
        positions=torch.from_numpy(positions).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        block_table=torch.from_numpy(np.ascontiguousarray(block_table[rows, :max_blocks])).to(
            device
        ),
    )
    return meta, req_idx, positions
