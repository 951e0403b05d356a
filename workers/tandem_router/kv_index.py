"""The exact index of which engine holds which KV block, built from the engines' KV events.

Each publisher (one EngineCore: an engine URL and its data-parallel rank) has the set of block hashes
its prefix cache holds, kept exactly by applying its `BlockStored`, `BlockRemoved` and
`AllBlocksCleared` events in order (workers/tandem_router/kv_events.py keeps them in order). A request's
chain of block hashes matches an engine as far as its leading blocks are all held there, which is
exactly how far the engine's own prefix-cache lookup gets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
import zmq.asyncio

from tandem_router.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineLoad,
    EventStream,
    KVEvent,
    cancel_all,
    fetch_info,
    publisher_host,
)
from tandem_router.prefix_index import leading_matches

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Publisher:
    url: str  # the engine's HTTP URL, as the pool knows it
    rank: int  # data-parallel rank: each has its own cache

    def __str__(self) -> str:
        return f"{self.url}#dp{self.rank}"


class KVIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[Publisher]] = {}
        self._held: dict[Publisher, set[int]] = {}
        # Blocks held per engine URL (over its ranks): read for every candidate of every routing decision,
        # which at 1,000 engines cannot each sum over every publisher.
        self._sizes: dict[str, int] = {}
        self.block_size: int | None = None  # from the events; every engine behind one router agrees

    def apply(self, pub: Publisher, events: Iterable[KVEvent]) -> None:
        held = self._held.setdefault(pub, set())
        for ev in events:
            if isinstance(ev, BlockStored):
                self.block_size = ev.block_size or self.block_size
                before = len(held)
                for h in ev.block_hashes:
                    if h not in held:
                        held.add(h)
                        self._holders.setdefault(h, set()).add(pub)
                self._sizes[pub.url] = self._sizes.get(pub.url, 0) + len(held) - before
            elif isinstance(ev, BlockRemoved):
                before = len(held)
                for h in ev.block_hashes:
                    if h in held:
                        held.discard(h)
                        self._forget(h, pub)
                self._sizes[pub.url] = self._sizes.get(pub.url, 0) - (before - len(held))
            elif isinstance(ev, AllBlocksCleared):
                self.clear(pub)
                held = self._held.setdefault(pub, set())

    def clear(self, pub: Publisher) -> None:
        """Forget everything `pub` held (its engine restarted, went away, or a resync starts over)."""
        held = self._held.pop(pub, set())
        for h in held:
            self._forget(h, pub)
        if held:
            self._sizes[pub.url] -= len(held)

    def drop_engine(self, url: str) -> None:
        for pub in [p for p in self._held if p.url == url]:
            self.clear(pub)

    def match(self, hashes: list[int]) -> dict[str, int]:
        """Leading blocks of `hashes` held per engine URL (the best of its ranks); engines with none omitted."""
        out: dict[str, int] = {}
        for pub, n in leading_matches(hashes, self._holders).items():
            out[pub.url] = max(out.get(pub.url, 0), n)
        return out

    def held(self, pub: Publisher) -> frozenset[int]:
        return frozenset(self._held.get(pub, ()))

    def size(self, url: str | None = None) -> int:
        """Blocks indexed for one engine (all its ranks), or for every engine."""
        return sum(self._sizes.values()) if url is None else self._sizes.get(url, 0)

    def _forget(self, h: int, pub: Publisher) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(pub)
            if not holders:
                del self._holders[h]


# An engine's load from its events: (requests running + waiting over its ranks, mean KV usage), or None
# while some rank's load is unknown (not yet received, or its stream was reset).
OnLoad = Callable[[str, tuple[int, float] | None], None]


class KVIndexFeed:
    """Keeps `index` fed from every engine it is told about: `attach(url)` asks the engine where it
    publishes (`GET /kv_events`) and follows each publisher; `detach(url)` stops and forgets it. The
    engines' load, which their batches carry, goes to `on_load` as it changes."""

    def __init__(self, index: KVIndex, on_resync: Callable[[str, str], None] | None = None,
                 on_load: OnLoad | None = None) -> None:
        self.index = index
        self.on_resync = on_resync
        self.on_load = on_load
        self._loads: dict[Publisher, EngineLoad] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._streams: dict[str, list[EventStream]] = {}
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}

    def attach(self, session: aiohttp.ClientSession, url: str) -> None:
        if url not in self._tasks:
            self._tasks[url] = [asyncio.create_task(self._attach(session, url), name=f"kv-events-info {url}")]

    async def _attach(self, session: aiohttp.ClientSession, url: str) -> None:
        try:
            info = await fetch_info(session, url)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # msgspec errors are ValueErrors
            logger.info("[kv-events] %s tells no KV events (%s); routing to it uses the approximate index", url, e)
            self._tasks.pop(url, None)  # asked again at its next admission
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
            # A SUB per publisher and a DEALER per replay: pyzmq's default of 1,023 sockets is 500-1,000 engines.
            self._ctx.set(zmq.MAX_SOCKETS, self._ctx.get(zmq.SOCKET_LIMIT))
        def resynced(reason: str) -> None:
            if self.on_resync is not None:
                self.on_resync(url, reason)

        streams = []
        for p in info.publishers:
            host = publisher_host(url, p.host)
            streams.append(EventStream(Publisher(url, p.rank), f"tcp://{host}:{p.port}",
                                       f"tcp://{host}:{p.replay_port}", self._apply, resynced,
                                       on_load=self._load))
        self._streams[url] = streams
        self._tasks[url] += [asyncio.create_task(s.run(self._ctx), name=f"kv-events {s.key}") for s in streams]
        logger.info("[kv-events] following %s: %s", url, ", ".join(s.endpoint for s in streams) or "publishes none")

    def _apply(self, pub: Publisher, events: list[KVEvent] | None) -> None:
        if events is None:
            self.index.clear(pub)
        else:
            self.index.apply(pub, events)

    def _load(self, pub: Publisher, load: EngineLoad | None) -> None:
        if load is None:
            self._loads.pop(pub, None)
        else:
            self._loads[pub] = load
        if self.on_load is not None:
            self.on_load(pub.url, self.load(pub.url))

    def load(self, url: str) -> tuple[int, float] | None:
        """The engine's requests running and waiting over its ranks and their mean KV usage, as its
        events last said; None unless every rank's is known."""
        loads = [self._loads.get(s.key) for s in self._streams.get(url, [])]
        if not loads or any(x is None for x in loads):
            return None
        known = [x for x in loads if x is not None]
        return sum(x.running + x.waiting for x in known), sum(x.kv_usage for x in known) / len(known)

    def covers(self, url: str) -> bool:
        """The index is exact for this engine: it publishes, and every publisher is caught up."""
        streams = self._streams.get(url)
        return bool(streams) and all(s.synced.is_set() for s in streams or ())

    async def detach(self, url: str) -> None:
        for s in self._streams.pop(url, []):
            self._loads.pop(s.key, None)
        await cancel_all(self._tasks.pop(url, []))
        self.index.drop_engine(url)

    async def stop(self) -> None:
        for url in list(self._tasks):
            await self.detach(url)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
