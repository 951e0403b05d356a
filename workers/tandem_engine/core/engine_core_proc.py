"""The EngineCore process: handshake, IO threads, and the busy loop.

Main thread: drain the input queue (blocking only when idle), step, queue outputs. The input thread
owns the DEALER socket (decodes requests, builds Request objects); the output thread owns the PUSH
socket. A fatal error in the loop sends a dead sentinel so the frontend fails every stream at once.
"""

from __future__ import annotations

import logging
import os
import pkgutil
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from tandem_engine.config import EngineConfig
from tandem_engine.cpu_budget import openmp_env
from tandem_engine.protocol import (
    EngineCoreOutputs,
    FailedMessage,
    ReadyMessage,
    RequestType,
    encoder,
    request_decoder,
)
from tandem_engine.request import Request

if TYPE_CHECKING:
    from tandem_engine.core.engine_core import RunnerFactory
    from tandem_engine.kv_transfer.interface import LeaseCounts  # imports torch, which must load after openmp_env

logger = logging.getLogger(__name__)

_WAKEUP = object()
_PARENT_POLL_MS = 1000


@dataclass
class EngineAddresses:
    input: str  # frontend ROUTER (bound): requests in
    output: str  # frontend PULL (bound): outputs out
    handshake: str  # frontend ROUTER (bound): READY / FAILED


def run_engine_core(config: EngineConfig, engine_index: int, addresses: EngineAddresses, runner: str,
                    log_level: int = logging.INFO) -> None:
    """Process entry point (spawned by the core client). `runner`: the model runner class by name
    (pkgutil.resolve_name), resolved here, once libgomp's environment is set, since it imports torch."""
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s [EngineCore_{engine_index}] %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group; the frontend owns shutdown, so the engine ignores it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import setproctitle

        setproctitle.setproctitle(f"tandem::EngineCore_{engine_index}")
    except ImportError:
        pass
    # libgomp reads its environment once, when torch loads it.
    os.environ.update(openmp_env())
    import torch

    torch.set_num_threads(config.thread_plan().threads)
    ctx = zmq.Context(io_threads=2)
    handshake = ctx.socket(zmq.DEALER)
    handshake.setsockopt(zmq.LINGER, 5000)
    handshake.connect(addresses.handshake)
    proc: EngineCoreProc | None = None
    try:
        try:
            proc = EngineCoreProc(config, engine_index, addresses, ctx, pkgutil.resolve_name(runner))
        except Exception as e:
            logger.exception("[startup] engine %d failed to start", engine_index)
            handshake.send(encoder.encode(FailedMessage(engine_index, f"{type(e).__name__}: {e}")))
            raise SystemExit(1) from e
        handshake.send(encoder.encode(proc.ready_message()))
        handshake.close()
        proc.run_busy_loop()
    finally:
        if proc is not None:
            proc.shutdown()
        ctx.term()


class EngineCoreProc:
    def __init__(self, config: EngineConfig, engine_index: int, addresses: EngineAddresses,
                 ctx: zmq.Context[Any], runner: RunnerFactory) -> None:
        from tandem_engine.core.engine_core import EngineCore
        from tandem_engine.kv_transfer.interface import LeaseCounts

        self.engine_index = engine_index
        self.core = EngineCore(config, engine_index, runner=runner)
        # SimpleQueue: its put is safe from a signal handler, which may run while the loop is inside get
        self.input_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self._shutdown = threading.Event()
        self._draining = False
        self._drain_start = self._drain_deadline = 0.0
        self._leases_at_start = LeaseCounts()
        self._parent = os.getppid()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._input_thread = threading.Thread(target=self._input_loop, args=(ctx, addresses.input),
                                              name="EngineCoreInput", daemon=True)
        self._output_thread = threading.Thread(target=self._output_loop, args=(ctx, addresses.output),
                                               name="EngineCoreOutput", daemon=True)
        self._input_ready = threading.Event()
        self._input_thread.start()
        self._output_thread.start()
        self._input_ready.wait(10)
        if self.core.kv_worker is not None:
            # Connector threads (handshake done, release or heartbeat arrived) wake an idle loop.
            self.core.kv_worker.set_wakeup(lambda: self.input_queue.put(_WAKEUP))

    def ready_message(self) -> ReadyMessage:
        return ReadyMessage(self.engine_index, self.core.runner.num_blocks, self.core.config.block_size,
                            self.core.max_model_len, os.getpid(), engine_id=self.core.engine_id,
                            startup_seconds=self.core.startup_seconds,
                            kv_cache_dtype=self.core.runner.kv_dtype_name,
                            dtype=str(self.core.dtype).removeprefix("torch."))

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only put a message on the queue: the loop drains live requests and leases, then exits.
        self.input_queue.put((RequestType.SHUTDOWN, float(self.core.config.drain_seconds)))

    def _begin_drain(self, drain_s: float) -> None:
        """Keep stepping until no request is open, no lease on our blocks is held and no KV load is pending,
        or for `drain_s` seconds; 0 aborts every request at once."""
        if self._shutdown.is_set():
            # Already leaving (SIGTERM, then the frontend's own ask): the earlier deadline holds.
            self._drain_deadline = min(self._drain_deadline, time.monotonic() + drain_s)
            return
        self._drain_start = time.monotonic()
        self._drain_deadline = self._drain_start + drain_s
        self._draining = drain_s > 0  # before the flag: the input thread reads on while either says so
        self._shutdown.set()
        if not self._draining:
            self._abort_all()
            return
        leases = self._leases()
        logger.info("[drain] engine %d draining for up to %.0fs: %d requests open, %d leases held "
                    "(%d blocks) for decode engines to read", self.engine_index, drain_s,
                    len(self.core.scheduler.requests), leases.held, leases.held_blocks)
        self._leases_at_start = leases

    def _leases(self) -> LeaseCounts:
        from tandem_engine.kv_transfer.interface import LeaseCounts

        return self.core.kv_connector.leases if self.core.kv_connector is not None else LeaseCounts()

    def _abort_all(self) -> None:
        self.core.abort_requests(list(self.core.scheduler.requests))
        self.output_queue.put(EngineCoreOutputs(self.engine_index, self.core.step(), self.core.stats(), time.time()))

    def _still_draining(self) -> bool:
        """While draining: is there work left that may still finish in time?"""
        if not self._draining:
            return False
        if self.core.has_requests or self.core.kv_busy:
            if time.monotonic() < self._drain_deadline:
                return True
            leases = self._leases()
            logger.warning("[drain] engine %d: the drain's %.0fs are up; aborting %d requests, dropping %d "
                           "leases (%d blocks)", self.engine_index, self._drain_deadline - self._drain_start,
                           len(self.core.scheduler.requests), leases.held, leases.held_blocks)
            self._abort_all()
        else:
            start, end = self._leases_at_start, self._leases()
            logger.info("[drain] engine %d drained in %.1fs: %d leases released, %d expired while it waited "
                        "(%d released, %d expired since it started)", self.engine_index,
                        time.monotonic() - self._drain_start, end.released - start.released,
                        end.expired - start.expired, end.released, end.expired)
        self._draining = False
        return False

    # -- busy loop ----------------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        last_stats = None
        try:
            while True:
                self._process_input_queue()
                if self._shutdown.is_set() and not self._still_draining():
                    logger.info("[shutdown] engine %d leaving the busy loop", self.engine_index)
                    return
                if self.core.has_requests or self.core.kv_busy:
                    outputs = self.core.step()
                    stats = self.core.stats()
                    # KV bookkeeping steps with nothing to say (polling a read) send nothing.
                    if outputs or self.core.has_requests or stats != last_stats:
                        self.output_queue.put(
                            EngineCoreOutputs(self.engine_index, outputs, stats, time.time()))
                    last_stats = stats
        except Exception as e:
            logger.exception("[fatal] EngineCore %d died", self.engine_index)
            dead = EngineCoreOutputs(self.engine_index, [], None, time.time(),
                                     dead_error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            self.output_queue.put(dead)
            self.output_queue.put(None)
            self._output_thread.join(5)
            raise SystemExit(1) from e

    def _process_input_queue(self) -> None:
        # Blocks only when idle; while KV transfers or leases are pending it waits with a timeout (while
        # draining too, at most until the drain's deadline).
        if not self._shutdown.is_set():
            timeout = self.core.wait_timeout()
        elif self._draining and (self.core.has_requests or self.core.kv_busy):
            left = max(0.0, self._drain_deadline - time.monotonic())
            wait = self.core.wait_timeout()
            timeout = left if wait is None else min(wait, left)
        else:
            timeout = 0.0
        block = timeout != 0.0
        while True:
            try:
                item = self.input_queue.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return
            block = False
            if item is _WAKEUP:
                continue
            kind, payload = item
            if kind == RequestType.ADD:
                if self._draining:
                    self.core.add_request(payload)
                    self.core.abort_requests([payload.request_id])
                else:
                    self.core.add_request(payload)
            elif kind == RequestType.ABORT:
                self.core.abort_requests(payload)
            elif kind == RequestType.SHUTDOWN:
                self._begin_drain(payload)

    # -- IO threads ---------------------------------------------------------------------------
    def _input_loop(self, ctx: zmq.Context[Any], address: str) -> None:
        try:
            self._input_loop_inner(ctx, address)
        except zmq.ContextTerminated:
            pass  # shutdown closed the context under a blocking poll: nothing left to read

    def _input_loop_inner(self, ctx: zmq.Context[Any], address: str) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.engine_index.to_bytes(2, "little"))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(b"")  # registers our identity with the frontend's ROUTER before READY
        self._input_ready.set()
        abort_decoder = msgspec.msgpack.Decoder(list[str])
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._shutdown.is_set() or self._draining:
            if not poller.poll(_PARENT_POLL_MS):
                if os.getppid() != self._parent:
                    logger.warning("[shutdown] frontend process is gone; exiting")
                    self.input_queue.put((RequestType.SHUTDOWN, 0.0))
                    return
                continue
            kind_b, payload = sock.recv_multipart()
            kind = RequestType(kind_b[0])
            if kind == RequestType.ADD:
                req = Request.from_engine_core_request(request_decoder.decode(payload))
                if self.core.kv_worker is not None and req.kv_transfer_params:
                    self.core.kv_worker.on_arrival(req.request_id, req.kv_transfer_params)
                self.input_queue.put((kind, req))
            elif kind == RequestType.ABORT:
                self.input_queue.put((kind, abort_decoder.decode(payload)))
            elif kind == RequestType.SHUTDOWN:
                self.input_queue.put((kind, msgspec.msgpack.decode(payload)))
        sock.close()

    def _output_loop(self, ctx: zmq.Context[Any], address: str) -> None:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)  # the dead sentinel must get out before exit
        sock.connect(address)
        buf = bytearray()
        while True:
            item = self.output_queue.get()
            if item is None:
                break
            encoder.encode_into(item, buf)
            sock.send(buf, copy=True)
        sock.close()

    def shutdown(self) -> None:
        self._shutdown.set()
        self._draining = False
        self.output_queue.put(None)
        self._output_thread.join(5)
        self.core.shutdown()
