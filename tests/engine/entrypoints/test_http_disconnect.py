"""A client that goes away aborts every engine request it started, streamed or not, before or after
the first token."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import prometheus_client
import pytest

from tandem_engine.entrypoints.api_server import build_app
from tests.engine.entrypoints.toy_engine import CHAT, ServerThread, ToyEngine

BOTH_ENDPOINTS = pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])


@pytest.fixture
def app(engine: ToyEngine, registry: prometheus_client.CollectorRegistry) -> Any:
    return build_app(engine, registry)


def wait_aborted(engine: ToyEngine) -> None:
    deadline = time.monotonic() + 5
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.02)


async def call_asgi_until(
    app: Any, path: str, body: dict[str, Any], disconnect_when: Any
) -> list[dict[str, Any]]:
    """Drive the app directly: send the body, then report http.disconnect once `disconnect_when()` holds."""
    raw = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        while not disconnect_when(sent):
            await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    return sent


@BOTH_ENDPOINTS
async def test_disconnect_non_streamed_aborts(engine: ToyEngine, app: Any, path: str) -> None:
    engine.hang_after = 1
    body = {"prompt": "hi", "messages": CHAT, "max_tokens": 10, "n": 2}
    await call_asgi_until(app, path, body, lambda sent: len(engine.calls) == 2)
    ids = sorted(c[0] for c in engine.calls)
    assert sorted(engine.cancelled) == ids  # the engine iterators were cancelled
    assert sorted(engine.aborted) == ids  # and abort was called for each unfinished request


@BOTH_ENDPOINTS
async def test_disconnect_streamed_aborts(engine: ToyEngine, app: Any, path: str) -> None:
    engine.hang_after = 2
    body = {"prompt": "hi", "messages": CHAT, "max_tokens": 10, "stream": True}

    def after_first_token(sent: list[dict[str, Any]]) -> bool:
        return any(b'"a"' in m.get("body", b"") for m in sent)

    sent = await call_asgi_until(app, path, body, after_first_token)
    assert sent[0]["status"] == 200
    [(rid, *_)] = engine.calls
    assert engine.cancelled == [rid] and engine.aborted == [rid]
    assert not any(b"[DONE]" in m.get("body", b"") for m in sent)


@BOTH_ENDPOINTS
async def test_disconnect_before_the_first_token_aborts(engine: ToyEngine, app: Any, path: str) -> None:
    engine.hang_after = 0  # a long prefill: the stream has not started when the client leaves
    body = {"prompt": "hi", "messages": CHAT, "max_tokens": 10, "stream": True, "n": 2}
    await call_asgi_until(app, path, body, lambda sent: len(engine.calls) == 2)
    ids = sorted(c[0] for c in engine.calls)
    assert sorted(engine.cancelled) == ids and sorted(engine.aborted) == ids


async def test_finished_requests_are_not_aborted(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2})
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    assert engine.aborted == [] and engine.cancelled == []


def test_disconnect_through_a_real_server_aborts(server: ServerThread) -> None:
    server.engine.reset()
    server.engine.delay = 0.05
    body = {"prompt": "hi", "max_tokens": 60, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=5) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    wait_aborted(server.engine)
    [(rid, *_)] = server.engine.calls
    assert server.engine.aborted == [rid] and server.engine.cancelled == [rid]

    server.engine.reset()
    server.engine.hang_after = 1
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}, timeout=0.3)
    wait_aborted(server.engine)
    [(rid, *_)] = server.engine.calls
    assert server.engine.aborted == [rid]


# --------------------------------------------------------------------------- the official openai client
