"""The paged KV cache's tensors: their size per block and their allocation."""

from __future__ import annotations

import torch

from impasto.models.interface import CausalLM


def kv_cache_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * h * d * elem for h, d in model.kv_cache_shapes())


def allocate_kv_caches(
    model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One [2 (k, v), num_blocks, block_size, Hkv, D] tensor per layer (layer_idx order).

    Zeroed, not empty: masked-out slots are multiplied by 0 and must not hold NaN."""
    return [
        torch.zeros((2, num_blocks, block_size, h, d), dtype=dtype, device=device)
        for h, d in model.kv_cache_shapes()
    ]
