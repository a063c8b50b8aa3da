"""Fixed pool of KV blocks: ref counts, an LRU free queue and the prefix-cache hash map.

Invariants (checked by `KVCacheManager.check_integrity`):
- block 0 is the null block: never free, never referenced, never hashed;
- every other block is either in the free queue with ref_cnt == 0, or referenced (ref_cnt > 0);
- a block carrying a hash is in `cached[hash]`, and every entry there carries that hash.

Eviction is lazy: a freed block keeps its hash (still a prefix-cache hit) until it is popped
for reuse. Freed hashed blocks go to the tail of the queue, unhashed ones to the head, so
plain scratch blocks are reused first and cached prefixes last (LRU).
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Intrusive doubly linked list with sentinels: O(1) pop, append, prepend, remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def _insert_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = anchor.next_free
        assert nxt is not None
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        prev = self._tail.prev_free
        assert prev is not None
        self._insert_after(prev, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def contains(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self):  # head (next to be reused) to tail
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # Block 0 pads block tables; it is taken out of circulation for good.
        self.null_block = self.free_queue.popleft()
        # hash -> {block_id: block}. No de-duplication: two requests that computed the same
        # block concurrently both keep theirs, so block tables stay append-only.
        self.cached: dict[bytes, dict[int, KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of usable blocks that are referenced (cached free blocks count as free)."""
        usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / usable

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        entry = self.cached.get(block_hash)
        if not entry:
            return None
        return next(iter(entry.values()))

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        entry = self.cached.get(block.block_hash)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks are queued in the order given (callers pass tails
        first, so a chain's tail is evicted before its ancestors)."""
        for block in ordered:
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)
                else:
                    self.free_queue.appendleft(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        if block.block_hash is not None:  # already cached (a prefix hit)
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, {})[block.block_id] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
