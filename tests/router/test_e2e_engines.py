"""End to end with real processes: `tandem up` runs a prefill engine and two decode engines on the
embedded model behind `tandem route`, and a second router sends every prompt through the P/D flow:
prefill engine -> KV blocks over NIXL -> decode engine.

One stack for the whole module (startup dominates). The engine-killing test runs last.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from tests.router.engines import BLOCK_SIZE, DECISIONS, ENGINE_ARGS, MODEL, RECEIVED, UpProcess, blocks_to_read, settled
from tests.router.streams import MAX_TOKENS, Reader, run_all, until

from tandem_router.procs import Child, free_port, metric, scrape, tandem_child

pytestmark = pytest.mark.slow
UPSTREAM = "tandem:router_upstream_requests_total"
DISCONNECTS = "tandem:router_client_disconnects_total"

PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
SYSTEM = "You are a terse geography tutor. " * 6
QUESTION = {"role": "user", "content": "What is the capital of Spain?"}


@dataclass
class Stack:
    prefill: str
    decode: list[str]
    decode_pids: list[int]
    up: UpProcess  # `tandem up`: one prefill and two decode engines behind a round-robin router
    router: str
    pd_router: str  # a second router over prefill-0 and decode-0 that prefills every prompt remotely


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    d = tmp_path_factory.mktemp("e2e")
    port = free_port()
    up = UpProcess(
        [
            "--port",
            str(port),
            "--prefill",
            "1",
            "--decode",
            "2",
            "--policy",
            "round-robin",
            "--engine-args",
            " ".join([*ENGINE_ARGS, "--block-size", str(BLOCK_SIZE)]),
            "--router-args",
            "--health-interval 0.5",
        ],
        d,
    )
    pd: Child | None = None
    try:
        up.wait_for("] ready in", timeout=400)
        decode = [up.url_of(f"decode-{i}") for i in range(2)]
        pids = [up.pid_of(f"decode-{i}") for i in range(2)]
        argv = ["--prefill", up.url_of("prefill-0"), "--decode", decode[0], "--remote-prefill-threshold", "0"]
        pd = tandem_child("pd-router", "route", argv, d / "pd-router.log", die_with_parent=False).start()
        pd.wait_healthy(timeout=30)
        yield Stack(up.url_of("prefill-0"), decode, pids, up, f"http://127.0.0.1:{port}", pd.url)
    finally:
        if pd is not None:
            pd.stop()
        up.interrupt()
    assert up.proc.returncode == 0, up.text()
    assert "[up] stopped" in up.text()


def messages(tag: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": tag + SYSTEM}, QUESTION]


def generate(base: str, stream: bool, chat: bool, tag: str = "") -> str:
    """A greedy answer; `tag` starts the prompt, so that a tagged prompt shares no KV block with another."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    kw = {"model": MODEL, "max_tokens": 12, "temperature": 0.0}
    if chat:
        if stream:
            chunks = client.chat.completions.create(messages=messages(tag), stream=True, **kw)  # type: ignore[call-overload]
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return client.chat.completions.create(messages=messages(tag), **kw).choices[0].message.content or ""  # type: ignore[call-overload]
    if stream:
        chunks = client.completions.create(prompt=tag + PROMPT, stream=True, **kw)  # type: ignore[call-overload]
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return client.completions.create(prompt=tag + PROMPT, **kw).choices[0].text  # type: ignore[call-overload]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_openai_client_through_router_equals_engine_greedy(stack: Stack, chat: bool) -> None:
    direct = generate(stack.decode[1], stream=False, chat=chat)
    assert direct.strip()
    assert generate(stack.decode[0], stream=True, chat=chat) == direct
    for _ in range(2):  # round-robin: both decode engines, through the router
        assert generate(stack.router, stream=False, chat=chat) == direct
        assert generate(stack.router, stream=True, chat=chat) == direct


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_pd_router_prefills_remotely_and_equals_engine_greedy(stack: Stack, chat: bool) -> None:
    decode = stack.decode[0]
    before = httpx.get(stack.pd_router + "/metrics").text
    received, served = scrape(decode, RECEIVED), scrape(decode, "vllm:request_success_total")
    blocks = 0
    for stream in (True, False):
        # A prompt no other request used: decode-0 holds none of its blocks and reads every one of them.
        tag = f"{'Chat' if chat else 'Text'} round, {'streamed' if stream else 'whole'} answer. "
        direct = generate(stack.decode[1], stream=False, chat=chat, tag=tag)
        assert generate(stack.pd_router, stream=stream, chat=chat, tag=tag) == direct
        blocks += blocks_to_read(decode, **({"messages": messages(tag)} if chat else {"prompt": tag + PROMPT}))

    def router_count(name: str, **labels: str) -> float:
        return scrape(stack.pd_router, name, **labels) - metric(before, name, **labels)

    # Each request went to prefill first (max_tokens=1), then to decode with prefill's kv_transfer_params,
    # and decode answered both. The router saw no failed decode leg. It may count the streamed one as a
    # client disconnect instead of a 200: the openai client closes a stream at `[DONE]`, which can beat
    # the engine's end of stream to the router.
    assert settled(lambda: scrape(decode, "vllm:request_success_total") - served, 2) == 2
    legs = settled(lambda: router_count(UPSTREAM, role="decode", outcome="200") + router_count(DISCONNECTS), 2)
    decode_ok = router_count(UPSTREAM, role="decode", outcome="200")
    assert legs >= 2 and decode_ok in (1, 2) and router_count(UPSTREAM, role="decode") == decode_ok
    assert router_count(UPSTREAM, role="prefill", outcome="200") == 2
    assert router_count(DECISIONS, decision="remote") == 2
    assert router_count(DECISIONS) == 2
    # ... and decode read each prompt's KV blocks from the prefill engine over NIXL.
    assert settled(lambda: scrape(decode, RECEIVED) - received, blocks) == blocks


def test_pd_next_turn_goes_to_the_decode_engine_holding_the_conversation(stack: Stack, tmp_path: Path) -> None:
    """A prefix-aware P/D router over all three engines: turn 1 is prefilled remotely and its KV lands on
    one decode engine (which publishes it); turn 2 goes to that engine, whose exact cached length makes
    the rest short enough to prefill there, and the engine's reported hit is what the router predicted."""
    argv = ["--prefill", stack.prefill, "--decode", ",".join(stack.decode), "--policy", "prefix-aware",
            "--health-interval", "0.5"]
    router = tandem_child("kv-router", "route", argv, tmp_path / "kv-router.log", die_with_parent=False).start()
    try:
        router.wait_healthy(timeout=30)
        turn1 = messages("A conversation about harbours. ")
        probe = {"model": MODEL, "messages": turn1}
        deadline = time.monotonic() + 60
        while not httpx.post(router.url + "/route/v1/chat/completions", json=probe, timeout=10).json()["exact"]:
            assert time.monotonic() < deadline, "the router does not follow the engines' KV events"
            time.sleep(0.2)
        body = {"model": MODEL, "max_tokens": 12, "temperature": 0.0}
        first = httpx.post(router.url + "/v1/chat/completions", json={**body, "messages": turn1}, timeout=120).json()
        turn2 = [*turn1, first["choices"][0]["message"], {"role": "user", "content": "And of Portugal?"}]
        ask = {**body, "messages": turn2}
        deadline = time.monotonic() + 30
        while not (where := httpx.post(router.url + "/route/v1/chat/completions", json=ask, timeout=10).json())[
                "cached_tokens"]:
            assert time.monotonic() < deadline, "turn 1's KV never showed up in the index"
            time.sleep(0.2)
        holder, cached = where["endpoint"], where["cached_tokens"][where["endpoint"]]
        assert where["reason"] == "prefix_hit" and list(where["cached_tokens"]) == [holder]
        assert where["prompt_tokens"] - cached <= 32  # the default remote-prefill threshold
        served = scrape(holder, "vllm:request_success_total")
        second = httpx.post(router.url + "/v1/chat/completions", json=ask, timeout=120).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == min(cached, second["usage"][
            "prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert settled(lambda: scrape(holder, "vllm:request_success_total") - served, 1) == 1
        text = httpx.get(router.url + "/metrics", timeout=10).text
        assert metric(text, DECISIONS, decision="remote") == 1
        assert metric(text, DECISIONS, decision="local_short_uncached") == 1
        assert metric(text, "tandem:router_prefix_index_lookups_total", role="decode", index="exact") >= 2
    finally:
        router.stop()


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "role": {"enum": ["admin", "user", "guest"]},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}},
    "required": ["name", "age", "role", "hobbies", "address"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
    "additionalProperties": False}}}
PARAMETERS: dict[str, Any] = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}  # type: ignore[index]


PHONES = r"(\+[0-9]{2} [0-9]{3}-[0-9]{4}\n){5}"


def structured(i: int) -> tuple[str, dict[str, Any]]:
    """Streamed request i, seeded at temperature 1, by i % 4: a person as JSON under a strict schema; calls
    demanded of two tools (`required`); one call of a named tool; five phone numbers by a regex (completions)."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 200, "stream": True, "temperature": 1.0,
                            "seed": 2000 + i, "return_token_ids": True, "stream_options": {"include_usage": True}}
    kind = i % 4
    if kind == 3:
        return "/v1/completions", {**body, "prompt": f"Phone book {i}:\n", "structured_outputs": {"regex": PHONES}}
    ask = [{"role": "user", "content": f"Weather in city number {i}, and the time in Tokyo?"}]
    if kind == 1:
        return "/v1/chat/completions", {**body, "tools": [WEATHER, TIME], "tool_choice": "required", "messages": ask}
    if kind == 2:
        return "/v1/chat/completions", {**body, "tools": [WEATHER, TIME], "parallel_tool_calls": False,
                                        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                                        "messages": ask}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Person {i} as JSON."}],
                                    "response_format": {"type": "json_schema", "json_schema": {
                                        "name": "person", "schema": PERSON, "strict": True}}}


def valid(r: Reader) -> None:
    """Reader `r` got what its request demanded."""
    assert not r.errors, (r.i, r.errors)
    kind = r.i % 4
    if kind in (1, 2):
        assert r.finish == ["tool_calls"] and r.calls and not r.text.strip(), (r.i, r.finish, r.text, r.calls)
        assert kind == 1 or [c["name"] for c in r.calls.values()] == ["get_time"], r.calls
        for call in r.calls.values():
            jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
    elif kind == 3:
        assert r.finish == ["stop"] and re.fullmatch(PHONES, r.text), (r.i, r.finish, r.text)
    else:
        assert r.finish == ["stop"], (r.i, r.finish, r.text)
        jsonschema.validate(json.loads(r.text), PERSON)


def calls(r: Reader) -> list[tuple[str, str]]:
    return [(c["name"], c["arguments"]) for _, c in sorted(r.calls.items())]


class Person(pydantic.BaseModel):
    name: str
    age: int
    hobbies: list[str]
    nickname: str | None = None


def test_structured_outputs_and_tool_calls_through_pd_equal_the_decode_engines_own(stack: Stack) -> None:
    """Through the router that prefills every prompt on the prefill engine: each structured answer (JSON under a
    schema, calls of tools required or named, a regex) is valid and equals the decode engine's own answer to
    the same request, token for token; so do the SDK's parse() with a Pydantic model, streamed and not, a
    json_object, a choice, an `auto` answer and a second turn with a tool's result; the prefill engine
    computed every prompt."""
    before = scrape(stack.pd_router, DECISIONS, decision="remote")
    through = asyncio.run(run_all(stack.pd_router, 8, build=structured))
    direct = asyncio.run(run_all(stack.decode[0], 8, build=structured))
    for r, d in zip(through, direct, strict=True):
        valid(r)
        assert (r.ids, r.text, r.finish, calls(r)) == (d.ids, d.text, d.finish, calls(d)), r.i
    pd, engine = (openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0) for u in (stack.pd_router,
                                                                                         stack.decode[0]))
    ask = [{"role": "user", "content": "Describe a person named Ada, as JSON."}]
    both = [c.chat.completions.parse(model=MODEL, messages=ask, response_format=Person, max_tokens=200,  # type: ignore[arg-type]
                                     temperature=0) for c in (pd, engine)]
    assert isinstance(both[0].choices[0].message.parsed, Person)
    assert both[0].choices[0].message.parsed == both[1].choices[0].message.parsed
    with pd.chat.completions.stream(model=MODEL, messages=ask, response_format=Person, max_tokens=200,  # type: ignore[arg-type]
                                    temperature=0) as streamed:
        assert streamed.get_final_completion().choices[0].message.parsed == both[1].choices[0].message.parsed
    kinds: list[dict[str, Any]] = [
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"tools": [WEATHER], "tool_choice": "auto"},
        {"tools": [WEATHER], "tool_choice": "required"},
    ]
    answers = []
    for extra in kinds:
        bodies = [c.chat.completions.create(model=MODEL, messages=ask, max_tokens=120, temperature=0,
                                            extra_body=extra) for c in (pd, engine)]  # type: ignore[call-overload]
        said = [(m.content, [(t.function.name, t.function.arguments) for t in m.tool_calls or []])  # type: ignore[union-attr]
                for m in (b.choices[0].message for b in bodies)]
        assert said[0] == said[1], extra
        answers.append(bodies[0].choices[0].message)
    assert isinstance(json.loads(answers[0].content or ""), dict) and answers[1].content in ("yes", "no")
    call = (answers[3].tool_calls or [])[0]
    turn = [*ask, answers[3].model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id,
                                                            "content": "21 degrees"}]
    second = [c.chat.completions.create(model=MODEL, messages=turn, tools=[WEATHER], max_tokens=30,  # type: ignore[list-item]
                                        temperature=0) for c in (pd, engine)]
    assert second[0].choices[0].message.content == second[1].choices[0].message.content
    n = 8 + 2 + len(kinds) + 1  # every request through the P/D router above prefilled remotely
    assert settled(lambda: scrape(stack.pd_router, DECISIONS, decision="remote"), before + n) == before + n


def test_structured_streams_resume_in_their_grammar_when_their_decode_engine_dies(stack: Stack) -> None:
    """Eight structured streams through the round-robin router, kill -9 decode-1 mid-stream: its four resume on
    decode-0 as themselves with the tokens so far (`resume_token_ids`), and every answer is valid and equal,
    token for token, call for call, to the same request's in a run without the failure."""
    baseline = asyncio.run(run_all(stack.router, 8, build=structured))
    for b in baseline:
        valid(b)
    victim = stack.decode[1]
    migrations = scrape(stack.router, "tandem:router_migrations_total")

    async def kill(readers: list[Reader]) -> None:
        await until(lambda: all(x.chunks >= 3 for x in readers), 120, "streams never got going")
        os.killpg(stack.decode_pids[1], signal.SIGKILL)
        await admitted(stack.router, victim, False, timeout=30)

    failed = asyncio.run(run_all(stack.router, 8, kill, build=structured))
    for b, f in zip(baseline, failed, strict=True):
        valid(f)
        assert (f.ids, f.text, f.finish, calls(f)) == (b.ids, b.text, b.finish, calls(b)), f"request {f.i} differs"
        assert f.usage["completion_tokens"] == b.usage["completion_tokens"]
    assert scrape(stack.router, "tandem:router_migrations_total") - migrations == 4
    # Both engines again for the tests after this one.
    stack.up.wait_for("decode-1 ready again", 400)
    asyncio.run(admitted(stack.router, victim, True, timeout=30))


def test_kill_a_decode_engine_under_load_streams_migrate_then_it_is_readmitted(stack: Stack) -> None:
    asyncio.run(_kill_under_load(stack))


async def _kill_under_load(stack: Stack) -> None:
    """P/D: 16 streams (chat and completions, greedy and seeded) through the round-robin router, half on
    each decode engine; kill -9 decode-0 mid-stream. Its streams resume on decode-1 (a local prefill of
    the prompt and the text so far, docs/architecture.md), every answer equals the same request's in a
    run without the failure, and the engines left hold no KV block afterwards."""
    baseline = await run_all(stack.router, 16)
    assert all(len(b.ids) == MAX_TOKENS and not b.errors for b in baseline)
    victim = stack.decode[0]
    migrations = await asyncio.to_thread(scrape, stack.router, "tandem:router_migrations_total")

    async def kill(readers: list[Reader]) -> None:
        await until(lambda: all(x.chunks >= 3 for x in readers), 120, "streams never got going")
        async with httpx.AsyncClient() as http:
            text = (await http.get(stack.router + "/metrics")).text
        assert metric(text, "tandem:router_in_flight_requests", endpoint=victim) == 8  # round-robin: half
        os.killpg(stack.decode_pids[0], signal.SIGKILL)
        # Noticed at once (before `tandem up` restarts it and the health checks admit it again).
        await admitted(stack.router, victim, False, timeout=30)

    failed = await run_all(stack.router, 16, kill)
    for b, f in zip(baseline, failed, strict=True):
        assert not f.errors, (f.i, f.errors)
        assert (f.ids, f.text, f.finish) == (b.ids, b.text, b.finish), f"request {f.i} differs after migration"
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens differ: a second run
        assert [f.usage[k] for k in counts] == [b.usage[k] for k in counts]
    for survivor in (stack.decode[1], stack.prefill):
        await until(lambda s=survivor: scrape(s, "vllm:kv_cache_usage_perc") == 0.0, 30, f"{survivor} holds KV blocks")
    async with httpx.AsyncClient() as http:
        text = (await http.get(stack.router + "/metrics")).text
    assert metric(text, "tandem:router_migrations_total") - migrations == 8
    assert metric(text, UPSTREAM, endpoint=victim, outcome="broken") == 8
    client = openai.AsyncOpenAI(base_url=stack.router + "/v1", api_key="x", max_retries=0)
    # New requests succeed on the survivor (the first may meet a refused connection and be retried).
    for _ in range(3):
        out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0.0)
        assert out.choices[0].text
    # `tandem up` restarts it on the same port; health checks re-admit it and it serves again.
    await asyncio.to_thread(stack.up.wait_for, "decode-0 ready again", 400)
    assert "restarting decode-0 (1/5)" in stack.up.text()
    await admitted(stack.router, victim, True, timeout=30)
    async with httpx.AsyncClient() as http:
        before = metric((await http.get(stack.router + "/metrics")).text, UPSTREAM, endpoint=victim, outcome="200")
        for _ in range(2):
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0.0)
        after = metric((await http.get(stack.router + "/metrics")).text, UPSTREAM, endpoint=victim, outcome="200")
    assert after - before == 1
    await client.close()


async def admitted(router: str, endpoint: str, healthy: bool, timeout: float) -> None:
    """Wait until the router's /health and its `endpoint_healthy` gauge both show `endpoint` as
    `healthy`; fail the test if they do not within `timeout`."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            state = (await http.get(router + "/health")).json()["decode"][endpoint]
            gauge = metric((await http.get(router + "/metrics")).text, "tandem:router_endpoint_healthy",
                           role="decode", endpoint=endpoint)
            if state is healthy and gauge == float(healthy):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"{endpoint} not {'admitted' if healthy else 'ejected'} within {timeout}s "
                            f"(/health says {state}, the gauge {gauge})")
            await asyncio.sleep(0.05)
