"""Mid-stream migration against upstreams that sample by position (tests/router/upstream.py): what the
client reads is one answer, whichever upstreams produced it. The real engines' version is in
tests/router/test_migration_e2e.py."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from tandem_router.procs import metric

EXPECTED = "".join(f" w{p}" for p in range(5, 13))  # 8 tokens after a 5-token prompt


async def pair(upstream, cut_after: int) -> tuple[Any, Any]:
    """Two positional upstreams in the order a fresh round-robin router tries them (by URL); the first
    cuts its streams after `cut_after` tokens."""
    a, b = sorted([await upstream(name=n, tokens=8, positional=True) for n in "ab"], key=lambda u: u.url)
    a.cut_after = cut_after
    return a, b


async def stream(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    async with aiohttp.ClientSession() as s, s.post(url + path, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data: "):
                data = line[6:].decode()
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def text_of(events: list[Any], chat: bool) -> str:
    out = ""
    for e in events:
        for c in e.get("choices", []) if isinstance(e, dict) else []:
            out += (c.get("delta") or {}).get("content") or "" if chat else c.get("text") or ""
    return out


async def test_a_cut_completions_stream_resumes_on_another_upstream(upstream, router) -> None:
    a, b = await pair(upstream, 3)
    r = await router(decode_urls=[a.url, b.url], decode_policy="round-robin")
    body = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream_options": {"include_usage": True}}
    events = await stream(r.url, "/v1/completions", body)
    assert text_of(events, chat=False) == EXPECTED
    assert events[-1] == "[DONE]" and sum(e == "[DONE]" for e in events) == 1
    chunks = [e for e in events if isinstance(e, dict)]
    assert {e["id"] for e in chunks} == {chunks[0]["id"]}  # one answer id throughout
    assert [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    assert not any("token_ids" in c or "prompt_token_ids" in c for e in chunks for c in e["choices"])
    # b got the prompt's ids plus the 3 sent, for the 5 tokens left, with the client's sampling settings.
    resumed = b.seen[-1].body
    assert resumed["prompt"] == [0, 1, 2, 3, 4, 5, 6, 7] and resumed["max_tokens"] == 5
    assert resumed["return_token_ids"] is True and resumed["add_special_tokens"] is False
    async with aiohttp.ClientSession() as s, s.get(r.url + "/metrics") as resp:
        text = await resp.text()
    assert metric(text, "tandem:router_migrations_total", reason="connection") == 1
    assert metric(text, "tandem:router_in_flight_requests", endpoint=b.url) == 0


async def test_a_cut_chat_stream_resumes_in_chat_format(upstream, router) -> None:
    a, b = await pair(upstream, 5)
    r = await router(decode_urls=[a.url, b.url], decode_policy="round-robin")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "return_token_ids": True}
    events = await stream(r.url, "/v1/chat/completions", body)
    assert text_of(events, chat=True) == EXPECTED
    chunks = [e for e in events if isinstance(e, dict)]
    assert {(e["id"], e["object"]) for e in chunks} == {(chunks[0]["id"], "chat.completion.chunk")}
    # The client asked for token ids: it gets every generated id once, and the prompt's once.
    assert [i for e in chunks for c in e["choices"] for i in c.get("token_ids", [])] == list(range(5, 13))
    assert [e.get("prompt_token_ids") for e in chunks if "prompt_token_ids" in e] == [[0, 1, 2, 3, 4]]
    assert "usage" not in chunks[-1]  # not asked for


async def test_a_resumed_request_keeps_the_budget_the_engine_would_have_given_it(upstream, router) -> None:
    """The continuation is a completions request, whose max_tokens defaults to 16 (OpenAI's default): a chat
    that set no limit (the end of the context) is resumed with `"max_tokens": null`, which asks an engine
    for the end of the context, and a completion that set none with what is left of its 16."""
    a, b = await pair(upstream, 3)
    r = await router(decode_urls=[a.url, b.url], decode_policy="round-robin")
    # The upstreams answer 8 tokens unless max_tokens is smaller: 3 from a, then 8 more from b.
    whole = "".join(f" w{p}" for p in range(5, 5 + 3 + 8))
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert text_of(await stream(r.url, "/v1/chat/completions", chat), chat=True) == whole
    assert "max_tokens" in b.seen[-1].body and b.seen[-1].body["max_tokens"] is None
    a, b = await pair(upstream, 3)  # a is ejected now: a new pair
    r = await router(decode_urls=[a.url, b.url], decode_policy="round-robin")
    assert text_of(await stream(r.url, "/v1/completions", {"model": "m", "prompt": "hello"}), chat=False) == whole
    assert b.seen[-1].body["max_tokens"] == 16 - 3


async def test_migrations_are_bounded_and_end_with_a_clean_error(upstream, router) -> None:
    ups = [await upstream(name=n, tokens=8, positional=True, cut_after=2) for n in "abc"]
    r = await router(decode_urls=[u.url for u in ups], decode_policy="round-robin", max_migrations=1)
    events = await stream(r.url, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 8})
    assert text_of(events, chat=False) == " w5 w6 w7 w8"  # 2 from the first, 2 from the second
    assert events[-2]["error"]["code"] == 502 and "--max-migrations" in events[-2]["error"]["message"]
    assert events[-1] == "[DONE]"
    # Alone, a broken upstream has nowhere to go: a clean error event, no hang.
    solo = await upstream(name="solo", tokens=8, positional=True, cut_after=2)
    r2 = await router(decode_urls=[solo.url])
    events = await stream(r2.url, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 8})
    assert events[-2]["error"]["code"] == 503 and events[-1] == "[DONE]"


async def test_no_migration_when_disabled_or_unsupported(upstream, router) -> None:
    a, b = await pair(upstream, 2)
    r = await router(decode_urls=[a.url, b.url], decode_policy="round-robin", max_migrations=0)
    events = await stream(r.url, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 8})
    assert events[-2]["error"]["code"] == 502 and "return_token_ids" not in a.seen[-1].body
    # logprobs cannot be stitched across engines: such a stream is not resumable, and asks for no ids.
    r = await router(decode_urls=[a.url, b.url], decode_policy="round-robin")
    events = await stream(r.url, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 8, "logprobs": 1})
    assert "error" in events[-2] and "return_token_ids" not in a.seen[-1].body
