"""Following the engines' KV events (docs/contracts.md, "KV events") into the router's exact index.

The router imports no engine code, so the event messages are its own copy of the engine's
(workers/tandem_engine/core/kv_events.py); tests/engine/core/test_kv_events.py proves that the router
decodes what an engine encodes. Per publisher one asyncio task: a SUB socket, a replay from batch 0 to
catch up (the engine answers with a snapshot when its buffer no longer reaches that far), then batches
in sequence order; a gap asks the replay socket for what is missing, a new engine id (a restart) clears
what the old one held, and any failure clears the publisher's entries and starts over after a pause,
so the index never claims blocks an engine may not hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec
import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

TOPIC = b"kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class BlockStored(msgspec.Struct, tag=True, array_like=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int


class BlockRemoved(msgspec.Struct, tag=True, array_like=True):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EngineLoad(msgspec.Struct, array_like=True):
    running: int
    waiting: int
    kv_usage: float


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    engine_id: str
    events: list[KVEvent]
    load: EngineLoad | None = None  # the engine's load after the step, when it changed


class PublisherInfo(msgspec.Struct):
    rank: int
    host: str
    port: int
    replay_port: int


class KVEventsInfo(msgspec.Struct):
    """An engine's `GET /kv_events` answer."""

    block_size: int | None
    publishers: list[PublisherInfo]


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def publisher_host(engine_url: str, advertised: str) -> str:
    """Where to connect: the advertised address, unless it is a wildcard (then the engine URL's host)."""
    try:
        wildcard = ipaddress.ip_address(advertised).is_unspecified
    except ValueError:
        wildcard = False
    host = advertised
    if wildcard or not advertised:
        host = urlsplit(engine_url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


# Called with (publisher key, events) for batches to apply in order, or (publisher key, None) to clear it.
Apply = Callable[[Any, list[KVEvent] | None], None]


class EventStream:
    """One publisher's batches, in order, into `apply`."""

    def __init__(self, key: Any, endpoint: str, replay_endpoint: str, apply: Apply,
                 on_resync: Callable[[str], None], replay_timeout: float = 5.0,
                 on_load: Callable[[Any, EngineLoad | None], None] | None = None) -> None:
        self.key = key
        self.on_load = on_load  # the engine's load from each batch that carries it; None when reset
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.apply = apply
        self.on_resync = on_resync
        self.replay_timeout = replay_timeout
        self.engine_id: str | None = None
        self.last = -1  # sequence number of the last batch applied
        self.applied = 0
        self.synced = asyncio.Event()  # set once caught up by the first replay

    async def run(self, ctx: zmq.asyncio.Context) -> None:
        backoff = 0.2
        while True:
            try:
                await self._follow(ctx)
            except asyncio.CancelledError:
                raise
            except (TimeoutError, zmq.ZMQError, msgspec.DecodeError, ValueError) as e:
                logger.warning("[kv-events] %s: %s; its index entries are dropped until it is caught up again",
                               self.endpoint, e)
            self._reset("error")
            self.synced.clear()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _follow(self, ctx: zmq.asyncio.Context) -> None:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(self.endpoint)
        try:
            await self._replay(ctx, self.last + 1)
            self.synced.set()
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    raise ValueError(f"a message of {len(frames)} frames is not a KV event batch")
                seq, batch = int.from_bytes(frames[1], "big"), decode_batch(frames[2])
                if batch.engine_id != self.engine_id:
                    self._restarted(batch.engine_id)
                    if seq != 0:  # its first batches went by before we listened
                        await self._replay(ctx, 0)
                        continue
                if seq <= self.last:
                    continue  # already applied by a replay
                if seq > self.last + 1:
                    self.on_resync("gap")
                    await self._replay(ctx, self.last + 1)
                    continue
                self._apply(seq, batch)
        finally:
            sub.close()

    async def _replay(self, ctx: zmq.asyncio.Context, start: int) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            # A replay of thousands of batches may take longer than replay_timeout in all: the timeout is
            # for silence (on a busy 2-core machine a 4,000-batch replay took over 2 s and was cut off).
            while True:
                if not await sock.poll(int(self.replay_timeout * 1000)):
                    raise TimeoutError(f"no replay from {self.replay_endpoint} in {self.replay_timeout:.0f}s")
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    raise ValueError(f"a replay message of {len(frames)} frames")
                if frames[1] == END_SEQ:
                    return
                seq, batch = int.from_bytes(frames[1], "big"), decode_batch(frames[2])
                if batch.engine_id != self.engine_id:
                    self._restarted(batch.engine_id)
                snapshot = bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
                if seq > self.last + 1 and not snapshot:  # a batch missing: applying on would drift
                    raise ValueError(f"a replay skipped from batch {self.last + 1} to {seq}")
                if seq > self.last:  # a snapshot starts with AllBlocksCleared: it replaces the state
                    self._apply(seq, batch)
        finally:
            sock.close()

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        self.apply(self.key, batch.events)
        if batch.load is not None and self.on_load is not None:
            self.on_load(self.key, batch.load)
        self.last = seq
        self.applied += 1

    def _restarted(self, engine_id: str) -> None:
        if self.engine_id is not None:
            logger.info("[kv-events] %s is a new engine (%s): what %s held is dropped",
                        self.endpoint, engine_id, self.engine_id)
            self.on_resync("restart")
        self._reset(None)
        self.engine_id = engine_id

    def _reset(self, reason: str | None) -> None:
        self.apply(self.key, None)
        if self.on_load is not None:
            self.on_load(self.key, None)
        self.last = -1
        self.engine_id = None
        if reason is not None:
            self.on_resync(reason)


async def fetch_info(session: aiohttp.ClientSession, url: str) -> KVEventsInfo:
    async with session.get(url + "/kv_events", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        if resp.status != 200:
            raise ValueError(f"GET {url}/kv_events answered {resp.status}")
        return msgspec.json.decode(await resp.read(), type=KVEventsInfo)


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
