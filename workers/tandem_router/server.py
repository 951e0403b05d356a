"""The router's HTTP surface: the engines' OpenAI API, plus /health, /metrics and optional API-key auth."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from tandem_router.config import RouterConfig
from tandem_router.migration import can_migrate, relay_resumable, relay_whole, with_token_ids
from tandem_router.pd import ClientErrorFromPrefill, open_pd
from tandem_router.policies import RoutingRequest
from tandem_router.proxy import NoEndpoint, error_response, open_upstream, relay
from tandem_router.request import BadRequest, Kind, ParsedRequest, parse_request
from tandem_router.router import Router

logger = logging.getLogger(__name__)

ROUTER_KEY: web.AppKey[Router] = web.AppKey("router", Router)
OPEN_PATHS = frozenset({"/health", "/metrics"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _auth_middleware(api_key: str) -> Middleware:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return web.json_response(
                    {
                        "error": {
                            "message": "invalid or missing API key",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": "invalid_api_key",
                        }
                    },
                    status=401,
                )
        return await handler(request)

    return auth


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    t_start = time.perf_counter()
    try:
        parsed = parse_request(kind, await request.read())
    except BadRequest as e:
        return error_response(400, str(e), "invalid_request_error", e.param)
    # A slot from before dispatch to the answer's end, however it ends; or a 429 (docs/operations.md, "Overload").
    async with router.admission.slot(parsed, request):
        return await _dispatch(request, router, parsed, t_start)


async def _dispatch(request: web.Request, router: Router, parsed: ParsedRequest, t_start: float) -> web.StreamResponse:
    cfg = router.config
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    rreq = await router.routing_request(parsed, request.headers.get(cfg.session_header))
    # Only what the engine needs crosses: no client Authorization (the engines know no API key).
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    route = request.path
    # A stream that may be resumed elsewhere asks its engine for token ids (docs/architecture.md).
    resumable = cfg.max_migrations > 0 and can_migrate(parsed)
    sent = parsed
    if resumable:
        body = with_token_ids(parsed.body)
        sent = dataclasses.replace(parsed, body=body, raw=json.dumps(body).encode())
    try:
        while True:
            try:
                if router.pd_mode:
                    up = await open_pd(router, route, sent, rreq, headers, t_start)
                else:
                    up = await open_upstream(router, router.decode, route, sent.raw, rreq, headers, t_start=t_start)
                break
            except NoEndpoint as e:
                if not await router.admission.hold_again(e, t_start, request_id):
                    raise
    except NoEndpoint as e:
        router.metrics.requests.labels(route, "", str(e.status)).inc()
        return e.response()
    except ClientErrorFromPrefill as e:
        router.metrics.requests.labels(route, "", str(e.status)).inc()
        return web.Response(body=e.body, status=e.status, content_type="application/json")
    except asyncio.CancelledError:  # the client left before any engine answered
        router.metrics.client_disconnects.inc()
        logger.info("client of request %s went away before the first byte", request_id)
        raise
    url = up.endpoint.url
    if resumable:
        # A P/D answer that errs before its first token is replayed with local prefill (the body without
        # kv_transfer_params, which `sent` never carries: the P/D flow adds them).
        replay = (route, sent.raw) if router.pd_mode else None
        resp = await relay_resumable(router, request, up, parsed, rreq, headers, request_id, t_start, replay)
    elif not parsed.stream and cfg.max_migrations > 0:
        resp = await relay_whole(router, request, up, parsed, route, rreq, headers, request_id, t_start)
    else:
        resp = await relay(router, request, up, request_id, t_start)
    router.metrics.requests.labels(route, url, str(resp.status)).inc()
    router.metrics.latency.labels(url).observe(time.perf_counter() - t_start)
    return resp


async def route_only(request: web.Request) -> web.Response:
    """`POST /route/v1/...`: the decision this router would take for the request now, without sending
    it (docs/contracts.md): where, why, and what the index holds where."""
    router = request.app[ROUTER_KEY]
    kind: Kind = "chat" if request.path.endswith("/chat/completions") else "completions"
    try:
        parsed = parse_request(kind, await request.read())
    except BadRequest as e:
        return error_response(400, str(e), "invalid_request_error", e.param)
    rreq = await router.routing_request(parsed, request.headers.get(router.config.session_header))
    pool = router.decode
    candidates = sorted(pool.healthy(), key=lambda e: e.url)
    if not candidates:
        return NoEndpoint("no healthy decode endpoint").response()
    d = router.choose(pool, router.admission.under_cap(candidates), rreq, record=False)
    view = d.view
    body = {
        "pool": pool.role.value,
        "endpoint": d.endpoint.url,
        "reason": d.reason,
        "policy": router.policies[pool.role].name,
        "prompt_tokens": rreq.prompt_tokens,
        "exact": bool(view and view.exact),
        "cached_tokens": {u: view.cached_tokens(u) for u in view.matches} if view else {},
        "candidates": d.scores,
    }
    return web.json_response(body)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Model list, tokenize, detokenize: answered by any healthy decode (or colocated) endpoint."""
    router = request.app[ROUTER_KEY]
    data = await request.read() if request.method == "POST" else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    try:
        up = await open_upstream(
            router,
            router.decode,
            request.path,
            data or b"",
            RoutingRequest([], 0, 0),
            headers,
            method=request.method,
        )
    except NoEndpoint as e:
        return e.response()
    return await relay(router, request, up, request.headers.get("X-Request-Id", ""), time.perf_counter())


async def health(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    body = {
        "decode": {e.url: e.healthy for e in router.decode.endpoints.values()},
        "prefill": {e.url: e.healthy for e in router.prefill.endpoints.values()},
    }
    # While it holds requests for an engine to come (scale from zero), the router itself is ready: a
    # readiness probe on this path must keep it in its Service, or the first request never reaches it.
    status = 200 if router.decode.healthy() or router.admission.holds else 503
    return web.Response(text=json.dumps(body), status=status, content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    return web.Response(body=router.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})


def build_app(config: RouterConfig) -> web.Application:
    middlewares: list[Middleware] = [_auth_middleware(config.api_key)] if config.api_key else []
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    router = Router(config)
    app[ROUTER_KEY] = router

    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        await router.start()
        yield
        await router.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/route/v1/completions", route_only)
    app.router.add_post("/route/v1/chat/completions", route_only)
    app.router.add_get("/v1/models", passthrough)
    app.router.add_post("/tokenize", passthrough)
    app.router.add_post("/detokenize", passthrough)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def start_server(config: RouterConfig) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (await `runner.cleanup()` to stop) and the bound port."""
    app = build_app(config)
    # handler_cancellation: a client that disconnects cancels its handler, which closes the upstream legs.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    await site.start()
    port = config.port
    for addr in runner.addresses:  # the bound port, when config.port was 0
        port = int(addr[1])
    return runner, port
