"""A simulated engine core: the real scheduler, KV cache manager and block pool (prefix hits, chunked prefill,
preemption, block hashes and KV events exactly as an engine's), stepped in an event loop with a step time
from a timing model instead of a forward pass. Many run in one process, under one AsyncLLM each
(docs/simulation.md, "The simulated engine").
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import zlib
from collections.abc import Callable

import zmq
import zmq.asyncio

from tandem_engine.config import EngineConfig
from tandem_engine.core.engine_core import SchedulingCore
from tandem_engine.core.kv_events import EventPublisher, KVEventBatch, KVEventLog, bind_replay
from tandem_engine.protocol import EngineCoreOutputs, EngineCoreRequest, ReadyMessage
from tandem_engine.request import Request, RequestStatus
from tandem_engine.scheduler_output import SampledToken, ScheduledRequest
from tandem_engine.sim.timing import StepTiming

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # as KVEventPublisher's


class AsyncKVEventPublisher:
    """KVEventPublisher's wire without its thread: the PUB socket sends at once, a task answers replays, and
    SimEvents' one timer sends every engine's heartbeats."""

    def __init__(self, ctx: zmq.asyncio.Context, pub_endpoint: str, replay_endpoint: str, buffer_steps: int) -> None:
        # A PUB never blocks: a plain socket on the same context, no future to await.
        self._pub: zmq.Socket[bytes] = zmq.Context.shadow(ctx.underlying).socket(zmq.PUB)
        self._replay = ctx.socket(zmq.ROUTER)
        try:
            self._pub.bind(pub_endpoint)
            bind_replay(self._replay, replay_endpoint)
        except zmq.ZMQError:
            self._pub.close(linger=0)
            self._replay.close(linger=0)
            raise
        self.log = KVEventLog(b"kv-events", buffer_steps)
        self._task = asyncio.get_running_loop().create_task(self._answer_replays(), name="sim-kv-replay")

    def publish(self, batch: KVEventBatch) -> None:
        self._pub.send_multipart(self.log.record(batch))

    def heartbeat(self) -> None:
        batch = self.log.heartbeat(HEARTBEAT_S)
        if batch is not None:
            self.publish(batch)

    async def _answer_replays(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            for answer in self.log.replay_answer(frames):
                await self._replay.send_multipart(answer)

    def close(self) -> None:
        self._task.cancel()
        self._pub.close(linger=500)  # let the last batch (AllBlocksCleared on a stop) leave
        self._replay.close(linger=0)


class SimEvents:
    """The ZMQ context of every simulated engine in the process (pyzmq's default allows 1,023 sockets; each
    engine has two) and the one timer that sends their heartbeats."""

    def __init__(self, engines: int) -> None:
        self.ctx = zmq.asyncio.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 2 * engines + 64)
        self.publishers: list[AsyncKVEventPublisher] = []
        self._timer: asyncio.Task[None] | None = None

    def publisher(self, config: EngineConfig) -> AsyncKVEventPublisher:
        (port, replay_port), host = config.kv_events_ports(0), config.kv_events_host
        pub = AsyncKVEventPublisher(self.ctx, f"tcp://{host}:{port}", f"tcp://{host}:{replay_port}",
                                    config.kv_events_buffer_steps)
        self.publishers.append(pub)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().create_task(self._heartbeats(), name="sim-kv-heartbeats")
        return pub

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S / 4)
            for pub in self.publishers:
                pub.heartbeat()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.ctx.destroy(linger=500)


class SimCore(SchedulingCore):
    """One simulated engine core, and the core client its AsyncLLM talks to (frontend/interface.py's
    EngineCores). Requests and aborts wait for the end of the step, as an EngineCore's input does; each step
    sleeps what `timing` says it would take; sampled tokens are words of the vocabulary chosen by the
    tokens so far, as a model's would be (greedy: the same prompt, the same answer; sampled: the seed or the
    request too), never EOS: a request ends at max_tokens or a stop string."""

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int, timing: StepTiming,
                 speedup: float, words: list[int], events: SimEvents, kv_dtype: str, dtype: str) -> None:
        self._events = events
        super().__init__(config, 0, num_blocks, max_model_len, "cpu")
        self.timing, self.speedup, self.words = timing, speedup, words
        self.ready = [ReadyMessage(0, num_blocks, config.block_size, max_model_len, os.getpid(), self.engine_id,
                                   0.0, kv_dtype, dtype)]
        self._dtype = dtype
        self._inbox: list[Callable[[], None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._digests: dict[str, tuple[int, int]] = {}  # request id -> (tokens digested, their CRC-32)
        self.steps = 0
        self.busy_seconds = 0.0  # simulated time spent computing steps

    def _event_publisher(self) -> EventPublisher:
        return self._events.publisher(self.config)

    # -- EngineCores ------------------------------------------------------------------------------
    @property
    def model_dtype(self) -> str:
        return self._dtype

    def run(self, on_outputs: Callable[[EngineCoreOutputs], None], on_dead: Callable[[str], None]) -> None:
        async def loop() -> None:
            try:
                await self._loop(on_outputs)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug: the engine's requests fail as a dead EngineCore's would
                logger.exception("simulated engine %s died", self.engine_id)
                on_dead(f"the simulated engine died: {e!r}")
        self._task = asyncio.get_running_loop().create_task(loop(), name=f"sim-core-{self.engine_id}")

    async def add_request(self, req: EngineCoreRequest) -> None:
        request = Request.from_engine_core_request(req)

        def add() -> None:
            if request.sampling_params.grammar is not None:
                self.scheduler.reject(request, RequestStatus.FINISHED_ERROR,
                                      "a simulated engine does not constrain its output (structured outputs)")
                return
            try:
                self.scheduler.add_request(request)
            except ValueError as e:  # a duplicate id: the frontend never sends one; the engine lives on
                logger.warning("simulated engine %s: %s", self.engine_id, e)
        self._post(add)

    async def abort(self, request_ids: list[str]) -> None:
        self._post(lambda: self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED))

    async def shutdown(self, drain_s: float = 30.0) -> None:
        """Finish what runs, for at most `drain_s` seconds, then abort the rest and stop publishing."""
        deadline = time.monotonic() + drain_s
        while self.scheduler.has_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._task is not None:
            self._task.cancel()
        self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
        self.close()

    # -- the loop ---------------------------------------------------------------------------------
    def _post(self, action: Callable[[], None]) -> None:
        self._inbox.append(action)
        self._wake.set()

    async def _loop(self, on_outputs: Callable[[EngineCoreOutputs], None]) -> None:
        while True:
            if not self._inbox and (self._idle or not self.scheduler.has_requests):
                self._wake.clear()
                await self._wake.wait()
            inbox, self._inbox = self._inbox, []
            for action in inbox:
                action()
            sched = self.begin_step()
            sampled: dict[str, SampledToken] = {}
            if not sched.is_empty:
                seconds = self.timing.seconds(sched, self.speedup)
                await asyncio.sleep(seconds)
                self.steps += 1
                self.busy_seconds += seconds
                sampled = {item.request.request_id: SampledToken(self._token(item))
                           for item in sched.scheduled if item.sample}
            else:
                await asyncio.sleep(0)  # a step that computed nothing still lets the loop breathe
            outputs = self.finish_step(sched, sampled)
            for out in outputs:
                if out.finish_reason is not None:
                    self._digests.pop(out.request_id, None)
            on_outputs(EngineCoreOutputs(0, outputs, self.stats(), time.time()))

    def _token(self, item: ScheduledRequest) -> int:
        req, params = item.request, item.request.sampling_params
        done, crc = self._digests.get(req.request_id, (0, 0))
        tokens = req.all_token_ids
        crc = zlib.crc32(b"".join(t.to_bytes(4, "little") for t in tokens[done:]), crc)
        self._digests[req.request_id] = (len(tokens), crc)
        if params.temperature > 0:  # sampled: another draw for another seed, or for another request
            salt = str(params.seed) if params.seed is not None else req.request_id
            crc = zlib.crc32(salt.encode(), crc)
        return self.words[crc % len(self.words)]
