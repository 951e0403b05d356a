"""The NIXL connector's worker side: registration, handshakes, READs, heartbeats and releases.

The whole KV pool `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` is registered once
(DRAM on CPU, VRAM on GPU). Descriptor lists have one entry per (layer, k|v, block), prepared once for
our pool and once per peer; a read names descriptors in (layer, k|v, block) order, so runs of blocks
contiguous on both sides sit next to each other and NIXL merges them into one descriptor.

Threads: the engine thread posts and polls reads; one control thread does the blocking work
(handshakes, then heartbeats and releases, all over the side channel) and wakes the engine loop.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tandem_engine.config import EngineConfig
from tandem_engine.kv_transfer import side_channel
from tandem_engine.kv_transfer.interface import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorWorker,
    LoadSpec,
    RemoteEngine,
    RemotePrefill,
)
from tandem_engine.kv_transfer.nixl_wrapper import NixlWrapper

logger = logging.getLogger(__name__)

_LAYOUT = "LKNBHD"  # [num_layers, k|v, num_blocks, block_size, num_kv_heads, head_dim]


@dataclass
class _Peer:
    name: str  # NIXL agent name = the remote engine id
    dlist: Any  # prepared remote descriptor list
    num_blocks: int


@dataclass
class _Pending:
    rp: RemotePrefill
    load: LoadSpec | None = None
    handle: Any = None
    t0: float = 0.0
    deadline: float = 0.0
    cancelled: bool = False
    lease_lost: bool = False  # the prefill engine let the lease run out while this read was in flight
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class _PeerState:
    peer: _Peer | None = None
    error: str | None = None
    requests: set[str] = field(default_factory=set)


def _descs(base: int, num_layers: int, num_blocks: int, block_bytes: int) -> np.ndarray:
    """`[num_layers * 2 * num_blocks, 3]` (addr, len, device id): one per (layer, k|v, block)."""
    addr = base + np.arange(num_layers * 2 * num_blocks, dtype=np.int64) * block_bytes
    return np.stack([addr, np.full_like(addr, block_bytes), np.zeros_like(addr)], axis=1)


class NixlConnectorWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, engine_id: str, side_channel_port: int,
                 debug: Callable[[], dict[str, Any]] | None = None,
                 held: Callable[[], set[str]] | None = None,
                 nixl_factory: Callable[[str, int], NixlWrapper] = NixlWrapper) -> None:
        self.config = config
        self.role = config.role
        self.engine_id = engine_id
        self.port = side_channel_port
        self.nixl = nixl_factory(engine_id, config.kv_transfer_threads)
        self._debug = debug or (lambda: {})
        self._held = held
        self._wakeup: Callable[[], None] = lambda: None
        self._server: side_channel.SideChannelServer | None = None
        self._ctrl: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._ctrl_thread = threading.Thread(target=self._control_loop, name="KVControl", daemon=True)
        self._lock = threading.Lock()  # guards _peers (written by the control thread)
        self._peers: dict[str, _PeerState] = {}  # remote engine id ->
        self._by_address: dict[str, str] = {}  # side-channel address -> the engine id last seen there
        self._pending: dict[str, _Pending] = {}
        self._out = KVConnectorOutput()
        self._hb_interval = max(0.2, config.kv_lease_seconds / 6)
        self._heartbeat_ids: dict[str, RemoteEngine] = {}  # guarded by _lock
        self._expired: set[str] = set()  # guarded by _lock
        # remote request id -> local monotonic time until which its lease is known to hold: a heartbeat
        # sent at t extends it to at least t + 2/3 of the lease on the prefill engine. Guarded by _lock.
        self._lease_until: dict[str, float] = {}
        self._hb_asked = False  # an immediate heartbeat is queued for reads waiting on a confirmed lease
        self._arrived: dict[str, RemotePrefill] = {}  # guarded by _lock: seen by the input thread only
        self._ctrl_thread.start()

    # -- registration -------------------------------------------------------------------------
    def register_kv_caches(self, kv_pool: torch.Tensor) -> None:
        # kv_pool: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
        assert kv_pool.is_contiguous()
        self.num_layers, _, self.num_blocks = kv_pool.shape[:3]
        self.block_bytes = kv_pool[0, 0, 0].numel() * kv_pool.element_size()
        mem = "VRAM" if kv_pool.is_cuda else "DRAM"
        self.mem_type = mem
        base = kv_pool.data_ptr()
        self.nixl.register(base, kv_pool.numel() * kv_pool.element_size(), mem)
        self.compat_hash = hashlib.sha256(
            f"tandem-kv-v1|{self.config.model}|{kv_pool.dtype}|{self.config.block_size}|{_LAYOUT}|"
            f"{self.num_layers}|{tuple(kv_pool.shape[3:])}".encode()).hexdigest()[:16]
        local = _descs(base, self.num_layers, self.num_blocks, self.block_bytes)
        self._local = self.nixl.prep_descs("", local, mem)
        if self.role == "prefill":
            reply = {"engine_id": self.engine_id, "agent_metadata": self.nixl.metadata(), "base_addr": base,
                     "num_layers": self.num_layers, "num_blocks": self.num_blocks,
                     "block_bytes": self.block_bytes, "layout": _LAYOUT, "mem_type": mem,
                     "compat_hash": self.compat_hash}
            self._server = side_channel.SideChannelServer(self.config.kv_host, self.port, reply, self._debug,
                                                          lambda: self._wakeup(), self._held)
        logger.info("[handshake] registered %s KV pool: %d layers x 2 x %d blocks of %d bytes (%s)", mem,
                    self.num_layers, self.num_blocks, self.block_bytes, self.engine_id)

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self._wakeup = wakeup

    # -- control thread -----------------------------------------------------------------------
    def _control_loop(self) -> None:
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
                next_hb = time.monotonic() + self._hb_interval
                if task is not self._send_heartbeats:
                    self._send_heartbeats()

    def _handshake(self, remote: RemoteEngine) -> None:
        t0 = time.perf_counter()
        try:
            reply = side_channel.call(remote.address, {"op": "handshake", "engine_id": self.engine_id})
            if reply["engine_id"] != remote.engine_id:
                raise side_channel.SideChannelError(
                    f"{remote.address} is now engine {reply['engine_id']}, not {remote.engine_id} "
                    "(restarted)")
            if reply["compat_hash"] != self.compat_hash:
                raise side_channel.SideChannelError(
                    f"incompatible KV layout at {remote.address} "
                    f"(hash {reply['compat_hash']} != {self.compat_hash})")
            name = self.nixl.add_remote(reply["agent_metadata"])
            dlist = self.nixl.prep_descs(name, _descs(reply["base_addr"], reply["num_layers"],
                                                      reply["num_blocks"], reply["block_bytes"]),
                                         reply.get("mem_type", "DRAM"))
            stale = self._by_address.get(remote.address)
            peer, error = _Peer(name, dlist, int(reply["num_blocks"])), None
            logger.info("[handshake] %s at %s ready in %.0f ms", name, remote.address,
                        (time.perf_counter() - t0) * 1000)
        except Exception as e:
            peer, error, stale = None, f"KV handshake with {remote.address} failed: {e}", None
            logger.warning("[handshake] %s", error)
        with self._lock:
            state = self._peers.setdefault(remote.engine_id, _PeerState())
            state.peer, state.error = peer, error
            if peer is not None:
                self._by_address[remote.address] = remote.engine_id
        if stale is not None and stale != remote.engine_id:
            logger.info("[handshake] dropping %s: %s restarted as %s", stale, remote.address,
                        remote.engine_id)
            with self._lock:
                self._peers.pop(stale, None)
            try:
                self.nixl.remove_remote(stale)
            except Exception as e:
                logger.debug("remove_remote(%s): %s", stale, e)
        self._wakeup()

    def _notify(self, remote: RemoteEngine, message: dict[str, Any], tag: str, queued: float) -> None:
        t0 = time.monotonic()
        try:
            side_channel.call(remote.address, message, timeout_s=2.0)
        except side_channel.SideChannelError as e:
            logger.warning("[lease] %s to %s failed: %s", tag, remote.engine_id, e)
        if time.monotonic() - queued > 1.0:
            logger.warning("[lease] %s to %s took %.2fs (%.2fs queued)", tag, remote.engine_id,
                           time.monotonic() - queued, t0 - queued)

    # -- engine thread ------------------------------------------------------------------------
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        for rp in meta.new_remote:
            with self._lock:
                self._arrived.pop(rp.request_id, None)
            self._pending[rp.request_id] = _Pending(rp)
            self._ensure_handshake(rp.remote)
        for load in meta.loads:
            p = self._pending.get(load.request_id)
            if p is not None:
                p.load, p.t0 = load, time.monotonic()
                p.deadline = p.t0 + max(self.config.kv_lease_seconds, 5.0)
        for rid in meta.cancels:
            p = self._pending.get(rid)
            if p is None:
                continue
            if p.handle is not None:
                p.cancelled = True  # a read may still write the blocks: report when it ends
                continue
            del self._pending[rid]
            self._release(p, 0)
            if p.load is not None:
                self._out.failed_recving[rid] = "cancelled"
        # Reads start before this step's forward pass, and new arrivals are heartbeaten during it.
        self._progress(poll=False)

    def on_arrival(self, request_id: str, params: dict[str, Any]) -> None:
        """Input thread: a remote-prefill request reached this process. Its lease is heartbeaten from
        now, even while the engine thread is busy with a long step and has not seen it yet."""
        if self.role != "decode" or not params.get("do_remote_prefill"):
            return
        try:
            rp = RemotePrefill.parse(request_id, params)
        except (KeyError, TypeError, ValueError):
            return  # the scheduler side reports it
        with self._lock:
            self._arrived[request_id] = rp

    def _ensure_handshake(self, remote: RemoteEngine) -> None:
        with self._lock:
            state = self._peers.get(remote.engine_id)
            if state is not None and (state.peer is not None or state.error is None):
                return  # ready, or in progress
            self._peers[remote.engine_id] = _PeerState()
        self._ctrl.put(lambda: self._handshake(remote))

    def _release(self, p: _Pending, num_blocks: int) -> None:
        msg = {"op": "release", "items": [[p.rp.remote_request_id, num_blocks]]}
        queued = time.monotonic()
        self._ctrl.put(lambda: self._notify(p.rp.remote, msg, "release", queued))

    def _post_read(self, p: _Pending, peer: _Peer) -> None:
        assert p.load is not None
        local = np.asarray(p.load.local_block_ids, dtype=np.int64)
        remote = np.asarray(p.load.remote_block_ids, dtype=np.int64)
        lk = np.arange(self.num_layers * 2, dtype=np.int64)[:, None]
        # [num_layers * 2, n] descriptor indices, flattened layer-major so runs stay adjacent
        local_idx = (lk * self.num_blocks + local).reshape(-1)
        remote_idx = (lk * peer.num_blocks + remote).reshape(-1)
        p.handle, status = self.nixl.read(self._local, local_idx, peer.dlist, remote_idx)
        if status == "ERR":
            self._peer_failed(p.rp.remote, "NIXL could not post the read (peer gone?)")
            self._finish(p, "NIXL could not post the read")

    def _peer_failed(self, remote: RemoteEngine, error: str) -> None:
        """Forget a peer whose reads fail: its queued loads fail fast, and a request that names it
        again handshakes afresh (a restarted engine comes back with a new boot nonce anyway)."""
        with self._lock:
            state = self._peers.get(remote.engine_id)
            if state is None or state.peer is None:
                return
            name, state.peer, state.error = state.peer.name, None, error
        logger.warning("[handshake] dropping %s: %s", name, error)
        try:
            self.nixl.remove_remote(name)
        except Exception as e:
            logger.debug("remove_remote(%s): %s", name, e)

    def _finish(self, p: _Pending, error: str | None) -> None:
        rid = p.rp.request_id
        if p.handle is not None and not self.nixl.release(p.handle) and error is not None \
                and time.monotonic() < p.deadline + self.config.kv_lease_seconds + 10:
            return  # NIXL could not cancel it: keep the blocks until the reclaim deadline
        del self._pending[rid]
        with self._lock:
            self._lease_until.pop(p.rp.remote_request_id, None)
        n = len(p.load.local_block_ids) if p.load is not None and error is None else 0
        self._release(p, n)
        if error is None:
            logger.info("read %d blocks of %s in %.1f ms (waited %.1f s since arrival)", n, rid,
                        (time.monotonic() - p.t0) * 1000, time.monotonic() - p.arrival)
            self._out.finished_recving.append(rid)
            self._out.received_blocks += n
            self._out.transfer_seconds.append(time.monotonic() - p.t0)
        else:
            logger.warning("request %s: KV load failed: %s", rid, error)
            self._out.failed_recving[rid] = error

    def _progress(self, poll: bool) -> None:
        """Post the reads whose peer is ready, poll posted ones (`poll`), refresh the heartbeat set."""
        now = time.monotonic()
        with self._lock:
            expired, self._expired = self._expired, set()
        # A read is posted only while its lease is known to hold for another heartbeat interval, so that
        # the prefill engine cannot free (and reuse) the blocks between our last heartbeat and the read.
        margin = self._hb_interval
        ask_heartbeat = False
        for p in list(self._pending.values()):
            if p.rp.remote_request_id in expired and p.handle is not None:
                p.lease_lost = True
            if p.load is None:
                continue
            if p.handle is None:
                with self._lock:
                    state = self._peers.get(p.rp.remote.engine_id)
                    confirmed = self._lease_until.get(p.rp.remote_request_id, 0.0) > now + margin
                if p.rp.remote_request_id in expired:
                    # Never read blocks the prefill engine may already have reused.
                    self._finish(p, "the prefill engine's lease ran out before the read")
                elif state is not None and state.error is not None:
                    self._finish(p, state.error)
                elif state is not None and state.peer is not None and confirmed:
                    p.t0 = now
                    self._post_read(p, state.peer)
                elif now > p.deadline:
                    self._finish(p, "KV handshake timed out" if state is None or state.peer is None
                                 else "the prefill engine did not confirm the lease")
                elif state is not None and state.peer is not None:
                    ask_heartbeat = True
                continue
            if not poll:
                continue
            status = self.nixl.check(p.handle)
            if status == "DONE" and p.lease_lost:
                # The bytes may come from blocks that were freed and reused under the read: never use them.
                self._finish(p, "the prefill engine's lease ran out during the read")
            elif status == "DONE":
                self._finish(p, None)
            elif status == "ERR":
                self._peer_failed(p.rp.remote, "NIXL read failed")
                self._finish(p, "NIXL read failed")
            elif now > p.deadline:
                self._finish(p, f"KV read did not finish in {p.deadline - p.t0:.0f}s")
        with self._lock:
            # Read by the control thread, which heartbeats on its own timer even through long steps.
            self._heartbeat_ids = {p.rp.remote_request_id: p.rp.remote for p in self._pending.values()}
            self._lease_until = {rid: t for rid, t in self._lease_until.items() if t > now}
            ask_heartbeat = ask_heartbeat and not self._hb_asked  # one queued request is enough
            self._hb_asked = self._hb_asked or ask_heartbeat
        if ask_heartbeat:
            self._ctrl.put(self._send_heartbeats)

    def get_finished(self) -> KVConnectorOutput:
        if self._server is not None:
            while True:
                try:
                    ev = self._server.events.get_nowait()
                except queue.Empty:
                    break
                if ev[0] == "release":
                    self._out.released.append((ev[1], ev[2]))
                else:
                    self._out.heartbeats.append(ev[1])
        self._progress(poll=True)
        out, self._out = self._out, KVConnectorOutput()
        return out

    def _send_heartbeats(self) -> None:
        """Control thread: one heartbeat per prefill engine for every load not yet reported."""
        with self._lock:
            items = list(self._heartbeat_ids.items())
            items += [(rp.remote_request_id, rp.remote) for rp in self._arrived.values()]
        by_remote: dict[RemoteEngine, list[str]] = {}
        for rid, remote in items:
            by_remote.setdefault(remote, []).append(rid)
        with self._lock:
            asked, self._hb_asked = self._hb_asked, False
        for remote, ids in by_remote.items():
            sent = time.monotonic()
            try:
                reply = side_channel.call(remote.address, {"op": "heartbeat", "ids": ids}, timeout_s=2.0)
            except side_channel.SideChannelError as e:
                logger.warning("[lease] heartbeat to %s failed: %s", remote.engine_id, e)
                continue
            gone = set(reply.get("expired") or ())
            with self._lock:
                for rid in ids:
                    if rid not in gone:
                        until = sent + self.config.kv_lease_seconds * 2 / 3
                        self._lease_until[rid] = max(self._lease_until.get(rid, 0.0), until)
                self._expired.update(gone)
            if gone:
                logger.warning("[lease] %s no longer holds %s", remote.engine_id, sorted(gone))
            if gone or asked:
                self._wakeup()

    @property
    def transfers_in_flight(self) -> bool:
        return any(p.load is not None for p in self._pending.values())

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def shutdown(self) -> None:
        self._ctrl.put(None)
        self._ctrl_thread.join(3)
        if self._server is not None:
            self._server.close()
        self.nixl.close()
