"""The P/D flow (docs/architecture.md, "The P/D request flow") against test upstreams acting as prefill and
decode engines."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from tests.router.utils import eventually

LONG = "You are a helpful assistant who answers in detail. " * 12


async def test_pd_flow_prefill_then_decode_with_kv_params(upstream, router) -> None:
    p = await upstream(name="p")
    d = await upstream(name="d", tokens=3)
    r = await router(decode_urls=[d.url], prefill_urls=[p.url], remote_prefill_threshold=0)
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x")
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": LONG}],
        stream=True,
        max_tokens=3,
        extra_body={"min_tokens": 2},
        stream_options={"include_usage": True},
    )
    text = "".join([c.choices[0].delta.content async for c in stream if c.choices])
    assert text == " d-0 d-1 d-2"
    await client.close()
    [pre] = p.seen
    [dec] = d.seen
    assert pre.body["max_tokens"] == 1 and pre.body["stream"] is False
    assert "min_tokens" not in pre.body and "stream_options" not in pre.body
    assert pre.body["kv_transfer_params"]["do_remote_decode"] is True
    assert pre.body["messages"] == dec.body["messages"]
    # decode gets the original request plus what prefill returned
    assert dec.body["stream"] is True and dec.body["max_tokens"] == 3 and dec.body["min_tokens"] == 2
    assert dec.body["kv_transfer_params"]["remote_engine_id"] == "p"
    assert dec.body["kv_transfer_params"]["remote_block_ids"] == [1, 2, 3]
    assert pre.headers["x-request-id"] == dec.headers["x-request-id"]


async def test_pd_short_uncached_prompt_skips_remote_prefill(upstream, router) -> None:
    p = await upstream(name="p")
    d = await upstream(name="d")
    r = await router(decode_urls=[d.url], prefill_urls=[p.url], remote_prefill_threshold=32)
    async with aiohttp.ClientSession() as s:
        async with s.post(r.url + "/v1/completions", json={"prompt": "short prompt"}) as resp:
            assert resp.status == 200
        assert (len(p.seen), len(d.seen)) == (0, 1)
        async with s.post(r.url + "/v1/completions", json={"prompt": LONG}) as resp:
            assert resp.status == 200
        assert (len(p.seen), len(d.seen)) == (1, 2)
        # The same long prompt again: its blocks are on the decode endpoint now, little is uncached.
        async with s.post(r.url + "/v1/completions", json={"prompt": LONG + "and a short follow-up"}) as resp:
            assert resp.status == 200
        assert (len(p.seen), len(d.seen)) == (1, 3)
        assert "kv_transfer_params" not in d.seen[2].body
        text = await (await s.get(r.url + "/metrics")).text()
    assert 'tandem:router_pd_decisions_total{decision="local_short_uncached"} 2.0' in text
    assert 'tandem:router_pd_decisions_total{decision="remote"} 1.0' in text
    assert f'tandem:router_upstream_requests_total{{endpoint="{p.url}",outcome="200",role="prefill"}} 1.0' in text
    assert f'tandem:router_upstream_requests_total{{endpoint="{p.url}",outcome="200",role="prefill"}} 1.0' in text


@pytest.mark.parametrize("extra", [{"n": 2}, {"best_of": 2}, {"prompt": [LONG, LONG + "again"]}],
                         ids=["n", "best_of", "two-prompts"])
async def test_pd_several_sequences_prefill_on_decode(upstream, router, extra) -> None:
    """An engine takes kv_transfer_params only for one prompt and one sequence: a request asking for more
    goes straight to decode, which prefills locally, instead of failing there with a 400."""
    p = await upstream(name="p")
    d = await upstream(name="d")
    r = await router(decode_urls=[d.url], prefill_urls=[p.url], remote_prefill_threshold=0)
    async with aiohttp.ClientSession() as s:
        async with s.post(r.url + "/v1/completions", json={"prompt": LONG, **extra}) as resp:
            assert resp.status == 200
        text = await (await s.get(r.url + "/metrics")).text()
    assert p.seen == [] and len(d.seen) == 1 and "kv_transfer_params" not in d.seen[0].body
    assert 'tandem:router_pd_decisions_total{decision="local_several_sequences"} 1.0' in text


async def long_prompt_with_prefill_answering(upstream, router, status: int):  # type: ignore[no-untyped-def]
    """LONG through a router whose one prefill upstream answers `status`: prefill, decode and the
    router's response (its status and text)."""
    p = await upstream(name="p", status=status)
    d = await upstream(name="d")
    r = await router(decode_urls=[d.url], prefill_urls=[p.url], remote_prefill_threshold=0)
    async with aiohttp.ClientSession() as s:
        async with s.post(r.url + "/v1/completions", json={"prompt": LONG}) as resp:
            return p, d, resp.status, await resp.text()


async def test_pd_failed_prefill_falls_back_to_local_prefill(upstream, router) -> None:
    p, d, status, text = await long_prompt_with_prefill_answering(upstream, router, 500)
    assert status == 200
    assert json.loads(text)["choices"][0]["text"].startswith(" d-0")
    assert len(p.seen) == 1 and "kv_transfer_params" not in d.seen[0].body


async def test_pd_prefill_rejecting_the_request_is_relayed(upstream, router) -> None:
    _, d, status, _ = await long_prompt_with_prefill_answering(upstream, router, 400)
    assert status == 400
    assert d.seen == []


async def test_pd_prefill_retried_on_another_prefill_endpoint(upstream, router) -> None:
    p1 = await upstream(name="p1", status=503)
    p2 = await upstream(name="p2", status=503)
    good = await upstream(name="p3")
    d = await upstream(name="d")
    r = await router(
        decode_urls=[d.url],
        prefill_urls=[p1.url, p2.url, good.url],
        remote_prefill_threshold=0,
        prefill_policy="round-robin",
    )
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(r.url + "/v1/completions", json={"prompt": LONG, "stream": True}) as resp:
                assert resp.status == 200
                await resp.read()
    assert [x.body["kv_transfer_params"]["remote_engine_id"] for x in d.seen] == ["p3"] * 3
    # Round-robin over three reaches a bad one; each bad one is tried once, then ejected.
    assert len(p1.seen) <= 1 and len(p2.seen) <= 1 and len(p1.seen) + len(p2.seen) >= 1
    assert len(good.seen) == 3


async def test_pd_client_disconnect_during_prefill_cancels_it_and_skips_decode(upstream, router) -> None:
    p = await upstream(name="p", token_delay=5.0)
    d = await upstream(name="d")
    r = await router(decode_urls=[d.url], prefill_urls=[p.url], remote_prefill_threshold=0)
    async with aiohttp.ClientSession() as s:
        with pytest.raises(asyncio.TimeoutError):
            await s.post(
                r.url + "/v1/completions",
                json={"prompt": LONG, "stream": True},
                headers={"X-Request-Id": "gone-pd"},
                timeout=aiohttp.ClientTimeout(total=0.3),
            )
    await eventually(lambda: p.disconnected == ["gone-pd"])
    await asyncio.sleep(0.1)
    assert d.seen == [] and p.finished == []
    ep = r.router.prefill.endpoints[p.url]
    assert (ep.in_flight_requests, ep.in_flight_tokens, ep.healthy) == (0, 0, True)


async def test_a_decode_leg_its_revision_cannot_take_is_prefilled_on_another_decode(upstream, router) -> None:
    """The decode endpoint chosen for a prompt whose KV waits on a prefill engine of revision "a" answers 503 (it
    began to drain before the router saw it leave), and no other decode endpoint of "a" is up: the request is
    not failed, nor is the KV handed across revisions; a decode endpoint of "b" prefills it itself."""
    p = await upstream(name="p", revision="a")
    draining = await upstream(name="da", revision="a", status=503)
    other = await upstream(name="db", revision="b")
    r = await router(decode_urls=[draining.url, other.url], prefill_urls=[p.url], remote_prefill_threshold=0,
                     health_interval=60)  # one round of checks at start: each endpoint's revision, then none
    async with aiohttp.ClientSession() as s:
        async with s.post(r.url + "/v1/completions", json={"prompt": LONG}) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["choices"][0]["text"].startswith(" db-0")
        text = await (await s.get(r.url + "/metrics")).text()
    assert len(p.seen) == 1 and "kv_transfer_params" in draining.seen[0].body
    assert "kv_transfer_params" not in other.seen[0].body
    assert 'tandem:router_pd_decisions_total{decision="local_fallback"} 1.0' in text
    assert 'decision="remote"' not in text
