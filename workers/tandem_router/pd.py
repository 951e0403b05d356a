"""The prefill -> decode flow (docs/architecture.md, "The P/D request flow"), decided per request.

The decode endpoint is picked first (by the decode policy: with prefix-aware, a conversation's next
turn goes where its KV already is), so the router knows how much of the prompt that endpoint already
holds, exactly when the engines publish KV events. Engines report a revision (the operator's shared
configuration and image): KV moves only between a prefill and a decode endpoint of one revision, so the
decode endpoint is one of a revision that has a prefill endpoint up, where there is one, and the prefill
leg goes to one of its revision; a decode endpoint whose revision has none prefills locally.
When the uncached part is short (at most `remote_prefill_threshold` tokens), or no prefill
endpoint is healthy, or the request asks for several sequences (`n`, `best_of`, a batch of prompts),
decode prefills locally. Otherwise a prefill endpoint computes the prompt with
`max_tokens=1` and returns `kv_transfer_params`, which go to decode with the original request. A prefill
that fails or returns no params falls back to local prefill: the client still gets its answer.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Protocol

import aiohttp
import msgspec

from tandem_router.policies import RoutingRequest
from tandem_router.pool import Endpoint, Pool
from tandem_router.proxy import NoEndpoint, Upstream, UpstreamRouter, open_upstream
from tandem_router.request import ParsedRequest, PrefillAnswer, RemotePrefillParams, decode_body, prefill_body

logger = logging.getLogger(__name__)
# A decode leg that failed with these took nothing in (refused, unreachable, overloaded, draining): safe to send
# again, as a whole request, to any decode endpoint.
FALLBACK_STATUS = frozenset({429, 502, 503})


class PDRouter(UpstreamRouter, Protocol):
    """What the P/D flow uses of the router besides sending: both pools and the revision pairing."""

    @property
    def decode(self) -> Pool: ...
    @property
    def prefill(self) -> Pool: ...
    def paired(self, decodes: list[Endpoint]) -> list[Endpoint]: ...


class ClientErrorFromPrefill(Exception):
    """Prefill rejected the request itself (4xx): the client gets that answer, decode is not tried."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


async def run_prefill(
    router: PDRouter, path: str, req: ParsedRequest, rreq: RoutingRequest, headers: dict[str, str], revision: str
) -> RemotePrefillParams | None:
    """The prefill leg, on a prefill endpoint of `revision` (the decode endpoint's); returns the
    `kv_transfer_params` to hand to decode, or None to prefill locally."""
    payload = json.dumps(prefill_body(req)).encode()
    t0 = time.perf_counter()
    try:
        up: Upstream = await open_upstream(
            router, router.prefill, path, payload, rreq, headers, tokens=rreq.prompt_tokens, revision=revision
        )
    except NoEndpoint as e:
        logger.warning("remote prefill failed, decode prefills locally: %s", e)
        return None
    try:
        body = await up.resp.read()
        status = up.resp.status
    except (TimeoutError, aiohttp.ClientError) as e:
        logger.warning("prefill endpoint %s failed mid-answer, decode prefills locally: %s", up.endpoint.url, e)
        router.metrics.upstream_requests.labels("prefill", up.endpoint.url, "broken").inc()
        return None
    finally:
        up.close()
    router.metrics.upstream_requests.labels("prefill", up.endpoint.url, str(status)).inc()
    router.metrics.prefill_latency.labels(up.endpoint.url).observe(time.perf_counter() - t0)
    if 400 <= status < 500:
        raise ClientErrorFromPrefill(status, body)
    if status != 200:
        logger.warning("prefill endpoint %s answered %s, decode prefills locally", up.endpoint.url, status)
        return None
    try:
        params = msgspec.json.decode(body, type=PrefillAnswer).kv_transfer_params
    except msgspec.DecodeError as e:  # ValidationError included
        logger.warning("prefill endpoint %s returned unusable kv_transfer_params (%s); decode prefills locally",
                       up.endpoint.url, e)
        return None
    if params is None:
        # e.g. an engine without a KV connector: decode computes the prompt itself.
        logger.info("prefill endpoint %s returned no kv_transfer_params; decode prefills locally", up.endpoint.url)
    return params


async def open_pd(
    router: PDRouter,
    path: str,
    req: ParsedRequest,
    rreq: RoutingRequest,
    headers: dict[str, str],
    t_start: float,
) -> Upstream:
    decode = router.decode
    candidates = sorted(decode.healthy(), key=lambda e: e.url)
    if not candidates:
        raise NoEndpoint("no healthy decode endpoint")
    d = router.choose(decode, router.admission.under_cap(router.paired(candidates)), rreq)
    revision = d.endpoint.revision
    # Exact when the decode engines publish KV events and the prompt was tokenized; else an estimate.
    cached_tokens = d.view.cached_tokens(d.endpoint.url) if d.view is not None else 0
    uncached = max(0, rreq.prompt_tokens - cached_tokens)
    metrics = router.metrics
    if not req.one_sequence:  # n, best_of or a batch of prompts: KV from one prefill serves none of them
        metrics.pd_decisions.labels("local_several_sequences").inc()
        return await open_upstream(router, decode, path, req.raw, rreq, headers, first=d, t_start=t_start)
    if uncached <= router.config.remote_prefill_threshold:
        metrics.pd_decisions.labels("local_short_uncached").inc()
        return await open_upstream(router, decode, path, req.raw, rreq, headers, first=d, t_start=t_start)
    if revision is None or not router.prefill.healthy(revision):  # KV never moves between revisions
        reason = "local_no_prefill_of_revision" if router.prefill.healthy() else "local_no_prefill"
        metrics.pd_decisions.labels(reason).inc()
        return await open_upstream(router, decode, path, req.raw, rreq, headers, first=d, t_start=t_start)
    metrics.overhead.observe(time.perf_counter() - t_start)
    params = await run_prefill(router, path, req, rreq, headers, revision)
    if params is None:
        metrics.pd_decisions.labels("local_fallback").inc()
        return await open_upstream(router, decode, path, req.raw, rreq, headers, first=d)
    payload = json.dumps(decode_body(req, params)).encode()
    # A retry on another decode endpoint reads the same prefill engine's blocks: one of the same revision.
    try:
        up = await open_upstream(router, decode, path, payload, rreq, headers, first=d, revision=revision)
    except NoEndpoint as e:
        if e.status not in FALLBACK_STATUS:
            raise
        # No decode endpoint of the revision took it (the one chosen was draining before the router saw it go,
        # and it was its revision's last): nothing was answered yet, so another decode endpoint prefills it
        # itself. The prefill engine's blocks go back when its lease runs out.
        logger.warning("no decode endpoint of revision %r took the KV of prefill (%s); decode prefills locally",
                       revision, e)
        metrics.pd_decisions.labels("local_fallback").inc()
        return await open_upstream(router, decode, path, req.raw, rreq, headers)
    metrics.pd_decisions.labels("remote").inc()
    return up
