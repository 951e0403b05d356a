"""Endpoints and pools: who can serve, whether they are admitted, and the load counted at dispatch."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from tandem_router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)


class PoolKind(StrEnum):
    """Which pool an endpoint serves in; the value is the `role` label on the router's metrics."""

    PREFILL = "prefill"
    DECODE = "decode"  # a decode engine, or a colocated one when there is no prefill pool


@dataclass(eq=False)
class Endpoint:
    url: str  # base URL without a trailing slash, e.g. http://10.0.0.7:8000
    role: PoolKind
    healthy: bool = False
    consecutive_failures: int = 0
    in_flight_requests: int = 0
    in_flight_tokens: int = 0  # prompt + max output tokens of the requests in flight, counted at dispatch
    served: int = 0
    ejections: int = 0
    last_error: str | None = field(default=None, repr=False)
    # From the engine's KV events when it publishes its load there (kv_index.py), else from its /metrics
    # when the router scrapes them (health.py): None until then.
    engine_queue: int | None = None  # vllm:num_requests_running + vllm:num_requests_waiting
    kv_usage: float | None = None  # vllm:kv_cache_usage_perc, 0-1
    load_from_events: bool = False  # engine_queue and kv_usage come from KV events; scrapes leave them
    max_num_seqs: int | None = None  # tandem:engine_max_num_seqs: requests the engine runs at once
    # What the engine's /health says it is (REVISION_HEADER; "" when it says nothing; None until a health check
    # has asked): KV moves only between a prefill and a decode engine of one (known) revision.
    revision: str | None = None

    def acquire(self, tokens: int) -> None:
        self.in_flight_requests += 1
        self.in_flight_tokens += tokens
        self.served += 1

    def release(self, tokens: int) -> None:
        self.in_flight_requests -= 1
        self.in_flight_tokens -= tokens


REVISION_HEADER = "X-Tandem-Revision"  # on an engine's /health answer (docs/contracts.md)

# Called with (endpoint, admitted) whenever an endpoint is ejected or re-admitted.
HealthListener = Callable[[Endpoint, bool], None]


class Pool:
    """The endpoints of one kind (prefill or decode). Discovery sets the membership, health checks set `healthy`."""

    def __init__(self, role: PoolKind, index_capacity_blocks: int, checked: bool = True) -> None:
        """`checked`: health checks run and tell each endpoint's revision; without them every endpoint is
        taken to be of one revision ("")."""
        self.role = role
        self.checked = checked
        self.endpoints: dict[str, Endpoint] = {}
        self.index = PrefixIndex(index_capacity_blocks)
        self.listeners: list[HealthListener] = []

    def healthy(self, revision: str | None = None) -> list[Endpoint]:
        """The admitted endpoints (of `revision` only, when one is given)."""
        return [e for e in self.endpoints.values() if e.healthy and (revision is None or e.revision == revision)]

    def set_urls(self, urls: list[str], healthy: bool) -> None:
        """Make the membership exactly `urls`; new endpoints start with `healthy`, known ones keep state."""
        wanted = {u.rstrip("/") for u in urls}
        for url in sorted(set(self.endpoints) - wanted):
            ep = self.endpoints.pop(url)
            self.index.remove_endpoint(url)
            logger.info("[discovery] %s endpoint %s removed", self.role.value, url)
            if ep.healthy:
                ep.healthy = False
                self._notify(ep, False)
        for url in sorted(wanted - set(self.endpoints)):
            ep = Endpoint(url=url, role=self.role, healthy=healthy, revision=None if self.checked else "")
            self.endpoints[url] = ep
            logger.info("[discovery] %s endpoint %s added", self.role.value, url)
            self._notify(ep, healthy)

    def eject(self, ep: Endpoint, reason: str) -> None:
        ep.last_error = reason
        if ep.healthy:
            ep.healthy = False
            ep.ejections += 1
            # An engine that failed has most likely lost its cache (restart): forget what it held.
            self.index.remove_endpoint(ep.url)
            logger.warning("[health] %s endpoint %s ejected: %s", self.role.value, ep.url, reason)
            self._notify(ep, False)

    def admit(self, ep: Endpoint) -> None:
        ep.consecutive_failures = 0
        if not ep.healthy and ep.url in self.endpoints:
            ep.healthy = True
            logger.info("[health] %s endpoint %s admitted", self.role.value, ep.url)
            self._notify(ep, True)

    def _notify(self, ep: Endpoint, admitted: bool) -> None:
        for listener in self.listeners:
            listener(ep, admitted)
