from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from tests.router.upstream import TestUpstream

from tandem_router.config import RouterConfig
from tandem_router.server import ROUTER_KEY, start_server

StartUpstream = Callable[..., Awaitable[TestUpstream]]


@pytest.fixture
async def upstream() -> AsyncIterator[StartUpstream]:
    started: list[TestUpstream] = []

    async def start(**kw: Any) -> TestUpstream:
        up = await TestUpstream(**kw).start()
        started.append(up)
        return up

    yield start
    for up in started:
        await up.stop()


class RunningRouter:
    def __init__(self, runner: Any, url: str) -> None:
        self.runner = runner
        self.url = url

    @property
    def router(self) -> Any:
        return self.runner.app[ROUTER_KEY]


@pytest.fixture
async def router() -> AsyncIterator[Callable[..., Awaitable[RunningRouter]]]:
    runners: list[Any] = []

    async def start(**kw: Any) -> RunningRouter:
        kw.setdefault("port", 0)
        kw.setdefault("health_interval", 0)
        runner, port = await start_server(RouterConfig(**kw))
        runners.append(runner)
        return RunningRouter(runner, f"http://127.0.0.1:{port}")

    yield start
    for r in runners:
        await r.cleanup()
