"""The ZMQ side channel of a prefill engine: handshake, lease heartbeats, release notifications, debug.

The server is a ROUTER socket on its own thread inside the EngineCore process. It answers handshakes
from a reply built once at registration and forwards heartbeats and releases to the engine loop
through a queue (it never touches scheduler state). Clients use a fresh REQ socket per call with a
receive timeout, so a dead peer costs one timeout and never wedges a socket.

    python -m tandem_engine.kv_transfer.side_channel tcp://127.0.0.1:5600   # prints held blocks
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
_POLL_MS = 200


class SideChannelError(RuntimeError):
    pass


def call(address: str, message: dict[str, Any], timeout_s: float = HANDSHAKE_TIMEOUT_S,
         ctx: zmq.Context[Any] | None = None) -> dict[str, Any]:
    """One request/reply to a side channel; raises SideChannelError on timeout or an error reply."""
    ctx = ctx or zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(address)
        sock.send(msgspec.msgpack.encode(message))
        reply = msgspec.msgpack.decode(sock.recv())
    except zmq.Again as e:
        raise SideChannelError(f"no answer from {address} within {timeout_s:.1f}s") from e
    finally:
        sock.close()
    if not isinstance(reply, dict) or not reply.get("ok"):
        raise SideChannelError(f"{address} refused {message.get('op')}: {reply}")
    return reply


class SideChannelServer:
    """Serves `handshake` and `debug`; queues `("heartbeat", id)` and `("release", id, num_blocks)`."""

    def __init__(self, host: str, port: int, handshake_reply: dict[str, Any],
                 debug: Callable[[], dict[str, Any]], wakeup: Callable[[], None],
                 held: Callable[[], set[str]] | None = None) -> None:
        self.address = f"tcp://{host}:{port}"
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._reply = msgspec.msgpack.encode({"ok": True, **handshake_reply})
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
            ident, empty, payload = self._sock.recv_multipart()
            try:
                msg = msgspec.msgpack.decode(payload)
                reply = self._handle(msg)
            except Exception as e:  # a malformed message fails that call only
                logger.warning("[handshake] bad side-channel message: %s", e)
                reply = msgspec.msgpack.encode({"ok": False, "error": str(e)})
            self._sock.send_multipart([ident, empty, reply])
        self._sock.close()

    def _handle(self, msg: dict[str, Any]) -> bytes:
        op = msg.get("op")
        if op == "handshake":
            logger.info("[handshake] serving agent metadata to %s", msg.get("engine_id", "?"))
            return self._reply
        if op == "heartbeat":
            for rid in msg["ids"]:
                self.events.put(("heartbeat", str(rid)))
            self._wakeup()
            # Ids no longer held (lease ran out): the decode engine must not read them.
            held = self._held() if self._held is not None else set(msg["ids"])
            return msgspec.msgpack.encode({"ok": True, "expired": [r for r in msg["ids"] if r not in held]})
        elif op == "release":
            for rid, n in msg["items"]:
                self.events.put(("release", str(rid), int(n)))
        elif op == "debug":
            return msgspec.msgpack.encode({"ok": True, **self._debug()})
        else:
            raise ValueError(f"unknown op {op!r}")
        self._wakeup()
        return msgspec.msgpack.encode({"ok": True})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._ctx.term()


if __name__ == "__main__":
    print(json.dumps(call(sys.argv[1], {"op": "debug"}), indent=2, default=str))
