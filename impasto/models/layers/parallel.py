"""Tensor-parallel group state: this process's rank and the group's size (1: no parallelism).

Layers shard their weights with `tp_rank()` / `tp_size()` and reduce with `all_reduce`, so a
multi-rank run only has to join the `torch.distributed` group and call
`set_tensor_parallel(rank, size)` before building the model (`impasto/engine/tensor_parallel.py`).

Sizes that N does not divide are padded: `shard_size(n)` is ceil(n / N) and `rank_shard` fills
the rows past the end with zeros, which the layers choose so that padding adds nothing (zero
rows of a column-parallel weight meet zero columns of the row-parallel one after it).
"""

from __future__ import annotations

import time

import torch

_RANK, _SIZE = 0, 1
# Collectives run by this process and the seconds spent in them (benchmarks read them).
_COLLECTIVES = {"count": 0, "seconds": 0.0}


def set_tensor_parallel(rank: int, size: int) -> None:
    global _RANK, _SIZE
    if not 0 <= rank < size:
        raise ValueError(f"bad tensor-parallel rank {rank} for size {size}")
    _RANK, _SIZE = rank, size


def tp_rank() -> int:
    return _RANK


def tp_size() -> int:
    return _SIZE


def collective_stats() -> dict[str, float]:
    """{"count", "seconds"}: the collectives this rank has run so far and their wall time."""
    return dict(_COLLECTIVES)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _SIZE > 1:
        start = time.perf_counter()
        torch.distributed.all_reduce(x)
        _COLLECTIVES["count"] += 1
        _COLLECTIVES["seconds"] += time.perf_counter() - start
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _SIZE == 1:
        return x
    start = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(_SIZE)]
    torch.distributed.all_gather(parts, x.contiguous())
    _COLLECTIVES["count"] += 1
    _COLLECTIVES["seconds"] += time.perf_counter() - start
    return torch.cat(parts, dim=-1)


def shard_size(n: int) -> int:
    """This rank's share of n, padded: ceil(n / N)."""
    return -(-n // _SIZE)


def rank_shard(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """This rank's `size` entries of `t` along `dim`, zero-padded past the end of `t`."""
    start = _RANK * size
    part = t.narrow(dim, min(start, t.shape[dim]), max(0, min(size, t.shape[dim] - start)))
    if part.shape[dim] == size:
        return part
    shape = list(t.shape)
    shape[dim] = size - part.shape[dim]
    return torch.cat([part, part.new_zeros(shape)], dim=dim)


def agree_min(value: int) -> int:
    """The smallest of every rank's `value` (1 rank: itself), e.g. the KV blocks all can hold."""
    if _SIZE == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


def divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by the tensor-parallel size {d}")
    return n // d
