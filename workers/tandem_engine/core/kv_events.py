"""KV-cache events: what an engine's prefix cache gains and loses (vLLM's `BlockStored`, `BlockRemoved`,
`AllBlocksCleared`, batched per step, with the engine's load), published on a PUB socket with a replay socket
for gaps, so that a router can keep an exact index of which engine holds which block (docs/contracts.md,
"KV events": the wire, the replay and the snapshot).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Protocol

import msgspec
import zmq

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class BlockStored(msgspec.Struct, tag=True, array_like=True):
    """Full blocks newly registered in the prefix cache, a chain: each hash's parent is the one
    before it, the first one's is `parent_block_hash` (None at the start of a prompt)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int


class BlockRemoved(msgspec.Struct, tag=True, array_like=True):
    """Blocks evicted from the prefix cache (their slots were reused)."""

    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True):
    """The whole prefix cache is gone (an engine that starts or stops)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EngineLoad(msgspec.Struct, array_like=True):
    """The scheduler's load after a step, for routers that weigh queues (every replica then sees the
    same numbers at the same time, where scrapes of /metrics would differ by their phase)."""

    running: int
    waiting: int  # waiting to be scheduled, or for their KV blocks to arrive
    kv_usage: float  # share of KV blocks in use, 0-1


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float  # time.time() when the step's events were taken
    engine_id: str  # host, DP rank and boot nonce: a restart changes it
    events: list[KVEvent]
    load: EngineLoad | None = None  # after the step, when it changed (or with events); else unchanged


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


class EventPublisher(Protocol):
    """Where an engine core hands its batches: KVEventPublisher, or a simulated engine's (tandem_engine/sim)."""

    def publish(self, batch: KVEventBatch) -> None: ...

    def close(self) -> None: ...


class KVEventLog:
    """What a publisher keeps, without its sockets: the sequence numbers, the last `buffer_steps` batches
    for replay, and what the published events say the cache holds, for a snapshot when a replay asks for
    more than the buffer reaches. KVEventPublisher drives one from a thread; the simulated engines drive
    theirs from one event loop (tandem_engine/sim)."""

    def __init__(self, topic: bytes, buffer_steps: int) -> None:
        self.topic = topic
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self.last_sent = time.monotonic()
        self._held: dict[int, None] = {}  # insertion-ordered set
        self.engine_id = ""
        self._block_size = 0
        self._load: EngineLoad | None = None  # the last load published: heartbeats and snapshots repeat it

    def record(self, batch: KVEventBatch) -> list[bytes]:
        """The PUB frames of `batch`, numbered next and kept for replay."""
        payload = _encoder.encode(batch)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        self.last_sent = time.monotonic()
        self._track(batch)
        return [self.topic, seq.to_bytes(8, "big"), payload]

    def heartbeat(self, heartbeat_s: float) -> KVEventBatch | None:
        """The empty batch an idle engine sends every `heartbeat_s`, so that a subscriber notices a restart
        (new engine id) or a lost batch (gap) within a second, not at the next request; None if not due."""
        if self.engine_id and time.monotonic() - self.last_sent >= heartbeat_s:
            return KVEventBatch(time.time(), self.engine_id, [], self._load)
        return None

    def _track(self, batch: KVEventBatch) -> None:
        if batch.engine_id != self.engine_id:
            self._load = None  # another engine's load is not this one's
        self.engine_id = batch.engine_id
        if batch.load is not None:
            self._load = batch.load
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._block_size = ev.block_size
                self._held.update(dict.fromkeys(ev.block_hashes))
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._held.pop(h, None)
            else:
                self._held.clear()

    def _snapshot(self) -> bytes:
        events: list[KVEvent] = [AllBlocksCleared()]
        if self._held:
            events.append(BlockStored(list(self._held), None, [], self._block_size))
        return _encoder.encode(KVEventBatch(time.time(), self.engine_id, events, self._load))

    def replay_answer(self, frames: list[bytes]) -> list[list[bytes]]:
        """The ROUTER frames answering a replay request: every buffered batch from the sequence number asked
        for, or one snapshot if the buffer no longer reaches it; then the end marker."""
        identity, start = frames[0], frames[-1]
        if len(start) != 8:
            logger.warning("kv-events replay: a request of %d bytes is not a sequence number", len(start))
            return [[identity, b"", END_SEQ, b""]]
        first = int.from_bytes(start, "big")
        if self._buffer and first < self._buffer[0][0]:  # part of what was asked for is gone
            last = self._seq - 1
            answer = [[identity, b"", last.to_bytes(8, "big"), self._snapshot()]]
        else:
            answer = [[identity, b"", seq.to_bytes(8, "big"), payload] for seq, payload in self._buffer
                      if seq >= first]
        return [*answer, [identity, b"", END_SEQ, b""]]


def bind_replay(sock: zmq.Socket[Any], endpoint: str) -> None:
    """A ROUTER drops what passes its high-water mark (1,000 messages by default): a replay of a full buffer
    would lose batches in its middle, or its end marker. The answer is queued whole instead (its batches
    are held in the buffer anyway)."""
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(endpoint)


class KVEventPublisher:
    """Publishes batches from the engine loop without blocking it: a thread owns both sockets and the
    KVEventLog, and answers replay requests."""

    def __init__(self, pub_endpoint: str, replay_endpoint: str, buffer_steps: int, topic: str = "kv-events",
                 heartbeat_s: float = 1.0) -> None:
        self._ctx: zmq.Context[Any] = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.bind(pub_endpoint)
            self._replay = self._ctx.socket(zmq.ROUTER)
            bind_replay(self._replay, replay_endpoint)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)  # a taken port: no socket or context outlives the error
            raise
        self.pub_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.log = KVEventLog(topic.encode(), buffer_steps)
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue()
        self.heartbeat_s = heartbeat_s
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        self._queue.put(batch)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._ctx.destroy(linger=500)  # let the last batch (AllBlocksCleared on a stop) leave

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                batch = self._queue.get(timeout=0.01)
            except queue.Empty:
                batch = None
                stop = False
            else:
                stop = batch is None
            if batch is None:
                batch = self.log.heartbeat(self.heartbeat_s)
            if batch is not None:
                self._pub.send_multipart(self.log.record(batch))
            for sock, _ in poller.poll(0):
                for frames in self.log.replay_answer(sock.recv_multipart()):
                    sock.send_multipart(frames)
            if stop:
                return


def replay(endpoint: str, start_seq: int, timeout_s: float = 5.0) -> list[tuple[int, KVEventBatch]]:
    """Fetch the buffered batches from `start_seq` on from an engine's replay socket (a client's side;
    the router has its own copy of these messages)."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[tuple[int, KVEventBatch]] = []
        deadline = time.monotonic() + timeout_s
        while True:
            if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError(f"kv-events replay from {endpoint}: no end marker in {timeout_s}s")
            _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), decode_batch(payload)))
    finally:
        sock.close()
