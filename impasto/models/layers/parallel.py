"""Tensor-parallel group state. World size 1 until torch.distributed is wired in.

Layers shard their weights with `tp_rank()` / `tp_size()` and reduce with `all_reduce`, so a
multi-rank run only has to call `set_tensor_parallel(rank, size)` before building the model.
"""

from __future__ import annotations

import torch

_RANK, _SIZE = 0, 1


def set_tensor_parallel(rank: int, size: int) -> None:
    global _RANK, _SIZE
    if not 0 <= rank < size:
        raise ValueError(f"bad tensor-parallel rank {rank} for size {size}")
    _RANK, _SIZE = rank, size


def tp_rank() -> int:
    return _RANK


def tp_size() -> int:
    return _SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _SIZE > 1:
        torch.distributed.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_SIZE)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by the tensor-parallel size {d}")
    return n // d
