"""A prefill engine told to stop (SIGTERM: a pod deleted by a scale-down or a rollout) while decode engines
have yet to read the blocks it holds for them: it keeps serving the reads, exits once every lease is
released, and says so in its log; bounded by `--drain-seconds`, after which it drops what is left. Real
processes and real NIXL; the decode engine stays up across both tests."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem_router.local_stack import split_cpus
from tandem_router.procs import free_port
from tests.engine.engine_server import Server
from tests.engine.kv_transfer.pd_proxy import completion, idle, launch, prefill, start_pair, wait_for

pytestmark = pytest.mark.slow

LEASE = 60.0  # far longer than the tests wait: what frees the blocks is the release, never the expiry
PROMPTS = [f"Day {i} in the valley: the shepherd wrote about the wind, the rain and the goats. " * 5
           for i in range(3)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, Path]]:
    log_dir = tmp_path_factory.mktemp("pddrain")
    p, d = start_pair(log_dir, LEASE)
    try:
        yield p, d, log_dir
    finally:
        d.stop()
        p.stop()


def post(url: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def refused(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 503
    except httpx.TransportError:
        return True


async def test_a_stopped_prefill_engine_serves_every_held_lease_before_it_exits(
        pair: tuple[Server, Server, Path]) -> None:
    p, d, _ = pair
    refs = [post(p.url, completion(text)).json()["choices"][0]["text"] for text in PROMPTS]
    async with httpx.AsyncClient(timeout=120) as c:
        params = [await prefill(c, p.url, completion(text)) for text in PROMPTS]
    assert all(params)
    held = sum(len(x["remote_block_ids"]) for x in params if x)
    assert p.metric("tandem:kv_blocks_held_for_transfer") == held

    p.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: refused(p.url), 10, "the stopping prefill engine to refuse new work")
    time.sleep(2)
    assert p.proc.poll() is None, "the prefill engine left while decode engines still had blocks to read"

    answers = [post(d.url, {**completion(text), "kv_transfer_params": x})
               for text, x in zip(PROMPTS, params, strict=True)]
    assert [r.status_code for r in answers] == [200] * len(PROMPTS)
    assert [r.json()["choices"][0]["text"] for r in answers] == refs
    assert d.metric("tandem:kv_transfer_failures_total") == 0
    assert d.metric("tandem:kv_transfer_received_blocks_total") > 0
    read = time.monotonic()
    assert p.proc.wait(30) == 0
    assert time.monotonic() - read < 10, "the engine waited out its drain after the last lease was released"
    log = p.log()
    assert "draining for up to 30s: 0 requests open, 3 leases held" in log, log[-3000:]
    assert "3 leases released, 0 expired while it waited" in log, log[-3000:]


async def test_a_drain_that_outlasts_drain_seconds_drops_the_leases_and_exits(
        pair: tuple[Server, Server, Path]) -> None:
    _, d, log_dir = pair
    p = launch(log_dir, ["--role", "prefill", "--kv-side-channel-port", str(free_port()),
                         "--kv-lease-seconds", str(LEASE), "--drain-seconds", "2"], cpus=split_cpus(2)[0])
    p.wait_healthy(300)
    async with httpx.AsyncClient(timeout=120) as c:
        params = await prefill(c, p.url, completion(PROMPTS[0] + " Nobody reads this one."))
    assert params is not None
    t0 = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    assert p.proc.wait(30) == 0
    took = time.monotonic() - t0
    assert 2.0 <= took < 10.0, took  # the drain's bound, not the 60 s lease
    assert "the drain's 2s are up; aborting 0 requests, dropping 1 leases" in p.log(), p.log()[-3000:]
    # Its blocks are gone with it: a decode engine that reads them now fails cleanly and frees its own.
    r = post(d.url, {**completion(PROMPTS[0] + " Nobody reads this one."), "kv_transfer_params": params})
    assert r.status_code == 500 and "error" in r.json()
    assert d.metric("tandem:kv_transfer_failures_total") == 1
    wait_for(lambda: idle(d), 10, "decode idle")
