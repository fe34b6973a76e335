"""Block pool and KV manager: exact block ids, reference counts, prefix hits, LRU eviction."""

from __future__ import annotations

from kvik.engine.kv_manager import KVCacheManager
from tests.engine.helpers import make_request


def computed(kv: KVCacheManager, request, num_tokens: int) -> None:
    """Pretend a step computed the first num_tokens tokens of the request."""
    request.num_computed_tokens = num_tokens
    kv.cache_computed_blocks(request)


def test_allocation_takes_blocks_in_order_and_frees_them():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request(list(range(10)))
    assert kv.allocate_slots(request, 10)
    assert kv.block_ids(request) == [0, 1, 2]
    assert kv.num_free_blocks() == 5
    kv.free(request)
    assert kv.num_free_blocks() == 8
    kv.pool.check_invariants()


def test_allocation_refuses_what_does_not_fit_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    request = make_request(list(range(13)))
    assert not kv.allocate_slots(request, 13)  # needs 4 blocks
    assert kv.block_ids(request) == []
    assert kv.num_free_blocks() == 3


def test_growing_sequence_gets_a_block_only_when_the_last_is_full():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request([1, 2, 3])
    assert kv.allocate_slots(request, 3)
    request.num_computed_tokens = 3
    request.all_token_ids.append(9)
    assert kv.allocate_slots(request, 1)  # position 3 fits block 0
    assert kv.block_ids(request) == [0]
    request.num_computed_tokens = 4
    request.all_token_ids.append(10)
    assert kv.allocate_slots(request, 1)
    assert kv.block_ids(request) == [0, 1]


def test_prefix_hit_shares_full_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request(list(range(12)))
    assert kv.allocate_slots(first, 12)
    computed(kv, first, 12)
    second = make_request(list(range(12)))
    hit = kv.find_cached_prefix(second)
    # 12 tokens = 3 full blocks, but one token must be computed for logits: 2 blocks hit.
    assert [b.block_id for b in hit.blocks] == [0, 1]
    assert kv.allocate_slots(second, 4, hit)
    assert kv.block_ids(second) == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    kv.free(first)
    kv.free(second)
    kv.pool.check_invariants()


def test_hits_are_checked_against_tokens_not_only_hashes():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.allocate_slots(first, 9)
    computed(kv, first, 9)
    # Corrupt the stored content: a hash match alone must not be trusted.
    kv.pool.blocks[0].token_ids = (1, 2, 3, 99)
    assert kv.find_cached_prefix(make_request([1, 2, 3, 4, 5, 6, 7, 8, 9])).blocks == []


def test_prefix_only_matches_whole_chain():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    first = make_request([1, 2, 3, 4, 5])
    assert kv.allocate_slots(first, 5)
    computed(kv, first, 5)
    # Same second block (3, 4) after a different first block: no hit at all.
    other = make_request([7, 7, 3, 4, 5])
    assert kv.find_cached_prefix(other).blocks == []
    partial = make_request([1, 2, 9, 9, 5])
    assert [b.block_id for b in kv.find_cached_prefix(partial).blocks] == [0]


def test_freed_cached_blocks_survive_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request([1, 2, 3])
    assert kv.allocate_slots(a, 3)
    computed(kv, a, 3)  # block 0 (1, 2) cached; block 1 holds a partial block
    kv.free(a)
    b = make_request([5, 6, 7])
    assert kv.allocate_slots(b, 3)
    # Uncached free blocks are reused first: b gets 1 (a's partial block) and 2, not cached 0.
    assert kv.block_ids(b) == [1, 2]
    assert [x.block_id for x in kv.find_cached_prefix(make_request([1, 2, 9])).blocks] == [0]
    c = make_request([8, 8, 8, 8, 8])
    assert not kv.allocate_slots(c, 5)  # needs 3, only 2 free
    assert kv.allocate_slots(make_request([8, 8, 8]), 3)  # takes 3, then evicts cached 0
    assert kv.find_cached_prefix(make_request([1, 2, 9])).blocks == []
    kv.pool.check_invariants()


def test_prefix_statistics_count_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.record_prefix_query(10, 8)
    kv.record_prefix_query(6, 0)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (16, 8)
