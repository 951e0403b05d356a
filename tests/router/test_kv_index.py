"""The router's exact KV index: events applied in order, caught up by replay or snapshot, cleared on a
restart, fed by the engine's own publisher (the real sockets, not a stand-in)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from tandem_engine.core import kv_events as engine_events
from tandem_router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventStream, publisher_host
from tandem_router.kv_index import KVIndex, KVIndexFeed, Publisher
from tandem_router.procs import free_port, free_port_pair

A0, A1, B0 = Publisher("http://a", 0), Publisher("http://a", 1), Publisher("http://b", 0)


def test_index_matches_leading_blocks_per_engine_across_ranks() -> None:
    idx = KVIndex()
    idx.apply(A0, [BlockStored([1, 2, 3], None, [], 16)])
    idx.apply(A1, [BlockStored([1, 2, 3, 4], None, [], 16)])
    idx.apply(B0, [BlockStored([1, 9], None, [], 16)])
    assert idx.block_size == 16
    assert idx.match([1, 2, 3, 4, 5]) == {"http://a": 4, "http://b": 1}
    assert idx.match([2, 3]) == {"http://a": 2}  # no first block: no prefix
    idx.apply(A1, [BlockRemoved([2])])  # a hole: rank 1 now matches only block 1, rank 0 still 3
    assert idx.match([1, 2, 3, 4]) == {"http://a": 3, "http://b": 1}
    idx.apply(A0, [AllBlocksCleared(), BlockStored([7], None, [], 16)])
    assert idx.match([1, 2, 3]) == {"http://a": 1, "http://b": 1} and idx.held(A0) == {7}
    idx.drop_engine("http://a")
    assert idx.size("http://a") == 0 and idx.match([1, 9]) == {"http://b": 2} and idx.size() == 2


def test_each_engines_block_count_follows_any_run_of_events() -> None:
    """size(url) is read for every candidate of every routing decision, so it is kept as the events come
    rather than summed over the publishers (which at 1,000 engines made each decision O(engines^2)): through
    a random run of stores, removals (of held and unheld blocks), clears and dropped engines it equals the
    count of what each engine's ranks hold."""
    import random

    rng = random.Random(3)
    idx, pubs = KVIndex(), [Publisher(f"http://e{i}", r) for i in range(4) for r in range(2)]
    for _ in range(2000):
        pub, roll = rng.choice(pubs), rng.random()
        if roll < 0.5:
            idx.apply(pub, [BlockStored([rng.randrange(60) for _ in range(rng.randint(1, 6))], None, [], 16)])
        elif roll < 0.9:
            idx.apply(pub, [BlockRemoved([rng.randrange(60) for _ in range(rng.randint(1, 6))])])
        elif roll < 0.97:
            idx.apply(pub, [AllBlocksCleared()])
        else:
            idx.drop_engine(pub.url)
        for url in {p.url for p in pubs}:
            assert idx.size(url) == sum(len(idx.held(p)) for p in pubs if p.url == url)
        assert idx.size() == sum(len(idx.held(p)) for p in pubs)


def test_publisher_host_uses_the_engine_url_for_wildcards() -> None:
    assert publisher_host("http://10.1.2.3:8000", "0.0.0.0") == "10.1.2.3"
    assert publisher_host("http://[fd00::7]:8000", "::") == "[fd00::7]"
    assert publisher_host("http://engine:8000", "127.0.0.1") == "127.0.0.1"


class Feed:
    """An EventStream on the engine's real KVEventPublisher, applying into a KVIndex."""

    def __init__(self, port: int, buffer_steps: int = 10_000) -> None:
        self.port = port
        self.pub = self.open_publisher(buffer_steps)
        self.index = KVIndex()
        self.resyncs: list[str] = []
        self.stream = EventStream(A0, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", self.apply,
                                  self.resyncs.append, replay_timeout=2.0)

    def open_publisher(self, buffer_steps: int = 10_000) -> engine_events.KVEventPublisher:
        return engine_events.KVEventPublisher(f"tcp://127.0.0.1:{self.port}", f"tcp://127.0.0.1:{self.port + 1}",
                                              buffer_steps)

    def apply(self, pub: Publisher, events: list[engine_events.KVEvent] | None) -> None:
        if events is None:
            self.index.clear(pub)
        else:
            self.index.apply(pub, events)

    async def settle(self, held: set[int], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.index.held(A0) != held:
            assert time.monotonic() < deadline, f"index {sorted(self.index.held(A0))} != {sorted(held)}"
            await asyncio.sleep(0.02)


def stored(engine_id: str, hashes: list[int]) -> engine_events.KVEventBatch:
    return engine_events.KVEventBatch(time.time(), engine_id, [engine_events.BlockStored(hashes, None, [], 16)])


def removed(engine_id: str, hashes: list[int]) -> engine_events.KVEventBatch:
    return engine_events.KVEventBatch(time.time(), engine_id, [engine_events.BlockRemoved(hashes)])


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def run_stream(feed: Feed, ctx: zmq.asyncio.Context) -> asyncio.Task[None]:
    task = asyncio.create_task(feed.stream.run(ctx))
    await asyncio.wait_for(feed.stream.synced.wait(), 10)
    return task


async def test_a_late_subscriber_catches_up_then_follows_live(ctx: zmq.asyncio.Context) -> None:
    feed = Feed(free_port_pair())
    feed.pub.publish(engine_events.KVEventBatch(0.0, "e1", [engine_events.AllBlocksCleared()]))
    feed.pub.publish(stored("e1", [1, 2, 3]))
    feed.pub.publish(removed("e1", [2]))
    await asyncio.sleep(0.1)  # published before anyone listened
    task = await run_stream(feed, ctx)
    await feed.settle({1, 3})
    feed.pub.publish(stored("e1", [4, 5]))
    await feed.settle({1, 3, 4, 5})
    assert feed.resyncs == [] and feed.stream.engine_id == "e1"
    task.cancel()
    feed.pub.close()


async def test_a_subscriber_older_than_the_buffer_rebuilds_from_the_snapshot(ctx: zmq.asyncio.Context) -> None:
    feed = Feed(free_port_pair(), buffer_steps=3)
    for n in range(20):
        feed.pub.publish(stored("e1", [n]))
    feed.pub.publish(removed("e1", list(range(0, 20, 2))))
    await asyncio.sleep(0.2)
    task = await run_stream(feed, ctx)
    await feed.settle(set(range(1, 20, 2)))
    assert feed.stream.last == 20
    task.cancel()
    feed.pub.close()


async def test_missed_batches_are_replayed(ctx: zmq.asyncio.Context) -> None:
    """Batches the SUB socket dropped (its queue full while the router was busy) leave a gap in the
    sequence numbers; the stream asks the replay socket for them and ends exact."""
    feed = Feed(free_port_pair())
    feed.pub._pub.setsockopt(zmq.SNDHWM, 1)
    task = await run_stream(feed, ctx)
    feed.pub.publish(stored("e1", [0]))
    await feed.settle({0})
    # Block the event loop (the stream cannot read) while far more than the SUB queue (1,000 batches)
    # and the kernel's socket buffers hold goes out: 4,000 batches of ~8 kB (token ids, not indexed).
    for n in range(1, 4001):
        feed.pub.publish(engine_events.KVEventBatch(0.0, "e1", [engine_events.BlockStored([n], None, [1] * 8000, 16)]))
    while not feed.pub._queue.empty():  # all of it handed to the PUB socket, the loop still blocked
        time.sleep(0.05)
    time.sleep(1.0)
    await feed.settle(set(range(4001)), timeout=30)
    assert "gap" in feed.resyncs
    task.cancel()
    feed.pub.close()


async def test_a_replay_that_skips_a_batch_is_asked_again(ctx: zmq.asyncio.Context) -> None:
    """A replay answer missing a batch in its middle (a socket dropped it) is not applied past the hole: the
    stream starts over and asks again, and ends exact."""
    port = free_port_pair()
    server = ctx.socket(zmq.ROUTER)
    server.bind(f"tcp://127.0.0.1:{port + 1}")
    answers = [[0, 2], [0, 1, 2]]  # the first answer lacks batch 1

    async def serve() -> None:
        for seqs in answers:
            identity, _, _start = await server.recv_multipart()
            for seq in seqs:
                payload = engine_events._encoder.encode(stored("e1", [seq]))
                await server.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            await server.send_multipart([identity, b"", engine_events.END_SEQ, b""])

    index, resyncs = KVIndex(), []
    stream = EventStream(A0, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}",
                         lambda pub, ev: index.clear(pub) if ev is None else index.apply(pub, ev), resyncs.append,
                         replay_timeout=2.0)
    server_task = asyncio.create_task(serve())
    task = asyncio.create_task(stream.run(ctx))
    await asyncio.wait_for(server_task, 10)
    await asyncio.wait_for(stream.synced.wait(), 10)
    assert index.held(A0) == {0, 1, 2} and stream.last == 2
    assert resyncs == ["error"]  # the first answer was refused, not applied
    task.cancel()
    server.close(linger=0)


async def test_a_restarted_engine_replaces_what_the_old_one_held(ctx: zmq.asyncio.Context) -> None:
    feed = Feed(free_port_pair())
    feed.pub.publish(stored("boot-1", [1, 2, 3]))
    task = await run_stream(feed, ctx)
    await feed.settle({1, 2, 3})
    feed.pub.close()
    feed.pub = feed.open_publisher()  # same ports, a new boot nonce: sequence numbers start again at 0
    feed.pub.publish(engine_events.KVEventBatch(0.0, "boot-2", [engine_events.AllBlocksCleared()]))
    feed.pub.publish(stored("boot-2", [7]))
    await feed.settle({7})
    assert feed.stream.engine_id == "boot-2" and "restart" in feed.resyncs
    task.cancel()
    feed.pub.close()


async def test_an_engine_that_cannot_replay_has_no_entries_and_is_not_synced(ctx: zmq.asyncio.Context) -> None:
    feed = Feed(free_port_pair())
    feed.pub.publish(stored("e1", [1, 2]))
    task = await run_stream(feed, ctx)
    await feed.settle({1, 2})
    feed.pub.close()
    # A new engine on the same port whose replay socket nobody answers: its batches come without
    # their beginning, and the stream cannot catch up, so it claims nothing for it.
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{feed.port}")
    deadline = time.monotonic() + 10
    seq = 1
    while "error" not in feed.resyncs:
        assert time.monotonic() < deadline
        batch = engine_events._encoder.encode(stored("e2", [5]))
        pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), batch])
        seq += 1
        await asyncio.sleep(0.1)
    assert feed.index.held(A0) == frozenset() and not feed.stream.synced.is_set()
    task.cancel()
    pub.close()


async def test_the_feed_passes_on_each_engines_load_summed_over_its_ranks() -> None:
    """An engine with two DP ranks, each a real publisher: once both ranks' batches carried a load, the
    feed reports requests running + waiting summed and KV usage averaged; a rank whose stream resets
    (a restart) makes the engine's load unknown until that rank reports again."""
    ports = [free_port_pair(), free_port_pair()]
    pubs = [engine_events.KVEventPublisher(f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{p + 1}", 100) for p in ports]
    app = web.Application()

    async def kv_events(_: web.Request) -> web.Response:
        return web.json_response({"block_size": 16, "publishers": [
            {"rank": r, "host": "127.0.0.1", "port": p, "replay_port": p + 1} for r, p in enumerate(ports)]})

    app.router.add_get("/kv_events", kv_events)
    runner = web.AppRunner(app)
    await runner.setup()
    http_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", http_port).start()
    url = f"http://127.0.0.1:{http_port}"
    seen: list[tuple[str, tuple[int, float] | None]] = []
    feed = KVIndexFeed(KVIndex(), on_load=lambda u, load: seen.append((u, load)))

    def batch(engine_id: str, running: int, waiting: int, usage: float) -> engine_events.KVEventBatch:
        return engine_events.KVEventBatch(time.time(), engine_id, [], engine_events.EngineLoad(running, waiting, usage))

    async def until(load: tuple[int, float] | None) -> None:
        deadline = time.monotonic() + 10
        while not seen or seen[-1] != (url, load):
            assert time.monotonic() < deadline, f"feed says {seen[-3:]}, not {load}"
            await asyncio.sleep(0.02)

    try:
        async with aiohttp.ClientSession() as session:
            feed.attach(session, url)
            pubs[0].publish(batch("r0", 2, 1, 0.5))
            await asyncio.sleep(0.5)
            assert feed.load(url) is None  # rank 1 has said nothing yet
            pubs[1].publish(batch("r1", 1, 0, 0.25))
            await until((4, 0.375))
            # Its sockets (a SUB per publisher, a DEALER per replay) are not capped at pyzmq's 1,023.
            assert feed._ctx is not None and feed._ctx.get(zmq.MAX_SOCKETS) >= 16 * 1024
            pubs[0].publish(batch("r0", 0, 0, 0.0))
            await until((1, 0.125))
            pubs[1].publish(engine_events.KVEventBatch(time.time(), "r1-restarted", [engine_events.AllBlocksCleared()]))
            await until(None)
            pubs[1].publish(batch("r1-restarted", 3, 2, 0.75))
            await until((5, 0.375))
            await feed.detach(url)
            assert feed.load(url) is None
    finally:
        await feed.stop()
        for p in pubs:
            p.close()
        await runner.cleanup()
