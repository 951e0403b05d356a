"""Fixtures of the HTTP tests: the toy engine, the app in-process (`client`) or under uvicorn (`server`,
`oai`). The engine itself is in toy_engine.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import prometheus_client
import pytest

from tandem_engine.entrypoints.api_server import build_app
from tests.engine.entrypoints.toy_engine import MODEL, ServerThread, ToyEngine


@pytest.fixture
def engine() -> ToyEngine:
    return ToyEngine()


@pytest.fixture
def registry() -> prometheus_client.CollectorRegistry:
    reg = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter("vllm:request_success", "done", ["model_name"], registry=reg)
    counter.labels(model_name=MODEL).inc(3)
    return reg


@pytest.fixture
async def client(
    engine: ToyEngine, registry: prometheus_client.CollectorRegistry
) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(engine, registry), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(ToyEngine()) as s:
        yield s


@pytest.fixture
def oai(server: ServerThread) -> openai.OpenAI:
    server.engine.reset()
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=10)
