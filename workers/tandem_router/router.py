"""The Router object: pools, policies, the upstream HTTP session, metrics, health checks and discovery."""

from __future__ import annotations

import logging

import aiohttp

from tandem_router.config import RouterConfig
from tandem_router.discovery import Discovery, make_discovery
from tandem_router.health import HealthChecker
from tandem_router.metrics import RouterMetrics
from tandem_router.policies import Decision, Policy, PrefixAware, RoutingRequest, make_policy
from tandem_router.pool import Endpoint, Pool, PoolKind

logger = logging.getLogger(__name__)


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.decode = Pool(PoolKind.DECODE, config.index_capacity_blocks)
        self.prefill = Pool(PoolKind.PREFILL, config.index_capacity_blocks)
        self.policies: dict[PoolKind, Policy] = {
            PoolKind.DECODE: make_policy(config.decode_policy, config.load_factor, config.cold_key_blocks),
            PoolKind.PREFILL: make_policy(config.prefill_policy, config.load_factor, config.cold_key_blocks),
        }
        # Whether anything reads prompt block hashes: a prefix-aware pool or the P/D decider.
        may_disaggregate = bool(config.prefill_urls or config.prefill_selector)
        self.uses_prefix_index = may_disaggregate or any(isinstance(p, PrefixAware) for p in self.policies.values())
        for pool in (self.decode, self.prefill):
            pool.listeners.append(self._on_health_change)
        self.health = HealthChecker(self)
        self.discovery: Discovery = make_discovery(config)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Router.start() was not awaited"
        return self._session

    @property
    def pd_mode(self) -> bool:
        """There is a prefill pool: run the P/D flow (decode prefills locally while none is healthy).
        With Kubernetes discovery the pool is whatever prefill EndpointSlices exist right now."""
        return bool(self.prefill.endpoints)

    def pool(self, role: PoolKind) -> Pool:
        return self.prefill if role is PoolKind.PREFILL else self.decode

    async def start(self) -> None:
        c = self.config
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=30),
            timeout=aiohttp.ClientTimeout(
                total=c.request_timeout, sock_connect=c.connect_timeout, sock_read=c.read_timeout
            ),
            auto_decompress=False,
        )
        await self.discovery.start(self)
        self.health.start()
        logger.info(
            "[startup] router ready: decode=%s prefill=%s policies decode=%s prefill=%s",
            sorted(self.decode.endpoints),
            sorted(self.prefill.endpoints),
            c.decode_policy,
            c.prefill_policy,
        )

    async def stop(self) -> None:
        await self.health.stop()
        await self.discovery.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None
        logger.info("[shutdown] router stopped")

    def choose(self, pool: Pool, candidates: list[Endpoint], rreq: RoutingRequest) -> Decision:
        policy = self.policies[pool.role]
        d = policy.choose(candidates, rreq, pool.index)
        role = pool.role.value
        self.metrics.routing_decisions.labels(role, policy.name, d.endpoint.url, d.reason).inc()
        if rreq.block_hashes:
            matched = (
                d.matches.get(d.endpoint.url, 0)
                if d.matches
                else pool.index.match(rreq.block_hashes).get(d.endpoint.url, 0)
            )
            d.matched_blocks = matched
            self.metrics.prefix_hit_ratio.labels(role).observe(matched / len(rreq.block_hashes))
        return d

    def acquire(self, ep: Endpoint, tokens: int) -> None:
        ep.acquire(tokens)
        self._export_load(ep)

    def release(self, ep: Endpoint, tokens: int) -> None:
        ep.release(tokens)
        self._export_load(ep)

    def _export_load(self, ep: Endpoint) -> None:
        role = ep.role.value
        self.metrics.in_flight.labels(role, ep.url).set(ep.in_flight_requests)
        self.metrics.in_flight_tokens.labels(role, ep.url).set(ep.in_flight_tokens)

    def _on_health_change(self, ep: Endpoint, admitted: bool) -> None:
        self.metrics.healthy.labels(ep.role.value, ep.url).set(1 if admitted else 0)
        if not admitted:
            self.health.poke()  # new or ejected: check it now rather than at the next interval
