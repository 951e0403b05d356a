"""Overload control: a bounded number of requests per decode endpoint, a bounded priority queue in
front of them, and 429 beyond it (docs/operations.md, "Overload").

A request holds its slot from before it is dispatched until its answer ends, however it ends, and the
policies are offered only the endpoints still under their cap. With `--cold-start-timeout` the same queue
holds requests while no decode endpoint is up (docs/operations.md, "Scale from zero").
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

from aiohttp import web

from tandem_router.config import RouterConfig
from tandem_router.metrics import RouterMetrics
from tandem_router.pool import Endpoint, Pool, PoolKind
from tandem_router.proxy import NoEndpoint, error_body
from tandem_router.request import ParsedRequest

logger = logging.getLogger(__name__)

DEFAULT_CAP = 64  # `tandem serve --max-num-seqs` by default, for engines that do not export theirs
HOLD_SMOOTHING = 0.1  # weight of the newest slot hold time in the running mean behind Retry-After
# Retry-After of a cold-start 503: a retry is held again, so retrying at once loses no time.
COLD_START_RETRY_AFTER = 1


class AdmissionRouter(Protocol):
    """What admission uses of the router: its settings, its metrics and the decode pool it caps."""

    @property
    def config(self) -> RouterConfig: ...
    @property
    def metrics(self) -> RouterMetrics: ...
    @property
    def decode(self) -> Pool: ...


@dataclass(order=True)
class Waiter:
    """A queued request; the heap orders by (priority, arrival). `fut` resolves True when the request
    is admitted, False when a higher-priority arrival pushed it out of a full queue."""

    priority: int
    seq: int
    arrived: float = field(compare=False)
    fut: asyncio.Future[bool] = field(compare=False)
    gone: bool = field(default=False, compare=False)  # left the queue, still in the heap until popped

    @property
    def live(self) -> bool:
        return not self.gone and not self.fut.done()


def request_priority(req: ParsedRequest) -> int:
    """The request's `priority` (an int; anything else counts as the default 0, and the engine judges it)."""
    p = req.body.get("priority", 0)
    return p if isinstance(p, int) and not isinstance(p, bool) else 0


class Slot:
    """One request's admission slot, held for the body of an `async with`."""

    def __init__(self, admission: Admission, priority: int, route: str) -> None:
        self.admission = admission
        self.priority = priority
        self.route = route
        self.since: float | None = None  # when the slot was taken

    async def __aenter__(self) -> None:
        if self.admission.queues:
            await self.admission.take(self.priority, self.route)
            self.since = time.perf_counter()

    async def __aexit__(self, *exc: object) -> None:
        if self.since is not None:
            self.admission.give_back(time.perf_counter() - self.since)
            self.since = None


class Admission:
    def __init__(self, router: AdmissionRouter) -> None:
        self.router = router
        self.config = router.config
        self.enabled = self.config.admission_control
        self.holds = self.config.cold_start_timeout > 0  # requests wait for a decode endpoint to exist
        self.last_arrival = 0.0  # Unix time of the last generation request
        self.admitted = 0  # requests holding a slot
        self.queued = 0  # live waiters in `_heap`
        self._heap: list[Waiter] = []
        self._seq = itertools.count()
        self._hold = 1.0  # running mean of how long a request holds its slot, seconds
        self._holds_seen = 0  # slot holds measured: the mean is a guess until the first
        metrics = router.metrics
        metrics.admission_capacity.set_function(self.capacity)
        metrics.admitted.set_function(lambda: self.admitted)
        metrics.queued.set_function(lambda: self.queued)
        metrics.held.set_function(lambda: self.queued if self.holding() else 0)
        metrics.last_request.set_function(lambda: self.last_arrival)
        # An endpoint admitted brings room; the last one ejected sends the queue on to its 503 (unless held).
        router.decode.listeners.append(lambda ep, admitted: self.poll())

    @property
    def queues(self) -> bool:
        """Whether requests take a slot, and wait for one: for the caps, for an engine to exist, or both."""
        return self.enabled or self.holds

    def holding(self) -> bool:
        """Whether requests are being held for want of any healthy decode endpoint."""
        return self.holds and not self.router.decode.healthy()

    @property
    def reads_engine_caps(self) -> bool:
        """Whether the health checks must scrape the engines' `tandem:engine_max_num_seqs`."""
        return self.enabled and self.config.max_in_flight_per_endpoint <= 0

    def cap(self, ep: Endpoint) -> int:
        return self.config.max_in_flight_per_endpoint or ep.max_num_seqs or DEFAULT_CAP

    def capacity(self) -> int:
        """Slots over the healthy decode endpoints."""
        return sum(self.cap(e) for e in self.router.decode.healthy())

    def under_cap(self, candidates: list[Endpoint]) -> list[Endpoint]:
        """The decode candidates still under their cap; all of them when none is (requests outside
        admission, such as /tokenize, can fill one) or for the prefill pool."""
        if not self.enabled or not candidates or candidates[0].role is not PoolKind.DECODE:
            return candidates
        return [e for e in candidates if e.in_flight_requests < self.cap(e)] or candidates

    def slot(self, req: ParsedRequest, request: web.Request) -> Slot:
        """`async with admission.slot(req, request):` holds a slot for the body, after waiting for one;
        entering raises `web.HTTPTooManyRequests` (the 429 answer) when the request is refused, or
        `web.HTTPServiceUnavailable` (503) when no decode endpoint came within `--cold-start-timeout`."""
        self.last_arrival = time.time()
        return Slot(self, request_priority(req), request.path)

    def _room(self) -> bool:
        healthy = self.router.decode.healthy()
        if not healthy:  # hold the request, or let it go on to the 503
            return not self.holds
        return not self.enabled or self.admitted < sum(self.cap(e) for e in healthy)

    def _patience(self) -> float:
        """How long after its arrival a queued request may still wait, in the pool's present state."""
        return self.config.cold_start_timeout if self.holding() else self.config.queue_timeout

    async def take(self, priority: int, route: str) -> None:
        arrived = time.perf_counter()
        if self.queued == 0 and self._room():
            self._admit(arrived)
            return
        if self.queued >= self.config.max_queued_requests and not self._push_out(priority):
            self._reject("queue_full", route)
        if self._foreseen_wait(priority) > self._patience():
            self._reject("queue_timeout_foreseen", route)
        w = Waiter(priority, next(self._seq), arrived, asyncio.get_running_loop().create_future())
        heapq.heappush(self._heap, w)
        self.queued += 1
        self.poll()
        try:
            admitted = await self._wait(w)
        except asyncio.CancelledError:  # the client went away while queued
            self.router.metrics.client_disconnects.inc()
            if self._leave_queue(w):  # ... just as it was admitted: the slot goes to the next
                self.give_back(0.0)
            raise
        if admitted is None:  # it waited as long as it may
            if self._leave_queue(w):
                return  # admitted as the time ran out
            if self.holding():
                self._unavailable(route)
            self._reject("queue_timeout", route)
        if not admitted:
            self._reject("queue_full", route)

    async def _wait(self, w: Waiter) -> bool | None:
        """`w`'s outcome, or None once it has waited its patience: that of the state the pool is in when
        the time is up (no engine: `--cold-start-timeout`; busy engines: `--queue-timeout`)."""
        deadline = w.arrived + self._patience()
        while True:
            # asyncio.wait, not a timeout around `await w.fut`: the future must outlive a deadline moved on.
            done, _ = await asyncio.wait((w.fut,), timeout=max(0.0, deadline - time.perf_counter()))
            if done:
                return w.fut.result()
            later = w.arrived + self._patience()
            if later <= time.perf_counter():
                return None
            deadline = later

    def _leave_queue(self, w: Waiter) -> bool:
        """`w` stops waiting; returns whether it had been admitted meanwhile (it then holds a slot)."""
        if w.fut.done() and not w.fut.cancelled():
            return w.fut.result()
        if not w.gone:
            w.gone = True
            self.queued -= 1
        return False

    async def hold_again(self, failure: NoEndpoint, arrived: float, request_id: str) -> bool:
        """A request whose engine could not take it after all, with that no decode endpoint left: a 502 (every
        try failed to connect) or a 503 (the last decode engine had begun to drain, as a DrainFirst rollout's
        does, before the router saw it leave). Wait again for one, within the request's
        `--cold-start-timeout` since `arrived` (perf_counter). True when one is admitted: try again;
        raises the held request's 503 when none comes in time."""
        if failure.status not in (502, 503) or not self.holding():
            return False
        logger.info("request %s: %s, and no decode endpoint is left: held again", request_id, failure)
        waited = self.config.cold_start_timeout
        # Woken by the pool's next admission, as queued requests are (nothing polls).
        admitted = asyncio.get_running_loop().create_future()

        def on_change(ep: Endpoint, up: bool) -> None:
            if up and not admitted.done():
                admitted.set_result(None)

        listeners = self.router.decode.listeners
        listeners.append(on_change)
        try:
            await asyncio.wait((admitted,), timeout=max(0.0, arrived + waited - time.perf_counter()))
        finally:
            listeners.remove(on_change)
        if not self.router.decode.healthy():
            self.router.metrics.rejected.labels("cold_start_timeout").inc()
            raise NoEndpoint(f"no healthy decode endpoint within {waited:g} s; the engines may be starting",
                             503, retry_after=str(COLD_START_RETRY_AFTER))
        return True

    def _push_out(self, priority: int) -> bool:
        """Make room in a full queue for a request of `priority` by refusing the last-arrived of the
        lowest priority queued, if that is lower than `priority`."""
        worst = max((w for w in self._heap if w.live), default=None)
        if worst is None or worst.priority <= priority:
            return False
        worst.gone = True
        self.queued -= 1
        worst.fut.set_result(False)
        return True

    def poll(self) -> None:
        """Admit queued requests, best first, while there is room."""
        while self._heap and self._room():
            w = heapq.heappop(self._heap)
            if w.live:
                self.queued -= 1
                self._admit(w.arrived)
                w.fut.set_result(True)
        if len(self._heap) > 2 * self.queued + 64:  # drop the entries of requests that left
            self._heap = [w for w in self._heap if w.live]
            heapq.heapify(self._heap)

    def _admit(self, arrived: float) -> None:
        self.admitted += 1
        self.router.metrics.queue_wait.observe(time.perf_counter() - arrived)

    def give_back(self, held: float) -> None:
        self.admitted -= 1
        if held > 0:
            # The first measurement replaces the starting guess; later ones move the mean.
            self._hold += (HOLD_SMOOTHING if self._holds_seen else 1.0) * (held - self._hold)
            self._holds_seen += 1
        self.poll()

    def _foreseen_wait(self, priority: int) -> float:
        """Seconds a request of `priority` arriving now would wait for a slot: the requests queued ahead of
        it (priority no lower) drain at `capacity / hold` a second, the estimate behind Retry-After. Zero
        while no slot hold has been measured (nothing to foresee from), or no decode endpoint is healthy
        (the wait is for an engine to come, bounded by --cold-start-timeout)."""
        slots = self.capacity()
        if not self._holds_seen or not slots or not self.enabled:
            return 0.0
        ahead = sum(1 for w in self._heap if w.live and w.priority <= priority)
        return (ahead + 1) * self._hold / slots

    def retry_after(self) -> int:
        """Seconds until the queue ahead of a new request has drained at the recent pace (at least 1)."""
        slots = max(1, self.capacity())
        return max(1, math.ceil((self.queued + 1) * self._hold / slots))

    def _unavailable(self, route: str) -> NoReturn:
        """A held request's 503: no decode endpoint came within `--cold-start-timeout`."""
        metrics = self.router.metrics
        metrics.rejected.labels("cold_start_timeout").inc()
        metrics.requests.labels(route, "", "503").inc()
        waited = self.config.cold_start_timeout
        logger.info("held request answered 503: no decode endpoint within %g s (%d held)", waited, self.queued)
        body = error_body(503, f"no healthy decode endpoint within {waited:g} s; the engines may be starting",
                          "service_unavailable")
        raise web.HTTPServiceUnavailable(text=json.dumps(body), content_type="application/json",
                                         headers={"Retry-After": str(COLD_START_RETRY_AFTER)})

    def _reject(self, reason: str, route: str) -> NoReturn:
        metrics = self.router.metrics
        metrics.rejected.labels(reason).inc()
        metrics.requests.labels(route, "", "429").inc()
        retry = self.retry_after()
        why = {"queue_full": "the router's queue is full",
               "queue_timeout_foreseen": f"no engine will have room within {self.config.queue_timeout:g} s "
                                         "at the recent pace"}.get(reason,
                                                                   f"no engine had room within "
                                                                   f"{self.config.queue_timeout:g} s")
        logger.debug("request refused (%s): %d admitted, %d queued", reason, self.admitted, self.queued)
        body = error_body(429, f"overloaded: {why}; retry in {retry} s", "rate_limit_exceeded")
        raise web.HTTPTooManyRequests(text=json.dumps(body), content_type="application/json",
                                      headers={"Retry-After": str(retry)})
