"""The KV connector contract: a scheduler side and a worker side (vLLM's KVConnectorBase_V1 split).

The scheduler side decides which blocks move and owns their accounting (leases on prefill, loads on
decode); it hands the worker side one `KVConnectorMetadata` per step. The worker side owns the
transport (registration, handshakes, reads, notifications) and answers with a `KVConnectorOutput`:
every load is reported done or failed exactly once. Both run in the EngineCore process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem_engine.kv_transfer.messages import RemotePrefillParams
from tandem_engine.request import Request


@dataclass(frozen=True)
class RemoteEngine:
    """A prefill engine as named in `kv_transfer_params`; the boot nonce is part of `engine_id`."""

    engine_id: str
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"


@dataclass
class RemotePrefill:
    """The decode side's view of one request's remote KV (its `RemotePrefillParams`)."""

    request_id: str
    remote: RemoteEngine
    remote_request_id: str
    remote_block_ids: list[int]
    block_size: int  # 0: not stated

    @classmethod
    def of(cls, request_id: str, params: RemotePrefillParams) -> RemotePrefill:
        return cls(request_id, RemoteEngine(params.remote_engine_id, params.remote_host, params.remote_port),
                   params.remote_request_id, params.remote_block_ids, params.block_size)


@dataclass
class LoadSpec:
    """Read `remote_block_ids[i]` into `local_block_ids[i]` (same length, prompt order)."""

    request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]


@dataclass
class KVConnectorMetadata:
    """Scheduler side -> worker side, once per step."""

    new_remote: list[RemotePrefill] = field(default_factory=list)  # arrived: heartbeat from now on
    loads: list[LoadSpec] = field(default_factory=list)  # blocks allocated: start reading
    cancels: list[str] = field(default_factory=list)  # ended on decode before or during the load


@dataclass
class KVConnectorOutput:
    """Worker side -> scheduler side, once per step."""

    finished_recving: list[str] = field(default_factory=list)
    failed_recving: dict[str, str] = field(default_factory=dict)  # request id -> reason
    released: list[tuple[str, int]] = field(default_factory=list)  # prefill: (request id, blocks read)
    heartbeats: list[str] = field(default_factory=list)  # prefill: request ids whose lease is extended
    received_blocks: int = 0
    transfer_seconds: list[float] = field(default_factory=list)


@dataclass
class KVTransferStats:
    held_blocks: int = 0
    sent_blocks: int = 0
    received_blocks: int = 0
    failures: int = 0
    expired_leases: int = 0
    seconds: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class LeaseCounts:
    """A prefill engine's leases: held now, and released or expired since it started."""
    held: int = 0
    held_blocks: int = 0
    released: int = 0
    expired: int = 0


class KVConnectorScheduler(ABC):
    """Scheduler side: block accounting only, never the transport."""

    @abstractmethod
    def on_new_request(self, req: Request) -> None:
        """A request arrived; a remote-prefill one starts its lease heartbeats now."""

    @abstractmethod
    def remote_blocks_to_load(self, req: Request, num_local_hit_tokens: int) -> int:
        """How many of the request's blocks, after the local prefix hit, to read from a remote engine
        (0: compute locally). Only asked once per request."""

    @abstractmethod
    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_local_hit_blocks: int) -> None:
        """Blocks for the request are allocated: record the load into `block_ids[num_local_hit_blocks:]`."""

    @abstractmethod
    def request_finished(self, req: Request, block_ids: list[int]) -> dict[str, Any] | None:
        """A request finished; returns `kv_transfer_params` (`RemotePrefillParams` as the plain dict the
        ZMQ and HTTP layers carry) when its blocks are held for a remote decode (the caller must not free
        them), None when the caller frees them at once."""

    @abstractmethod
    def request_ended_early(self, req: Request) -> bool:
        """A request ended (abort, error) on this engine before any load of it reported. Returns False
        when a transfer may still write its blocks: the caller frees them only once the load reports."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata: ...

    @abstractmethod
    def update_from_output(self, out: KVConnectorOutput, now: float) -> list[Request]:
        """Apply release notifications, heartbeats and lease expiry (every lease is scanned); returns
        the held requests whose blocks the caller frees now."""

    @abstractmethod
    def take_stats(self) -> KVTransferStats:
        """Counters since the previous call (and the held-blocks gauge)."""

    @abstractmethod
    def next_deadline(self) -> float | None:
        """Monotonic time of the next lease expiry, if any blocks are held."""

    @property
    @abstractmethod
    def num_held_blocks(self) -> int: ...

    @property
    @abstractmethod
    def leases(self) -> LeaseCounts: ...


class KVConnectorWorker(ABC):
    """Worker side: registration, handshakes, transfers and notifications."""

    engine_id: str  # includes a boot nonce

    @abstractmethod
    def register_kv_caches(self, kv_pool: torch.Tensor) -> None:
        """Register the whole pool `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` once."""

    @abstractmethod
    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """Called from connector threads when the engine loop has connector work to pick up."""

    @abstractmethod
    def on_arrival(self, request_id: str, params: dict[str, Any]) -> None:
        """Called from the input thread as a request reaches the process (before the scheduler), with the
        request's `kv_transfer_params` as received."""

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None: ...

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput: ...

    @property
    @abstractmethod
    def transfers_in_flight(self) -> bool:
        """True while a load is handshaking or reading (the engine loop then polls)."""

    @property
    @abstractmethod
    def has_pending(self) -> bool:
        """True while any remote-prefill request has not had its load reported (heartbeats go on)."""

    @abstractmethod
    def shutdown(self) -> None: ...
