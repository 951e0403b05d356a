"""The NIXL connector's worker side: registration, READs, and the reports the scheduler side needs.

The whole KV pool `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` is registered once
(DRAM on CPU, VRAM on GPU). Descriptor lists have one entry per (layer, k|v, block), prepared once for
our pool and once per peer; a read names descriptors in (layer, k|v, block) order, so runs of blocks
contiguous on both sides sit next to each other and NIXL merges them into one descriptor.

Threads: the engine thread posts and polls reads (this module); one control thread does the blocking
work (handshakes, then heartbeats and releases, all over the side channel: nixl_control.py) and wakes
the engine loop.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from tandem_engine.config import EngineConfig
from tandem_engine.kv_transfer import side_channel
from tandem_engine.kv_transfer.interface import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorWorker,
    LoadSpec,
    RemotePrefill,
)
from tandem_engine.kv_transfer.messages import DebugView, HandshakeReply, Heartbeat, remote_prefill_params
from tandem_engine.kv_transfer.nixl_control import KVControl, Peer, descs
from tandem_engine.kv_transfer.nixl_wrapper import NixlWrapper

logger = logging.getLogger(__name__)

_LAYOUT = "LKNBHD"  # [num_layers, k|v, num_blocks, block_size, num_kv_heads, head_dim]


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


class NixlConnectorWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, engine_id: str, side_channel_port: int,
                 debug: Callable[[], DebugView] | None = None,
                 held: Callable[[], set[str]] | None = None,
                 nixl_factory: Callable[[str, int], NixlWrapper] = NixlWrapper) -> None:
        self.config = config
        self.role = config.role
        self.engine_id = engine_id
        self.port = side_channel_port
        self.nixl = nixl_factory(engine_id, config.kv_transfer_threads)
        self._debug = debug or (lambda: DebugView(engine_id, 0, {}, []))
        self._held = held
        self._server: side_channel.SideChannelServer | None = None
        self._control = KVControl(config, engine_id, self.nixl)
        self._pending: dict[str, _Pending] = {}
        self._out = KVConnectorOutput()

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
        self._control.compat_hash = self.compat_hash
        self._control.kv_cache_dtype = str(kv_pool.dtype).removeprefix("torch.")
        self._local = self.nixl.prep_descs("", descs(base, self.num_layers, self.num_blocks, self.block_bytes), mem)
        if self.role == "prefill":
            reply = HandshakeReply(self.engine_id, self.nixl.metadata(), base, self.num_layers, self.num_blocks,
                                   self.block_bytes, _LAYOUT, self.compat_hash, mem, self._control.kv_cache_dtype)
            self._server = side_channel.SideChannelServer(self.config.kv_host, self.port, reply, self._debug,
                                                          lambda: self._control.wakeup(), self._held)
        logger.info("[handshake] registered %s KV pool: %d layers x 2 x %d blocks of %d bytes, %s (%s)", mem,
                    self.num_layers, self.num_blocks, self.block_bytes, self._control.kv_cache_dtype, self.engine_id)

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self._control.wakeup = wakeup

    # -- engine thread ------------------------------------------------------------------------
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        for rp in meta.new_remote:
            self._control.taken_over(rp.request_id)
            self._pending[rp.request_id] = _Pending(rp)
            self._control.ensure_handshake(rp.remote)
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
            self._control.release(p.rp.remote, p.rp.remote_request_id, 0)
            if p.load is not None:
                self._out.failed_recving[rid] = "cancelled"
        # Reads start before this step's forward pass, and new arrivals are heartbeaten during it.
        self._progress(poll=False)

    def on_arrival(self, request_id: str, params: dict[str, Any]) -> None:
        """Input thread: a remote-prefill request reached this process. Its lease is heartbeaten from
        now, even while the engine thread is busy with a long step and has not seen it yet."""
        if self.role != "decode":
            return
        try:
            parsed = remote_prefill_params(params)
        except msgspec.ValidationError:
            return  # the scheduler side reports it
        if parsed is not None:
            self._control.arrived(RemotePrefill.of(request_id, parsed))

    def _post_read(self, p: _Pending, peer: Peer) -> None:
        assert p.load is not None
        local = np.asarray(p.load.local_block_ids, dtype=np.int64)
        remote = np.asarray(p.load.remote_block_ids, dtype=np.int64)
        lk = np.arange(self.num_layers * 2, dtype=np.int64)[:, None]
        # [num_layers * 2, n] descriptor indices, flattened layer-major so runs stay adjacent
        local_idx = (lk * self.num_blocks + local).reshape(-1)
        remote_idx = (lk * peer.num_blocks + remote).reshape(-1)
        p.handle, status = self.nixl.read(self._local, local_idx, peer.dlist, remote_idx)
        if status == "ERR":
            self._control.peer_failed(p.rp.remote, "NIXL could not post the read (peer gone?)")
            self._finish(p, "NIXL could not post the read")

    def _finish(self, p: _Pending, error: str | None) -> None:
        rid = p.rp.request_id
        if p.handle is not None and not self.nixl.release(p.handle) and error is not None \
                and time.monotonic() < p.deadline + self.config.kv_lease_seconds + 10:
            return  # NIXL could not cancel it: keep the blocks until the reclaim deadline
        del self._pending[rid]
        self._control.forget_lease(p.rp.remote_request_id)
        n = len(p.load.local_block_ids) if p.load is not None and error is None else 0
        self._control.release(p.rp.remote, p.rp.remote_request_id, n)
        if error is None:
            logger.info("read %d blocks of %s in %.1f ms (waited %.1f s since arrival)", n, rid,
                        (time.monotonic() - p.t0) * 1000, time.monotonic() - p.arrival)
            self._out.finished_recving.append(rid)
            self._out.received_blocks += n
            self._out.transfer_seconds.append(time.monotonic() - p.t0)
        else:
            logger.warning("request %s: KV load failed: %s", rid, error)
            self._out.failed_recving[rid] = error

    def _try_post(self, p: _Pending, now: float, expired: set[str]) -> bool:
        """A load whose read is not posted yet: post it once its peer is ready and its lease confirmed,
        or fail it. Returns True when it waits on a lease confirmation (ask for a heartbeat now)."""
        # A read is posted only while its lease is known to hold for another heartbeat interval, so that
        # the prefill engine cannot free (and reuse) the blocks between our last heartbeat and the read.
        state, confirmed = self._control.read_state(p.rp, now + self._control.hb_interval)
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
            return True
        return False

    def _poll_read(self, p: _Pending, now: float) -> None:
        status = self.nixl.check(p.handle)
        if status == "DONE" and p.lease_lost:
            # The bytes may come from blocks that were freed and reused under the read: never use them.
            self._finish(p, "the prefill engine's lease ran out during the read")
        elif status == "DONE":
            self._finish(p, None)
        elif status == "ERR":
            self._control.peer_failed(p.rp.remote, "NIXL read failed")
            self._finish(p, "NIXL read failed")
        elif now > p.deadline:
            self._finish(p, f"KV read did not finish in {p.deadline - p.t0:.0f}s")

    def _progress(self, poll: bool) -> None:
        """Post the reads whose peer is ready, poll posted ones (`poll`), refresh the heartbeat set."""
        now = time.monotonic()
        expired = self._control.take_expired()
        ask_heartbeat = False
        for p in list(self._pending.values()):
            if p.rp.remote_request_id in expired and p.handle is not None:
                p.lease_lost = True
            if p.load is None:
                continue
            if p.handle is None:
                ask_heartbeat = self._try_post(p, now, expired) or ask_heartbeat
            elif poll:
                self._poll_read(p, now)
        self._control.heartbeat({p.rp.remote_request_id: p.rp.remote for p in self._pending.values()}, now,
                                ask_heartbeat)

    def get_finished(self) -> KVConnectorOutput:
        if self._server is not None:
            while True:
                try:
                    ev = self._server.events.get_nowait()
                except queue.Empty:
                    break
                if isinstance(ev, Heartbeat):
                    self._out.heartbeats.extend(ev.ids)
                else:
                    self._out.released.append((ev.request_id, ev.num_blocks))
        self._progress(poll=True)
        out, self._out = self._out, KVConnectorOutput()
        return out

    @property
    def transfers_in_flight(self) -> bool:
        return any(p.load is not None for p in self._pending.values())

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def shutdown(self) -> None:
        self._control.close()
        if self._server is not None:
            self._server.close()
        self.nixl.close()
