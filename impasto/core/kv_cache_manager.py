"""Scheduler-facing paged KV-cache manager: per-request block tables and prefix caching.

One KV group, full attention, hash block size == block size. Token layout of a request when
allocating: | computed | new prefix hits | new tokens (incl. drafts/canvas) | lookahead |.

`align` (masked block diffusion: the diffusion block size; 1 otherwise): the KV of a token is
final only once its whole diffusion block is written (block-causal attention: it depends on the
later tokens of its block), so prefix-cache hits end at multiples of lcm(block_size, align) and
a page is hashed only when every diffusion block it touches is committed and written. Without
this a page covering half a diffusion block would be hit by a prompt sharing only that half.
"""

from __future__ import annotations

import math
from collections import Counter

from impasto.core.block_pool import BlockPool, KVCacheBlock
from impasto.core.hashing import update_block_hashes
from impasto.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
        align: int = 1,
    ) -> None:
        self.block_size = block_size
        self.align = align
        self._hit_pages = math.lcm(block_size, align) // block_size  # hits: multiples of this
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}  # leading blocks already hashed, per request
        # Prefix-cache counters, in tokens (as vLLM's metrics), recorded at admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queries ------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        return self.block_pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks, ending at or below `num_tokens - 1`.

        At least one token is always recomputed (its logits are needed), and the hit is
        block-aligned, so N=32 with block size 16 hits 16 tokens and N=33 hits 32.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position: no cache reads.
            return [], 0
        hashes = update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:  # chained hashes: every later block misses too
                break
            hits.append(block)
        del hits[len(hits) - len(hits) % self._hit_pages :]  # whole diffusion blocks only
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    # -- allocation ---------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; return the new block ids, or None (and
        change nothing) when the free blocks cannot hold them."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        held = self.req_to_blocks.get(request.request_id)
        if held is not None and not new_computed_blocks:
            # Fast path (most decode steps): the held blocks already have room.
            num_slots = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
            if num_slots <= len(held) * self.block_size:
                if self.enable_caching:
                    num_committed = min(num_slots - num_lookahead_tokens, self._final(request))
                    self._cache_blocks(request, num_committed)
                return []
        hit_blocks = new_computed_blocks or []
        num_held = len(held) if held else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_required = max(cdiv(num_slots, self.block_size) - num_held - len(hit_blocks), 0)
        # Hits sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        num_free = self.block_pool.num_free_blocks
        if num_required + num_free_hits > num_free:
            return None
        if full_sequence_must_fit:
            seq_len = min(request.num_tokens, self.max_model_len)
            full = max(cdiv(seq_len, self.block_size) - num_held - len(hit_blocks), 0)
            if full + num_free_hits > num_free:
                return None

        if held is None:
            held = self.req_to_blocks[request.request_id] = []
            self.num_cached_block[request.request_id] = len(hit_blocks)
        if hit_blocks:
            self.block_pool.touch(hit_blocks)
            held.extend(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_required)
        held.extend(new_blocks)
        if self.enable_caching:
            # Only committed tokens are cached: the cap at num_tokens excludes drafts,
            # placeholders, lookahead and canvas slots.
            self._cache_blocks(request, min(num_computed + num_new_tokens, self._final(request)))
        return [b.block_id for b in new_blocks]

    def _final(self, request: Request) -> int:
        """Committed tokens whose KV is final once computed: all of them, or (block diffusion)
        those before the diffusion block the last committed token sits in (a prompt's tail
        shares its block with the canvas and is rewritten by the block's commit)."""
        n = request.num_tokens
        return n - n % self.align

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        num_full = num_tokens // self.block_size
        start = self.num_cached_block.get(rid, 0)
        if num_full <= start:
            return
        hashes = update_block_hashes(request, self.block_size)
        blocks = self.req_to_blocks[rid]
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_block[rid] = num_full

    def free(self, request: Request, drop_cached: bool = False) -> None:
        """Release the request's blocks, tail first. `drop_cached` un-hashes the blocks only
        this request holds (their KV may be garbage after a failed step)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if not blocks:
            return
        if drop_cached:
            for block in blocks:
                if block.ref_cnt == 1:
                    self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # -- checks -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if the pool and the block tables disagree."""
        pool = self.block_pool
        refs: Counter[int] = Counter()
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] += 1
        free_ids = [b.block_id for b in pool.free_queue]
        assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks, "free queue corrupt"
        free_set = set(free_ids)
        null = pool.null_block
        assert null.block_id not in free_set and null.ref_cnt == 0 and null.block_hash is None
        assert refs[null.block_id] == 0, "null block in a block table"
        for b in pool.blocks[1:]:
            assert (b.block_id in free_set) != (b.ref_cnt > 0), f"{b} neither free xor referenced"
            assert b.ref_cnt == refs[b.block_id], f"{b} ref count != {refs[b.block_id]} holders"
            if b.block_hash is not None:
                assert pool.cached.get(b.block_hash, {}).get(b.block_id) is b, f"{b} not mapped"
        for block_hash, entry in pool.cached.items():
            assert entry, "empty hash entry"
            for bid, b in entry.items():
                assert b.block_id == bid and b.block_hash == block_hash, f"{b} stale in hash map"
