"""`tandem serve`: parse flags into one EngineConfig, start the engines, then serve HTTP.

The server only listens once every EngineCore has reported READY. SIGTERM/Ctrl-C stop accepting,
let in-flight requests finish, then shut the engines down. A dead engine makes the process exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time

from tandem_engine.config import EngineConfig

logger = logging.getLogger("tandem_engine.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem serve", description="Serve a model over an OpenAI-compatible API.")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="safetensors directory, .gguf file, or the alias smollm2-135m-instruct")
    p.add_argument("--served-model-name", default=os.environ.get("TANDEM_SERVED_MODEL_NAME") or None,
                   help="model id in the API (default: $TANDEM_SERVED_MODEL_NAME, else --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache size per engine (GiB)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks (overrides GiB)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per EngineCore")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--kv-side-channel-port", type=int, default=5600)
    p.add_argument("--kv-host", default="127.0.0.1", help="address decode engines use to reach this one")
    p.add_argument("--kv-lease-seconds", type=float, default=30.0)
    p.add_argument("--kv-failure-policy", default="fail", choices=["fail", "recompute"])
    p.add_argument("--kv-transfer-threads", type=int, default=2,
                   help="UCX threads that split one KV read into parallel copies (0: the progress thread only)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for EngineCore READY")
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model, served_model_name=a.served_model_name, dtype=a.dtype, role=a.role,
        max_model_len=a.max_model_len, block_size=a.block_size, kv_cache_gib=a.kv_cache_gib,
        num_kv_blocks=a.num_kv_blocks, enable_prefix_caching=not a.no_prefix_caching,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        data_parallel_size=a.data_parallel_size, num_threads=a.num_threads,
        kv_side_channel_port=a.kv_side_channel_port, kv_host=a.kv_host, kv_lease_seconds=a.kv_lease_seconds,
        kv_failure_policy=a.kv_failure_policy, kv_transfer_threads=a.kv_transfer_threads,
        attention_backend=a.attention_backend,
        ready_timeout_s=a.ready_timeout,
    )


async def serve(config: EngineConfig, host: str, port: int, log_level: str) -> int:
    import uvicorn

    from tandem_engine.entrypoints.api_server import build_app
    from tandem_engine.frontend.async_llm import AsyncLLM
    from tandem_engine.frontend.core_client import EngineStartupError

    _Server = _make_server_class()
    t0 = time.perf_counter()
    engine = AsyncLLM(config)
    try:
        await engine.start()
    except EngineStartupError as e:
        logger.error("[startup] %s", e)
        return 1
    app = build_app(engine, engine.metrics.registry)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=30, access_log=False))
    exit_code = 0

    def on_dead(message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    engine.core._on_dead = _chain(engine.core._on_dead, on_dead)
    logger.info("[startup] ready in %.1fs: http://%s:%d (model %s)", time.perf_counter() - t0, host, port,
                engine.model_name)
    try:
        await server.serve()
    finally:
        engine.begin_drain()
        await engine.shutdown(drain=exit_code == 0)
    if exit_code:
        logger.error("[shutdown] exiting with an error: the engine died (%s)", engine.dead_error)
    return exit_code if not server.started or exit_code else 0


def _make_server_class():  # type: ignore[no-untyped-def]
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises the captured SIGTERM after a graceful shutdown, which would kill us before
        the engines are shut down and turn a clean exit into -15: handle the signals ourselves."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[no-untyped-def,override]
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    return Server


def _chain(*fns):  # type: ignore[no-untyped-def]
    def call(message: str) -> None:
        for fn in fns:
            fn(message)
    return call


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s [APIServer] %(name)s: %(message)s")
    try:
        return asyncio.run(serve(config_from_args(args), args.host, args.port, args.log_level))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
