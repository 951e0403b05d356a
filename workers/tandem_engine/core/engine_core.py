"""EngineCore: the model, the scheduler and the KV cache of one engine, stepped by its busy loop."""

from __future__ import annotations

import logging
import time

import torch

from tandem_engine.config import EngineConfig
from tandem_engine.core.kv_cache_manager import KVCacheManager
from tandem_engine.core.scheduler import Scheduler
from tandem_engine.models.loader import load_model, pick_dtype, resolve_model
from tandem_engine.protocol import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from tandem_engine.request import Request, RequestStatus
from tandem_engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.engine_index = engine_index
        src = resolve_model(config.model)
        # CUDA when present (Triton attention); otherwise the CPU with the torch/C attention backend.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        loaded = load_model(src, pick_dtype(config.dtype), self.device)
        model_limit = int(getattr(loaded.hf_config, "max_position_embeddings", 2048))
        self.max_model_len = min(config.max_model_len or model_limit, model_limit)
        self.runner = ModelRunner(config, loaded, self.max_model_len, self.device)
        usable_tokens = (self.runner.num_blocks - 1) * config.block_size
        if usable_tokens < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {usable_tokens} tokens ({self.runner.num_blocks} blocks of "
                f"{config.block_size}), less than --max-model-len {self.max_model_len}: raise "
                "--kv-cache-gib or lower --max-model-len")
        self.scheduler = Scheduler(
            KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching),
            config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
        )
        warm = self.runner.warm_up()
        self.startup_seconds = time.perf_counter() - t0
        logger.info("[startup] engine %d ready in %.1fs (warm-up %.2fs): %s %s, %d KV blocks of %d, "
                    "max_model_len %d, %d threads", engine_index, self.startup_seconds, warm,
                    config.model, loaded.dtype, self.runner.num_blocks, config.block_size,
                    self.max_model_len, torch.get_num_threads())

    def add_request(self, req: Request | EngineCoreRequest) -> None:
        if isinstance(req, EngineCoreRequest):
            req = Request.from_engine_core_request(req)
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    @property
    def has_requests(self) -> bool:
        return self.scheduler.has_requests

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        sampled = self.runner.execute(sched) if not sched.is_empty else {}
        return self.scheduler.update_from_output(sched, sampled)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()
