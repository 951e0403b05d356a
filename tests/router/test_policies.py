from __future__ import annotations

import json
from typing import Any

from tandem_router.hashing import HashRing, block_hashes, hash64
from tandem_router.policies import (
    NO_PREFIX,
    BoundedPrefix,
    LeastLoad,
    PrefixAware,
    PrefixView,
    RoundRobin,
    RoutingRequest,
    ScoreWeights,
    SessionAffinity,
    load_bound,
)
from tandem_router.pool import Endpoint, PoolKind
from tandem_router.prefix_index import PrefixIndex
from tandem_router.request import DEFAULT_MAX_TOKENS, Kind, parse_request


def eps(n: int) -> list[Endpoint]:
    return [Endpoint(url=f"http://e{i}", role=PoolKind.DECODE, healthy=True) for i in range(n)]


def req(text: str = "", session: str | None = None) -> RoutingRequest:
    return RoutingRequest(block_hashes(text, 8, 64), len(text) // 4, 10, session)


def view(idx: PrefixIndex, r: RoutingRequest) -> PrefixView:
    """What Router.prefix_view gives a policy from the approximate index (8-character blocks: 2 tokens)."""
    sizes = {f"http://e{i}": idx.size(f"http://e{i}") for i in range(10)}
    return PrefixView(idx.match(r.block_hashes), 2.0, len(r.block_hashes), False, sizes)


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
    assert [rr.choose(e, req(), NO_PREFIX).endpoint.url for _ in range(4)] == [
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
    assert ll.choose(e, req(), NO_PREFIX).endpoint is e[0]
    e[0].acquire(1)
    assert ll.choose(e, req(), NO_PREFIX).endpoint is e[2]
    e[0].release(1)
    e[0].release(10)
    assert ll.choose(e, req(), NO_PREFIX).endpoint is e[0]


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


def test_bounded_prefix_follows_the_longest_prefix_until_the_load_bound() -> None:
    e = eps(2)
    idx = PrefixIndex(1000)
    pa = BoundedPrefix(load_factor=1.25, cold_key_blocks=2)
    r = req("system prompt " * 10 + "question one")
    first = pa.choose(e, r, view(idx, r))
    assert first.reason == "cold_hash"
    idx.insert(first.endpoint.url, r.block_hashes)
    other = e[1] if first.endpoint is e[0] else e[0]
    follow = req("system prompt " * 10 + "question one, then more text")
    d = pa.choose(e, follow, view(idx, follow))
    assert (d.endpoint, d.reason) == (first.endpoint, "prefix_hit")
    assert d.matched_blocks == len(r.block_hashes)
    # The hot endpoint holds a request, the other none: the bound (mean 1) is reached.
    first.endpoint.acquire(1)
    d = pa.choose(e, follow, view(idx, follow))
    assert (d.endpoint, d.reason) == (other, "overflow")
    other.acquire(1)
    d = pa.choose(e, follow, view(idx, follow))
    assert (d.endpoint, d.reason) == (first.endpoint, "prefix_hit")


def test_bounded_prefix_places_cold_prefixes_by_ring_consistently() -> None:
    idx = PrefixIndex(1000)
    prompts = [f"group {g} " * 20 for g in range(40)]
    a = [BoundedPrefix().choose(eps(4), req(p), view(idx, req(p))).endpoint.url for p in prompts]
    b = [BoundedPrefix().choose(list(reversed(eps(4))), req(p), view(idx, req(p))).endpoint.url for p in prompts]
    assert a == b
    assert len(set(a)) == 4  # spread over the pool
    # Same leading blocks (the key covers the first 8 blocks), different tails: same endpoint.
    x, y = (req("shared " * 80 + "tail one"), req("shared " * 80 + "tail two, longer"))
    x = BoundedPrefix().choose(eps(4), x, view(idx, x)).endpoint
    y = BoundedPrefix().choose(eps(4), y, view(idx, y)).endpoint
    assert x.url == y.url


def test_bounded_prefix_cold_placement_is_bounded_by_cache_footprint() -> None:
    e = eps(2)
    idx = PrefixIndex(10_000)
    prompts = [f"tenant {i} " * 60 for i in range(50)]
    to_e0 = [p for p in prompts if BoundedPrefix().choose(e, req(p), view(PrefixIndex(10), req(p))).endpoint is e[0]]
    assert len(to_e0) > 5
    # e0 already holds a lot (other prefixes): new prefixes whose ring place is e0 go to e1 instead ...
    idx.insert(e[0].url, list(range(1000)))
    d = BoundedPrefix().choose(e, req(to_e0[0]), view(idx, req(to_e0[0])))
    assert (d.endpoint, d.reason) == (e[1], "cold_hash")
    # ... until the footprints are within the load factor again.
    idx.insert(e[1].url, list(range(1000, 1900)))
    assert BoundedPrefix().choose(e, req(to_e0[0]), view(idx, req(to_e0[0]))).endpoint is e[0]


def test_bounded_prefix_short_prompt_uses_least_load() -> None:
    e = eps(2)
    e[0].acquire(1)
    d = BoundedPrefix().choose(e, req("hi"), view(PrefixIndex(10), req("hi")))
    assert (d.endpoint, d.reason) == (e[1], "least_load")


SYSTEM = "You are a careful assistant for the harbour office. " * 8  # 36 blocks of 8 characters


def exact(matches: dict[str, int], r: RoutingRequest) -> PrefixView:
    """An exact view (KV events) with 16-token blocks; `r.prompt_tokens` tokens in the prompt."""
    return PrefixView(matches, 16, r.prompt_tokens // 16, True)


def test_prefix_aware_keeps_the_hit_that_the_load_bound_gave_away() -> None:
    """The reported failure: two engines, requests overlapping. With 2 in flight on the engine holding
    the conversation and none on the other, the bounded policy spills; the scored one stays."""
    e = eps(2)
    r = RoutingRequest(block_hashes(SYSTEM + "turn 3", 8, 64), 160, 10)
    held = exact({e[0].url: 9}, r)  # 144 of 160 tokens cached on e0
    e[0].acquire(1)
    e[0].acquire(1)
    assert BoundedPrefix().choose(e, r, held).endpoint is e[1]
    d = PrefixAware().choose(e, r, held)
    assert (d.endpoint, d.reason, d.matched_blocks) == (e[0], "prefix_hit", 9)


def test_prefix_aware_spills_when_the_queue_outweighs_the_hit() -> None:
    e = eps(2)
    r = RoutingRequest(block_hashes(SYSTEM, 8, 64), 160, 10)
    held = exact({e[0].url: 9}, r)
    for _ in range(2):  # 3 * 0.9 = 2.7 > 2: still worth waiting for
        e[0].acquire(1)
    assert PrefixAware().choose(e, r, held).endpoint is e[0]
    e[0].acquire(1)  # 2.7 < 3: the idle engine's full prefill is the better bet
    d = PrefixAware().choose(e, r, held)
    assert (d.endpoint, d.reason) == (e[1], "overflow")
    # The engine's own count (other routers' requests) weighs the same as this router's.
    f = eps(2)
    f[0].engine_queue = 3
    assert PrefixAware().choose(f, r, exact({f[0].url: 9}, r)).endpoint is f[1]
    # A heavier prefix weight keeps it.
    assert PrefixAware(ScoreWeights(prefix=20.0)).choose(e, r, held).endpoint is e[0]
    # A small advantage (both hold the system prompt, one also the last turn) yields to one request less.
    both = exact({e[0].url: 9, e[1].url: 8}, r)
    g = eps(2)
    assert PrefixAware().choose(g, r, both).endpoint is g[0]
    g[0].acquire(1)
    assert PrefixAware().choose(g, r, both).endpoint is g[1]


def test_prefix_aware_prefers_the_engine_with_free_kv_cache_among_equal_hits() -> None:
    e = eps(3)
    r = RoutingRequest(block_hashes(SYSTEM, 8, 64), 160, 10)
    both = exact({e[0].url: 9, e[1].url: 9}, r)
    e[0].kv_usage, e[1].kv_usage = 0.9, 0.2
    assert PrefixAware().choose(e, r, both).endpoint is e[1]


def test_prefix_aware_ties_and_cold_prompts_follow_the_ring_so_replicas_agree() -> None:
    prompts = [f"conversation {g}: " * 12 for g in range(40)]
    reqs = [RoutingRequest(block_hashes(p, 8, 64), 60, 10) for p in prompts]
    a = [PrefixAware().choose(eps(4), r, NO_PREFIX) for r in reqs]
    b = [PrefixAware().choose(list(reversed(eps(4))), r, NO_PREFIX) for r in reqs]
    assert [d.endpoint.url for d in a] == [d.endpoint.url for d in b]
    assert {d.reason for d in a} == {"cold_hash"} and len({d.endpoint.url for d in a}) == 4
    # Equal hits on every engine (a shared system prompt everywhere): the ring decides, not the order.
    r = reqs[0]
    everywhere = exact({f"http://e{i}": 2 for i in range(4)}, r)
    picks = {PrefixAware().choose(c, r, everywhere).endpoint.url for c in (eps(4), list(reversed(eps(4))))}
    assert picks == {a[0].endpoint.url}


def test_prefix_aware_cold_prompt_goes_to_its_ring_place_among_the_least_loaded() -> None:
    e = eps(3)
    r = RoutingRequest(block_hashes("a brand new conversation " * 4, 8, 64), 25, 10)
    order = [u for u in PrefixAware()._ring_order(e, r)]
    owner = PrefixAware().choose(e, r, NO_PREFIX).endpoint
    assert owner.url == order[0]
    owner.acquire(1)  # busier than the others: the next idle one in ring order
    assert PrefixAware().choose(e, r, NO_PREFIX).endpoint.url == order[1]
    # With slack, the ring place keeps it until it is that far above the least loaded.
    assert PrefixAware(ScoreWeights(cold_queue_slack=1)).choose(e, r, NO_PREFIX).endpoint is owner
    # A prefix cached below the useful fraction counts as cold too.
    tiny = exact({order[2]: 0}, r)
    assert PrefixAware().choose(e, r, tiny).reason == "cold_hash"


def test_session_affinity_sticks_and_spreads() -> None:
    e = eps(3)
    sa = SessionAffinity()
    picks = {s: sa.choose(e, req(session=s), NO_PREFIX).endpoint.url for s in (f"user-{i}" for i in range(30))}
    assert len(set(picks.values())) == 3
    assert all(sa.choose(e, req(session=s), NO_PREFIX).endpoint.url == u for s, u in picks.items())
    assert sa.choose(e, req(), NO_PREFIX).reason == "least_load"


def test_replicas_that_each_just_sent_a_request_still_agree_when_engines_publish_their_queues() -> None:
    """Two router replicas each count only their own requests in flight. When the engines publish their
    queues (KV events), both weigh those, so a request one replica just sent (not yet in the engine's
    published queue) does not split their choice: cold prompts and equal hits both."""
    prompts = [f"conversation {g}: " * 12 for g in range(40)]
    reqs = [RoutingRequest(block_hashes(p, 8, 64), 60, 10) for p in prompts]

    def replica(sent_to: int) -> list[Endpoint]:
        e = eps(4)
        for i, ep in enumerate(e):
            ep.load_from_events, ep.engine_queue, ep.kv_usage = True, i % 2, 0.25
        e[sent_to].acquire(1)  # this replica's request in flight, not yet in the engine's queue
        return e

    a, b = replica(0), replica(3)
    everywhere = exact({f"http://e{i}": 2 for i in range(4)}, reqs[0])
    for r, prefix in [(r, NO_PREFIX) for r in reqs] + [(reqs[0], everywhere)]:
        assert PrefixAware().choose(a, r, prefix).endpoint.url == PrefixAware().choose(b, r, prefix).endpoint.url
    # The published queues still steer: the engines that reported one more request get no cold prompt.
    assert {PrefixAware().choose(a, r, NO_PREFIX).endpoint.url for r in reqs} == {"http://e0", "http://e2"}
    # Without published queues a router has only its own count, and uses it.
    c = eps(2)
    c[0].acquire(1)
    assert {PrefixAware().choose(c, r, NO_PREFIX).endpoint.url for r in reqs} == {"http://e1"}


def test_a_requests_load_counts_the_tokens_the_engine_may_generate() -> None:
    """Least-load weighs prompt + max_tokens: a completion without max_tokens may generate OpenAI's default
    16, not the 256 the router assumes for an answer bounded only by the context (a chat without a limit,
    or a completion with `"max_tokens": null`)."""
    def load(kind: Kind, **body: Any) -> int:
        field = "prompt" if kind == "completions" else "messages"
        value = "x" * 40 if kind == "completions" else [{"role": "user", "content": "x" * 40}]
        req = parse_request(kind, json.dumps({field: value, **body}).encode())
        return req.max_tokens

    assert load("completions") == 16
    assert load("completions", max_tokens=5) == 5
    assert load("completions", max_tokens=None) == DEFAULT_MAX_TOKENS
    assert load("chat") == DEFAULT_MAX_TOKENS
    assert load("chat", max_tokens=9, max_completion_tokens=3) == 3
