"""The NIXL connector's scheduler side: leases on a prefill engine, loads on a decode engine.

Prefill: a request sent with `do_remote_decode` that ends on its length cap keeps its blocks under a
lease (initial `kv_lease_seconds`, each heartbeat extends it to at least now + 2/3 of the lease); they
are freed on the decode engine's release notification or when the lease runs out, exactly once.
Decode: a request sent with `do_remote_prefill` reads only the blocks it does not already cache; its
blocks are never freed while a read may still write them.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from tandem_engine.config import EngineConfig
from tandem_engine.kv_transfer.interface import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVTransferStats,
    LeaseCounts,
    LoadSpec,
    RemotePrefill,
)
from tandem_engine.kv_transfer.messages import (
    DebugView,
    LeaseView,
    RemotePrefillParams,
    remote_prefill_params,
    wants_remote_decode,
)
from tandem_engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def new_engine_id(engine_index: int) -> str:
    """Host name, DP rank and a boot nonce: a restarted engine on the same address gets a new id."""
    return f"{socket.gethostname()}-dp{engine_index}-{uuid.uuid4().hex[:12]}"


@dataclass
class _Lease:
    req: Request
    num_blocks: int
    expiry: float  # monotonic


class NixlConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: EngineConfig, engine_id: str, side_channel_port: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.role = config.role
        self.engine_id = engine_id
        self.block_size = config.block_size
        self.lease_s = config.kv_lease_seconds
        self.host = config.kv_host
        self.port = side_channel_port
        self.clock = clock
        self._held: dict[str, _Lease] = {}
        self._remote: dict[str, RemotePrefill] = {}  # decode: arrived, blocks not yet allocated
        self._loading: set[str] = set()  # decode: load handed to the worker, not yet reported
        self._meta = KVConnectorMetadata()
        self._stats = KVTransferStats()
        self._released = self._expired = 0  # leases, since start

    # -- decode -------------------------------------------------------------------------------
    def on_new_request(self, req: Request) -> None:
        if self.role != "decode":
            return
        try:
            params = remote_prefill_params(req.kv_transfer_params)
        except msgspec.ValidationError as e:
            logger.warning("request %s: malformed kv_transfer_params (%s); prefilling locally",
                           req.request_id, e)
            req.kv_transfer_params = None
            return
        if params is None:
            return
        rp = RemotePrefill.of(req.request_id, params)
        if rp.block_size not in (0, self.block_size):
            logger.warning("request %s: remote block size %d != %d; prefilling locally",
                           req.request_id, rp.block_size, self.block_size)
            req.kv_transfer_params = None
            self._meta.new_remote.append(rp)
            self._meta.cancels.append(req.request_id)
            return
        self._remote[req.request_id] = rp
        self._meta.new_remote.append(rp)

    def _blocks_needed(self, req: Request) -> int:
        # The last prompt token is recomputed locally for its logits; blocks cover tokens before it.
        return -(-(req.num_prompt_tokens - 1) // self.block_size)

    def remote_blocks_to_load(self, req: Request, num_local_hit_tokens: int) -> int:
        rp = self._remote.get(req.request_id)
        if rp is None:
            return 0
        needed = self._blocks_needed(req)
        n = needed - num_local_hit_tokens // self.block_size
        if len(rp.remote_block_ids) < needed:
            logger.warning("request %s: prefill sent %d blocks, %d needed; prefilling locally",
                           req.request_id, len(rp.remote_block_ids), needed)
            n = 0
        if n <= 0:  # a full local prefix hit (or unusable params): nothing to read, release now
            del self._remote[req.request_id]
            req.kv_transfer_params = None
            self._meta.cancels.append(req.request_id)
            return 0
        return n

    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_local_hit_blocks: int) -> None:
        rp = self._remote.pop(req.request_id)
        needed = self._blocks_needed(req)
        self._meta.loads.append(LoadSpec(req.request_id, block_ids[num_local_hit_blocks:needed],
                                         rp.remote_block_ids[num_local_hit_blocks:needed]))
        self._loading.add(req.request_id)
        # At most one transfer per request: after a preemption it recomputes locally.
        req.kv_transfer_params = None

    def request_ended_early(self, req: Request) -> bool:
        rid = req.request_id
        if self._remote.pop(rid, None) is not None:
            self._meta.cancels.append(rid)
            return True
        if rid in self._loading:
            self._meta.cancels.append(rid)
            return False
        return True

    # -- prefill ------------------------------------------------------------------------------
    def request_finished(self, req: Request, block_ids: list[int]) -> dict[str, Any] | None:
        if (self.role != "prefill" or not wants_remote_decode(req.kv_transfer_params)
                or req.status is not RequestStatus.FINISHED_LENGTH or not block_ids):
            return None
        self._held[req.request_id] = _Lease(req, len(block_ids), self.clock() + self.lease_s)
        logger.info("[lease] holding %d blocks of %s for %.1fs", len(block_ids), req.request_id,
                     self.lease_s)
        params = RemotePrefillParams(
            remote_engine_id=self.engine_id, remote_request_id=req.request_id, remote_block_ids=list(block_ids),
            remote_host=self.host, remote_port=self.port, block_size=self.block_size,
            lease_seconds=self.lease_s)
        built: dict[str, Any] = msgspec.to_builtins(params)
        return built

    def update_from_output(self, out: KVConnectorOutput, now: float) -> list[Request]:
        freed: list[Request] = []
        for rid, n in out.released:
            lease = self._held.pop(rid, None)
            if lease is None:
                logger.info("[lease] release for unknown or expired request %s dropped", rid)
                continue
            self._stats.sent_blocks += n
            self._released += 1
            freed.append(lease.req)
        for rid in out.heartbeats:
            lease = self._held.get(rid)
            if lease is not None:
                lease.expiry = max(lease.expiry, now + self.lease_s * 2 / 3)
        # Heartbeats break expiry order, so every lease is scanned (vLLM #58222).
        for rid, lease in list(self._held.items()):
            if lease.expiry <= now:
                logger.warning("[lease] %s expired; freeing its %d blocks", rid, lease.num_blocks)
                del self._held[rid]
                self._stats.expired_leases += 1
                self._expired += 1
                freed.append(lease.req)
        for rid in out.finished_recving:
            self._loading.discard(rid)
        for rid in out.failed_recving:
            self._loading.discard(rid)
        self._stats.received_blocks += out.received_blocks
        self._stats.failures += len(out.failed_recving)
        self._stats.seconds.extend(out.transfer_seconds)
        return freed

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    def next_deadline(self) -> float | None:
        return min((lease.expiry for lease in self._held.values()), default=None)

    @property
    def num_held_blocks(self) -> int:
        return sum(lease.num_blocks for lease in self._held.values())

    @property
    def leases(self) -> LeaseCounts:
        return LeaseCounts(len(self._held), self.num_held_blocks, self._released, self._expired)

    def take_stats(self) -> KVTransferStats:
        stats, self._stats = self._stats, KVTransferStats()
        stats.held_blocks = self.num_held_blocks
        return stats

    def held_ids(self) -> set[str]:
        """Request ids under a lease; called from the side-channel thread (one atomic copy)."""
        return set(self._held)

    def debug_view(self) -> DebugView:
        """Held blocks per request, for the side channel's `Debug` call."""
        now = self.clock()
        return DebugView(self.engine_id, self.num_held_blocks,
                         {rid: LeaseView(lease.num_blocks, round(lease.expiry - now, 3))
                          for rid, lease in list(self._held.items())},
                         sorted(self._loading))
