"""Scale from zero at the router: requests are held while no decode endpoint exists, served once one is
admitted, and answered 503 with Retry-After when none comes within --cold-start-timeout
(docs/operations.md, "Scale from zero"). A real router process and test upstream processes, started late
on the port the router was given, as a pod would come up."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tests.router.conftest import RunningRouter
from tests.router.test_admission import body, client, send
from tests.router.test_pd import LONG
from tests.router.upstream import TestUpstream
from tests.router.utils import eventually, start_upstream_process

from tandem_router.cli import config_from_args
from tandem_router.procs import Child, free_port, metric, tandem_child

HELD = "tandem:router_requests_held"


def start_router(tmp_path: Path, *args: str) -> Child:
    """`tandem route *args` with quick health checks, as a process, once healthy: with the hold on it
    is healthy with no engine."""
    router = tandem_child("router", "route", [*args, "--health-interval", "0.1"], tmp_path / "router.log",
                          die_with_parent=False).start()
    try:
        router.wait_healthy(30)
    except Exception:
        router.kill()
        raise
    return router


def held_in(r: RunningRouter) -> float:
    """The held gauge of a router running in this process."""
    return metric(r.router.metrics.render().decode(), HELD)


async def answer(s: aiohttp.ClientSession, url: str, path: str, payload: dict[str, Any]) -> tuple[int, str, str, float]:
    """(status, Retry-After, body, seconds until the status line) of one request."""
    t0 = time.perf_counter()
    async with s.post(url + path, json=payload) as resp:
        return resp.status, resp.headers.get("Retry-After", ""), await resp.text(), time.perf_counter() - t0


async def health(s: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with s.get(url + "/health") as resp:
        return resp.status, await resp.json()


async def test_requests_held_at_zero_are_served_when_the_engine_comes(tmp_path) -> None:
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    router = start_router(tmp_path, "--decode", engine_url, "--cold-start-timeout", "60")
    engine: Child | None = None
    try:
        async with client() as s:
            # Ready although no engine answers: the router must stay in its Service to take the first request.
            assert await health(s, router.url) == (200, {"decode": {engine_url: False}, "prefill": {}})
            t0 = time.time()
            # Completions and chat, streamed and not.
            tasks = [asyncio.create_task(send(s, router.url, *body(i, max_tokens=4))) for i in range(4)]
            await eventually(lambda: router.metric(HELD) == 4, timeout=10)
            await asyncio.sleep(0.3)
            assert not any(t.done() for t in tasks) and router.metric(HELD) == 4
            assert router.metric("tandem:router_last_request_timestamp_seconds") >= int(t0)
            engine = start_upstream_process(port, "e", tmp_path)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert [status for status, _, _ in results] == [200] * 4
        assert all(" e-3" in text for _, _, text in results)  # whole answers, streamed ones included
        assert router.metric(HELD) == 0
        assert router.metric("tandem:router_queue_wait_seconds_count") == 4
        assert router.metric("tandem:router_queue_wait_seconds_sum") >= 4 * 0.3
    finally:
        router.stop()
        if engine is not None:
            engine.kill()


async def test_held_requests_get_503_with_retry_after_bounded_by_the_queue(tmp_path) -> None:
    router = start_router(tmp_path, "--decode", f"http://127.0.0.1:{free_port()}", "--cold-start-timeout", "3",
                          "--max-queued-requests", "2")
    try:
        async with client() as s:
            first = asyncio.create_task(answer(s, router.url, "/v1/chat/completions",
                                               {"messages": [{"role": "user", "content": "hi"}], "stream": True}))
            gone = asyncio.create_task(answer(s, router.url, "/v1/completions", {"prompt": "leaves"}))
            await eventually(lambda: router.metric(HELD) == 2, timeout=2)
            status, waited, text = await send(s, router.url, "/v1/completions", {"prompt": "one too many"})
            assert status == 429 and waited < 0.5 and '"rate_limit_exceeded"' in text
            gone.cancel()  # the client goes away: its place is free
            await eventually(lambda: router.metric(HELD) == 1, timeout=2)
            last = asyncio.create_task(answer(s, router.url, "/v1/completions", {"prompt": "takes the place"}))
            await eventually(lambda: router.metric(HELD) == 2, timeout=2)
            status, retry_after, text, elapsed = await asyncio.wait_for(first, 10)
            assert (await asyncio.wait_for(last, 10))[0] == 503
        # Not before its 3 s; after them within a poll and a loaded machine's turn, far from a second timeout.
        assert status == 503 and 3.0 <= elapsed < 6.0 and int(retry_after) >= 1
        err = json.loads(text)["error"]
        assert err["code"] == 503 and err["type"] == "service_unavailable" and "within 3 s" in err["message"]
        assert router.metric(HELD) == 0
        assert router.metric("tandem:router_rejected_requests_total", reason="cold_start_timeout") == 2
        assert router.metric("tandem:router_rejected_requests_total", reason="queue_full") == 1
        assert router.metric("tandem:router_requests_total", status="503") == 2
        assert router.metric("tandem:router_client_disconnects_total") == 1
    finally:
        router.stop()


async def test_without_a_cold_start_timeout_no_engine_means_503_at_once(tmp_path) -> None:
    port = free_port()
    engine = start_upstream_process(port, "e", tmp_path)
    try:
        engine.wait_healthy(30)
        router = start_router(tmp_path, "--decode", f"http://127.0.0.1:{port}")
    finally:
        engine.kill()  # scaled to zero, or crashed: the checks eject it
    try:
        async with client() as s:
            await eventually(lambda: router.metric("tandem:router_endpoint_healthy") == 0, timeout=5)
            assert (await health(s, router.url))[0] == 503
            status, _, text, elapsed = await answer(s, router.url, "/v1/completions", {"prompt": "anyone?"})
        assert status == 503 and elapsed < 0.5 and "no healthy decode endpoint" in text
        assert router.metric(HELD) == 0
    finally:
        router.stop()


async def test_pd_held_request_waits_for_decode_then_prefills_remotely(tmp_path) -> None:
    """No request needs the prefill pool (decode prefills locally without one): the hold ends when a
    decode endpoint is admitted, and a prefill endpoint admitted before it is used."""
    prefill_port, decode_port = free_port(), free_port()
    router = start_router(tmp_path, "--prefill", f"http://127.0.0.1:{prefill_port}",
                          "--decode", f"http://127.0.0.1:{decode_port}", "--cold-start-timeout", "60",
                          "--remote-prefill-threshold", "0")
    engines: list[Child] = []
    try:
        async with client() as s:
            held = asyncio.create_task(answer(s, router.url, "/v1/completions", {"prompt": LONG, "stream": True}))
            await eventually(lambda: router.metric(HELD) == 1, timeout=10)
            engines.append(start_upstream_process(prefill_port, "p", tmp_path))
            await eventually(lambda: router.metric("tandem:router_endpoint_healthy", role="prefill") == 1, timeout=15)
            await asyncio.sleep(0.3)
            assert not held.done() and router.metric(HELD) == 1
            engines.append(start_upstream_process(decode_port, "d", tmp_path))
            status, _, text, _ = await asyncio.wait_for(held, 30)
        assert status == 200 and " d-3" in text
        assert router.metric("tandem:router_pd_decisions_total", decision="remote") == 1
        assert router.metric("tandem:router_upstream_requests_total", role="prefill", outcome="200") == 1
    finally:
        router.stop()
        for e in engines:
            e.kill()


async def test_endpoint_slices_from_empty_to_ready_release_the_hold(upstream, router) -> None:
    """What Kubernetes discovery does when the first pod of a pool at zero turns ready, with admission
    control off (the hold alone queues)."""
    r = await router(decode_urls=[], cold_start_timeout=30, admission_control=False)
    async with client() as s:
        tasks = [asyncio.create_task(send(s, r.url, *body(i, max_tokens=2))) for i in range(3)]
        await eventually(lambda: held_in(r) == 3)
        up = await upstream(name="k")
        r.router.decode.set_urls([up.url], healthy=True)  # what the EndpointSlice watch publishes
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert [status for status, _, _ in results] == [200] * 3 and all(" k-1" in t for _, _, t in results)
    assert r.router.admission.queued == 0 and r.router.admission.admitted == 0


async def test_queued_requests_are_held_when_the_last_engine_goes(upstream, router) -> None:
    """Without the hold they would get the 503 (test_admission.py); with it they wait for the engine."""
    up = await upstream(name="a", tokens=20, token_delay=0.05)
    r = await router(decode_urls=[up.url], max_in_flight_per_endpoint=1, cold_start_timeout=30)
    pool = r.router.decode
    async with client() as s:
        first = asyncio.create_task(send(s, r.url, "/v1/completions", {"prompt": "x", "stream": True}))
        await eventually(lambda: up.running == 1)
        queued = asyncio.create_task(send(s, r.url, "/v1/completions", {"prompt": "y"}))
        await eventually(lambda: r.router.admission.queued == 1)
        assert held_in(r) == 0  # waiting for room, not for an engine
        pool.eject(pool.endpoints[up.url], "test")
        assert held_in(r) == 1
        assert (await first)[0] == 200  # the answer under way is not cut
        await asyncio.sleep(0.2)
        assert not queued.done()
        pool.admit(pool.endpoints[up.url])  # what the next passing health check does
        status, _, text = await asyncio.wait_for(queued, 5)
    assert status == 200 and " a-19" in text and held_in(r) == 0


async def test_held_requests_that_cannot_reach_their_engine_are_held_again(router) -> None:
    """A pool at zero whose first endpoint is announced ready but cannot be reached yet (a pod IP whose
    route is not up; discovery said ready before the engine listens): the held requests fail to connect,
    the endpoint is ejected, and they wait again for the next admitted endpoint instead of a 502."""
    port = free_port()
    r = await router(decode_urls=[], cold_start_timeout=30, health_interval=0.1)
    up = TestUpstream(name="a", tokens=3)
    async with client() as s:
        tasks = [asyncio.create_task(send(s, r.url, "/v1/completions", {"prompt": f"p{i}"})) for i in range(3)]
        await eventually(lambda: held_in(r) == 3)
        r.router.decode.set_urls([f"http://127.0.0.1:{port}"], healthy=True)  # nothing listens there yet
        await eventually(lambda: r.router.metrics.upstream_requests.labels(
            "decode", f"http://127.0.0.1:{port}", "connect_error")._value.get() >= 1)
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in tasks)
        await up.start(port)  # the engine listens: the next health check admits it
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        finally:
            await up.stop()
    assert [status for status, _, _ in results] == [200] * 3, results
    assert r.router.admission.admitted == 0 and held_in(r) == 0


async def test_a_request_whose_last_decode_engine_began_to_drain_is_held_for_the_next(upstream, router) -> None:
    """A DrainFirst rollout of a one-pod decode role: a request reaches the pod that has just begun to drain (it
    answers 503 before the router saw it leave) and no other decode endpoint is left. The request waits for the
    replacement, as a held request does, instead of passing the 503 on."""
    draining = await upstream(name="a", status=503)
    r = await router(decode_urls=[draining.url], cold_start_timeout=30)
    async with client() as s:
        task = asyncio.create_task(send(s, r.url, "/v1/completions", {"prompt": "p"}))
        await eventually(lambda: len(draining.seen) == 1)
        await asyncio.sleep(0.3)
        assert not task.done()
        replacement = await upstream(name="b")
        r.router.decode.set_urls([replacement.url], healthy=True)  # what the EndpointSlice watch publishes
        status, _, text = await asyncio.wait_for(task, 10)
    assert status == 200 and " b-0" in text, (status, text)


async def test_held_requests_go_to_a_new_engine_no_faster_than_its_slots(router) -> None:
    """The engine's slot count is read before it is admitted: a cold start does not release every held
    request onto the first engine at once (the default cap, 64, would)."""
    port = free_port()
    r = await router(decode_urls=[f"http://127.0.0.1:{port}"], cold_start_timeout=30, health_interval=0.1)
    up = TestUpstream(name="a", tokens=5, token_delay=0.05, max_num_seqs=2)
    async with client() as s:
        tasks = [asyncio.create_task(send(s, r.url, "/v1/completions", {"prompt": f"p{i}"})) for i in range(6)]
        await eventually(lambda: held_in(r) == 6)
        await up.start(port)
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        finally:
            await up.stop()
    assert [status for status, _, _ in results] == [200] * 6
    assert up.peak == 2


def test_flags() -> None:
    assert config_from_args(["--decode", "http://e:8000"]).cold_start_timeout == 0
    assert config_from_args(["--decode", "http://e:8000", "--cold-start-timeout", "120"]).cold_start_timeout == 120
    with pytest.raises(SystemExit):
        config_from_args(["--decode", "http://e:8000", "--cold-start-timeout", "-1"])
