"""Prefill -> decode between two real `tandem serve` processes with real NIXL (UCX, DRAM), driven by the
in-test proxy: greedy equality with the colocated path, leases, client aborts at each stage, and the
prefill engine dying before and during the read under the default `fail` policy (last: it kills P)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tandem_engine.kv_transfer import side_channel
from tandem_engine.kv_transfer.messages import Debug, DebugView
from tandem_router.procs import cpu_seconds, engine_pids
from tests.engine.engine_server import MODEL, Server
from tests.engine.kv_transfer.pd_proxy import (
    completion,
    freeze,
    idle,
    kill,
    pd_completion,
    prefill,
    start_pair,
    wait_for,
)

pytestmark = pytest.mark.slow

LEASE = 4.0
SENTENCE = "The quick brown fox jumps over the lazy dog while the river keeps flowing to the sea. "
# No two prompts share a full KV block (16 tokens), so a decode engine holds none of another's blocks
# and reads every block of each prompt but the last token's. None makes the model stop at once (a
# prefill that ends on EOS hands nothing to decode).
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the ocean.",
    "Summarise this: " + SENTENCE * 3,
    "List three prime numbers:",
    "Answer after reading: " + SENTENCE * 12 + "What does the fox do? The fox",
    "Once upon a time, in a small village,",
    "Count the dogs in: " + SENTENCE * 15,
    "def fibonacci(n):",
]
BLOCK_SIZE = 16  # the engine's default --block-size
LEASED = "[lease] holding"  # the prefill engine's log lines for blocks held for decode ...
EXPIRED = "expired; freeing"  # ... and for a lease that ran out


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    p, d = start_pair(tmp_path_factory.mktemp("pd"), LEASE)
    try:
        yield p, d
    finally:
        d.stop()
        p.stop()


def blocks_read(prompt_tokens: int) -> int:
    """Blocks a decode engine holding none of the prompt reads: all but the last token's, which it
    recomputes for its logits."""
    return -(-(prompt_tokens - 1) // BLOCK_SIZE)


def prompt_tokens(server: Server, prompt: str) -> int:
    body = {"model": MODEL, "prompt": prompt}
    return int(httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["count"])


def side_address(p: Server) -> str:
    return f"tcp://127.0.0.1:{p.log().split('side channel listening on tcp://127.0.0.1:')[1].split()[0]}"


async def test_pd_greedy_output_equals_colocated_for_concurrent_mixed_prompts(pd: tuple[Server, Server]) -> None:
    p, d = pd
    async with httpx.AsyncClient(timeout=120) as c:
        # The colocated reference: a request without kv_transfer_params runs the whole way on one engine.
        refs = await asyncio.gather(*[c.post(p.url + "/v1/completions", json=completion(t)) for t in PROMPTS])
        received = d.metric("tandem:kv_transfer_received_blocks_total")
        sent = p.metric("tandem:kv_transfer_sent_blocks_total")
        leases = p.log().count(LEASED)
        outs = await asyncio.gather(*[pd_completion(c, p.url, d.url, completion(t)) for t in PROMPTS])
    for ref, out in zip(refs, outs, strict=True):
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
        assert out.json()["usage"]["completion_tokens"] == ref.json()["usage"]["completion_tokens"]
    assert p.log().count(LEASED) - leases == len(PROMPTS)  # each prompt's KV went to decode
    blocks = sum(blocks_read(out.json()["usage"]["prompt_tokens"]) for out in outs)
    # Every read was released: no lease is left to run out, and prefill counts the blocks each release names.
    wait_for(lambda: idle(p) and idle(d), 3.0, "both engines idle")
    assert p.metric("tandem:kv_blocks_held_for_transfer") == 0
    assert d.metric("tandem:kv_transfer_received_blocks_total") - received == blocks
    assert p.metric("tandem:kv_transfer_sent_blocks_total") - sent == blocks
    assert EXPIRED not in p.log()


async def test_idle_pd_engines_use_no_cpu_after_transfers(pd: tuple[Server, Server]) -> None:
    """NIXL's progress thread must wait on UCX events, not spin: an idle P/D pair costs no CPU."""
    p, d = pd
    async with httpx.AsyncClient(timeout=120) as c:  # handshake done and a read made, whatever ran before
        out = await pd_completion(c, p.url, d.url, completion(PROMPTS[2]))
    assert out.status_code == 200, out.text
    wait_for(lambda: idle(p) and idle(d), LEASE + 10, "both engines idle")
    pids = [p.proc.pid, *engine_pids(p.proc.pid), d.proc.pid, *engine_pids(d.proc.pid)]
    assert len(pids) == 4
    await asyncio.sleep(1.0)
    start = cpu_seconds(pids)
    await asyncio.sleep(3.0)
    assert cpu_seconds(pids) - start < 0.3


async def test_blocks_held_under_a_lease_are_freed_when_nobody_reads(pd: tuple[Server, Server]) -> None:
    p, _ = pd
    async with httpx.AsyncClient(timeout=60) as c:
        params = await prefill(c, p.url, completion(SENTENCE * 4 + "unread"))
    assert params is not None and params["remote_block_ids"] and ":" not in params["remote_engine_id"]
    assert p.metric("tandem:kv_blocks_held_for_transfer") == len(params["remote_block_ids"])
    view = side_channel.call(side_address(p), Debug(), DebugView)
    assert view.leases[params["remote_request_id"]].blocks == len(params["remote_block_ids"])
    took = wait_for(lambda: idle(p), LEASE + 3, "prefill idle after the lease")
    assert took > 1.0
    assert p.metric("tandem:kv_blocks_held_for_transfer") == 0


async def test_client_aborts_at_each_stage_leave_both_engines_idle(pd: tuple[Server, Server]) -> None:
    p, d = pd
    long_prompt = SENTENCE * 60 + "And then?"
    # 1. The client leaves during prefill: the prefill engine frees at once (no lease).
    async with httpx.AsyncClient(timeout=httpx.Timeout(0.3)) as fast:
        with pytest.raises(httpx.TimeoutException):
            await prefill(fast, p.url, completion(long_prompt + " two"))
    wait_for(lambda: idle(p), LEASE - 1, "prefill idle after an abort during prefill")
    sent = p.metric("tandem:kv_transfer_sent_blocks_total")
    async with httpx.AsyncClient(timeout=60) as c:
        # 2. The client leaves while decode streams: decode had read every block and released them.
        streamed = await prefill(c, p.url, completion(long_prompt + " three"))
        body = {**completion(long_prompt + " three", max_tokens=200), "stream": True, "ignore_eos": True,
                "kv_transfer_params": streamed}
        async with c.stream("POST", d.url + "/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                break
        # 3. The client leaves right after sending to decode (before or during the read).
        params = await prefill(c, p.url, completion(long_prompt + " four"))
    async with httpx.AsyncClient(timeout=httpx.Timeout(0.05)) as fast:
        with pytest.raises(httpx.TimeoutException):
            await fast.post(d.url + "/v1/completions",
                            json={**completion(long_prompt + " four", max_tokens=200), "kv_transfer_params": params})
    wait_for(lambda: idle(p) and idle(d), LEASE + 3, "both engines idle after client aborts")
    # Freed by decode's release, not by the lease running out: prefill logged no expiry for either and
    # counted the blocks decode read for the streamed request (decode held none of that prompt before).
    assert streamed is not None and params is not None
    for rid in (streamed["remote_request_id"], params["remote_request_id"]):
        assert f"[lease] {rid} expired" not in p.log()
    read = blocks_read(prompt_tokens(p, long_prompt + " three"))
    assert p.metric("tandem:kv_transfer_sent_blocks_total") - sent >= read


async def test_prefill_dies_during_then_before_the_read_fails_cleanly(pd: tuple[Server, Server]) -> None:
    p, d = pd
    async with httpx.AsyncClient(timeout=60) as c:
        during = await prefill(c, p.url, completion(SENTENCE * 30 + "during"))
        before = await prefill(c, p.url, completion(SENTENCE * 30 + "before"))
        failures = d.metric("tandem:kv_transfer_failures_total")
        freeze(p)  # the read is posted against a stopped peer, which is then killed
        t0 = time.monotonic()
        task = asyncio.create_task(c.post(d.url + "/v1/completions",
                                          json={**completion(SENTENCE * 30 + "during"), "kv_transfer_params": during}))
        await asyncio.sleep(0.3)
        kill(p)
        r = await task
        # Either the read had finished (shared memory needs no help from the peer) or it failed cleanly.
        assert r.status_code in (200, 500), r.text
        r = await c.post(d.url + "/v1/completions",
                         json={**completion(SENTENCE * 30 + "before"), "kv_transfer_params": before})
        assert r.status_code == 500 and "error" in r.json()
        assert time.monotonic() - t0 < 3 * LEASE + 10
    assert d.metric("tandem:kv_transfer_failures_total") > failures
    wait_for(lambda: idle(d), LEASE + 3, "decode idle after the prefill engine died")
    # The decode engine still serves plain requests.
    async with httpx.AsyncClient(timeout=60) as c:
        assert (await c.post(d.url + "/v1/completions", json=completion("Hello"))).status_code == 200
