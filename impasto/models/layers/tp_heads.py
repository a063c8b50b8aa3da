"""Which attention heads a tensor-parallel rank holds (Megatron-style head sharding).

Query heads are split in contiguous slots of `ceil(Hq / N)` per rank; when N does not divide
Hq the last slots are *padding*: zero query rows and zero o_proj columns, so they add exactly
nothing to the output. Each rank holds the KV heads its query slots read (grouped-query
attention: query head i reads KV head `i // (Hq / Hkv)`), so KV heads are split when N
divides them and copied onto several ranks when they are fewer than N (or do not divide).

Invariants of a layout (checked by the tests over many (Hq, Hkv, N)):
- every real query head is in exactly one rank's slots, in order;
- local slot j reads local KV head `j // group`, and that local KV head is the global KV
  head that query head reads (so local attention is plain GQA with `group` query heads per
  KV head, and the backend needs nothing new);
- with N = 1 the layout is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadLayout:
    q_heads: tuple[int | None, ...]  # global query head of each local slot; None: padding
    kv_heads: tuple[int, ...]  # global KV head of each local KV slot (copies allowed)

    @property
    def group(self) -> int:  # local query slots per local KV head
        return len(self.q_heads) // len(self.kv_heads)


def head_layout(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadLayout:
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads}")
    per_kv = num_heads // num_kv_heads  # query heads reading one KV head
    if num_heads % size == 0 and num_kv_heads % size == 0:  # plain split
        q, kv = num_heads // size, num_kv_heads // size
        return HeadLayout(
            tuple(range(rank * q, rank * q + q)), tuple(range(rank * kv, rank * kv + kv))
        )
    slots = -(-num_heads // size)
    q_heads = tuple(h if h < num_heads else None for h in range(rank * slots, rank * slots + slots))
    real = [h for h in q_heads if h is not None]
    last_kv = real[-1] // per_kv if real else 0
    # The KV head each slot reads (padding reads the last one: its output is zeroed anyway).
    reads = [h // per_kv if h is not None else last_kv for h in q_heads]
    runs: list[list[int]] = []  # consecutive slots reading the same KV head
    for kv in reads:
        if runs and runs[-1][0] == kv:
            runs[-1].append(kv)
        else:
            runs.append([kv])
    if len({len(r) for r in runs}) == 1:  # equal runs: one copy of each KV head read
        return HeadLayout(q_heads, tuple(r[0] for r in runs))
    return HeadLayout(q_heads, tuple(reads))  # unequal runs: one KV copy per slot (group 1)
