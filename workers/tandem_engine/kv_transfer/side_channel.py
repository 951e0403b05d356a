"""The ZMQ side channel of a prefill engine: handshake, lease heartbeats, release notifications, debug.

The server is a ROUTER socket on its own thread inside the EngineCore process. It answers handshakes
from a reply built once at registration and forwards heartbeats and releases to the engine loop
through a queue (it never touches scheduler state). Clients use a fresh REQ socket per call with a
receive timeout, so a dead peer costs one timeout and never wedges a socket. The messages are in
messages.py.

    python -m tandem_engine.kv_transfer.side_channel tcp://127.0.0.1:5600   # prints held blocks
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import zmq

from tandem_engine.kv_transfer.messages import (
    Ack,
    Debug,
    DebugView,
    ErrorReply,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatReply,
    Release,
    SideChannelReply,
    SideChannelRequest,
    encoder,
    reply_decoder,
    request_decoder,
)

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
_POLL_MS = 200

ReplyT = TypeVar("ReplyT", HandshakeReply, HeartbeatReply, Ack, DebugView)


class SideChannelError(RuntimeError):
    pass


def call(address: str, message: SideChannelRequest, reply_type: type[ReplyT],
         timeout_s: float = HANDSHAKE_TIMEOUT_S, ctx: zmq.Context[Any] | None = None) -> ReplyT:
    """One request/reply to a side channel; raises SideChannelError on timeout, an error reply or an
    answer of another type."""
    ctx = ctx or zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(address)
        sock.send(encoder.encode(message))
        reply: SideChannelReply = reply_decoder.decode(sock.recv())
    except zmq.Again as e:
        raise SideChannelError(f"no answer from {address} within {timeout_s:.1f}s") from e
    except msgspec.DecodeError as e:  # e.g. a peer of another tandem version
        raise SideChannelError(f"{address} answered {type(message).__name__} with an unknown message: {e}") from e
    finally:
        sock.close()
    if not isinstance(reply, reply_type):
        raise SideChannelError(f"{address} refused {type(message).__name__}: {reply}")
    return reply


class SideChannelServer:
    """Serves `Handshake` and `Debug`; queues `Heartbeat` and `Release` for the engine loop."""

    def __init__(self, host: str, port: int, handshake_reply: HandshakeReply,
                 debug: Callable[[], DebugView], wakeup: Callable[[], None],
                 held: Callable[[], set[str]] | None = None) -> None:
        self.address = f"tcp://{host}:{port}"
        self.events: queue.Queue[Heartbeat | Release] = queue.Queue()
        self._reply = encoder.encode(handshake_reply)
        self._debug = debug
        self._held = held
        self._wakeup = wakeup
        self._stop = threading.Event()
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{'*' if host in ('0.0.0.0', '') else host}:{port}")
        self._thread = threading.Thread(target=self._serve, name="KVSideChannel", daemon=True)
        self._thread.start()
        logger.info("[handshake] side channel listening on %s", self.address)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                # Not a REQ/DEALER call of ours: e.g. a stray socket of a dead process reconnecting to
                # a port this engine now owns. Drop it; the thread must outlive any peer.
                logger.warning("[handshake] dropped a side-channel message of %d frames", len(frames))
                continue
            ident, empty, payload = frames
            try:
                reply = self._handle(request_decoder.decode(payload))
            except Exception as e:  # a malformed message fails that call only
                logger.warning("[handshake] bad side-channel message: %s", e)
                reply = encoder.encode(ErrorReply(str(e)))
            self._sock.send_multipart([ident, empty, reply])
        self._sock.close()

    def _handle(self, msg: SideChannelRequest) -> bytes:
        if isinstance(msg, Handshake):
            logger.info("[handshake] serving agent metadata to %s", msg.engine_id)
            return self._reply
        if isinstance(msg, Debug):
            return encoder.encode(self._debug())
        self.events.put(msg)
        self._wakeup()
        if isinstance(msg, Heartbeat):
            # Ids no longer held (lease ran out): the decode engine must not read them.
            held = self._held() if self._held is not None else set(msg.ids)
            return encoder.encode(HeartbeatReply([r for r in msg.ids if r not in held]))
        return encoder.encode(Ack())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._ctx.term()


if __name__ == "__main__":
    view = call(sys.argv[1], Debug(), DebugView)
    print(msgspec.json.format(msgspec.json.encode(view), indent=2).decode())
