"""Active health checks: `GET /health` on every endpoint; consecutive failures eject, a success re-admits.

The proxy also ejects an endpoint at once when a connection to it is refused or cut; these checks then
bring it back when it answers again, e.g. after its pod or process restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import aiohttp

from tandem_router.pool import Endpoint, Pool

if TYPE_CHECKING:
    from tandem_router.router import Router

logger = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, router: Router) -> None:
        self.router = router
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        if self.router.config.health_interval > 0:
            self._task = asyncio.create_task(self._run(), name="health-checks")

    def poke(self) -> None:
        """Check soon (an endpoint was added or ejected) instead of at the next interval."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        interval = self.router.config.health_interval
        while True:
            self._wake.clear()
            await self.check_all()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)
            if self._wake.is_set():
                await asyncio.sleep(min(0.2, interval))  # coalesce bursts of pokes

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
        except (TimeoutError, aiohttp.ClientError) as e:
            ok = False
            reason = f"/health failed: {type(e).__name__}"
        if ok:
            pool.admit(ep)
        else:
            ep.consecutive_failures += 1
            if ep.consecutive_failures >= cfg.health_failures:
                pool.eject(ep, reason)
        return ok
