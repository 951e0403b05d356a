"""A prefill engine killed between its answers and the decode engines' reads: real engines (one prefill, two
decodes) behind the router, 16 concurrent streamed P/D requests. The decode engines' EngineCores are paused
(SIGSTOP) while the prefill engine answers every prefill leg, the prefill engine is killed (kill -9), and the decode
engines resume: every KV load then fails (`--kv-failure-policy fail`, the default), each decode engine
answers its streams with an error before their first token, and the router replays each request whole on
decode, which prefills it itself. No client sees an error, and every answer equals decode's own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from tandem_router.procs import Child, engine_pids, free_port, scrape, stop_all, tandem_child

pytestmark = pytest.mark.slow
N = 16
MAX_TOKENS = 24
MODEL = "smollm2-135m-instruct"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def prompt(i: int) -> str:
    """Long enough (well above the router's 32-token remote-prefill threshold) and new to every engine."""
    return f"Note {i}: " + " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(120))


def serve(name: str, args: list[str], logs: Path) -> Child:
    return tandem_child(name, "serve", ["--model", MODEL, "--dtype", "float32", "--num-threads", "1", *args],
                        logs / f"{name}.log").start()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Child, list[Child], Child]]:
    prefill = serve("prefill", ["--role", "prefill", "--kv-side-channel-port", str(free_port())], tmp_path)
    decodes = [serve(f"decode{i}", ["--role", "decode"], tmp_path) for i in range(2)]
    children = [prefill, *decodes]
    try:
        for c in children:
            c.wait_healthy(300)
        # No health checks (a paused engine would be ejected) and time enough to wait out the pause.
        router = tandem_child("router", "route", ["--prefill", prefill.url, *[a for d in decodes for a in
                                                                              ("--decode", d.url)],
                                                  "--health-interval", "0", "--read-timeout", "300"],
                              tmp_path / "router.log").start()
        children.append(router)
        router.wait_healthy(60)
        yield prefill, decodes, router
    finally:
        stop_all(children)


def signal_engine_cores(engine: Child, sig: int) -> None:
    """`sig` to the engine's EngineCore processes (its API server keeps accepting requests)."""
    assert engine.proc is not None
    for pid in engine_pids(engine.proc.pid):
        os.kill(pid, sig)


async def stream(http: aiohttp.ClientSession, url: str, i: int) -> tuple[int, str, list[str]]:
    """Request i streamed through the router: its status, its text and the error events it carried."""
    body = {"model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "temperature": 0}
    text, errors = "", []
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return resp.status, await resp.text(), []
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"]["message"])
                else:
                    text += "".join(c["text"] for c in event["choices"])
    return 200, text, errors


async def test_streams_whose_prefill_engine_died_before_the_read_are_replayed_with_local_prefill(stack) -> None:
    prefill, decodes, router = stack
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        warm = await stream(http, router.url, 1000)  # the NIXL handshakes
        assert warm[0] == 200 and not warm[2], warm
        answered = scrape(prefill.url, "vllm:request_success_total")
        for d in decodes:
            signal_engine_cores(d, signal.SIGSTOP)
        try:
            tasks = [asyncio.create_task(stream(http, router.url, i)) for i in range(N)]
            deadline = time.monotonic() + 240
            while scrape(prefill.url, "vllm:request_success_total") < answered + N:
                assert time.monotonic() < deadline, "the prefill engine never answered every prefill leg"
                await asyncio.sleep(0.2)
            prefill.kill()  # kill -9: its KV blocks go with it
        finally:
            for d in decodes:
                signal_engine_cores(d, signal.SIGCONT)
        results = await asyncio.gather(*tasks)
    failed = sum(scrape(d.url, "tandem:kv_transfer_failures_total") for d in decodes)
    assert failed >= N // 2, f"only {failed} KV loads failed: the kill came too late to test anything"
    for i, (status, text, errors) in enumerate(results):
        assert status == 200 and not errors, (i, status, text[:300], errors)
    # Each answer is what a decode engine computes for the prompt itself (greedy, float32: token-exact).
    for i, (_, text, _) in enumerate(results):
        r = httpx.post(decodes[i % 2].url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0})
        assert r.json()["choices"][0]["text"] == text, i
    assert scrape(router.url, "tandem:router_migrations_total", reason="replay") == failed
