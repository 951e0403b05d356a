"""The router's proxy against real test upstreams on real sockets (colocated mode)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from tests.router.conftest import RunningRouter


async def sse_texts(resp: aiohttp.ClientResponse) -> list[Any]:
    events = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


async def test_openai_client_streamed_and_not_through_the_router(upstream, router) -> None:
    up = await upstream(name="a", tokens=3)
    r: RunningRouter = await router(decode_urls=[up.url])
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="unused")
    out = await client.completions.create(model="m", prompt="hello", max_tokens=3)
    assert out.choices[0].text == " a-0 a-1 a-2"
    chat = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == " a-0 a-1 a-2"
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces = []
    usage = None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(pieces) == " a-0 a-1 a-2" and usage is not None and usage.completion_tokens == 3
    models = await client.models.list()
    assert [m.id for m in models.data] == ["test-model"]
    await client.close()
    # The router forwards the client's bytes and a request id; not the client's Authorization.
    assert all("authorization" not in s.headers and s.headers.get("x-request-id") for s in up.seen)


async def test_every_answer_says_where_it_was_routed_and_why(upstream, router) -> None:
    """`X-Tandem-Route` names the engine and the policy's reason, streamed or not: an operator can tell a
    prefix hit from a spill to another engine without reading the router's logs."""
    a = await upstream(name="a")
    b = await upstream(name="b")
    r = await router(decode_urls=[a.url, b.url], decode_policy="prefix-aware")
    prompt = "the same long document " * 40
    routes = []
    async with aiohttp.ClientSession() as s:
        for stream in (False, True, False):
            async with s.post(r.url + "/v1/completions", json={"model": "m", "prompt": prompt, "stream": stream},
                              headers={"X-Request-Id": f"r{len(routes)}"}) as resp:
                assert resp.status == 200
                await resp.read()
                assert resp.headers["X-Request-Id"] == f"r{len(routes)}"
                route = resp.headers["X-Tandem-Route"].split(";")
                routes.append(dict(part.strip().partition("=")[::2] for part in route))
    first, *rest = routes
    assert "cold_hash" in first and first["endpoint"] in (a.url, b.url), routes
    assert all("prefix_hit" in x and x["endpoint"] == first["endpoint"] for x in rest), routes
    assert all(int(x["matched-blocks"]) > 0 for x in rest), routes


async def test_retries_before_first_byte_then_ejects(upstream, router) -> None:
    bad = await upstream(name="bad", status=503)
    good = await upstream(name="good")
    r = await router(decode_urls=[bad.url, good.url], decode_policy="round-robin")
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(r.url + "/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                assert resp.status == 200
                assert (await resp.json())["choices"][0]["text"].startswith(" good-0")
    assert len(bad.seen) == 1  # tried once, ejected on its 503, never again
    assert not r.router.decode.endpoints[bad.url].healthy
    metrics = await (await aiohttp.ClientSession().get(r.url + "/metrics")).text()
    assert 'tandem:router_retries_total{role="decode"} 1.0' in metrics


async def test_refused_connection_is_retried_elsewhere(upstream, router) -> None:
    good = await upstream(name="good")
    dead = await upstream(name="dead")
    dead_url = dead.url
    await dead.stop()
    r = await router(decode_urls=[dead_url, good.url], decode_policy="round-robin")
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(r.url + "/v1/completions", json={"prompt": "x", "stream": True}) as resp:
                assert resp.status == 200
                events = await sse_texts(resp)
                assert events[-1] == "[DONE]" and events[0]["choices"][0]["text"] == " good-0"


async def test_no_healthy_endpoint_is_503_in_openai_shape(upstream, router) -> None:
    bad = await upstream(name="bad", status=503)
    r = await router(decode_urls=[bad.url])
    async with aiohttp.ClientSession() as s:
        async with s.post(r.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 503
            body = await resp.json()
            assert set(body["error"]) == {"message", "type", "param", "code"}
        async with s.post(r.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 503
            assert "no healthy decode endpoint" in (await resp.json())["error"]["message"]
        async with s.get(r.url + "/health") as resp:
            assert resp.status == 503


async def test_client_errors_are_relayed_not_retried(upstream, router) -> None:
    a = await upstream(name="a", status=400)
    b = await upstream(name="b")
    r = await router(decode_urls=[a.url, b.url], decode_policy="round-robin")
    statuses = []
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(r.url + "/v1/completions", json={"prompt": "x"}) as resp:
                statuses.append(resp.status)
                if resp.status == 400:
                    assert (await resp.json())["error"]["message"] == "a says 400"
        async with s.post(r.url + "/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"
    assert sorted(statuses) == [200, 400]
    assert (len(a.seen), len(b.seen)) == (1, 1)  # the 400 was not retried on b
    assert r.router.decode.endpoints[a.url].healthy


async def test_stream_cut_off_mid_way_ends_with_a_clean_error_event(upstream, router) -> None:
    up = await upstream(name="a", tokens=5, cut_after=2)
    r = await router(decode_urls=[up.url])
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    got = []
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        stream = await client.completions.create(model="m", prompt="x", stream=True)
        async for chunk in stream:
            got.append(chunk.choices[0].text)
    assert got == [" a-0", " a-1"]
    await client.close()
    assert not r.router.decode.endpoints[up.url].healthy


async def test_client_disconnect_cancels_the_upstream_request(upstream, router) -> None:
    up = await upstream(name="a", tokens=200, token_delay=0.02)
    r = await router(decode_urls=[up.url])
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            r.url + "/v1/completions",
            json={"prompt": "x", "stream": True},
            headers={"X-Request-Id": "gone-1"},
        )
        await resp.content.readline()
        resp.close()  # the client goes away mid-stream
    for _ in range(100):
        if up.disconnected:
            break
        await asyncio.sleep(0.02)
    assert up.disconnected == ["gone-1"] and up.finished == []
    ep = r.router.decode.endpoints[up.url]
    for _ in range(50):
        if ep.in_flight_requests == 0:
            break
        await asyncio.sleep(0.02)
    assert (ep.in_flight_requests, ep.in_flight_tokens) == (0, 0)
    assert ep.healthy


async def test_client_disconnect_cancels_a_non_streamed_request(upstream, router) -> None:
    up = await upstream(name="a", tokens=100, token_delay=0.02)
    r = await router(decode_urls=[up.url])
    async with aiohttp.ClientSession() as s:
        with pytest.raises(asyncio.TimeoutError):
            await s.post(
                r.url + "/v1/completions",
                json={"prompt": "x"},
                headers={"X-Request-Id": "gone-2"},
                timeout=aiohttp.ClientTimeout(total=0.3),
            )
    for _ in range(100):
        if up.disconnected:
            break
        await asyncio.sleep(0.02)
    assert up.disconnected == ["gone-2"]
    assert r.router.metrics.client_disconnects._value.get() == 1


async def test_upstream_silence_times_out(upstream, router) -> None:
    up = await upstream(name="slow", tokens=3, token_delay=1.0)
    r = await router(decode_urls=[up.url], read_timeout=0.2)
    async with aiohttp.ClientSession() as s:
        async with s.post(r.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 504
        async with s.post(r.url + "/v1/completions", json={"prompt": "x", "stream": True}) as resp:
            events = await sse_texts(resp)
            assert events[0]["error"]["code"] == 504 and events[-1] == "[DONE]"


async def test_api_key_is_required_by_the_router_only(upstream, router) -> None:
    up = await upstream(name="a")
    r = await router(decode_urls=[up.url], api_key="s3cret")
    async with aiohttp.ClientSession() as s:
        async with s.post(r.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
        async with s.post(
            r.url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"}
        ) as resp:
            assert resp.status == 401
        async with s.get(r.url + "/health") as resp:
            assert resp.status == 200
        async with s.get(r.url + "/metrics") as resp:
            assert resp.status == 200
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="s3cret")
    assert (await client.completions.create(model="m", prompt="x")).choices[0].text.startswith(" a-0")
    await client.close()
    assert len(up.seen) == 1 and "authorization" not in up.seen[0].headers


async def test_metrics_count_requests_and_decisions_per_endpoint_and_policy(upstream, router) -> None:
    a = await upstream(name="a")
    b = await upstream(name="b")
    r = await router(decode_urls=[a.url, b.url], decode_policy="prefix-aware")
    async with aiohttp.ClientSession() as s:
        for i in range(4):
            prompt = "a long shared system prompt " * 20 + str(i)
            async with s.post(r.url + "/v1/completions", json={"prompt": prompt}) as resp:
                assert resp.status == 200
        text = await (await s.get(r.url + "/metrics")).text()
    served = a.url if a.seen else b.url
    assert len(a.seen) + len(b.seen) == 4 and (len(a.seen) == 4 or len(b.seen) == 4)
    assert (
        f'tandem:router_routing_decisions_total{{endpoint="{served}",policy="prefix-aware",'
        f'reason="prefix_hit",role="decode"}} 3.0'
    ) in text
    assert f'tandem:router_requests_total{{endpoint="{served}",route="/v1/completions",status="200"}} 4.0' in text
    assert "tandem:router_overhead_seconds_count 4.0" in text
