"""EngineCore: the model, the scheduler and the KV cache of one engine, stepped by its busy loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import torch

from tandem_engine.config import EngineConfig
from tandem_engine.core.kv_cache_manager import KVCacheManager
from tandem_engine.core.kv_events import (
    AllBlocksCleared,
    EngineLoad,
    EventPublisher,
    KVEvent,
    KVEventBatch,
    KVEventPublisher,
)
from tandem_engine.core.scheduler import Scheduler
from tandem_engine.core.structured_output import Grammar, GrammarCompiler
from tandem_engine.kv_transfer.factory import make_connector
from tandem_engine.kv_transfer.interface import KVConnectorScheduler, KVConnectorWorker
from tandem_engine.kv_transfer.nixl_connector import new_engine_id
from tandem_engine.models.loader import LoadedModel, load_model, pick_dtype, resolve_model, weights_dir
from tandem_engine.protocol import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from tandem_engine.request import Request, RequestStatus
from tandem_engine.scheduler_output import SampledToken, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelExecutor(Protocol):
    """What the engine core asks of the model runner it is given (worker/model_runner.py's ModelRunner)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def kv_dtype_name(self) -> str: ...

    def register_kv_connector(self, connector: KVConnectorWorker) -> None: ...

    def warm_up(self) -> float: ...

    def execute(self, sched: SchedulerOutput) -> dict[str, SampledToken]: ...


# (config, the loaded model, max_model_len, device) -> the runner that steps it
RunnerFactory = Callable[[EngineConfig, LoadedModel, int, torch.device], ModelExecutor]


class SchedulingCore:
    """The half of an engine core that needs no model: the scheduler over the KV cache's blocks, the KV
    connector's scheduler side, and the KV events routers follow. EngineCore steps it with a model runner;
    the simulated engine (tandem_engine/sim) with a timing model, so both publish and schedule alike."""

    def __init__(self, config: EngineConfig, engine_index: int, num_blocks: int, max_model_len: int,
                 device_type: str, connector: tuple[KVConnectorScheduler, KVConnectorWorker] | None = None,
                 engine_id: str | None = None) -> None:
        """`connector`: the KV connector's two sides (a prefill or decode engine); `engine_id` its engine id
        when it has one, else a new one."""
        self.config = config
        self.engine_index = engine_index
        self.max_model_len = max_model_len
        self.kv_connector: KVConnectorScheduler | None = None
        self.kv_worker: KVConnectorWorker | None = None
        if connector is not None:
            self.kv_connector, self.kv_worker = connector
        self.engine_id = engine_id or new_engine_id(engine_index)
        self.kv_events: EventPublisher | None = None
        self._published_load: EngineLoad | None = None
        if config.kv_events_port:
            self.kv_events = self._event_publisher()
            self._publish([AllBlocksCleared()], EngineLoad(0, 0, 0.0))  # a new engine id starts empty
        self.scheduler = Scheduler(
            KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                           record_events=self.kv_events is not None),
            config.max_num_seqs, config.step_token_budget(device_type), self.max_model_len,
            self.kv_connector, config.kv_failure_policy, config.scheduling_policy,
        )
        self._idle = True  # the last step computed nothing and produced no output

    def _event_publisher(self) -> EventPublisher:
        (port, replay_port), host = self.config.kv_events_ports(self.engine_index), self.config.kv_events_host
        return KVEventPublisher(f"tcp://{host}:{port}", f"tcp://{host}:{replay_port}",
                                self.config.kv_events_buffer_steps)

    def begin_step(self) -> SchedulerOutput:
        """The next step's batch, its KV loads started and the load published: what the model computes next."""
        if self.kv_worker is not None:
            self.scheduler.update_from_kv_output(self.kv_worker.get_finished(), time.monotonic())
        sched = self.scheduler.schedule()
        if self.kv_worker is not None and self.kv_connector is not None:
            self.kv_worker.start_load_kv(self.kv_connector.build_connector_meta())
        # Before the forward pass too: the requests that came in during the last step are now counted,
        # and routers weighing queues see them a step sooner (a long prefill step is most of a second).
        self._publish_changes()
        return sched

    def finish_step(self, sched: SchedulerOutput, sampled: dict[str, SampledToken]) -> list[EngineCoreOutput]:
        """The step's tokens taken into the requests; what finished or produced output, to send back."""
        outputs = self.scheduler.update_from_output(sched, sampled)
        self._idle = sched.is_empty and not outputs
        self._publish_changes()
        return outputs

    def _publish_changes(self) -> None:
        """The cache events since the last batch, with the load when it changed."""
        if self.kv_events is not None:
            events, load = self.scheduler.kv.pool.take_events(), self._load_change()
            if events or load is not None:
                self._publish(events, load or self._published_load)

    def _load_change(self) -> EngineLoad | None:
        """The scheduler's load, when routers have not seen it: a request came, started or ended, or
        KV usage moved by a percent point since the last load published."""
        s = self.scheduler
        now = EngineLoad(len(s.running), len(s.waiting) + len(s.waiting_for_kv), s.kv.usage)
        last = self._published_load
        if last is not None and (now.running, now.waiting) == (last.running, last.waiting) \
                and abs(now.kv_usage - last.kv_usage) < 0.01:
            return None
        return now

    def _publish(self, events: list[KVEvent], load: EngineLoad | None = None) -> None:
        assert self.kv_events is not None
        self.kv_events.publish(KVEventBatch(time.time(), self.engine_id, events, load))
        if load is not None:
            self._published_load = load

    @property
    def kv_busy(self) -> bool:
        """Blocks held under a lease, or loads not yet reported: the loop keeps stepping."""
        return self.kv_worker is not None and self.kv_worker.has_pending or \
            self.kv_connector is not None and self.kv_connector.num_held_blocks > 0

    def close(self) -> None:
        """Stop the KV connector's worker side; tell routers the cache is gone and stop publishing."""
        if self.kv_worker is not None:
            self.kv_worker.shutdown()
        if self.kv_events is not None:
            self._publish([AllBlocksCleared()])
            self.kv_events.close()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()


class EngineCore(SchedulingCore):
    def __init__(self, config: EngineConfig, engine_index: int = 0, *, runner: RunnerFactory) -> None:
        """`runner` builds the model runner (the process entry point names it: frontend/core_client.py), so
        that the core depends on what it asks of a runner, not on the worker."""
        t0 = time.perf_counter()
        src = resolve_model(config.model, config.cache_path)
        # CUDA when present (Triton attention); otherwise the CPU with the torch/C attention backend.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = pick_dtype(config.dtype, config.quantization)
        # oneDNN's packed copies come last, from the runner's plan_weights (worker/weight_plan.py)
        loaded = load_model(src, dtype, self.device, onednn_pack=False, quantization=config.quantization)
        self.dtype = loaded.dtype
        model_limit = int(getattr(loaded.hf_config, "max_position_embeddings", 2048))
        max_model_len = min(config.max_model_len or model_limit, model_limit)
        self.runner = runner(config, loaded, max_model_len, self.device)
        usable_tokens = (self.runner.num_blocks - 1) * config.block_size
        if usable_tokens < max_model_len:
            raise ValueError(
                f"the KV cache holds {usable_tokens} tokens ({self.runner.num_blocks} blocks of "
                f"{config.block_size}), less than --max-model-len {max_model_len}: raise "
                "--kv-cache-gib or lower --max-model-len")
        connector, engine_id = None, None
        if config.role != "both":
            connector = make_connector(config, engine_index)
            engine_id = connector[1].engine_id
            self.runner.register_kv_connector(connector[1])
        super().__init__(config, engine_index, self.runner.num_blocks, max_model_len, self.device.type, connector,
                         engine_id)
        # Structured output: grammars compile on a worker thread; their requests wait here meanwhile.
        self.grammars = GrammarCompiler(weights_dir(src), int(loaded.hf_config.vocab_size), loaded.eos_token_ids)
        self._compiling: dict[str, tuple[Request, Future[Grammar]]] = {}
        warm = self.runner.warm_up()
        self.startup_seconds = time.perf_counter() - t0
        logger.info("[startup] engine %d ready in %.1fs (warm-up %.2fs): %s %s, quantization %s, %d KV blocks "
                    "of %d (%s KV cache), max_model_len %d, %d tokens a step, %d threads", engine_index,
                    self.startup_seconds, warm, config.model, loaded.dtype, config.quantization,
                    self.runner.num_blocks, config.block_size, self.runner.kv_dtype_name, self.max_model_len,
                    self.scheduler.max_num_batched_tokens, torch.get_num_threads())

    def add_request(self, req: Request | EngineCoreRequest) -> None:
        if isinstance(req, EngineCoreRequest):
            req = Request.from_engine_core_request(req)
        if req.sampling_params.grammar is not None and req.grammar is None:
            if req.request_id in self._compiling or req.request_id in self.scheduler.requests:
                raise ValueError(f"duplicate request id {req.request_id!r}")
            self._compiling[req.request_id] = (req, self.grammars.submit(req.sampling_params.grammar))
            return
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if (entry := self._compiling.pop(rid, None)) is not None:
                entry[1].cancel()
                self.scheduler.reject(entry[0], RequestStatus.FINISHED_ABORTED)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    @property
    def has_requests(self) -> bool:
        return self.scheduler.has_requests or bool(self._compiling)

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready go to the scheduler (in their order of arrival), at the grammar's
        start; one whose grammar failed to compile ends with an error."""
        for rid, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            try:
                req.grammar = future.result()
            except ValueError as exc:
                self.scheduler.reject(req, RequestStatus.FINISHED_ERROR, f"the grammar does not compile: {exc}")
                continue
            resumed = req.sampling_params.resumed_tokens
            if resumed and not req.grammar.accept_all(req.prompt_token_ids[-resumed:]):
                self.scheduler.reject(req, RequestStatus.FINISHED_ERROR,
                                      f"the resumed tokens do not follow the grammar: {req.grammar.error}")
                continue
            self.scheduler.add_request(req)

    def step(self) -> list[EngineCoreOutput]:
        if self._compiling:
            self._admit_compiled()
        sched = self.begin_step()
        return self.finish_step(sched, self.runner.execute(sched) if not sched.is_empty else {})

    def wait_timeout(self) -> float | None:
        """How long the busy loop may block on its input queue: 0 not at all, None until input."""
        if self.scheduler.has_requests and not self._idle:
            return 0.0
        if self._compiling:
            return 0.002  # a grammar compiling: look again soon (new input still wakes the loop at once)
        if self.kv_worker is None or self.kv_connector is None:
            return 0.0 if self.has_requests else None
        if self.kv_worker.transfers_in_flight:
            return 0.005  # NIXL completion is polled; new input still wakes the loop at once
        timeouts = [0.05] if self.has_requests else []
        if self.kv_worker.has_pending:
            timeouts.append(0.2)  # heartbeats of requests waiting to be scheduled
        deadline = self.kv_connector.next_deadline()
        if deadline is not None:
            timeouts.append(max(0.0, deadline - time.monotonic()) + 0.01)
        return min(timeouts, default=None)

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.close()
