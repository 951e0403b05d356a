"""Active health checks: `GET /health` on every endpoint; consecutive failures eject, a success re-admits.

The proxy also ejects an endpoint at once when a connection to it is refused or cut; these checks then
bring it back when it answers again, e.g. after its pod or process restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tandem_router.config import RouterConfig
from tandem_router.pool import REVISION_HEADER, Endpoint, Pool

logger = logging.getLogger(__name__)
ENGINE_LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                       "tandem:engine_max_num_seqs")


class EngineCaps(Protocol):
    """Admission's part in health checks: whether they read the engines' caps, and a nudge when a cap grew."""

    @property
    def reads_engine_caps(self) -> bool: ...
    def poll(self) -> None: ...


class CheckedRouter(Protocol):
    """What health checks use of the router: both pools, the session, and where a check's findings go."""

    @property
    def config(self) -> RouterConfig: ...
    @property
    def session(self) -> aiohttp.ClientSession: ...
    @property
    def decode(self) -> Pool: ...
    @property
    def prefill(self) -> Pool: ...
    @property
    def scrapes_engine_load(self) -> bool: ...
    @property
    def admission(self) -> EngineCaps: ...
    def note_revision(self, ep: Endpoint, revision: str) -> None: ...


class HealthChecker:
    def __init__(self, router: CheckedRouter) -> None:
        self.router = router
        self._task: asyncio.Task[None] | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    async def start(self) -> None:
        """The first round of checks runs before this returns (endpoints start unadmitted, so until then
        the router could only answer 503), then the rest every `health_interval` on a task."""
        if self.router.config.health_interval > 0:
            await self.check_all()
            self._task = asyncio.create_task(self._run(), name="health-checks")
        if self.router.scrapes_engine_load and self.router.config.load_interval > 0:
            self._load_task = asyncio.create_task(self._scrape_loads(), name="load-scrapes")

    def poke(self) -> None:
        """Check soon (an endpoint was added or ejected) instead of at the next interval."""
        self._wake.set()

    async def stop(self) -> None:
        for task in (self._task, self._load_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._load_task = None

    async def _scrape_loads(self) -> None:
        """The prefix-aware score weighs each engine's queue: read it every `load_interval` (more often
        than health checks), so that router replicas see each other's requests soon after they land.
        Engines whose KV events carry their load are not scraped here (health checks still read caps)."""
        while True:
            await asyncio.gather(*(self.scrape_load(ep) for pool in (self.router.decode, self.router.prefill)
                                   for ep in pool.healthy() if not ep.load_from_events))
            await asyncio.sleep(self.router.config.load_interval)

    async def _run(self) -> None:
        interval = self.router.config.health_interval
        while True:
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)
            if self._wake.is_set():
                await asyncio.sleep(min(0.2, interval))  # coalesce bursts of pokes
            await self.check_all()

    async def check_all(self) -> None:
        checks = [
            self.check(pool, ep)
            for pool in (self.router.decode, self.router.prefill)
            for ep in list(pool.endpoints.values())
        ]
        if checks:
            await asyncio.gather(*checks)

    async def check(self, pool: Pool, ep: Endpoint) -> bool:
        cfg = self.router.config
        reason = ""
        try:
            timeout = aiohttp.ClientTimeout(total=cfg.health_timeout)
            async with self.router.session.get(ep.url + "/health", timeout=timeout) as resp:
                await resp.read()
                ok = resp.status == 200
                reason = f"/health answered {resp.status}"
                if ok:
                    self.router.note_revision(ep, resp.headers.get(REVISION_HEADER, ""))
        except (TimeoutError, aiohttp.ClientError) as e:
            ok = False
            reason = f"/health failed: {type(e).__name__}"
        if ok:
            reads = self.router.scrapes_engine_load or self.router.admission.reads_engine_caps
            if reads and (not ep.healthy or self._load_task is None):
                # Before admitting: queued and held requests are released against its real slot count.
                await self.scrape_load(ep)
            pool.admit(ep)
        else:
            ep.consecutive_failures += 1
            if ep.consecutive_failures >= cfg.health_failures:
                pool.eject(ep, reason)
        return ok

    async def scrape_load(self, ep: Endpoint) -> None:
        """The engine's own queue and KV usage, for the prefix-aware policy's score, and how many requests
        it runs at once, for admission control (stale when it fails)."""
        try:
            timeout = aiohttp.ClientTimeout(total=self.router.config.health_timeout)
            async with self.router.session.get(ep.url + "/metrics", timeout=timeout) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
            return
        samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name in ENGINE_LOAD_METRICS}
        if ep.load_from_events:
            pass  # the engine's KV events carry fresher numbers
        elif "vllm:num_requests_running" in samples:
            ep.engine_queue = int(samples["vllm:num_requests_running"] + samples.get("vllm:num_requests_waiting", 0))
            ep.kv_usage = samples.get("vllm:kv_cache_usage_perc", ep.kv_usage)
        if "tandem:engine_max_num_seqs" in samples:
            ep.max_num_seqs = int(samples["tandem:engine_max_num_seqs"])
            self.router.admission.poll()  # a larger cap may admit queued requests now
