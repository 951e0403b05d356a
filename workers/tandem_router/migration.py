"""Mid-stream migration: a streamed answer survives the engine that was producing it.

The router keeps what the client has been sent (the prompt's token ids and the generated ones); when the
stream breaks after the first byte, it resumes the answer on another healthy engine of the pool from those
ids, and rewrites the new engine's chunks into the client's format. A whole answer whose engine breaks
before its body is read is sent again. See docs/architecture.md, "When something fails".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from tandem_router.policies import RoutingRequest
from tandem_router.pool import Pool
from tandem_router.proxy import NoEndpoint, Upstream, UpstreamRouter, error_body, error_response, open_upstream, relay
from tandem_router.request import ParsedRequest, token_limit

logger = logging.getLogger(__name__)


class MigrationRouter(UpstreamRouter, Protocol):
    """What migration uses of the router besides sending: the decode pool and the revision to resume on."""

    @property
    def decode(self) -> Pool: ...
    def revision_up(self, pool: Pool, revision: str | None, exclude: set[str]) -> str | None: ...


# Request fields a continuation carries over unchanged: they shape sampling and stopping the same way
# in both APIs. (Presence and frequency penalties count only output tokens, so a resumed request with
# them is not exact: its earlier output became prompt. docs/operations.md says so.)
CARRIED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "skip_special_tokens",
           "include_stop_str_in_output", "spaces_between_special_tokens", "priority", "user")


def constrained(req: ParsedRequest) -> bool:
    """A request whose answer follows a grammar or carries tool calls: it resumes as itself, on its own endpoint,
    with `resume_token_ids` (the engine starts the grammar and the tool-call parser after them)."""
    b = req.body
    fmt = b.get("response_format")
    return bool(b.get("structured_outputs")) or (isinstance(fmt, dict) and fmt.get("type", "text") != "text") \
        or (bool(b.get("tools")) and b.get("tool_choice") != "none")


def can_migrate(req: ParsedRequest) -> bool:
    """One streamed sequence without logprobs: what a continuation can reproduce chunk for chunk."""
    b = req.body
    return req.stream and req.one_sequence and not b.get("logprobs") and not b.get("top_logprobs") \
        and not b.get("echo") and not b.get("prompt_logprobs")


def with_token_ids(body: dict[str, Any]) -> dict[str, Any]:
    """The upstream body: the client's, asking for token ids (and usage, to count the whole answer)."""
    out = {**body, "return_token_ids": True}
    out["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return out


@dataclass
class StreamState:
    """What the client has seen of one streamed answer, across the engines that produced it."""

    kind: str  # completions | chat
    client_wants_ids: bool
    client_wants_usage: bool
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    first_id: str | None = None  # the answer's id and creation time, kept across engines
    created: int | None = None
    model: str | None = None
    finished: bool = False  # a finish_reason was sent
    done: bool = False  # [DONE] was sent
    migrations: int = 0
    resumed_from: int = 0  # ids generated before the current engine took over
    usage: dict[str, Any] | None = None
    as_itself: bool = False  # resumed on its own endpoint (`constrained`), its chunks already in the client's format

    def rewrite(self, event: dict[str, Any], resumed: bool) -> dict[str, Any] | None:
        """Record one upstream chunk and return it as the client must see it (None: send nothing)."""
        if self.first_id is None:
            self.first_id, self.created, self.model = event.get("id"), event.get("created"), event.get("model")
        # Prompt ids: at the top (chat) or on the choice (completions). A continuation's are the original
        # prompt plus what was generated: never the client's business.
        keep = self.client_wants_ids and not resumed
        prompt_ids = event.get("prompt_token_ids") if keep else event.pop("prompt_token_ids", None)
        choices = event.get("choices") or []
        for c in choices:
            ids = c.get("prompt_token_ids") if keep else c.pop("prompt_token_ids", None)
            prompt_ids = ids if ids is not None else prompt_ids
            self.generated += c.get("token_ids") or []
            if not self.client_wants_ids:
                c.pop("token_ids", None)
            if c.get("finish_reason"):
                self.finished = True
        if prompt_ids is not None and self.prompt_ids is None and not resumed:
            self.prompt_ids = list(prompt_ids)
        if usage := event.get("usage"):
            self.usage = self._whole_usage(usage, resumed)
            event["usage"] = self.usage
        if resumed and self.as_itself:
            event.update(id=self.first_id, created=self.created, model=self.model)
            if choices and all(set(c.get("delta") or {}) == {"role"} and not c.get("finish_reason")
                               for c in choices):
                return None  # the resumed engine's opening role chunk: the client had one
        elif resumed:
            event = self._as_client_chunk(event)
        if not choices and event.get("usage") and not self.client_wants_usage:
            return None
        return event

    def _whole_usage(self, usage: dict[str, Any], resumed: bool) -> dict[str, Any]:
        if not resumed or self.prompt_ids is None:
            return usage
        prompt = len(self.prompt_ids)
        completion = self.resumed_from + int(usage.get("completion_tokens", 0))
        out = {**usage, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if isinstance(details := usage.get("prompt_tokens_details"), dict) and "cached_tokens" in details:
            # The continuation's prompt held the answer so far: count only the original prompt's part.
            out["prompt_tokens_details"] = {**details, "cached_tokens": min(int(details["cached_tokens"]), prompt)}
        return out

    def _as_client_chunk(self, event: dict[str, Any]) -> dict[str, Any]:
        """A continuation's completions chunk in the client's format, with the first engine's id."""
        out: dict[str, Any] = {"id": self.first_id, "created": self.created, "model": self.model}
        if self.kind == "chat":
            out["object"] = "chat.completion.chunk"
            out["choices"] = [{"index": c.get("index", 0), "delta": {"content": c.get("text", "")},
                               "logprobs": None, "finish_reason": c.get("finish_reason"),
                               **({"token_ids": c["token_ids"]} if "token_ids" in c else {})}
                              for c in event.get("choices") or []]
        else:
            out["object"] = "text_completion"
            out["choices"] = event.get("choices") or []
        if "usage" in event:
            out["usage"] = event["usage"]
        return out

    def continuation(self, req: ParsedRequest) -> dict[str, Any] | None:
        """The body that resumes this answer, or None when nothing can (no prompt ids, or the token budget is
        spent): the client's request with `resume_token_ids` where it is `constrained` (to its own endpoint),
        else a completions body whose prompt is the prompt's ids and the answer's."""
        if self.prompt_ids is None:
            return None
        limit = token_limit(req.kind, req.body)
        if limit is not None and limit - len(self.generated) <= 0:
            return None
        if self.as_itself:
            return {**req.body, "resume_token_ids": list(self.generated), "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}}
        body: dict[str, Any] = {k: req.body[k] for k in CARRIED if k in req.body}
        # null: to the end of the context (a chat without a limit); a completions body without the field
        # would stop at OpenAI's default of 16
        body["max_tokens"] = None if limit is None else limit - len(self.generated)
        min_tokens = req.body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > len(self.generated):
            body["min_tokens"] = min_tokens - len(self.generated)
        body.update(prompt=self.prompt_ids + self.generated, stream=True, return_token_ids=True,
                    stream_options={"include_usage": True}, add_special_tokens=False)
        return body


def sse(event: dict[str, Any] | str) -> bytes:
    data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class SSEReader:
    """Splits a byte stream into SSE events' `data` payloads."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        out = []
        while (i := self._buf.find(b"\n\n")) >= 0:
            raw, self._buf = self._buf[:i], self._buf[i + 2:]
            data = [ln[5:].lstrip() for ln in raw.split(b"\n") if ln.startswith(b"data:")]
            if data:
                out.append(b"\n".join(data).decode("utf-8", "replace"))
        return out


@dataclass
class Break:
    """Why a stream stopped before its end: the migration reason label and a message."""

    reason: str  # connection | error_event | timeout | eof
    message: str
    at: float = field(default_factory=time.perf_counter)


async def pump(up: Upstream, out: web.StreamResponse, state: StreamState, resumed: bool,
               on_chunk: Callable[[], None]) -> Break | None:
    """Relay one upstream stream until it ends (None) or breaks (a Break)."""
    reader = SSEReader()
    try:
        async for chunk in up.resp.content.iter_any():
            for data in reader.feed(chunk):
                if data == "[DONE]":
                    await out.write(sse("[DONE]"))
                    state.done = True
                    return None
                try:
                    event = json.loads(data)
                except ValueError:
                    return Break("error_event", f"an unreadable event from {up.endpoint.url}")
                if not isinstance(event, dict) or "error" in event:
                    message = event.get("error", {}).get("message", "") if isinstance(event, dict) else ""
                    return Break("error_event", f"the engine sent an error mid-stream: {message}")
                if (client_event := state.rewrite(event, resumed)) is not None:
                    await out.write(sse(client_event))
                    on_chunk()
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
        return Break("connection", f"{type(e).__name__}: {e}")
    except (TimeoutError, aiohttp.SocketTimeoutError):
        return Break("timeout", "the engine stopped sending")
    return Break("eof", "the stream ended without [DONE]")


async def end_with_error(out: web.StreamResponse, status: int, message: str, kind: str) -> None:
    """The stream's last events: an OpenAI-style error, then [DONE]."""
    await out.write(sse(error_body(status, message, kind)))
    await out.write(sse("[DONE]"))


async def finish_locally(out: web.StreamResponse, state: StreamState, finish_reason: str | None) -> None:
    """End an answer whose tokens were all sent but whose engine broke before it said so."""
    if finish_reason is not None:
        await out.write(sse(state._as_client_chunk({"choices": [{"index": 0, "text": "",
                                                                  "finish_reason": finish_reason}]})))
    if state.client_wants_usage and state.prompt_ids is not None:
        n, k = len(state.prompt_ids), len(state.generated)
        usage = {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k}
        await out.write(sse(state._as_client_chunk({"choices": [], "usage": usage})))
    await out.write(sse("[DONE]"))


async def relay_resumable(router: MigrationRouter, request: web.Request, up: Upstream, req: ParsedRequest,
                          rreq: RoutingRequest, headers: dict[str, str], request_id: str,
                          t_start: float, replay: tuple[str, bytes] | None = None) -> web.StreamResponse:
    """Relay a streamed answer, resuming it on another engine when its engine breaks; closes every
    upstream it opened. `replay` (path, body): the request as a decode engine computes it whole, sent once
    if an engine's answer errs before anything reached the client (a KV load from a prefill engine that
    died after its answer): decode prefills it itself, and the client never sees the failure."""
    if up.resp.content_type != "text/event-stream":  # an error answer: relayed as is
        return await relay(router, request, up, request_id, t_start)
    metrics, cfg = router.metrics, router.config
    state = StreamState(req.kind, bool(req.body.get("return_token_ids")),
                        bool((req.body.get("stream_options") or {}).get("include_usage")), as_itself=constrained(req))
    resume_path = ("/v1/chat/completions" if req.kind == "chat" else "/v1/completions") if state.as_itself \
        else "/v1/completions"
    out = web.StreamResponse(status=up.resp.status, headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **up.headers(request_id)})
    await out.prepare(request)
    tried, resumed, replayed = {up.endpoint.url}, False, False
    # When the client last waited for a first chunk: the request's arrival, then each break.
    waiting: list[float] = [t_start]

    def on_chunk() -> None:
        if waiting:
            elapsed = time.perf_counter() - waiting.pop()
            if resumed:
                metrics.migration_resume.observe(elapsed)
            else:
                metrics.ttft.labels(up.endpoint.url).observe(elapsed)

    try:
        while True:
            brk = await pump(up, out, state, resumed, on_chunk)
            ep = up.endpoint
            up.close()
            if brk is None:
                metrics.upstream_requests.labels(ep.role.value, ep.url, str(up.resp.status)).inc()
                break
            metrics.upstream_requests.labels(ep.role.value, ep.url, "broken" if brk.reason != "timeout"
                                             else "timeout").inc()
            if brk.reason == "error_event" and state.first_id is None and replay is not None and not replayed:
                # The engine answered with an error before any token: it lives (a dead one fails its health
                # checks), the request failed. Replayed whole, on any decode engine, this one included.
                replayed = True
                logger.warning("[migration] request %s: %s failed before its first token (%s); replayed with "
                               "local prefill", request_id, ep.url, brk.message)
                metrics.migrations.labels("replay").inc()
                try:
                    up = await open_upstream(router, router.decode, replay[0], replay[1], rreq, headers,
                                             revision=router.revision_up(router.decode, ep.revision, set()))
                except NoEndpoint as e:
                    await end_with_error(out, 503, f"the engine serving this request failed ({brk.message}) and "
                                                   f"no engine is left to retry it: {e}", "service_unavailable")
                    break
                continue
            router.pool(ep.role).eject(ep, f"stream broke: {brk.message}")
            if state.finished:
                await finish_locally(out, state, None)
                break
            body = state.continuation(req)
            if body is None and state.prompt_ids is not None:  # the budget is spent: that is a length stop
                await finish_locally(out, state, "length")
                break
            if body is None or state.migrations >= cfg.max_migrations:
                why = "no prompt token ids to resume from" if body is None else \
                    f"{state.migrations} migrations already (--max-migrations)"
                status = 504 if brk.reason == "timeout" else 502
                await end_with_error(out, status, f"the engine serving this request failed mid-stream "
                                                  f"({brk.message}); not resumed: {why}", "upstream_error")
                break
            try:
                # On the same revision where one is up: the same model and settings continue the answer.
                up = await open_upstream(router, router.decode, resume_path, json.dumps(body).encode(),
                                         rreq, headers, exclude=tried,
                                         revision=router.revision_up(router.decode, ep.revision, tried))
            except NoEndpoint as e:
                await end_with_error(out, 503, f"the engine serving this request failed mid-stream ({brk.message}) "
                                               f"and no engine is left to resume it: {e}", "service_unavailable")
                break
            state.migrations += 1
            state.resumed_from = len(state.generated)
            resumed = True
            tried.add(up.endpoint.url)
            waiting[:] = [brk.at]
            metrics.migrations.labels(brk.reason).inc()
            logger.warning("[migration] request %s: %s broke after %d tokens (%s); resumed on %s (%d/%d)",
                           request_id, ep.url, len(state.generated), brk.message, up.endpoint.url,
                           state.migrations, cfg.max_migrations)
        await out.write_eof()
        return out
    except (ConnectionResetError, asyncio.CancelledError):
        metrics.client_disconnects.inc()
        logger.info("client of request %s went away; closing upstream %s", request_id, up.endpoint.url)
        raise
    finally:
        up.close()


async def relay_whole(router: MigrationRouter, request: web.Request, up: Upstream, req: ParsedRequest, path: str,
                      rreq: RoutingRequest, headers: dict[str, str], request_id: str,
                      t_start: float) -> web.StreamResponse:
    """A whole (non-streamed) answer: the client has seen nothing until it is complete, so an engine
    that breaks before its body is read is replaced by another that answers the client's request from
    the start (greedy and seeded answers are the same)."""
    metrics, tried = router.metrics, {up.endpoint.url}
    for attempt in range(router.config.max_migrations + 1):
        if up.resp.content_type == "text/event-stream" or attempt == router.config.max_migrations:
            return await relay(router, request, up, request_id, t_start)
        ep = up.endpoint
        try:
            body = await up.resp.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            up.close()
            reason = "timeout" if isinstance(e, TimeoutError) else "connection"
            metrics.upstream_requests.labels(ep.role.value, ep.url, "broken").inc()
            router.pool(ep.role).eject(ep, f"answer cut off: {type(e).__name__}")
            try:
                up = await open_upstream(router, router.decode, path, req.raw, rreq, headers, exclude=tried,
                                         revision=router.revision_up(router.decode, ep.revision, tried))
            except NoEndpoint as no:
                return error_response(502, f"endpoint {ep.url} failed mid-answer ({type(e).__name__}) and no "
                                           f"engine is left to answer: {no}", "upstream_error")
            tried.add(up.endpoint.url)
            metrics.migrations.labels(reason).inc()
            logger.warning("[migration] request %s: %s broke before its answer was read (%s); sent to %s",
                           request_id, ep.url, type(e).__name__, up.endpoint.url)
            continue
        up.close()
        metrics.ttft.labels(ep.url).observe(time.perf_counter() - t_start)
        metrics.upstream_requests.labels(ep.role.value, ep.url, str(up.resp.status)).inc()
        return web.Response(body=body, status=up.resp.status, content_type=up.resp.content_type,
                            headers=up.headers(request_id))
    raise AssertionError("unreachable")
