"""A real engine behind a real router: the router's exact index follows the engine's prefix cache through
a random run with evictions (a small KV cache), predicts every request's prefix-cache hit exactly, and
drops the engine's entries when the engine restarts. A simulated engine (`tandem sim`, issue 45) passes the
same test: the router cannot tell them apart."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from tests.engine.engine_server import MODEL, launch, launch_sim

from tandem_engine.core import kv_events as engine_events
from tandem_router import router as router_module
from tandem_router.kv_events import BlockRemoved, decode_batch
from tandem_router.kv_index import KVIndex, Publisher
from tandem_router.procs import free_ports
from tandem_router.request import parse_request

pytestmark = pytest.mark.slow
BS = 16
WORDS = "harbour lantern ferry tide anchor gull rope sail compass storm keel mast chart beacon".split()


def engine_state(replay_endpoint: str) -> tuple[int, set[int], int]:
    """(last sequence number, block hashes held, blocks evicted so far) from the engine's replay socket."""
    index, pub, removed, last = KVIndex(), Publisher("e", 0), 0, -1
    for seq, engine_batch in engine_events.replay(replay_endpoint, 0):
        batch = decode_batch(msgspec.msgpack.encode(engine_batch))  # as the router reads the wire
        index.apply(pub, batch.events)
        removed += sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockRemoved))
        last = seq
    return last, set(index.held(pub)), removed


async def caught_up(stream, replay_endpoint: str, timeout: float = 20.0) -> tuple[set[int], int]:
    deadline = time.monotonic() + timeout
    while True:
        last, held, removed = await asyncio.to_thread(engine_state, replay_endpoint)
        if stream.last >= last:
            return held, removed
        assert time.monotonic() < deadline, f"router at batch {stream.last}, engine at {last}"
        await asyncio.sleep(0.05)


async def load_follows_the_engine(rt, url: str) -> None:
    """A request sent to the engine behind the router's back shows in the router's view of the engine's
    queue within a second, and leaves it when it ends: the engine's events carry its load."""
    ep = rt.decode.endpoints[url]
    assert ep.load_from_events and ep.engine_queue == 0

    async def until(queue: int) -> None:
        deadline = time.monotonic() + 1.0
        while ep.engine_queue != queue:
            assert time.monotonic() < deadline, f"router sees {ep.engine_queue} requests on the engine, not {queue}"
            await asyncio.sleep(0.01)

    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 48, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as client:
        direct = asyncio.create_task(client.post(url + "/v1/completions", json=body))
        await until(1)
        assert 0 < ep.kv_usage <= 1
        assert (await direct).status_code == 200
        await until(0)
    assert ep.kv_usage == 0.0


@pytest.mark.parametrize("sim", [False, True], ids=["real", "sim"])
async def test_index_predicts_every_hit_through_evictions_and_forgets_a_restarted_engine(
        router, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sim: bool) -> None:
    # The engine's ports; a simulated fleet's first engine takes the ones before them.
    events_port, http_port = free_ports("127.0.0.1", 4) + 2, free_ports("127.0.0.1", 2) + 1
    args = ["--kv-events-port", str(events_port), "--block-size", str(BS), "--num-kv-blocks", "40",
            "--max-model-len", "320"]
    replay_endpoint = f"tcp://127.0.0.1:{events_port + 1}"

    def start() -> Any:
        return launch_sim(tmp_path, args, first_port=http_port - 1) if sim else launch(tmp_path, args, port=http_port)

    engine = start()
    try:
        await asyncio.to_thread(engine.wait_healthy, 300)
        # Engine load is read from /metrics once a minute here: what the router knows sooner came in events.
        r = await router(decode_urls=[engine.url], decode_policy="prefix-aware", load_interval=60)
        rt = r.router
        deadline = time.monotonic() + 30
        while not (rt.kv_feed.covers(engine.url) and rt.tokenizer is not None):
            assert time.monotonic() < deadline, "the router never followed the engine"
            await asyncio.sleep(0.1)
        stream = rt.kv_feed._streams[engine.url][0]
        rng = random.Random(7)
        prefixes = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120))) for _ in range(5)]
        hits = 0
        async with httpx.AsyncClient(timeout=120) as client:
            for i in range(30):
                prompt = rng.choice(prefixes) + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 30)))
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0.0}
                held, _ = await caught_up(stream, replay_endpoint)
                assert rt.kv_index.held(Publisher(engine.url, 0)) == held, f"request {i}: index != engine"
                # Every other prompt tokenized in a thread, as long prompts are (the rest on the event loop).
                monkeypatch.setattr(router_module, "INLINE_TOKENIZE_CHARS", 0 if i % 2 else 1 << 20)
                rreq = await rt.routing_request(parse_request("completions", json.dumps(body).encode()), None)
                view = rt.prefix_view(rt.decode, rt.decode.healthy(), rreq)
                assert view.exact
                answer = (await client.post(r.url + "/v1/completions", json=body)).json()
                n = answer["usage"]["prompt_tokens"]
                assert rreq.prompt_tokens == n
                predicted = min(view.matches.get(engine.url, 0), (n - 1) // BS) * BS
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted, f"request {i}"
                hits += predicted > 0
        held, removed = await caught_up(stream, replay_endpoint)
        assert rt.kv_index.held(Publisher(engine.url, 0)) == held and held
        assert removed > 20 and hits > 10  # the small cache really evicted, and prefixes really hit
        await load_follows_the_engine(rt, engine.url)
        # A restarted engine (same ports, new boot nonce) starts empty: its old entries go.
        old_id = stream.engine_id
        engine.stop()  # a clean stop says AllBlocksCleared already; the new engine's id must replace the old
        engine = start()
        await asyncio.to_thread(engine.wait_healthy, 300)
        deadline = time.monotonic() + 30
        while stream.engine_id in (None, old_id):
            assert time.monotonic() < deadline, "the restarted engine was never followed"
            await asyncio.sleep(0.1)
        assert rt.kv_index.size(engine.url) == 0
        assert 'reason="restart"' in (await asyncio.to_thread(httpx.get, r.url + "/metrics")).text
    finally:
        engine.stop()
