"""A test upstream: a tiny OpenAI-compatible HTTP server that stands in for an engine in router tests.

It is a real server on a real socket (aiohttp), deterministic, and observable: it records every request
it received and every request whose client (the router) went away. Knobs make it slow, make it answer
an error status, make it cut a stream off, or make it act as a prefill engine. Run it as a process with
`python -m tests.router.upstream --port N --name X` to be killed for real.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class Answer:
    """One generated answer in OpenAI's completion or chat shape, whole or as stream chunks."""

    rid: str
    body: dict[str, Any]
    chat: bool
    pieces: list[str]
    ids: list[int] = field(default_factory=list)  # the pieces' token ids (positional upstreams)
    prompt_ids: list[int] = field(default_factory=list)

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def usage(self) -> dict[str, int]:
        n, p = len(self.pieces), len(self.prompt_ids) or 5
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    def complete(self, kv_out: dict[str, Any] | None) -> dict[str, Any]:
        text = "".join(self.pieces)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": f"cmpl-{self.rid}", "object": self.object, "created": int(time.time()),
                "model": self.body.get("model"), "choices": [choice], "usage": self.usage,
                "kv_transfer_params": kv_out}

    def delta(self, i: int) -> list[dict[str, Any]]:
        last = i == len(self.pieces) - 1
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last and self.ids else None}
        if self.chat:
            choice["delta"] = {"content": self.pieces[i]}
        else:
            choice["text"] = self.pieces[i]
        if self.ids and self.body.get("return_token_ids"):
            choice["token_ids"] = [self.ids[i]]
            if i == 0 and not self.chat:
                choice["prompt_token_ids"] = self.prompt_ids
        return [choice]

    def sse(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {"id": f"cmpl-{self.rid}", "object": self.object + ".chunk", "created": 0,
                 "model": self.body.get("model"), "choices": choices, **extra}
        return f"data: {json.dumps(chunk)}\n\n".encode()


@dataclass
class TestUpstream:
    __test__ = False  # not a pytest class

    name: str = "up"
    tokens: int = 4  # tokens per answer unless max_tokens is smaller
    token_delay: float = 0.0
    status: int = 200  # answer this status (with an OpenAI error body) instead of generating
    cut_after: int | None = None  # close the connection abruptly after this many streamed tokens
    # Like an engine that samples by position: the token at absolute position p (prompt + output) is id p
    # with text " w{p}"; a text prompt is 5 tokens, a token-id prompt is itself. With `return_token_ids` the
    # chunks carry ids, as a real engine's do, so the router can resume an answer on another upstream.
    positional: bool = False
    healthy: bool = True
    revision: str = ""  # sent on /health as X-Tandem-Revision when set, as `tandem serve --revision` does
    max_num_seqs: int | None = None  # exported as tandem:engine_max_num_seqs on GET /metrics, as an engine does
    metrics_scrapes: int = 0  # GET /metrics served (it also exports `running` as vllm:num_requests_running)
    seen: list[Seen] = field(default_factory=list)
    disconnected: list[str] = field(default_factory=list)  # X-Request-Ids whose client went away
    finished: list[str] = field(default_factory=list)
    running: int = 0  # generation requests being answered now, and the most at once
    peak: int = 0
    url: str = ""
    host: str = "127.0.0.1"  # a pod-network address where a real EndpointSlice must name it (no loopback)
    _runner: web.AppRunner | None = None

    def text(self, n: int) -> list[str]:
        return [f" {self.name}-{i}" for i in range(n)]

    def _kv_out(self, body: dict[str, Any], rid: str) -> dict[str, Any] | None:
        """What a prefill engine returns for a request that asked for remote decode."""
        if not (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.name,
            "remote_request_id": rid,
            "remote_block_ids": [1, 2, 3],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        }

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers.get("X-Request-Id", "")
        self.seen.append(Seen(request.path, body, {k.lower(): v for k, v in request.headers.items()}))
        if self.status != 200:
            err = {"message": f"{self.name} says {self.status}", "type": "x", "param": None, "code": self.status}
            return web.json_response({"error": err}, status=self.status)
        n = min(self.tokens, int(body.get("max_tokens") or body.get("max_completion_tokens") or self.tokens))
        answer = Answer(rid, body, request.path.endswith("chat/completions"), self.text(n))
        if self.positional:
            prompt = body.get("prompt")
            answer.prompt_ids = list(prompt) if isinstance(prompt, list) else list(range(5))
            start = len(answer.prompt_ids)
            answer.ids = list(range(start, start + n))
            answer.pieces = [f" w{p}" for p in answer.ids]
        if body.get("stream"):
            return await self._stream(request, answer)
        try:
            await asyncio.sleep(self.token_delay * n)
        except asyncio.CancelledError:
            self.disconnected.append(rid)
            raise
        self.finished.append(rid)
        return web.json_response(answer.complete(self._kv_out(body, rid)))

    async def _stream(self, request: web.Request, answer: Answer) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(len(answer.pieces)):
                if self.cut_after is not None and i >= self.cut_after:
                    assert request.transport is not None
                    request.transport.abort()  # like a killed process: no terminating chunk
                    return resp
                await asyncio.sleep(self.token_delay)
                top = {"prompt_token_ids": answer.prompt_ids} if (
                    i == 0 and answer.chat and answer.ids and answer.body.get("return_token_ids")) else {}
                await resp.write(answer.sse(answer.delta(i), **top))
            if (answer.body.get("stream_options") or {}).get("include_usage"):
                await resp.write(answer.sse([], usage=answer.usage))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.append(answer.rid)
            raise
        self.finished.append(answer.rid)
        return resp

    @web.middleware
    async def _count(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "POST" or not request.path.startswith("/v1/"):
            return await handler(request)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            return await handler(request)
        finally:
            self.running -= 1

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_scrapes += 1
        text = f'vllm:num_requests_running{{model_name="test-model"}} {self.running}\n'
        if self.max_num_seqs is not None:
            text += f'tandem:engine_max_num_seqs{{model_name="test-model"}} {self.max_num_seqs}\n'
        return web.Response(text=text, content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        headers = {"X-Tandem-Revision": self.revision} if self.revision else None
        return web.Response(status=200 if self.healthy else 503, headers=headers)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "test-model", "object": "model", "owned_by": self.name}]}
        )

    async def start(self, port: int = 0) -> TestUpstream:
        app = web.Application(middlewares=[self._count])
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, port)
        await site.start()
        assert site._server is not None
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self.host}:{bound}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="up")
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--token-delay", type=float, default=0.0)
    # `tandem serve`'s flags, so that `tandem up --engine-command` can run this instead of an engine.
    p.add_argument("--model", default="test-model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--role", choices=("both", "prefill", "decode"), default="both")
    p.add_argument("--kv-side-channel-port", type=int, default=0)
    p.add_argument("--kv-events-port", type=int, default=0)  # publishes nothing: GET /kv_events is a 404
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")  # orders nothing
    a = p.parse_args()

    async def run() -> None:
        name = a.name if a.role == "both" else f"{a.role}"
        up = await TestUpstream(name=name, tokens=a.tokens, token_delay=a.token_delay).start(a.port)
        print(f"ready {up.url}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
