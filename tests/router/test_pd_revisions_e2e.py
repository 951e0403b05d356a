"""Two revisions serving at once, as in a rollout: real engines of revision "a" (block size 16) and of revision
"b" (block size 32), a prefill and a decode engine each, behind one router. KV cannot move between them (the
decode engine refuses the handshake: the block sizes differ), so the router must pair a prefill engine only
with a decode engine of its revision. Every answer is whole and equals decode's own, no KV load fails, and both
revisions serve. With revision b's prefill engine gone, its decode engine gets no P/D request it would have to
read from revision a; with no prefill engine left at all, decode prefills locally."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from tandem_router.procs import Child, free_port, scrape, stop_all, tandem_child

pytestmark = pytest.mark.slow
N = 12
MAX_TOKENS = 8
MODEL = "smollm2-135m-instruct"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def prompt(i: int) -> str:
    """Well above the router's 32-token remote-prefill threshold, and new to every engine."""
    return f"Entry {i}: " + " ".join(WORDS[(i * 5 + k * 3) % len(WORDS)] for k in range(100))


def serve(name: str, revision: str, block_size: int, role: str, logs: Path) -> Child:
    args = ["--model", MODEL, "--dtype", "float32", "--num-threads", "1", "--role", role, "--revision", revision,
            "--block-size", str(block_size)]
    if role == "prefill":
        args += ["--kv-side-channel-port", str(free_port())]
    return tandem_child(name, "serve", args, logs / f"{name}.log").start()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[dict[str, Child]]:
    engines = {"prefill-a": serve("prefill-a", "a", 16, "prefill", tmp_path),
               "decode-a": serve("decode-a", "a", 16, "decode", tmp_path),
               "prefill-b": serve("prefill-b", "b", 32, "prefill", tmp_path),
               "decode-b": serve("decode-b", "b", 32, "decode", tmp_path)}
    children = list(engines.values())
    try:
        for c in children:
            c.wait_healthy(300)
        args = [a for n, c in engines.items() for a in (f"--{n.split('-')[0]}", c.url)]
        router = tandem_child("router", "route", [*args, "--health-interval", "0.5", "--policy", "round-robin"],
                              tmp_path / "router.log").start()
        children.append(router)
        router.wait_healthy(60)
        yield {**engines, "router": router}
    finally:
        stop_all(children)


async def complete(http: aiohttp.ClientSession, url: str, i: int) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return resp.status, await resp.text()
        return 200, (await resp.json())["choices"][0]["text"]


def own_answer(decode: Child, i: int) -> str:
    r = httpx.post(decode.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0})
    return str(r.json()["choices"][0]["text"])


def decisions(router: Child, decision: str) -> float:
    return scrape(router.url, "tandem:router_pd_decisions_total", decision=decision)


async def run(router: Child, first: int) -> list[tuple[int, str]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        return list(await asyncio.gather(*(complete(http, router.url, first + i) for i in range(N))))


async def test_prefill_and_decode_pair_within_one_revision(stack: dict[str, Child]) -> None:
    router, decodes = stack["router"], [stack["decode-a"], stack["decode-b"]]
    results = await run(router, 0)
    assert [s for s, _ in results] == [200] * N, results
    assert decisions(router, "remote") == N
    for d in decodes:
        assert scrape(d.url, "tandem:kv_transfer_failures_total") == 0, d.name
        assert scrape(d.url, "tandem:kv_transfer_received_blocks_total") > 0, d.name  # both revisions served
    # What an operator reads of the router: endpoints and requests per revision.
    for role in ("prefill", "decode"):
        for rev in ("a", "b"):
            assert scrape(router.url, "tandem:router_revision_endpoints", role=role, revision=rev) == 1
    shares = [scrape(router.url, "tandem:router_revision_requests_total", revision=rev) for rev in ("a", "b")]
    assert sum(shares) == N and min(shares) > 0, shares
    # Each answer is what the decode engine of one revision computes for the prompt itself (greedy, float32).
    for i, (_, text) in enumerate(results):
        assert text in {own_answer(d, i) for d in decodes}, i

    # Revision b loses its prefill engine: its decode engine would have to read from revision a. Every
    # request goes to revision a's pair instead.
    received_b = scrape(stack["decode-b"].url, "tandem:kv_transfer_received_blocks_total")
    stack["prefill-b"].stop()
    await asyncio.sleep(1.5)  # the health checks eject it
    assert scrape(router.url, "tandem:router_revision_endpoints", role="prefill", revision="b") == 0
    results = await run(router, N)
    assert [s for s, _ in results] == [200] * N, results
    assert decisions(router, "remote") == 2 * N
    assert scrape(stack["decode-b"].url, "tandem:kv_transfer_received_blocks_total") == received_b
    for d in decodes:
        assert scrape(d.url, "tandem:kv_transfer_failures_total") == 0, d.name

    # No prefill engine left: decode prefills locally, on either revision.
    stack["prefill-a"].stop()
    await asyncio.sleep(1.5)
    results = await run(router, 2 * N)
    assert [s for s, _ in results] == [200] * N, results
    assert decisions(router, "local_no_prefill") == N
    log = router.log()
    assert "serves revision 'a'" in log and "serves revision 'b'" in log, log[-2000:]
