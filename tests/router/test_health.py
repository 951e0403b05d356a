"""Active health checks eject and re-admit; killing a real upstream process under load."""

from __future__ import annotations

import asyncio
import collections

import aiohttp
import openai
from tests.router.utils import eventually, start_upstream_process

from tandem_router.procs import free_port


async def test_static_endpoints_are_admitted_before_the_router_is_ready(upstream, router) -> None:
    """The first round of checks is part of start-up: a request sent the moment the router is up is
    served, not answered 503 because no check has admitted anyone yet (a slow interval makes a race
    with the periodic checks impossible)."""
    up = await upstream(name="a")
    down = f"http://127.0.0.1:{free_port()}"
    r = await router(decode_urls=[up.url, down], health_interval=30)
    assert r.router.decode.endpoints[up.url].healthy
    assert not r.router.decode.endpoints[down].healthy
    async with aiohttp.ClientSession() as s, s.post(r.url + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["text"].startswith(" a-0")


async def test_failed_checks_eject_and_a_passing_check_readmits(upstream, router) -> None:
    a = await upstream(name="a")
    b = await upstream(name="b")
    r = await router(decode_urls=[a.url, b.url], health_interval=0.05, health_failures=2)
    ea, eb = r.router.decode.endpoints[a.url], r.router.decode.endpoints[b.url]
    await eventually(lambda: ea.healthy and eb.healthy)
    a.healthy = False
    await eventually(lambda: not ea.healthy)
    assert ea.ejections == 1 and eb.healthy
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(r.url + "/v1/completions", json={"prompt": "x"}) as resp:
                assert (await resp.json())["choices"][0]["text"].startswith(" b-0")
        a.healthy = True
        await eventually(lambda: ea.healthy)
        text = await (await s.get(r.url + "/metrics")).text()
    assert f'tandem:router_endpoint_healthy{{endpoint="{a.url}",role="decode"}} 1.0' in text


async def test_kill_an_upstream_process_under_load(router, tmp_path) -> None:
    """Streams from the killed process end with a clean error, new requests go to the survivor, and the
    process is re-admitted when it comes back on the same port."""
    ports = [free_port(), free_port()]
    procs = [start_upstream_process(p, f"u{i}", tmp_path, tokens=150, token_delay=0.03) for i, p in enumerate(ports)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        await asyncio.gather(*(asyncio.to_thread(p.wait_healthy, 30) for p in procs))
        r = await router(decode_urls=urls, decode_policy="round-robin", health_interval=0.1)
        await eventually(lambda: len(r.router.decode.healthy()) == 2)
        client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        outcome: collections.Counter[str] = collections.Counter()
        started = [asyncio.Event() for _ in range(6)]

        async def one(i: int) -> None:
            stream = await client.completions.create(model="m", prompt="x", stream=True)
            served = None
            try:
                async for chunk in stream:
                    served = served or chunk.choices[0].text.split("-")[0].strip()
                    started[i].set()
                outcome[f"ok-{served}"] += 1
            except openai.APIError as e:
                assert "failed mid-stream" in str(e)
                outcome[f"error-{served}"] += 1

        load = [asyncio.create_task(one(i)) for i in range(6)]
        # Every stream is placed and flowing (150 tokens, 30 ms apart: none ends before the kill).
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        assert [e.in_flight_requests for e in r.router.decode.endpoints.values()] == [3, 3]
        procs[0].kill()
        await asyncio.gather(*load)
        # Exactly the streams on the killed process failed, and cleanly.
        assert outcome == {"error-u0": 3, "ok-u1": 3}, outcome
        # New requests all go to the survivor (the first may find u0 refused and retry; none fails).
        after = [
            (await client.completions.create(model="m", prompt="x", max_tokens=2)).choices[0].text for _ in range(4)
        ]
        assert all(t.startswith(" u1-0") for t in after)
        assert not r.router.decode.endpoints[urls[0]].healthy
        procs[0] = start_upstream_process(ports[0], "u0", tmp_path, tokens=150, token_delay=0.03)
        await eventually(lambda: r.router.decode.endpoints[urls[0]].healthy, timeout=15)
        back = [
            (await client.completions.create(model="m", prompt="x", max_tokens=1)).choices[0].text for _ in range(4)
        ]
        assert sorted(t.split("-")[0] for t in back) == [" u0", " u0", " u1", " u1"]
        await client.close()
    finally:
        for p in procs:
            p.kill()


async def test_prefix_aware_reads_engine_queues_between_health_checks(upstream, router) -> None:
    # Router replicas weigh each other's requests only through the engines' own counts: the prefix-aware
    # policy reads them every --load-interval, not only at the (slower) health checks.
    up = await upstream(name="a", tokens=20, token_delay=0.05)
    r = await router(decode_urls=[up.url], decode_policy="prefix-aware", health_interval=30, load_interval=0.05)
    ep = r.router.decode.endpoints[up.url]
    await eventually(lambda: ep.engine_queue == 0)
    async with aiohttp.ClientSession() as s:
        # Sent straight to the engine, as another router replica would: this router only sees its count.
        answer = asyncio.create_task(s.post(up.url + "/v1/completions", json={"prompt": "x"}))
        await eventually(lambda: ep.engine_queue == 1, timeout=2)
        await (await answer).read()
    await eventually(lambda: ep.engine_queue == 0, timeout=2)
    scrapes = up.metrics_scrapes
    await asyncio.sleep(0.5)
    assert up.metrics_scrapes - scrapes >= 4  # ~10 in 0.5 s; the health check alone would be 0
    other = await upstream(name="b")
    least = await router(decode_urls=[other.url], health_interval=30)  # least-load reads no queue
    await eventually(lambda: least.router.decode.endpoints[other.url].healthy)
    await asyncio.sleep(0.3)
    assert other.metrics_scrapes <= 1  # the first health check reads its slot count (admission control)
