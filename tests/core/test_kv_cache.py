"""Block pool and KV-cache manager: allocation, LRU eviction, prefix hits, integrity."""

import pytest

from impasto.core.kv_cache_manager import KVCacheManager
from impasto.testing import make_requests


def _alloc(kv, request, n, hit_blocks=None, hit=0):
    ids = kv.allocate_slots(request, n, num_new_computed_tokens=hit, new_computed_blocks=hit_blocks)
    request.num_computed_tokens += hit + n
    return ids


def test_null_block_reserved_and_usage():
    kv = KVCacheManager(num_blocks=11, block_size=16, max_model_len=1000, enable_caching=True)
    assert kv.num_free_blocks == 10 and kv.usage == 0.0
    (req,) = make_requests(1, num_tokens=40)
    ids = _alloc(kv, req, 40)
    assert ids == [1, 2, 3]  # block 0 is the null block
    assert kv.usage == pytest.approx(0.3)
    kv.check_integrity()
    kv.free(req)
    assert kv.num_free_blocks == 10
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=16, max_model_len=1000, enable_caching=False)
    a, b = make_requests(2, num_tokens=32)
    _alloc(kv, a, 32)
    assert kv.allocate_slots(b, 32) is None
    assert kv.num_free_blocks == 1 and "1" not in kv.req_to_blocks
    kv.check_integrity()


@pytest.mark.parametrize(
    "num_tokens,expected_hit", [(32, 16), (33, 32), (16, 0), (17, 16), (129, 128)]
)
def test_hit_capped_at_num_tokens_minus_one(num_tokens, expected_hit):
    kv = KVCacheManager(num_blocks=100, block_size=16, max_model_len=1000, enable_caching=True)
    a, b = make_requests(2, num_tokens=num_tokens, same_prompt=True)
    _alloc(kv, a, num_tokens)
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == expected_hit and len(blocks) == expected_hit // 16
    assert [blk.block_id for blk in blocks] == kv.get_block_ids("0")[: len(blocks)]


def test_lru_eviction_order_and_reverse_free():
    kv = KVCacheManager(num_blocks=11, block_size=4, max_model_len=1000, enable_caching=True)
    a, b, c = make_requests(3, num_tokens=10)  # 2 full blocks + 1 partial each
    _alloc(kv, a, 10)  # blocks 1, 2, 3
    _alloc(kv, b, 10)  # blocks 4, 5, 6
    kv.free(a)
    kv.free(b)
    # Unhashed partial tails go to the head; hashed blocks to the tail, each request's
    # chain tail first (freed in reverse) so ancestors are evicted last.
    order = [blk.block_id for blk in kv.block_pool.free_queue]
    assert order[:2] == [6, 3]
    assert order[-4:] == [2, 1, 5, 4]
    kv.check_integrity()
    # Allocate 8 blocks: the two partial blocks and the 4 never-used blocks go first,
    # then a's chain tail (2) then its head (1) are evicted; b's chain survives.
    _alloc(kv, c, 32)
    assert kv.block_pool.blocks[2].block_hash is None and kv.block_pool.blocks[1].block_hash is None
    b2 = make_requests(2, num_tokens=10)[1]
    blocks, hit = kv.get_computed_blocks(b2)
    assert [blk.block_id for blk in blocks] == [4, 5] and hit == 8
    kv.check_integrity()


def test_touching_a_free_hit_takes_it_out_of_the_free_queue():
    kv = KVCacheManager(num_blocks=5, block_size=4, max_model_len=1000, enable_caching=True)
    a, b = make_requests(2, num_tokens=9, same_prompt=True)
    _alloc(kv, a, 9)  # 3 blocks, 2 hashed
    kv.free(a)
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8
    # 1 new block + 2 free hits must fit in the 4 free blocks.
    assert _alloc(kv, b, 1, blocks, hit) is not None
    assert kv.num_free_blocks == 1
    assert all(blk.ref_cnt == 1 for blk in blocks)
    kv.check_integrity()


def test_drafts_are_never_cached():
    kv = KVCacheManager(num_blocks=20, block_size=4, max_model_len=1000, enable_caching=True)
    (a,) = make_requests(1, num_tokens=6)
    a.spec_token_ids = [9, 9, 9]
    kv.allocate_slots(a, 9)  # 6 committed + 3 drafts: 3 blocks, only 1 full committed block
    assert kv.num_cached_block["0"] == 1
    assert len(kv.block_pool.cached) == 1


def test_cache_salt_isolates_chains():
    kv = KVCacheManager(num_blocks=20, block_size=4, max_model_len=1000, enable_caching=True)
    a, b = make_requests(2, num_tokens=9, same_prompt=True)
    b.cache_salt = "tenant-b"
    _alloc(kv, a, 9)
    assert kv.get_computed_blocks(b) == ([], 0)


def test_integrity_check_catches_corruption():
    kv = KVCacheManager(num_blocks=5, block_size=4, max_model_len=1000, enable_caching=True)
    (a,) = make_requests(1, num_tokens=8)
    _alloc(kv, a, 8)
    kv.block_pool.blocks[1].ref_cnt += 1
    with pytest.raises(AssertionError):
        kv.check_integrity()
