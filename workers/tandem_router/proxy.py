"""Sending one request to a pool and relaying the answer: retries, streaming, cancellation, timeouts.

A request is retried on another endpoint only while nothing has reached the client: on a refused or
dropped connection before the response headers, or on 429/502/503/504. Once the first byte is relayed
the endpoint is committed; if it dies mid-stream the client gets a clean SSE error event. A client that
goes away cancels the handler (the server runs with handler cancellation), and leaving the upstream
response's context closes that connection, which the engine sees as an abort.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from tandem_router.config import RouterConfig
from tandem_router.metrics import RouterMetrics
from tandem_router.policies import Decision, RoutingRequest
from tandem_router.pool import Endpoint, Pool, PoolKind

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({429, 502, 503, 504})


class CapFilter(Protocol):
    """Admission's part in choosing: the candidates still under their cap."""

    def under_cap(self, candidates: list[Endpoint]) -> list[Endpoint]: ...


class UpstreamRouter(Protocol):
    """What sending a request to a pool and relaying its answer use of the router."""

    @property
    def config(self) -> RouterConfig: ...
    @property
    def metrics(self) -> RouterMetrics: ...
    @property
    def session(self) -> aiohttp.ClientSession: ...
    @property
    def admission(self) -> CapFilter: ...
    def choose(self, pool: Pool, candidates: list[Endpoint], rreq: RoutingRequest) -> Decision: ...
    def acquire(self, ep: Endpoint, tokens: int) -> None: ...
    def release(self, ep: Endpoint, tokens: int) -> None: ...
    def pool(self, role: PoolKind) -> Pool: ...


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(status: int, message: str, type_: str = "router_error", param: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, type_, param), status=status)


class NoEndpoint(Exception):
    """Every try failed (or nothing was healthy); `status`/`body`/`retry_after` hold the last upstream answer."""

    def __init__(self, message: str, status: int = 503, body: bytes | None = None,
                 retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.retry_after = retry_after

    def response(self) -> web.Response:
        headers = {"Retry-After": self.retry_after} if self.retry_after else None
        if self.body is not None and self.status != 503:
            return web.Response(body=self.body, status=self.status, content_type="application/json",
                                headers=headers)
        resp = error_response(self.status, str(self), "service_unavailable" if self.status == 503 else "upstream_error")
        if headers:
            resp.headers.update(headers)
        return resp


@dataclass
class Upstream:
    """A response whose headers arrived; the endpoint's load stays acquired until `close()`."""

    decision: Decision
    resp: aiohttp.ClientResponse
    tokens: int
    router: UpstreamRouter
    closed: bool = False

    @property
    def endpoint(self) -> Endpoint:
        return self.decision.endpoint

    def headers(self, request_id: str) -> dict[str, str]:
        """The client's answer headers: its request id, and where the router sent it and why
        (`X-Tandem-Route: prefix_hit; endpoint=http://...; matched-blocks=12`, the policy's reason as in
        tandem:router_routing_decisions_total; the engine that began the answer when it migrated)."""
        d = self.decision
        return {"X-Request-Id": request_id,
                "X-Tandem-Route": f"{d.reason}; endpoint={d.endpoint.url}; matched-blocks={d.matched_blocks}"}

    def close(self) -> None:
        """Idempotent: the endpoint's load is released once."""
        if self.closed:
            return
        self.closed = True
        # An unfinished body (client gone, engine cut off) must not return its connection to the pool:
        # closing it is also what tells the engine to abort the request.
        if self.resp.content.at_eof():
            self.resp.release()
        else:
            self.resp.close()
        self.router.release(self.endpoint, self.tokens)


async def open_upstream(
    router: UpstreamRouter,
    pool: Pool,
    path: str,
    payload: bytes,
    rreq: RoutingRequest,
    headers: dict[str, str],
    first: Decision | None = None,
    tokens: int | None = None,
    method: str = "POST",
    t_start: float | None = None,
    exclude: set[str] | None = None,
    revision: str | None = None,
) -> Upstream:
    """Try endpoints of `pool` (but not those in `exclude`; only those of `revision` when given) until one
    answers with a status worth relaying."""
    metrics = router.metrics
    role = pool.role.value
    tokens = rreq.load_tokens if tokens is None else tokens
    tried: set[str] = set(exclude or ())
    last = NoEndpoint(f"no healthy {role} endpoint")
    for attempt in range(router.config.max_attempts):
        decision = first if attempt == 0 and first is not None and first.endpoint.healthy else None
        if decision is None:
            candidates = sorted((e for e in pool.healthy(revision) if e.url not in tried), key=lambda e: e.url)
            candidates = router.admission.under_cap(candidates)
            if not candidates:
                break
            decision = router.choose(pool, candidates, rreq)
        if attempt > 0:
            metrics.retries.labels(role).inc()
        ep = decision.endpoint
        tried.add(ep.url)
        router.acquire(ep, tokens)
        if t_start is not None and attempt == 0:
            metrics.overhead.observe(time.perf_counter() - t_start)
        try:
            resp = await router.session.request(method, ep.url + path, data=payload, headers=headers)
        except asyncio.CancelledError:
            router.release(ep, tokens)
            raise
        except (
            aiohttp.ClientConnectorError,
            aiohttp.ConnectionTimeoutError,
            aiohttp.ServerDisconnectedError,
        ) as e:
            # Refused, unreachable or dropped before answering: nothing reached the client, so try another.
            router.release(ep, tokens)
            metrics.upstream_requests.labels(role, ep.url, "connect_error").inc()
            pool.eject(ep, f"{type(e).__name__}: {e}")
            last = NoEndpoint(f"{role} endpoint {ep.url} failed: {type(e).__name__}", 502)
            continue
        except (TimeoutError, aiohttp.ClientError) as e:
            router.release(ep, tokens)
            metrics.upstream_requests.labels(role, ep.url, "timeout").inc()
            raise NoEndpoint(f"{role} endpoint {ep.url} did not answer: {type(e).__name__}", 504) from e
        if resp.status in RETRYABLE_STATUS:
            try:
                body = await resp.read()
            except (TimeoutError, aiohttp.ClientError):
                body = b""
            finally:
                resp.close()
                router.release(ep, tokens)
            metrics.upstream_requests.labels(role, ep.url, str(resp.status)).inc()
            if resp.status == 503:  # dead or draining engine; the health check re-admits it
                pool.eject(ep, "answered 503")
            last = NoEndpoint(f"{role} endpoint {ep.url} answered {resp.status}", resp.status, body or None,
                              resp.headers.get("Retry-After"))
            continue
        pool.index.insert(ep.url, rreq.block_hashes)
        if pool.role is PoolKind.DECODE and ep.revision is not None:
            metrics.revision_requests.labels(ep.revision).inc()
        return Upstream(decision, resp, tokens, router)
    raise last


def sse_error(status: int, message: str) -> bytes:
    event = json.dumps(error_body(status, message, "upstream_error"))
    return f"data: {event}\n\ndata: [DONE]\n\n".encode()


async def relay(
    router: UpstreamRouter, request: web.Request, up: Upstream, request_id: str, t_start: float
) -> web.StreamResponse:
    """Relay an upstream answer to the client; always closes `up`."""
    metrics = router.metrics
    ep = up.endpoint
    role = ep.role.value
    resp = up.resp
    try:
        if resp.content_type != "text/event-stream":
            try:
                body = await resp.read()
            except (TimeoutError, aiohttp.ClientError) as e:
                metrics.upstream_requests.labels(role, ep.url, "broken").inc()
                router.pool(ep.role).eject(ep, f"answer cut off: {type(e).__name__}")
                return error_response(502, f"endpoint {ep.url} failed mid-answer: {type(e).__name__}", "upstream_error")
            metrics.ttft.labels(ep.url).observe(time.perf_counter() - t_start)
            metrics.upstream_requests.labels(role, ep.url, str(resp.status)).inc()
            return web.Response(
                body=body,
                status=resp.status,
                content_type=resp.content_type,
                headers=up.headers(request_id),
            )
        out = web.StreamResponse(
            status=resp.status,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **up.headers(request_id)},
        )
        await out.prepare(request)
        first = True
        try:
            async for chunk in resp.content.iter_any():
                if first:
                    metrics.ttft.labels(ep.url).observe(time.perf_counter() - t_start)
                    first = False
                await out.write(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            logger.warning("endpoint %s died mid-stream (request %s): %s", ep.url, request_id, e)
            metrics.upstream_requests.labels(role, ep.url, "broken").inc()
            router.pool(ep.role).eject(ep, f"stream cut off: {type(e).__name__}")
            await out.write(sse_error(502, f"the engine serving this request failed mid-stream ({type(e).__name__})"))
        except (TimeoutError, aiohttp.SocketTimeoutError):
            metrics.upstream_requests.labels(role, ep.url, "timeout").inc()
            await out.write(sse_error(504, "the engine serving this request stopped sending"))
        else:
            metrics.upstream_requests.labels(role, ep.url, str(resp.status)).inc()
        await out.write_eof()
        return out
    except (ConnectionResetError, asyncio.CancelledError):
        metrics.client_disconnects.inc()
        logger.info("client of request %s went away; closing upstream %s", request_id, ep.url)
        raise
    finally:
        up.close()
