"""The frontend's side of the ZMQ boundary: binds the sockets, launches the EngineCore processes,
waits for their READY handshake, then sends requests and feeds outputs to a callback.

With `data_parallel_size > 1` there are N engines behind one ROUTER socket; each new request goes to
the engine with the fewest live requests, and aborts follow the request to its engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from tandem_engine.config import EngineConfig
from tandem_engine.core.engine_core_proc import EngineAddresses, run_engine_core
from tandem_engine.cpu_budget import ThreadPlan
from tandem_engine.frontend.interface import EngineDeadError
from tandem_engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FailedMessage,
    ReadyMessage,
    RequestType,
    encoder,
    handshake_decoder,
    outputs_decoder,
)

logger = logging.getLogger(__name__)

# The model runner each engine core process steps (named, not imported: it imports torch, which the process
# must load after setting libgomp's environment).
RUNNER = "tandem_engine.worker.model_runner:ModelRunner"


class EngineStartupError(RuntimeError):
    pass


class CoreClient:
    """Three phases, in order: `launch()` the processes, `wait_ready()` for their handshake, then
    `run()` the IO tasks that deliver outputs and announce a dead engine."""

    def __init__(self, config: EngineConfig, thread_plan: ThreadPlan) -> None:
        self.config = config
        self.thread_plan = thread_plan
        self.ctx = zmq.asyncio.Context(io_threads=2)
        self.input_socket = self.ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input_socket.bind("tcp://127.0.0.1:*")
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind("tcp://127.0.0.1:*")
        self._handshake = self.ctx.socket(zmq.ROUTER)
        self._handshake.bind("tcp://127.0.0.1:*")
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.ready: list[ReadyMessage] = []
        self.engine_load = [0] * config.data_parallel_size
        self.owner: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.launched_at = 0.0  # time.perf_counter() at launch()

    @classmethod
    def start(cls, config: EngineConfig) -> CoreClient:
        """Decide the EngineCores' thread count (once, so that the log and the metric say what they
        use) and launch them. Light to import: `tandem serve` calls it before it imports torch and
        transformers for its tokenizer, so both imports run at once."""
        plan = config.thread_plan()
        logger.info("[startup] %d intra-op thread(s) per EngineCore: %s", plan.threads, plan.reason)
        core = cls(dataclasses.replace(config, num_threads=plan.threads), plan)
        core.launch()
        return core

    @property
    def max_model_len(self) -> int:
        return self.ready[0].max_model_len

    @property
    def model_dtype(self) -> str:
        return self.ready[0].dtype

    def launch(self) -> None:
        """Start the EngineCore processes; they load the model while the frontend loads its tokenizer."""
        # tcp://127.0.0.1:* placeholders resolved to the endpoints actually bound.
        addresses = EngineAddresses(
            input=self.input_socket.getsockopt_string(zmq.LAST_ENDPOINT),
            output=self.output_socket.getsockopt_string(zmq.LAST_ENDPOINT),
            handshake=self._handshake.getsockopt_string(zmq.LAST_ENDPOINT),
        )
        self.launched_at = time.perf_counter()
        mp = multiprocessing.get_context("spawn")
        for i in range(self.config.data_parallel_size):
            p = mp.Process(target=run_engine_core, args=(self.config, i, addresses, RUNNER, logging.getLogger().level),
                           name=f"EngineCore_{i}", daemon=False)
            p.start()
            self.procs.append(p)

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait for every launched engine's READY; raises EngineStartupError (engines terminated) on
        failure."""
        timeout_s = self.config.ready_timeout_s if timeout_s is None else timeout_s
        try:
            await self._wait_for_ready(self._handshake, timeout_s)
        except BaseException:
            self.terminate()
            raise
        finally:
            self._handshake.close(linger=0)
        # Each engine's input DEALER announced itself with an empty frame; drain those.
        for _ in self.procs:
            await asyncio.wait_for(self.input_socket.recv_multipart(), 30)

    def run(self, on_outputs: Callable[[EngineCoreOutputs], None], on_dead: Callable[[str], None]) -> None:
        """Deliver every engine's outputs to `on_outputs`, and the reason to `on_dead` when an engine
        dies outside shutdown (a death can be reported twice: by its sentinel and by its exit)."""
        self._tasks.append(asyncio.create_task(self._output_loop(on_outputs, on_dead),
                                               name="core-client-outputs"))
        self._tasks.append(asyncio.create_task(self._monitor_procs(on_dead), name="core-client-monitor"))

    async def _wait_for_ready(self, handshake: zmq.asyncio.Socket, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(range(len(self.procs)))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineStartupError(
                    f"EngineCore did not report READY within {timeout_s:.0f}s (engines {sorted(pending)})")
            if await handshake.poll(min(remaining, 0.5) * 1000):
                _, payload = await handshake.recv_multipart()
                msg = handshake_decoder.decode(payload)
                if isinstance(msg, FailedMessage):
                    raise EngineStartupError(f"EngineCore {msg.engine_index} failed to start: {msg.error}")
                assert isinstance(msg, ReadyMessage)
                logger.info("[handshake] engine %d READY (pid %d, %d %s KV blocks, %.1fs)", msg.engine_index,
                            msg.pid, msg.num_kv_blocks, msg.kv_cache_dtype, msg.startup_seconds)
                self.ready.append(msg)
                pending.discard(msg.engine_index)
                continue
            for i in pending:
                if not self.procs[i].is_alive():
                    raise EngineStartupError(
                        f"EngineCore {i} exited with code {self.procs[i].exitcode} before READY "
                        "(see its log lines above)")
        self.ready.sort(key=lambda m: m.engine_index)

    async def _output_loop(self, on_outputs: Callable[[EngineCoreOutputs], None],
                           on_dead: Callable[[str], None]) -> None:
        while True:
            frames = await self.output_socket.recv_multipart(copy=False)
            outputs = outputs_decoder.decode(frames[0].buffer)
            if outputs.dead_error is not None:
                self._dead(on_dead, f"EngineCore {outputs.engine_index} died: {outputs.dead_error}")
                return
            for out in outputs.outputs:
                if out.finish_reason is not None:
                    idx = self.owner.pop(out.request_id, None)
                    if idx is not None:
                        self.engine_load[idx] -= 1
            on_outputs(outputs)

    async def _monitor_procs(self, on_dead: Callable[[str], None]) -> None:
        sentinels = [p.sentinel for p in self.procs]
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, multiprocessing.connection.wait, sentinels)
        if not self._closing:
            dead = [p for p in self.procs if not p.is_alive()]
            codes = ", ".join(f"EngineCore {self.procs.index(p)} exit code {p.exitcode}" for p in dead)
            self._dead(on_dead, f"EngineCore process died unexpectedly ({codes})")

    def _dead(self, on_dead: Callable[[str], None], message: str) -> None:
        if self._closing:
            return
        logger.error("[fatal] %s", message.splitlines()[0])
        on_dead(message)

    async def add_request(self, req: EngineCoreRequest) -> None:
        idx = min(range(len(self.engine_load)), key=self.engine_load.__getitem__)
        self.engine_load[idx] += 1
        self.owner[req.request_id] = idx
        await self._send(idx, RequestType.ADD, encoder.encode(req))

    async def abort(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            idx = self.owner.get(rid)
            if idx is not None:
                by_engine.setdefault(idx, []).append(rid)
        for idx, ids in by_engine.items():
            await self._send(idx, RequestType.ABORT, encoder.encode(ids))

    async def _send(self, idx: int, kind: RequestType, payload: bytes) -> None:
        try:
            await self.input_socket.send_multipart([idx.to_bytes(2, "little"), bytes([kind]), payload])
        except zmq.ZMQError as e:
            raise EngineDeadError(f"EngineCore {idx} is unreachable: {e}") from e

    async def shutdown(self, drain_s: float = 30.0) -> None:
        """Ask every engine to exit once its requests and KV leases are done, aborting what is still open
        after `drain_s` seconds (0: at once); kill stragglers a few seconds later."""
        self._closing = True
        for idx, p in enumerate(self.procs):
            if p.is_alive():
                try:
                    await self._send(idx, RequestType.SHUTDOWN, msgspec.msgpack.encode(float(drain_s)))
                except EngineDeadError:
                    pass
        deadline = time.monotonic() + drain_s + 10
        for p in self.procs:
            while p.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self.terminate()
        for t in self._tasks:
            t.cancel()
        self.ctx.destroy(linger=0)
        logger.info("[shutdown] engines stopped")

    def terminate(self) -> None:
        self._closing = True
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
