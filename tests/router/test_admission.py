"""Overload control in the router: per-endpoint caps, the priority queue, 429 with Retry-After, and
slots that are always given back (docs/operations.md, "Overload")."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from tests.router.conftest import RunningRouter
from tests.router.upstream import TestUpstream
from tests.router.utils import eventually

from tandem_router.cli import config_from_args


def body(i: int, **extra: Any) -> tuple[str, dict[str, Any]]:
    """Request `i` of a mix: completions and chat, streamed and not."""
    if i % 2:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"hi {i}"}],
                                        "stream": i % 4 == 1, **extra}
    return "/v1/completions", {"prompt": f"hello {i}", "stream": i % 4 == 0, **extra}


async def _headers_sent(session: aiohttp.ClientSession, ctx: Any, params: Any) -> None:
    if ctx.trace_request_ctx is not None:
        ctx.trace_request_ctx["sent"] = time.perf_counter()


def client() -> aiohttp.ClientSession:
    """A client session that notes when each request went out (its connection open)."""
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_headers_sent)
    return aiohttp.ClientSession(trace_configs=[trace])


async def send(s: aiohttp.ClientSession, url: str, path: str, payload: dict[str, Any]) -> tuple[int, float, str]:
    """(status, seconds from the request's arrival to the status line, the whole body)."""
    sent: dict[str, float] = {}
    async with s.post(url + path, json=payload, trace_request_ctx=sent) as resp:
        first = time.perf_counter() - sent["sent"]
        return resp.status, first, await resp.text()


def settled(r: RunningRouter) -> bool:
    """No slot held, nothing queued, nothing in flight on any endpoint."""
    adm = r.router.admission
    return adm.admitted == 0 and adm.queued == 0 and all(
        e.in_flight_requests == 0 for e in r.router.decode.endpoints.values())


async def test_a_burst_of_ten_times_capacity_completes_or_is_refused_at_once(upstream, router) -> None:
    ups = [await upstream(name=n, tokens=4, token_delay=0.1) for n in ("a", "b")]
    r = await router(decode_urls=[u.url for u in ups], max_in_flight_per_endpoint=1, max_queued_requests=2)
    capacity = 2
    async with client() as s:
        # One request first, so that the burst does not measure Python's first calls.
        assert (await send(s, r.url, "/v1/completions", {"prompt": "warm", "max_tokens": 1}))[0] == 200
        results = await asyncio.wait_for(
            asyncio.gather(*(send(s, r.url, *body(i, max_tokens=4)) for i in range(10 * capacity))), 30)
        metrics = await (await s.get(r.url + "/metrics")).text()
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}
    ok = [text for status, _, text in results if status == 200]
    refused = [(first, text) for status, first, text in results if status == 429]
    # All 20 arrive within one answer's time (0.4 s): the slots and the queue take 4, the rest are refused.
    assert len(ok) == capacity + 2, statuses
    assert all("-3" in text for text in ok)  # every admitted answer is whole
    slowest = max(first for first, _ in refused)
    assert slowest < 0.4, f"a 429 took {slowest * 1000:.0f} ms"  # before any slot frees (0.4 s per answer)
    assert all('"rate_limit_exceeded"' in text for _, text in refused)
    assert all(u.peak == 1 for u in ups) and sum(len(u.finished) for u in ups) == len(ok) + 1
    await eventually(lambda: settled(r))
    assert 'tandem:router_rejected_requests_total{reason="queue_full"} 16.0' in metrics
    assert "tandem:router_queue_wait_seconds_count 5.0" in metrics
    assert "tandem:router_admission_capacity 2.0" in metrics
    assert 'tandem:router_requests_total{endpoint="",route="/v1/completions",status="429"}' in metrics


async def test_cancelled_clients_give_their_slots_back(upstream, router) -> None:
    up = await upstream(name="a", tokens=50, token_delay=0.02)
    r = await router(decode_urls=[up.url], max_in_flight_per_endpoint=2, max_queued_requests=10)
    async with client() as s:
        # Two being answered, four queued; all of them give up.
        tasks = [asyncio.create_task(send(s, r.url, *body(i))) for i in range(6)]
        await eventually(lambda: r.router.admission.queued == 4 and up.running == 2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await eventually(lambda: settled(r))
        assert len(up.seen) == 2  # the queued ones never reached the engine
        status, _, text = await send(s, r.url, "/v1/completions", {"prompt": "after", "max_tokens": 2})
    assert status == 200 and " a-1" in text
    assert settled(r)


async def test_higher_priority_requests_are_admitted_first(upstream, router) -> None:
    up = await upstream(name="a", tokens=10, token_delay=0.1)
    r = await router(decode_urls=[up.url], max_in_flight_per_endpoint=1)
    adm = r.router.admission
    async with client() as s:
        # The first holds the only slot for 1 s while the others queue, one after the other.
        tasks = [asyncio.create_task(send(s, r.url, "/v1/completions", {"prompt": "first"}))]
        await eventually(lambda: up.running == 1)
        for n, priority in enumerate((5, 5, 0, -1, 0)):
            payload = {"prompt": f"p{priority} #{n}", "priority": priority, "max_tokens": 1}
            tasks.append(asyncio.create_task(send(s, r.url, "/v1/completions", payload)))
            await eventually(lambda k=n + 1: adm.queued == k)  # queued in this order
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert [status for status, _, _ in results] == [200] * 6
    order = [seen.body["prompt"] for seen in up.seen]
    assert order == ["first", "p-1 #3", "p0 #2", "p0 #4", "p5 #0", "p5 #1"]
    assert up.peak == 1 and settled(r)


async def test_a_full_queue_makes_room_for_a_higher_priority(upstream, router) -> None:
    up = await upstream(name="a", tokens=10, token_delay=0.1)
    r = await router(decode_urls=[up.url], max_in_flight_per_endpoint=1, max_queued_requests=2)
    adm = r.router.admission
    async with client() as s:
        tasks = [asyncio.create_task(send(s, r.url, "/v1/completions", {"prompt": "first"}))]
        await eventually(lambda: up.running == 1)
        for n in range(2):
            tasks.append(asyncio.create_task(send(s, r.url, "/v1/completions",
                                                  {"prompt": f"low #{n}", "priority": 3, "max_tokens": 1})))
            await eventually(lambda k=n + 1: adm.queued == k)
        same, _, _ = await send(s, r.url, "/v1/completions", {"prompt": "also low", "priority": 3})
        high = {"prompt": "high", "priority": 1, "max_tokens": 1}
        tasks.append(asyncio.create_task(send(s, r.url, "/v1/completions", high)))
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert same == 429  # full, and it outranks nobody
    assert [status for status, _, _ in results] == [200, 200, 429, 200]  # the last low one made room
    assert [seen.body["prompt"] for seen in up.seen] == ["first", "high", "low #0"]


async def test_a_request_that_waits_past_the_queue_timeout_gets_429(upstream, router) -> None:
    up = await upstream(name="a", tokens=4, token_delay=0.25)
    r = await router(decode_urls=[up.url], max_in_flight_per_endpoint=1, queue_timeout=0.2)
    async with client() as s:
        first = asyncio.create_task(send(s, r.url, "/v1/completions", {"prompt": "long"}))
        await eventually(lambda: up.running == 1)
        t0 = time.perf_counter()
        async with s.post(r.url + "/v1/chat/completions", json={"messages": [], "stream": True}) as resp:
            waited = time.perf_counter() - t0
            assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
            err = (await resp.json())["error"]
        assert (await first)[0] == 200
        metrics = await (await s.get(r.url + "/metrics")).text()
    assert 0.2 <= waited < 0.5
    assert err["code"] == 429 and err["type"] == "rate_limit_exceeded" and "0.2 s" in err["message"]
    assert 'tandem:router_rejected_requests_total{reason="queue_timeout"} 1.0' in metrics
    assert len(up.seen) == 1 and settled(r)


async def test_a_wait_foreseen_past_the_queue_timeout_gets_its_429_at_once(upstream, router) -> None:
    """Once the pace is measured (a request holds its slot ~0.4 s here), a burst's requests that would reach
    the only slot after the 1 s queue timeout are refused on arrival with Retry-After, not after waiting
    it out; those that fit wait and are served."""
    up = await upstream(name="a", tokens=2, token_delay=0.2)
    timeout = 1.0
    r = await router(decode_urls=[up.url], max_in_flight_per_endpoint=1, queue_timeout=timeout)
    adm = r.router.admission
    async with client() as s:
        assert (await send(s, r.url, "/v1/completions", {"prompt": "warm"}))[0] == 200
        hold = adm._hold
        assert 0.35 < hold < 0.55, hold  # two tokens 0.2 s apart, and their relay
        fit = sum(1 for ahead in range(10) if (ahead + 1) * hold <= timeout)  # 2: waits of 0.4 and 0.8 s
        burst = [asyncio.create_task(send(s, r.url, "/v1/completions", {"prompt": f"b{i}"})) for i in range(10)]
        await eventually(lambda: sum(t.done() for t in burst) == 10 - 1 - fit)  # the refused, at once
        results = await asyncio.wait_for(asyncio.gather(*burst), 10)
        metrics = await (await s.get(r.url + "/metrics")).text()
    refused = [(first, text) for status, first, text in results if status == 429]
    assert sorted(status for status, _, _ in results) == [200] * (1 + fit) + [429] * (9 - fit)
    assert all(first < timeout / 2 for first, _ in refused), [first for first, _ in refused]
    assert all("at the recent pace" in text and '"rate_limit_exceeded"' in text for _, text in refused)
    assert f'tandem:router_rejected_requests_total{{reason="queue_timeout_foreseen"}} {9 - fit}.0' in metrics
    assert 'reason="queue_timeout"}' not in metrics  # nobody was let in to wait in vain
    await eventually(lambda: settled(r))


async def test_per_endpoint_caps_steer_the_policy_elsewhere(upstream, router) -> None:
    ups = [await upstream(name=n, tokens=10, token_delay=0.05) for n in ("a", "b")]
    # Prefix-aware with a heavy prefix weight sends every request with this prompt where the first went.
    r = await router(decode_urls=[u.url for u in ups], decode_policy="prefix-aware", prefix_weight=100.0,
                     max_in_flight_per_endpoint=2)
    payload = {"prompt": "a long shared system prompt " * 20, "stream": True}
    async with client() as s:
        tasks = [asyncio.create_task(send(s, r.url, "/v1/completions", payload))]
        await eventually(lambda: any(r.router.decode.index.size(u.url) for u in ups))  # its prefix is known
        tasks += [asyncio.create_task(send(s, r.url, "/v1/completions", payload)) for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert [status for status, _, _ in results] == [200] * 4
    assert [(u.peak, len(u.seen)) for u in ups] == [(2, 2), (2, 2)]
    assert r.router.metrics.queue_wait._sum.get() < 0.05  # nobody waited: the other engine had room


async def test_queued_requests_get_503_when_the_last_engine_goes(upstream, router) -> None:
    up = await upstream(name="a", tokens=20, token_delay=0.05)
    r = await router(decode_urls=[up.url], max_in_flight_per_endpoint=1)
    async with client() as s:
        first = asyncio.create_task(send(s, r.url, "/v1/completions", {"prompt": "x", "stream": True}))
        await eventually(lambda: up.running == 1)
        queued = asyncio.create_task(send(s, r.url, "/v1/completions", {"prompt": "y"}))
        await eventually(lambda: r.router.admission.queued == 1)
        r.router.decode.eject(r.router.decode.endpoints[up.url], "test")
        status, _, text = await asyncio.wait_for(queued, 2)
        assert status == 503 and "no healthy decode endpoint" in text
        assert (await first)[0] == 200
    assert settled(r)


async def test_the_cap_is_read_from_the_engine_unless_set(upstream, router) -> None:
    up = await upstream(name="a", max_num_seqs=3)
    r = await router(decode_urls=[up.url], health_interval=0.05)
    ep = r.router.decode.endpoints[up.url]
    await eventually(lambda: ep.max_num_seqs == 3)
    assert r.router.admission.capacity() == 3
    r2 = await router(decode_urls=[up.url], health_interval=0.05, max_in_flight_per_endpoint=5)
    await eventually(lambda: r2.router.decode.endpoints[up.url].healthy)
    assert r2.router.admission.capacity() == 5 and r2.router.decode.endpoints[up.url].max_num_seqs is None
    plain = await upstream(name="b")  # exports no cap: the default
    r3 = await router(decode_urls=[plain.url], health_interval=0.05)
    await eventually(lambda: r3.router.decode.endpoints[plain.url].healthy)
    assert r3.router.admission.capacity() == 64


async def test_without_admission_control_nothing_is_refused(upstream, router) -> None:
    up: TestUpstream = await upstream(name="a", tokens=2, token_delay=0.2)
    r = await router(decode_urls=[up.url], admission_control=False, max_in_flight_per_endpoint=1,
                     max_queued_requests=0)
    async with client() as s:
        results = await asyncio.gather(*(send(s, r.url, *body(i)) for i in range(8)))
    assert [status for status, _, _ in results] == [200] * 8 and up.peak == 8
    assert r.router.admission.admitted == 0


def test_flags() -> None:
    c = config_from_args(["--decode", "http://e:8000", "--max-in-flight-per-endpoint", "8",
                          "--max-queued-requests", "100", "--queue-timeout", "2.5"])
    assert (c.admission_control, c.max_in_flight_per_endpoint, c.max_queued_requests, c.queue_timeout) == \
        (True, 8, 100, 2.5)
    assert not config_from_args(["--decode", "http://e:8000", "--no-admission-control"]).admission_control
    with pytest.raises(SystemExit):
        config_from_args(["--decode", "http://e:8000", "--queue-timeout", "0"])
