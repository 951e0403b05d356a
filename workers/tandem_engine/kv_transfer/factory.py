"""Builds both sides of the KV connector for an engine whose role is prefill or decode."""

from __future__ import annotations

from tandem_engine.config import EngineConfig
from tandem_engine.kv_transfer.nixl_connector import NixlConnectorScheduler, new_engine_id
from tandem_engine.kv_transfer.nixl_worker import NixlConnectorWorker


def make_connector(config: EngineConfig,
                   engine_index: int) -> tuple[NixlConnectorScheduler, NixlConnectorWorker]:
    engine_id = new_engine_id(engine_index)
    port = config.kv_side_channel_port + engine_index  # one side channel per DP rank, like vLLM
    sched = NixlConnectorScheduler(config, engine_id, port)
    worker = NixlConnectorWorker(config, engine_id, port, debug=sched.debug_view, held=sched.held_ids)
    return sched, worker
