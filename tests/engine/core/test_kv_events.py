"""KV events: the prefix cache's gains and losses, exactly, and their publication with replay."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from tandem_engine.core.block_pool import NONE_HASH, hash_block
from tandem_engine.core.kv_cache_manager import KVCacheManager
from tandem_engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineLoad,
    KVEvent,
    KVEventBatch,
    KVEventPublisher,
    decode_batch,
    replay,
)
from tests.engine.core.test_kv_cache_manager import BS, admit, make_req


def apply(index: set[int], events: list[KVEvent]) -> None:
    """What a router's index does with an engine's events; a stored chain must re-hash from its tokens."""
    for ev in events:
        if isinstance(ev, BlockStored):
            parent = NONE_HASH if ev.parent_block_hash is None else ev.parent_block_hash
            assert ev.block_size == BS and len(ev.token_ids) == BS * len(ev.block_hashes)
            for i, h in enumerate(ev.block_hashes):
                parent = hash_block(parent, ev.token_ids[i * BS:(i + 1) * BS])
                assert parent == h
            index.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            assert set(ev.block_hashes) <= index
            index.difference_update(ev.block_hashes)
        else:
            index.clear()


def test_stored_chain_then_hit_then_eviction() -> None:
    kv = KVCacheManager(6, BS, record_events=True)  # 5 usable blocks
    a = make_req("a", list(range(1, 11)))  # 2 full blocks + 2 tokens
    admit(kv, a)
    [stored] = kv.pool.take_events()
    assert stored == BlockStored(a.block_hashes[:2], None, list(range(1, 9)), BS)
    assert kv.pool.take_events() == []
    # Shares the first block: a hit stores nothing new for it; its own second block chains on.
    b = make_req("b", [1, 2, 3, 4, 50, 51, 52, 53])
    admit(kv, b)
    [stored_b] = kv.pool.take_events()
    assert stored_b == BlockStored([b.block_hashes[1]], a.block_hashes[0], [50, 51, 52, 53], BS)
    kv.free(a)
    kv.free(b)
    # Five new blocks evict every cached one: their hashes leave, in eviction order, in one event.
    c = make_req("c", list(range(100, 120)))
    admit(kv, c)
    removed, stored_c = kv.pool.take_events()
    assert isinstance(removed, BlockRemoved)
    assert sorted(removed.block_hashes) == sorted([*a.block_hashes[:2], b.block_hashes[1]])
    assert stored_c == BlockStored(c.block_hashes, None, list(range(100, 120)), BS)
    assert kv.pool.cached_hashes() == set(c.block_hashes)


def test_no_events_unless_asked_and_none_without_prefix_caching() -> None:
    quiet = KVCacheManager(6, BS)
    admit(quiet, make_req("a", list(range(1, 11))))
    assert quiet.pool.take_events() == []
    off = KVCacheManager(6, BS, enable_caching=False, record_events=True)
    admit(off, make_req("a", list(range(1, 11))))
    assert off.pool.take_events() == [] and off.pool.cached_hashes() == set()


def test_index_from_events_matches_the_cache_after_random_traffic() -> None:
    """Shared prefixes, a small pool (constant eviction), requests finishing in random order."""
    rng = random.Random(7)
    kv = KVCacheManager(12, BS, record_events=True)
    index: set[int] = set()
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(4)]
    live = []
    removed = 0
    for i in range(300):
        tokens = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 14))]
        req = make_req(f"r{i}", tokens)
        hits, n_hit = kv.get_computed_blocks(req)
        while kv.allocate_slots(req, req.num_tokens - n_hit, hits) is None:
            kv.free(live.pop(rng.randrange(len(live))))
            hits, n_hit = kv.get_computed_blocks(req)
        req.num_computed_tokens = req.num_tokens
        live.append(req)
        if rng.random() < 0.5:
            kv.free(live.pop(rng.randrange(len(live))))
        events = kv.pool.take_events()
        removed += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        apply(index, events)
        assert index == kv.pool.cached_hashes(), f"step {i}"
    assert removed > 100  # the small pool really evicted


def subscriber(endpoint: str) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sock.connect(endpoint)
    return sock


def batch(n: int) -> KVEventBatch:
    return KVEventBatch(float(n), "host-dp0-abc", [BlockRemoved([n])])


@pytest.fixture
def publisher() -> KVEventPublisher:
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=4)
    yield pub
    pub.close()


def test_subscriber_gets_numbered_batches_and_a_late_one_catches_up_by_replay(publisher: KVEventPublisher) -> None:
    sub = subscriber(publisher.pub_endpoint)
    # A SUB socket's subscription takes a moment to reach the publisher: publish until one arrives.
    deadline = time.monotonic() + 10
    while not sub.poll(50):
        assert time.monotonic() < deadline, "no batch reached the subscriber"
        publisher.publish(batch(0))
    topic, seq, payload = sub.recv_multipart()
    first = int.from_bytes(seq, "big")
    assert topic == b"kv-events" and decode_batch(payload) == batch(0)
    for n in range(1, 4):
        publisher.publish(batch(n))
    got = [sub.recv_multipart() for _ in range(3)]
    assert [int.from_bytes(s, "big") for _, s, _ in got] == [first + 1, first + 2, first + 3]
    assert [decode_batch(p).events for _, _, p in got] == [[BlockRemoved([n])] for n in range(1, 4)]
    sub.close()
    # A subscriber that joins now asks for everything from the first batch it missed; the buffer keeps 4.
    last = first + 3
    replayed = replay(publisher.replay_endpoint, last - 1)
    assert [s for s, _ in replayed] == [last - 1, last]
    assert [b.events for _, b in replayed] == [[BlockRemoved([2])], [BlockRemoved([3])]]
    assert [s for s, _ in replay(publisher.replay_endpoint, last - 3)] == list(range(last - 3, last + 1))
    assert replay(publisher.replay_endpoint, last + 1) == []


def test_a_subscriber_older_than_the_buffer_gets_a_snapshot_of_the_cache(publisher: KVEventPublisher) -> None:
    """Batches 0..9 with a buffer of 4: asking for batch 0 cannot be answered batch by batch, so the
    publisher answers the state those batches left, numbered like the last one."""
    publisher.publish(KVEventBatch(0.0, "e-1", [AllBlocksCleared()]))
    for n in range(1, 9):
        publisher.publish(KVEventBatch(float(n), "e-1", [BlockStored([10 * n, 10 * n + 1], None, [n] * 8, 4)]))
    publisher.publish(KVEventBatch(9.0, "e-1", [BlockRemoved([10, 11, 31, 999])]))
    deadline = time.monotonic() + 10
    while (got := replay(publisher.replay_endpoint, 9)) == []:  # the thread sends what is queued first
        assert time.monotonic() < deadline
    assert [s for s, _ in got] == [9]
    (seq, snap), = replay(publisher.replay_endpoint, 0)
    assert seq == 9 and snap.engine_id == "e-1"
    held = [20, 21, 30, 40, 41, 50, 51, 60, 61, 70, 71, 80, 81]
    assert snap.events == [AllBlocksCleared(), BlockStored(held, None, [], 4)]


def test_a_malformed_replay_request_gets_the_end_marker(publisher: KVEventPublisher) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(publisher.replay_endpoint)
    sock.send_multipart([b"", b"x"])
    assert sock.poll(5000)
    assert sock.recv_multipart() == [b"", (-1).to_bytes(8, "big", signed=True), b""]
    sock.close()


def test_wire_form_is_vllm_shaped_msgpack() -> None:
    """Tagged arrays, as vLLM's KV events encode: [tag, fields...] inside [ts, engine_id, events, load]."""
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(
        KVEventBatch(1.5, "e", [BlockStored([7], None, [1, 2, 3, 4], 4), BlockRemoved([7]), AllBlocksCleared()])))
    assert raw == [1.5, "e", [["BlockStored", [7], None, [1, 2, 3, 4], 4], ["BlockRemoved", [7]],
                              ["AllBlocksCleared"]], None]
    with_load = KVEventBatch(2.0, "e", [], EngineLoad(3, 1, 0.25))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(with_load)) == [2.0, "e", [], [3, 1, 0.25]]
    # A batch without the load (an engine from before it was added) still decodes, load unknown.
    assert decode_batch(msgspec.msgpack.encode([1.0, "e", [["AllBlocksCleared"]]])) == \
        KVEventBatch(1.0, "e", [AllBlocksCleared()])
