"""Block accounting: exact block ids, reference counts, LRU eviction order and prefix hits."""

from __future__ import annotations

import pytest

from tandem_engine.core.block_pool import BlockPool
from tandem_engine.core.kv_cache_manager import KVCacheManager
from tandem_engine.request import Request
from tandem_engine.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), eos_token_ids=[0])


def admit(kv: KVCacheManager, req: Request) -> list[int]:
    hits, n_hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - n_hit, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return kv.get_block_ids(req.request_id)


def test_pool_allocates_from_head_and_frees_to_tail() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [1, 2]
    assert pool.free_block_ids() == [3, 4, 5]
    pool.free([2, 1])
    assert pool.free_block_ids() == [3, 4, 5, 2, 1]
    assert pool.allocate(4) == [3, 4, 5, 2]
    with pytest.raises(RuntimeError):
        pool.allocate(2)


def test_double_free_is_an_error() -> None:
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])


def block_hashes(tokens: list[int]) -> list[int]:
    req = make_req("h", tokens)
    KVCacheManager(num_blocks=4, block_size=BS).update_block_hashes(req)
    return req.block_hashes


def test_hashes_are_chained_and_stable() -> None:
    a = block_hashes(list(range(8)))
    b = block_hashes(list(range(8)))
    assert a == b and len(a) == 2
    # Same second block, different first block: different chained hash.
    c = block_hashes([9, 9, 9, 9] + list(range(4, 8)))
    assert c[1] != a[1]


def test_prefix_hit_reuses_exact_blocks_and_refcounts() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(kv, a) == [1, 2, 3]
    b = make_req("b", list(range(8)) + [77, 78, 79])
    assert admit(kv, b) == [1, 2, 4]
    assert kv.pool.ref_cnt[1:5] == [2, 2, 1, 1]
    q, h = kv.take_prefix_stats()
    assert (q, h) == (10 + 11, 8)
    kv.free(a)
    assert kv.pool.ref_cnt[1:5] == [1, 1, 0, 1]
    kv.free(b)
    # b's blocks go to the tail last-first; a's tail block 3 was freed before them.
    assert kv.pool.free_block_ids() == [5, 6, 7, 8, 9, 3, 4, 2, 1]
    assert kv.usage == 0.0


def test_hit_never_covers_last_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    again = make_req("again", list(range(8)))
    hits, n = kv.get_computed_blocks(again)
    assert hits == [1] and n == 4  # the second block holds the last token: recomputed


def test_freed_cached_block_is_hit_from_the_free_queue_then_evicted_lru() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable blocks
    a = make_req("a", list(range(9)))
    assert admit(kv, a) == [1, 2, 3]
    kv.free(a)
    b = make_req("b", list(range(8)) + [5])
    assert admit(kv, b) == [1, 2, 3]  # blocks 1, 2 hit while free; 3 reallocated
    kv.free(b)
    c = make_req("c", [50 + i for i in range(9)])
    # Eviction from the head: 3 (b's tail), then 2, then 1.
    assert admit(kv, c) == [3, 2, 1]
    d = make_req("d", list(range(8)) + [5])
    kv.free(c)
    hits, _ = kv.get_computed_blocks(d)
    assert hits == []  # evicted


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_req("a", list(range(8)))
    admit(kv, a)
    before = (list(kv.pool.ref_cnt), kv.pool.free_block_ids())
    big = make_req("big", list(range(100, 112)))
    assert kv.allocate_slots(big, 12) is None
    assert (list(kv.pool.ref_cnt), kv.pool.free_block_ids()) == before
    assert kv.get_block_ids("big") == []


def test_duplicate_content_blocks_stay_private() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    # Two requests with the same prompt admitted before either is cached: both compute it.
    a, b = make_req("a", list(range(9))), make_req("b", list(range(9)))
    assert kv.allocate_slots(a, 9) == [1, 2, 3]
    # a's blocks are cached at allocation, so b hits them.
    hits, n = kv.get_computed_blocks(b)
    assert hits == [1, 2] and n == 8


def test_blocks_allocated_without_caching_are_cached_by_the_next_allocation() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", list(range(9)))
    # Blocks whose KV is still to arrive from another engine must not be hit yet.
    assert kv.allocate_slots(a, 8, cache_blocks=False) == [1, 2]
    assert kv.get_computed_blocks(make_req("b", list(range(9)))) == ([], 0)
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 1) == [3]
    assert kv.get_computed_blocks(make_req("c", list(range(9)))) == ([1, 2], 8)
