"""P/D failure handling with real processes and real NIXL, under `--kv-failure-policy recompute`: the
prefill engine dies before the read (decode recomputes), restarts on the same address (decode
handshakes again with the new boot nonce), then the decode engine dies before reading (prefill frees the
blocks when the lease runs out). The tests run in order and share one engine pair."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem_router.local_stack import split_cpus
from tests.engine.engine_server import Server
from tests.engine.kv_transfer.pd_proxy import completion, freeze, idle, kill, launch, prefill, start_pair, wait_for

pytestmark = pytest.mark.slow

LEASE = 4.0
PROMPT = "In a quiet valley between two mountains there lived a shepherd who kept a diary of the weather. " * 6


class Pair:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.p, self.d = start_pair(log_dir, LEASE, decode_args=["--kv-failure-policy", "recompute"])
        self.p_args = _args(self.p)

    def restart_prefill(self) -> None:
        """A new prefill process on the same HTTP port and side-channel port (a pod restart)."""
        port = int(self.p.url.rsplit(":", 1)[1])
        self.p = launch(self.log_dir, self.p_args, port=port, cpus=split_cpus(2)[0])
        self.p.wait_healthy(300)


def _args(server: Server) -> list[str]:
    args = [str(a) for a in server.proc.args]  # type: ignore[union-attr]
    return args[args.index("--role"):]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    pair = Pair(tmp_path_factory.mktemp("pdfail"))
    try:
        yield pair
    finally:
        pair.d.stop()
        pair.p.stop()


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


async def test_prefill_dies_before_the_read_and_decode_recomputes(pair: Pair) -> None:
    ref = post(pair.p.url, completion(PROMPT)).json()["choices"][0]["text"]
    async with httpx.AsyncClient(timeout=120) as c:
        warm = await prefill(c, pair.p.url, completion("Warm up the handshake, please."))
        assert post(pair.d.url, {**completion("Warm up the handshake, please."),
                                 "kv_transfer_params": warm}).status_code == 200
        received = pair.d.metric("tandem:kv_transfer_received_blocks_total")
        assert received > 0
        params = await prefill(c, pair.p.url, completion(PROMPT))
    assert params is not None
    kill(pair.p)
    r = post(pair.d.url, {**completion(PROMPT), "kv_transfer_params": params})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
    assert pair.d.metric("tandem:kv_transfer_failures_total") == 1
    assert pair.d.metric("tandem:kv_transfer_received_blocks_total") == received
    wait_for(lambda: idle(pair.d), 5, "decode idle")


async def test_prefill_restarted_on_the_same_address_is_handshaken_again(pair: Pair) -> None:
    pair.restart_prefill()
    prompt = PROMPT + " A second day."
    ref = post(pair.p.url, completion(prompt)).json()["choices"][0]["text"]
    async with httpx.AsyncClient(timeout=120) as c:
        params = await prefill(c, pair.p.url, completion(prompt))
    assert params is not None
    r = post(pair.d.url, {**completion(prompt), "kv_transfer_params": params})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
    assert pair.d.metric("tandem:kv_transfer_received_blocks_total") > 0
    assert f"[handshake] {params['remote_engine_id']} at" in pair.d.log()  # the new boot nonce
    wait_for(lambda: idle(pair.p) and idle(pair.d), LEASE + 3, "both idle")


async def test_decode_dies_before_reading_and_prefill_frees_on_lease_expiry(pair: Pair) -> None:
    prompt = PROMPT + " A third day."
    async with httpx.AsyncClient(timeout=120) as c:
        params = await prefill(c, pair.p.url, completion(prompt))
    assert params is not None
    assert pair.p.metric("tandem:kv_blocks_held_for_transfer") == len(params["remote_block_ids"])
    freeze(pair.d)  # the request reaches a decode engine that never gets to read it
    with pytest.raises(httpx.TimeoutException):
        httpx.post(pair.d.url + "/v1/completions", json={**completion(prompt), "kv_transfer_params": params},
                   timeout=1.0)
    kill(pair.d)
    took = wait_for(lambda: idle(pair.p), LEASE + 5, "prefill idle after the decode engine died")
    assert took > 1.0 and pair.p.metric("tandem:kv_blocks_held_for_transfer") == 0
    assert "expired; freeing" in pair.p.log()
