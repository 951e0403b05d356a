"""End to end with real processes: `tandem up` runs two `tandem serve` engines on the embedded model
behind `tandem route`, and a second router drives the same engines through the P/D flow.

One engine pair for the whole module (startup dominates). The engine-killing test runs last.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from tests.router.engines import ENGINE_ARGS, MODEL, UpProcess

from tandem_router.procs import Child, free_port, metric, tandem_child

pytestmark = pytest.mark.slow
UPSTREAM = "tandem:router_upstream_requests_total"

PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
MESSAGES = [
    {"role": "system", "content": "You are a terse geography tutor. " * 6},
    {"role": "user", "content": "What is the capital of Spain?"},
]


@dataclass
class Stack:
    engines: list[str]
    pids: list[int]
    up: UpProcess  # `tandem up`: two colocated engines behind a round-robin router
    router: str
    pd_router: str  # a second router over the same engines: prefill = engine 0, decode = engine 1


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    d = tmp_path_factory.mktemp("e2e")
    port = free_port()
    up = UpProcess(
        [
            "--port",
            str(port),
            "--prefill",
            "0",
            "--decode",
            "2",
            "--policy",
            "round-robin",
            "--engine-args",
            " ".join(ENGINE_ARGS),
            "--router-args",
            "--health-interval 0.5",
        ],
        d,
    )
    pd: Child | None = None
    try:
        up.wait_for("] ready in", timeout=400)
        engines = [up.url_of(f"engine-{i}") for i in range(2)]
        pids = [up.pid_of(f"engine-{i}") for i in range(2)]
        argv = ["--prefill", engines[0], "--decode", engines[1]]
        pd = tandem_child("pd-router", "route", [*argv, "--remote-prefill-threshold", "0"], d / "pd-router.log",
                          die_with_parent=False).start()
        pd.wait_healthy(timeout=30)
        yield Stack(engines, pids, up, f"http://127.0.0.1:{port}", pd.url)
    finally:
        if pd is not None:
            pd.stop()
        up.interrupt()
    assert up.proc.returncode == 0, up.text()
    assert "[up] stopped" in up.text()


def generate(base: str, stream: bool, chat: bool) -> str:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    kw = {"model": MODEL, "max_tokens": 12, "temperature": 0.0}
    if chat:
        if stream:
            chunks = client.chat.completions.create(messages=MESSAGES, stream=True, **kw)  # type: ignore[call-overload]
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return client.chat.completions.create(messages=MESSAGES, **kw).choices[0].message.content or ""  # type: ignore[call-overload]
    if stream:
        chunks = client.completions.create(prompt=PROMPT, stream=True, **kw)  # type: ignore[call-overload]
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return client.completions.create(prompt=PROMPT, **kw).choices[0].text  # type: ignore[call-overload]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_openai_client_through_router_equals_engine_greedy(stack: Stack, chat: bool) -> None:
    direct = generate(stack.engines[1], stream=False, chat=chat)
    assert direct.strip()
    assert generate(stack.engines[0], stream=True, chat=chat) == direct
    for _ in range(2):  # round-robin: both engines, through the router
        assert generate(stack.router, stream=False, chat=chat) == direct
        assert generate(stack.router, stream=True, chat=chat) == direct


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_openai_client_through_pd_router_equals_engine_greedy(stack: Stack, chat: bool) -> None:
    direct = generate(stack.engines[1], stream=False, chat=chat)
    before = httpx.get(stack.pd_router + "/metrics").text
    assert generate(stack.pd_router, stream=True, chat=chat) == direct
    assert generate(stack.pd_router, stream=False, chat=chat) == direct
    # Each request went to prefill first (max_tokens=1), then decode: remotely prefilled when the
    # engine returned kv_transfer_params, otherwise decode recomputed the prompt (local_fallback).
    name = "tandem:router_upstream_requests_total"
    # The router counts a streamed answer once its stream is closed, which can trail the client's last
    # chunk by a moment: wait for the counters to settle before comparing.
    deadline = time.monotonic() + 10
    while True:
        after = httpx.get(stack.pd_router + "/metrics").text
        settled = metric(after, name, role="decode", outcome="200") - metric(before, name, role="decode", outcome="200")
        if settled >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert metric(after, name, role="prefill", outcome="200") - metric(before, name, role="prefill", outcome="200") == 2
    assert metric(after, name, role="decode", outcome="200") - metric(before, name, role="decode", outcome="200") == 2
    decisions = "tandem:router_pd_decisions_total"
    assert metric(after, decisions) - metric(before, decisions) == 2


def test_kill_an_engine_under_load_then_readmit(stack: Stack) -> None:
    asyncio.run(_kill_under_load(stack))


async def _kill_under_load(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.router + "/v1", api_key="x", max_retries=0)
    outcome: collections.Counter[str] = collections.Counter()
    first_chunk = [asyncio.Event() for _ in range(4)]

    async def one(i: int) -> None:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"{i}: tell a long story",
            max_tokens=60,
            stream=True,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        try:
            async for _ in stream:
                first_chunk[i].set()
            outcome["ok"] += 1
        except openai.APIError as e:
            assert "failed mid-stream" in str(e), e
            outcome["error"] += 1

    load = [asyncio.create_task(one(i)) for i in range(4)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_chunk)), 120)
    async with httpx.AsyncClient() as http:
        text = (await http.get(stack.router + "/metrics")).text
    victim = stack.engines[0]
    on_victim = metric(text, "tandem:router_in_flight_requests", endpoint=victim)
    assert on_victim == 2  # round-robin put half the streams on each engine
    os.kill(stack.pids[0], signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(*load), 180)
    assert outcome == {"error": 2, "ok": 2}, outcome
    # New requests succeed on the survivor (the first may meet a refused connection and be retried).
    for _ in range(3):
        out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0.0)
        assert out.choices[0].text
    async with httpx.AsyncClient() as http:
        text = (await http.get(stack.router + "/metrics")).text
    assert metric(text, UPSTREAM, endpoint=victim, outcome="broken") == 2
    # `tandem up` restarts it on the same port; health checks re-admit it and it serves again.
    await asyncio.to_thread(stack.up.wait_for, "engine-0 ready again", 400)
    assert "restarting engine-0 (1/5)" in stack.up.text()
    async with httpx.AsyncClient() as http:
        for _ in range(100):
            if (await http.get(stack.router + "/health")).json()["decode"][victim]:
                break
            await asyncio.sleep(0.1)
        before = metric(
            (await http.get(stack.router + "/metrics")).text,
            "tandem:router_upstream_requests_total",
            endpoint=victim,
            outcome="200",
        )
        for _ in range(2):
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0.0)
        after = metric(
            (await http.get(stack.router + "/metrics")).text,
            "tandem:router_upstream_requests_total",
            endpoint=victim,
            outcome="200",
        )
    assert after - before == 1
    await client.close()
