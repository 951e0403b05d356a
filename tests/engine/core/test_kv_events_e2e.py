"""A real engine's KV events: its prompt's blocks, with the hashes a router computes from the tokens; and a
simulated engine's (`tandem sim`, issue 45), which must be the same wire."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from tandem_engine.config import EngineConfig
from tandem_engine.core.block_pool import NONE_HASH, hash_block
from tandem_engine.core.engine_core import EngineCore
from tandem_engine.core.kv_events import (
    AllBlocksCleared,
    BlockStored,
    EngineLoad,
    KVEventBatch,
    decode_batch,
    replay,
)
from tandem_engine.request import Request
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.worker.model_runner import ModelRunner
from tandem_router.procs import free_port_pair, free_ports
from tests.engine.engine_server import MODEL, run_server

pytestmark = pytest.mark.slow
BS = 16
PROMPT = "The lighthouse keeper counted the ships that passed the rocks every night. " * 6


def chain(tokens: list[int]) -> list[int]:
    hashes, parent = [], NONE_HASH
    for start in range(0, len(tokens) - BS + 1, BS):
        parent = hash_block(parent, tokens[start:start + BS])
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("sim", [False, True], ids=["real", "sim"])
def test_engine_publishes_its_cache_and_a_restart_clears_it(tmp_path: Path, sim: bool) -> None:
    # PUB on the port, replay on the next; a simulated fleet's first engine on the two before.
    port = free_ports("127.0.0.1", 4) + 2
    args = ["--kv-events-port", str(port), "--block-size", str(BS), "--max-model-len", "512"]
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    with run_server(args, tmp_path, sim=sim) as s:
        # Routers find the sockets through the HTTP port.
        assert httpx.get(s.url + "/kv_events", timeout=10).json() == {"block_size": BS, "publishers": [
            {"rank": 0, "host": "127.0.0.1", "port": port, "replay_port": port + 1}]}
        tokens = httpx.post(s.url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}, timeout=30).json()["tokens"]
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0.0}
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=120).status_code == 200
        # Replay from 0 (this subscriber may have joined after the start-up batch): the cache began
        # empty, then gained the prompt's full blocks, chained exactly as a router hashes the tokens.
        deadline = time.monotonic() + 10
        while True:
            batches = [b for _, b in replay(f"tcp://127.0.0.1:{port + 1}", 0)]
            stored = [h for b in batches for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes]
            loads = [b.load for b in batches if b.load is not None]
            ended = bool(loads) and loads[-1] == EngineLoad(0, 0, 0.0) and len(loads) > 1
            if len(stored) >= len(tokens) // BS and ended or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert batches[0].events == [AllBlocksCleared()]
        assert stored[:len(tokens) // BS] == chain(tokens)
        # The batches carry the engine's load as it changed: empty at start, the request running (its
        # blocks in use), then nothing running and no block in use once it ended.
        assert loads[0] == EngineLoad(0, 0, 0.0)
        assert any(x.running == 1 and x.kv_usage > 0 for x in loads), loads
        assert loads[-1] == EngineLoad(0, 0, 0.0), loads
        engine_id = batches[0].engine_id
        assert {b.engine_id for b in batches} == {engine_id}
    # A clean stop says the cache is gone; the live subscriber saw it.
    seen = []
    while sub.poll(2000):
        seen.append(decode_batch(sub.recv_multipart()[2]))
    sub.close()
    assert seen and seen[-1].events == [AllBlocksCleared()] and seen[-1].engine_id == engine_id
    # A restarted engine is a new engine id whose cache starts empty.
    with run_server(args, tmp_path / "again", sim=sim) as s:
        (_, first), *_ = replay(f"tcp://127.0.0.1:{port + 1}", 0)
        assert first.events == [AllBlocksCleared()] and first.engine_id != engine_id


def test_a_new_request_is_in_the_published_load_before_its_step_computes() -> None:
    """Routers weigh the queues engines publish; a request that came in during a step is counted in the
    load sent before the next forward pass, not after it (a prefill step can take most of a second)."""
    core = EngineCore(EngineConfig(model=MODEL, dtype="float32", kv_cache_gib=0.05, max_model_len=512,
                                   block_size=BS, kv_events_port=free_port_pair()), runner=ModelRunner)
    assert core.kv_events is not None
    trace: list[object] = []
    publish, execute = core.kv_events.publish, core.runner.execute

    def record_publish(batch: KVEventBatch) -> None:
        trace.append(batch.load)
        publish(batch)

    def record_execute(sched: Any) -> Any:
        trace.append("execute")
        return execute(sched)

    try:
        core.kv_events.publish = record_publish  # type: ignore[method-assign]
        core.runner.execute = record_execute  # type: ignore[method-assign]
        for i in range(2):
            core.add_request(Request(f"r{i}", list(range(1, 40)), SamplingParams(max_tokens=3, temperature=0), [0]))
        core.step()
        first = trace.index("execute")
        assert EngineLoad(2, 0, pytest.approx(core.scheduler.kv.usage)) in trace[:first], trace
        while core.has_requests:
            core.step()
        assert trace[-1] == EngineLoad(0, 0, 0.0), trace
    finally:
        core.shutdown()
