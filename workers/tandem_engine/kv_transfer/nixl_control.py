"""The NIXL worker's control thread: handshakes, lease heartbeats and release notifications.

Everything here blocks on a prefill engine's side channel, so it runs on one thread of its own and
never on the engine thread. It owns the peer table and what is known of each remote lease, shared
with the engine thread (nixl_worker.py) under one lock, and wakes the engine loop when news arrives.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem_engine.config import EngineConfig
from tandem_engine.kv_transfer import side_channel
from tandem_engine.kv_transfer.interface import RemoteEngine, RemotePrefill
from tandem_engine.kv_transfer.messages import Ack, Handshake, HandshakeReply, Heartbeat, HeartbeatReply, Release
from tandem_engine.kv_transfer.nixl_wrapper import NixlWrapper

logger = logging.getLogger(__name__)


@dataclass
class Peer:
    name: str  # NIXL agent name = the remote engine id
    dlist: Any  # prepared remote descriptor list
    num_blocks: int


@dataclass
class PeerState:
    peer: Peer | None = None
    error: str | None = None  # the handshake failed, or reads from this peer did


def descs(base: int, num_layers: int, num_blocks: int, block_bytes: int) -> np.ndarray:
    """`[num_layers * 2 * num_blocks, 3]` (addr, len, device id): one per (layer, k|v, block)."""
    addr = base + np.arange(num_layers * 2 * num_blocks, dtype=np.int64) * block_bytes
    return np.stack([addr, np.full_like(addr, block_bytes), np.zeros_like(addr)], axis=1)


class KVControl:
    """The control thread and the state it shares with the engine thread (guarded by `_lock`)."""

    def __init__(self, config: EngineConfig, engine_id: str, nixl: NixlWrapper) -> None:
        self.engine_id = engine_id
        self.nixl = nixl
        self.lease_s = config.kv_lease_seconds
        self.hb_interval = max(0.2, config.kv_lease_seconds / 6)
        self.compat_hash = ""  # set by the worker once its pool is registered, before any handshake
        self.kv_cache_dtype = ""  # likewise
        self.wakeup: Callable[[], None] = lambda: None
        self._ctrl: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._peers: dict[str, PeerState] = {}  # remote engine id ->
        self._by_address: dict[str, str] = {}  # side-channel address -> the engine id last seen there
        self._heartbeat_ids: dict[str, RemoteEngine] = {}
        self._expired: set[str] = set()
        # remote request id -> local monotonic time until which its lease is known to hold: a heartbeat
        # sent at t extends it to at least t + 2/3 of the lease on the prefill engine.
        self._lease_until: dict[str, float] = {}
        self._hb_asked = False  # an immediate heartbeat is queued for reads waiting on a confirmed lease
        self._arrived: dict[str, RemotePrefill] = {}  # seen by the input thread only
        self._thread = threading.Thread(target=self._loop, name="KVControl", daemon=True)
        self._thread.start()

    # -- called from other threads --------------------------------------------------------------
    def arrived(self, rp: RemotePrefill) -> None:
        """Input thread: heartbeat this request's lease until the engine thread takes it over."""
        with self._lock:
            self._arrived[rp.request_id] = rp

    def taken_over(self, request_id: str) -> None:
        with self._lock:
            self._arrived.pop(request_id, None)

    def ensure_handshake(self, remote: RemoteEngine) -> None:
        with self._lock:
            state = self._peers.get(remote.engine_id)
            if state is not None and (state.peer is not None or state.error is None):
                return  # ready, or in progress
            self._peers[remote.engine_id] = PeerState()
        self._ctrl.put(lambda: self._handshake(remote))

    def read_state(self, rp: RemotePrefill, until: float) -> tuple[PeerState | None, bool]:
        """The peer's state, and whether the lease is known to hold past `until`."""
        with self._lock:
            state = self._peers.get(rp.remote.engine_id)
            return state, self._lease_until.get(rp.remote_request_id, 0.0) > until

    def take_expired(self) -> set[str]:
        with self._lock:
            expired, self._expired = self._expired, set()
        return expired

    def forget_lease(self, remote_request_id: str) -> None:
        with self._lock:
            self._lease_until.pop(remote_request_id, None)

    def heartbeat(self, pending: dict[str, RemoteEngine], now: float, ask: bool) -> None:
        """Engine thread: heartbeat these remote request ids from now on; `ask` for one at once."""
        with self._lock:
            # Read by this thread, which heartbeats on its own timer even through long steps.
            self._heartbeat_ids = pending
            self._lease_until = {rid: t for rid, t in self._lease_until.items() if t > now}
            ask = ask and not self._hb_asked  # one queued request is enough
            self._hb_asked = self._hb_asked or ask
        if ask:
            self._ctrl.put(self._send_heartbeats)

    def release(self, remote: RemoteEngine, remote_request_id: str, num_blocks: int) -> None:
        msg = Release(remote_request_id, num_blocks)
        queued = time.monotonic()
        self._ctrl.put(lambda: self._notify(remote, msg, queued))

    def peer_failed(self, remote: RemoteEngine, error: str) -> None:
        """Forget a peer whose reads fail: its queued loads fail fast, and a request that names it
        again handshakes afresh (a restarted engine comes back with a new boot nonce anyway)."""
        with self._lock:
            state = self._peers.get(remote.engine_id)
            if state is None or state.peer is None:
                return
            name, state.peer, state.error = state.peer.name, None, error
        logger.warning("[handshake] dropping %s: %s", name, error)
        self._remove_remote(name)

    def close(self) -> None:
        self._ctrl.put(None)
        self._thread.join(3)

    # -- the control thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        # Heartbeats run on this thread's own timer: an engine step (a long prefill) may take longer
        # than a lease, and the lease must not run out while this engine still means to read.
        next_hb = 0.0
        while True:
            try:
                task = self._ctrl.get(timeout=max(0.0, next_hb - time.monotonic()))
            except queue.Empty:
                task = self._send_heartbeats
            if task is None:
                return
            try:
                task()
            except Exception:
                logger.exception("KV control task failed")
            if time.monotonic() >= next_hb:
                next_hb = time.monotonic() + self.hb_interval
                if task is not self._send_heartbeats:
                    self._send_heartbeats()

    def _connect(self, remote: RemoteEngine) -> Peer:
        t0 = time.perf_counter()
        reply = side_channel.call(remote.address, Handshake(self.engine_id), HandshakeReply)
        if reply.engine_id != remote.engine_id:
            raise side_channel.SideChannelError(
                f"{remote.address} is now engine {reply.engine_id}, not {remote.engine_id} (restarted)")
        if reply.kv_cache_dtype and reply.kv_cache_dtype != self.kv_cache_dtype:
            raise side_channel.SideChannelError(
                f"KV cache dtype mismatch: the prefill engine at {remote.address} stores {reply.kv_cache_dtype}, "
                f"this decode engine {self.kv_cache_dtype}; give both the same --kv-cache-dtype (and --dtype)")
        if reply.compat_hash != self.compat_hash:
            raise side_channel.SideChannelError(
                f"incompatible KV layout at {remote.address} (hash {reply.compat_hash} != {self.compat_hash})")
        name = self.nixl.add_remote(reply.agent_metadata)
        dlist = self.nixl.prep_descs(
            name, descs(reply.base_addr, reply.num_layers, reply.num_blocks, reply.block_bytes), reply.mem_type)
        logger.info("[handshake] %s at %s ready in %.0f ms", name, remote.address, (time.perf_counter() - t0) * 1000)
        return Peer(name, dlist, reply.num_blocks)

    def _handshake(self, remote: RemoteEngine) -> None:
        peer: Peer | None = None
        error: str | None = None
        try:
            peer = self._connect(remote)
        except Exception as e:
            error = f"KV handshake with {remote.address} failed: {e}"
            logger.warning("[handshake] %s", error)
        with self._lock:
            state = self._peers.setdefault(remote.engine_id, PeerState())
            state.peer, state.error = peer, error
            stale = self._by_address.get(remote.address) if peer is not None else None
            if peer is not None:
                self._by_address[remote.address] = remote.engine_id
        if stale is not None and stale != remote.engine_id:
            logger.info("[handshake] dropping %s: %s restarted as %s", stale, remote.address, remote.engine_id)
            with self._lock:
                self._peers.pop(stale, None)
            self._remove_remote(stale)
        self.wakeup()

    def _remove_remote(self, name: str) -> None:
        try:
            self.nixl.remove_remote(name)
        except Exception as e:
            logger.debug("remove_remote(%s): %s", name, e)

    def _notify(self, remote: RemoteEngine, message: Release, queued: float) -> None:
        t0 = time.monotonic()
        try:
            side_channel.call(remote.address, message, Ack, timeout_s=2.0)
        except side_channel.SideChannelError as e:
            logger.warning("[lease] release to %s failed: %s", remote.engine_id, e)
        if time.monotonic() - queued > 1.0:
            logger.warning("[lease] release to %s took %.2fs (%.2fs queued)", remote.engine_id,
                           time.monotonic() - queued, t0 - queued)

    def _send_heartbeats(self) -> None:
        """One heartbeat per prefill engine for every load not yet reported."""
        with self._lock:
            items = list(self._heartbeat_ids.items())
            items += [(rp.remote_request_id, rp.remote) for rp in self._arrived.values()]
            asked, self._hb_asked = self._hb_asked, False
        by_remote: dict[RemoteEngine, list[str]] = {}
        for rid, remote in items:
            by_remote.setdefault(remote, []).append(rid)
        for remote, ids in by_remote.items():
            sent = time.monotonic()
            try:
                reply = side_channel.call(remote.address, Heartbeat(ids), HeartbeatReply, timeout_s=2.0)
            except side_channel.SideChannelError as e:
                logger.warning("[lease] heartbeat to %s failed: %s", remote.engine_id, e)
                continue
            gone = set(reply.expired)
            with self._lock:
                for rid in ids:
                    if rid not in gone:
                        until = sent + self.lease_s * 2 / 3
                        self._lease_until[rid] = max(self._lease_until.get(rid, 0.0), until)
                self._expired.update(gone)
            if gone:
                logger.warning("[lease] %s no longer holds %s", remote.engine_id, sorted(gone))
            if gone or asked:
                self.wakeup()
