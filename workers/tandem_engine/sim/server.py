"""`tandem sim`: N simulated engines in one process, engine i at http://HOST:PORT+i with its KV events on
KV_PORT+2i (replay on the next port). Each has the real HTTP app (entrypoints/api_server.py) over the real
AsyncLLM, with a SimCore behind it; one uvicorn server listens on every port and hands each connection to
its engine's app (docs/simulation.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import re
import socket
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem_engine.config import EngineConfig
from tandem_engine.cpu_budget import ThreadPlan
from tandem_engine.entrypoints.api_server import build_app
from tandem_engine.entrypoints.cli import KEEP_ALIVE_SECONDS, build_parser, config_from_args, make_server_class
from tandem_engine.frontend.async_llm import AsyncLLM
from tandem_engine.models.loader import eos_token_ids, load_config_and_tokenizer, pick_dtype, resolve_model
from tandem_engine.sim.engine import SimCore, SimEvents
from tandem_engine.sim.timing import DEFAULT_TIMING, StepTiming
from tandem_engine.worker.model_runner import kv_cache_blocks, kv_cache_dtype, kv_layout

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]
_WORD = re.compile(r" [A-Za-z]{2,12}")


def word_tokens(tokenizer: Any, eos_ids: list[int], limit: int = 4096) -> list[int]:
    """Token ids that decode to a space and a word and encode back to themselves alone: a simulated answer
    made of them reads as words and re-tokenizes to the same ids (a resumed or migrated stream, a router's
    hash of the text)."""
    words = []
    for token_id in range(len(tokenizer)):
        if token_id in eos_ids:
            continue
        text = tokenizer.decode([token_id])
        if _WORD.fullmatch(text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            words.append(token_id)
            if len(words) == limit:
                break
    if not words:
        raise ValueError("the vocabulary has no word tokens for a simulated engine to answer with")
    return words


@dataclass
class SimEngine:
    port: int
    core: SimCore
    llm: AsyncLLM
    app: ASGIApp


class Fleet:
    """The engines, their shared ZMQ context, and the dispatch of each connection to its engine's app by the
    port it came in on."""

    def __init__(self, engines: list[SimEngine], events: SimEvents) -> None:
        self.engines, self.events = engines, events
        self._by_port = {e.port: e.app for e in engines}

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        await self._by_port[scope["server"][1]](scope, receive, send)

    async def shutdown(self, drain_s: float) -> None:
        for e in self.engines:
            e.llm.begin_drain()
        await asyncio.gather(*(e.llm.shutdown(drain_s) for e in self.engines))
        self.events.close()


async def start_fleet(config: EngineConfig, engines: int, first_port: int, timing: StepTiming,
                      speedup: float) -> Fleet:
    """`engines` simulated engines of `config`'s model and settings: the tokenizer, config and vocabulary
    loaded once and shared; each engine its own scheduler, KV cache, metrics, KV event sockets and app."""
    src = resolve_model(config.model, config.cache_path)
    hf_config, tokenizer, generation = await asyncio.to_thread(load_config_and_tokenizer, src)
    eos = eos_token_ids(hf_config, tokenizer, generation)
    dtype = pick_dtype(config.dtype, config.quantization)
    kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
    num_blocks = kv_cache_blocks(config, kv_layout(hf_config), kv_dtype)
    model_limit = int(getattr(hf_config, "max_position_embeddings", 2048))
    max_model_len = min(config.max_model_len or model_limit, model_limit)
    if (num_blocks - 1) * config.block_size < max_model_len:
        raise ValueError(f"the KV cache holds {(num_blocks - 1) * config.block_size} tokens ({num_blocks} blocks of "
                         f"{config.block_size}), less than --max-model-len {max_model_len}: raise --kv-cache-gib "
                         "or lower --max-model-len")
    words = await asyncio.to_thread(word_tokens, tokenizer, eos)
    plan = ThreadPlan(0, "simulated: no forward pass", None)
    events = SimEvents(engines)
    spec: bytes | None = None
    fleet: list[SimEngine] = []
    for i in range(engines):
        cfg = dataclasses.replace(config, kv_events_port=config.kv_events_port + 2 * i if config.kv_events_port else 0)
        core = SimCore(cfg, num_blocks, max_model_len, timing, speedup, words, events,
                       str(kv_dtype).removeprefix("torch."), str(dtype).removeprefix("torch."))
        llm = AsyncLLM(cfg, plan, core, hf_config, tokenizer, eos, tokenizer_spec=spec)
        if spec is None:
            spec = await asyncio.to_thread(llm.tokenizer_spec)  # ~2 MB of JSON, built once for all
        app = build_app(llm, llm.metrics.registry, cfg.kv_events_info(), cfg.revision)
        fleet.append(SimEngine(first_port + i, core, llm, app))
    logger.info("[startup] %d simulated engines of %s: %d KV blocks of %d each, max_model_len %d, timing %s%s",
                engines, config.model, num_blocks, config.block_size, max_model_len, timing.source or "given",
                f", {speedup:g}x faster" if speedup != 1 else "")
    return Fleet(fleet, events)


def listen(host: str, ports: list[int]) -> list[socket.socket]:
    """A listening socket per port (uvicorn serves them all from one server)."""
    out = []
    try:
        for port in ports:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(2048)
            sock.setblocking(False)
    except OSError:
        for sock in out:
            sock.close()
        raise
    return out


async def serve(config: EngineConfig, host: str, first_port: int, engines: int, timing: StepTiming,
                speedup: float, log_level: str) -> int:
    import uvicorn

    t0 = time.perf_counter()
    ports = [first_port + i for i in range(engines)]
    sockets = listen(host, ports)  # before the engines: a taken port fails at once
    fleet = await start_fleet(config, engines, first_port, timing, speedup)
    server = make_server_class()(uvicorn.Config(fleet, log_level=log_level, access_log=False, lifespan="off",
                                                timeout_graceful_shutdown=config.drain_seconds,
                                                timeout_keep_alive=KEEP_ALIVE_SECONDS))
    logger.info("[startup] ready in %.1fs: http://%s:%d-%d", time.perf_counter() - t0, host, ports[0], ports[-1])
    try:
        await server.serve(sockets=sockets)
    finally:
        await fleet.shutdown(config.drain_seconds)
        for sock in sockets:
            sock.close()
    return 0


def build_sim_parser() -> argparse.ArgumentParser:
    """`tandem serve`'s flags (an engine's settings: each simulated engine takes them), and the fleet's. Flags
    of the forward pass (threads, kernels, quantization) are accepted and change nothing but the dtype."""
    p = build_parser()
    p.prog = "tandem sim"
    p.description = ("N simulated engines in one process: engine i serves on --port + i and publishes KV "
                     "events on --kv-events-port + 2i (docs/simulation.md).")
    sim = p.add_argument_group("simulation")
    sim.add_argument("--engines", type=int, default=1, help="how many engines")
    sim.add_argument("--first-port", dest="port", type=int, help="the first engine's HTTP port (= --port)")
    sim.add_argument("--speedup", type=float, default=1.0,
                     help="divide every step time by this (a faster machine than the one the timing came from)")
    sim.add_argument("--timing", type=Path, default=DEFAULT_TIMING,
                     help="the timing model (bench/sim_calibrate.py writes one)")
    return p


def main(argv: list[str]) -> int:
    parser = build_sim_parser()
    args = parser.parse_args(argv)
    config = config_from_args(args)
    if args.engines < 1:
        parser.error("--engines must be at least 1")
    if args.speedup <= 0:
        parser.error("--speedup must be positive")
    if config.role != "both":
        parser.error("--role prefill and decode are not simulated yet: a simulated engine serves both")
    try:
        timing = StepTiming.load(args.timing)
    except (OSError, ValueError, KeyError) as e:
        parser.error(f"--timing {args.timing}: {e}")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s [sim] %(name)s: %(message)s")
    try:
        return asyncio.run(serve(config, args.host, args.port, args.engines, timing, args.speedup, args.log_level))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
