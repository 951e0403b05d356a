"""Streams survive their engine: three real engines behind the router, 16 concurrent streams (chat and
completions, greedy and seeded), kill -9 the engine serving the most of them mid-stream, then the one
that took them over: every stream ends equal, token for token, to the same request in a run without
failures, and the survivor holds no KV block afterwards. (P/D: tests/router/test_e2e_engines.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.engine.engine_server import launch
from tests.router.streams import MAX_TOKENS, Reader, run_all, until

from tandem_router.local_stack import split_cpus
from tandem_router.procs import Child, scrape

pytestmark = pytest.mark.slow
N = 16


@pytest.fixture
async def engines(tmp_path: Path) -> AsyncIterator[list[Child]]:
    children = [launch(tmp_path, ["--max-model-len", "512"], cpus=cpus) for cpus in split_cpus(3)]
    try:
        for c in children:
            await asyncio.to_thread(c.wait_healthy, 300)
        yield children
    finally:
        for c in children:
            c.stop()


async def test_streams_survive_two_engine_kills(engines: list[Child], router) -> None:
    r = await router(decode_urls=[c.url for c in engines], decode_policy="least-load", health_interval=0.5)
    rt = r.router
    baseline = await run_all(r.url, N)
    assert all(len(b.ids) == MAX_TOKENS and b.finish == ["length"] and not b.errors for b in baseline)
    by_url = {c.url: c for c in engines}

    def busiest() -> Child:
        ep = max(rt.decode.healthy(), key=lambda e: e.in_flight_requests)
        return by_url[ep.url]

    async def kill_twice(readers: list[Reader]) -> None:
        await until(lambda: all(x.chunks >= 5 for x in readers), 120, "streams never got going")
        first = busiest()
        await asyncio.to_thread(first.kill)  # kill -9, EngineCores included
        # The streams it carried resume elsewhere; once they are flowing again, kill their new home.
        await until(lambda: first.url not in [e.url for e in rt.decode.healthy()], 30, "the kill went unnoticed")
        seen = {x.i: x.chunks for x in readers}
        await until(lambda: sum(x.chunks > seen[x.i] + 3 for x in readers) >= N // 2, 120, "no progress after a kill")
        second = busiest()
        await asyncio.to_thread(second.kill)

    failed = await run_all(r.url, N, kill_twice)
    for b, f in zip(baseline, failed, strict=True):
        assert not f.errors, (f.i, f.errors)
        assert (f.ids, f.text, f.finish) == (b.ids, b.text, b.finish), f"request {f.i} differs after migration"
        assert f.usage["completion_tokens"] == MAX_TOKENS and f.usage["prompt_tokens"] == b.usage["prompt_tokens"]
    metrics = await asyncio.to_thread(lambda: scrape(r.url, "tandem:router_migrations_total"))
    assert metrics >= 2
    survivor = next(c for c in engines if c.alive())
    await until(lambda: scrape(survivor.url, "vllm:kv_cache_usage_perc") == 0.0, 20, "the survivor holds KV blocks")
