from __future__ import annotations

from tandem_router.hashing import HashRing, block_hashes, hash64
from tandem_router.policies import (
    LeastLoad,
    PrefixAware,
    RoundRobin,
    RoutingRequest,
    SessionAffinity,
    load_bound,
)
from tandem_router.pool import Endpoint, PoolKind
from tandem_router.prefix_index import PrefixIndex


def eps(n: int) -> list[Endpoint]:
    return [Endpoint(url=f"http://e{i}", role=PoolKind.DECODE, healthy=True) for i in range(n)]


def req(text: str = "", session: str | None = None) -> RoutingRequest:
    return RoutingRequest(block_hashes(text, 8, 64), len(text) // 4, 10, session)


def test_block_hashes_are_chained_deterministic_and_ignore_the_partial_tail() -> None:
    a = block_hashes("abcdefgh" * 3 + "xyz", 8, 100)
    assert len(a) == 3
    assert a == block_hashes("abcdefgh" * 3 + "other", 8, 100)
    b = block_hashes("zzzzzzzz" + "abcdefgh" * 2, 8, 100)
    assert a[1] != b[1] and a[2] != b[2]  # same block text, different history
    assert block_hashes("abcdefgh" * 3, 8, 2) == a[:2]
    assert block_hashes("abcdefgh", 8, 10, seed="m1") != block_hashes("abcdefgh", 8, 10, seed="m2")


def test_ring_walk_visits_each_member_once_and_is_stable_under_membership_change() -> None:
    ring = HashRing(vnodes=32)
    ring.set_members({"a", "b", "c"})
    keys = [hash64(str(i).encode()) for i in range(300)]
    assert all(sorted(ring.walk(k)) == ["a", "b", "c"] for k in keys[:20])
    before = {k: next(ring.walk(k)) for k in keys}
    assert set(before.values()) == {"a", "b", "c"}
    ring.set_members({"a", "b", "c", "d"})
    after = {k: next(ring.walk(k)) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "d" for k in moved)  # only keys taken over by the new member move
    assert 0 < len(moved) < len(keys) // 2
    other = HashRing(vnodes=32)  # a second router replica computes the same placement
    other.set_members({"d", "c", "b", "a"})
    assert {k: next(other.walk(k)) for k in keys} == after


def test_prefix_index_matches_leading_blocks_and_evicts_lru() -> None:
    idx = PrefixIndex(capacity_blocks=4)
    idx.insert("A", [1, 2, 3])
    idx.insert("B", [1, 2, 9])
    assert idx.match([1, 2, 3, 4]) == {"A": 3, "B": 2}
    assert idx.match([5, 1]) == {}
    idx.insert("A", [7, 8])  # A holds 1,2,3,7,8 -> evicts 1, its oldest
    assert idx.size("A") == 4
    assert idx.match([1, 2, 3]) == {"B": 2}
    assert idx.match([2, 3]) == {"A": 2, "B": 1}
    idx.remove_endpoint("B")
    assert idx.match([1, 2]) == {}


def test_round_robin_cycles() -> None:
    e = eps(3)
    rr = RoundRobin()
    idx = PrefixIndex(10)
    assert [rr.choose(e, req(), idx).endpoint.url for _ in range(4)] == [
        "http://e0",
        "http://e1",
        "http://e2",
        "http://e0",
    ]


def test_least_load_counts_requests_then_tokens() -> None:
    e = eps(3)
    e[0].acquire(10)
    e[1].acquire(500)
    e[2].acquire(20)
    ll = LeastLoad()
    assert ll.choose(e, req(), PrefixIndex(10)).endpoint is e[0]
    e[0].acquire(1)
    assert ll.choose(e, req(), PrefixIndex(10)).endpoint is e[2]
    e[0].release(1)
    e[0].release(10)
    assert ll.choose(e, req(), PrefixIndex(10)).endpoint is e[0]


def test_load_bound_counts_the_new_request() -> None:
    e = eps(2)
    assert load_bound(e, 1.25) == 1
    e[0].acquire(1)
    assert load_bound(e, 1.25) == 1  # mean 1: the idle endpoint takes the next one
    e[1].acquire(1)
    e[1].acquire(1)
    assert load_bound(e, 1.25) == 2  # mean 2: 2 + 2, never 3 + 1
    many = eps(10)
    for ep in many:
        for _ in range(5):
            ep.acquire(1)
    assert load_bound(many, 1.25) == 6  # mean 5.1: 25% slack


def test_prefix_aware_follows_the_longest_prefix_until_the_load_bound() -> None:
    e = eps(2)
    idx = PrefixIndex(1000)
    pa = PrefixAware(load_factor=1.25, cold_key_blocks=2)
    r = req("system prompt " * 10 + "question one")
    first = pa.choose(e, r, idx)
    assert first.reason == "cold_hash"
    idx.insert(first.endpoint.url, r.block_hashes)
    other = e[1] if first.endpoint is e[0] else e[0]
    follow = req("system prompt " * 10 + "question one, then more text")
    d = pa.choose(e, follow, idx)
    assert (d.endpoint, d.reason) == (first.endpoint, "prefix_hit")
    assert d.matched_blocks == len(r.block_hashes)
    # The hot endpoint holds a request, the other none: the bound (mean 1) is reached.
    first.endpoint.acquire(1)
    d = pa.choose(e, follow, idx)
    assert (d.endpoint, d.reason) == (other, "overflow")
    other.acquire(1)
    d = pa.choose(e, follow, idx)
    assert (d.endpoint, d.reason) == (first.endpoint, "prefix_hit")


def test_prefix_aware_places_cold_prefixes_by_ring_consistently() -> None:
    idx = PrefixIndex(1000)
    prompts = [f"group {g} " * 20 for g in range(40)]
    a = [PrefixAware().choose(eps(4), req(p), idx).endpoint.url for p in prompts]
    b = [PrefixAware().choose(list(reversed(eps(4))), req(p), idx).endpoint.url for p in prompts]
    assert a == b
    assert len(set(a)) == 4  # spread over the pool
    # Same leading blocks (the key covers the first 8 blocks), different tails: same endpoint.
    x = PrefixAware().choose(eps(4), req("shared " * 80 + "tail one"), idx).endpoint
    y = PrefixAware().choose(eps(4), req("shared " * 80 + "tail two, longer"), idx).endpoint
    assert x.url == y.url


def test_prefix_aware_cold_placement_is_bounded_by_cache_footprint() -> None:
    e = eps(2)
    idx = PrefixIndex(10_000)
    prompts = [f"tenant {i} " * 60 for i in range(50)]
    to_e0 = [p for p in prompts if PrefixAware().choose(e, req(p), PrefixIndex(10)).endpoint is e[0]]
    assert len(to_e0) > 5
    # e0 already holds a lot (other prefixes): new prefixes whose ring place is e0 go to e1 instead ...
    idx.insert(e[0].url, list(range(1000)))
    d = PrefixAware().choose(e, req(to_e0[0]), idx)
    assert (d.endpoint, d.reason) == (e[1], "cold_hash")
    # ... until the footprints are within the load factor again.
    idx.insert(e[1].url, list(range(1000, 1900)))
    assert PrefixAware().choose(e, req(to_e0[0]), idx).endpoint is e[0]


def test_prefix_aware_short_prompt_uses_least_load() -> None:
    e = eps(2)
    e[0].acquire(1)
    d = PrefixAware().choose(e, req("hi"), PrefixIndex(10))
    assert (d.endpoint, d.reason) == (e[1], "least_load")


def test_session_affinity_sticks_and_spreads() -> None:
    e = eps(3)
    sa = SessionAffinity()
    idx = PrefixIndex(10)
    picks = {s: sa.choose(e, req(session=s), idx).endpoint.url for s in (f"user-{i}" for i in range(30))}
    assert len(set(picks.values())) == 3
    assert all(sa.choose(e, req(session=s), idx).endpoint.url == u for s, u in picks.items())
    assert sa.choose(e, req(), idx).reason == "least_load"
