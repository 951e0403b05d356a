"""`tandem serve`: parse flags into one EngineConfig, start the engines, then serve HTTP.

The server only listens once every EngineCore has reported READY. SIGTERM/Ctrl-C stop accepting,
let in-flight requests finish, then shut the engines down. A dead engine makes the process exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any, get_args

from tandem_engine.config import (
    CACHE_DIR_ENV,
    SERVED_MODEL_NAME_ENV,
    AttentionBackendName,
    DType,
    EngineConfig,
    EngineRole,
    KVCacheDType,
    KVConnectorName,
    KVFailurePolicy,
    Quantization,
    SchedulingPolicy,
)
from tandem_engine.entrypoints.tools import TOOL_FORMATS

logger = logging.getLogger("tandem_engine.serve")
KEEP_ALIVE_SECONDS = 75  # above the router's keepalive_timeout (tandem_router/router.py)


def build_parser() -> argparse.ArgumentParser:
    """Every EngineConfig field is a flag of the same name (`dest`), with the config's default."""
    p = argparse.ArgumentParser(prog="tandem serve", description="Serve a model over an OpenAI-compatible API.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = EngineConfig()
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="HTTP port")
    server.add_argument("--log-level", default="info", help="debug, info, warning or error")
    server.add_argument("--ready-timeout", dest="ready_timeout_s", type=float, default=d.ready_timeout_s,
                        help="seconds to wait for every EngineCore's READY")
    server.add_argument("--revision", default=d.revision,
                        help="this engine's revision, reported by /health (X-Tandem-Revision): routers move KV only "
                             "between a prefill and a decode engine of one revision")
    server.add_argument("--drain-seconds", type=_non_negative, default=d.drain_seconds,
                        help="after SIGTERM, how long requests in flight and KV leases held for decode "
                             "engines may keep the server up")
    model = p.add_argument_group("model")
    model.add_argument("--model", default=d.model,
                       help="safetensors directory, .gguf file, or the alias smollm2-135m-instruct")
    model.add_argument("--served-model-name", default=d.served_model_name,
                       help=f"model id in the API; ${SERVED_MODEL_NAME_ENV} when set, None: --model")
    model.add_argument("--dtype", default=d.dtype, choices=get_args(DType),
                       help="auto: bfloat16 on a GPU or a CPU with AMX, else float32")
    model.add_argument("--quantization", default=d.quantization, choices=get_args(Quantization),
                       help="none: dense weights; int8: dynamic int8 projections (weights per output "
                       "channel, activations per token); gguf: the GGUF file's own Q4_1/Q8_0 blocks through "
                       "a C kernel; both float32 only")
    model.add_argument("--tool-call-parser", default=d.tool_call_parser, choices=TOOL_FORMATS,
                       help="the format of tool calls in the model's text: smollm2 (a JSON list in one "
                       "<tool_call> tag), hermes (one object per tag, Qwen2.5/3); auto: hermes where the chat "
                       "template renders tools, else smollm2")
    model.add_argument("--max-model-len", type=int, default=d.max_model_len,
                       help="context length; None: the model's")
    model.add_argument("--cache-dir", default=d.cache_dir,
                       help=f"dequantized GGUF models and the built CPU kernel; ${CACHE_DIR_ENV} when set")
    _add_engine_flags(p, d)
    _add_kv_transfer_flags(p, d)
    _add_kv_events_flags(p, d)
    return p


def _add_engine_flags(p: argparse.ArgumentParser, d: EngineConfig) -> None:
    cache = p.add_argument_group("KV cache and scheduling")
    cache.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    cache.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=get_args(KVCacheDType),
                       help="what the KV cache stores (auto: the model's dtype); a 16-bit cache holds twice "
                       "the tokens and is widened to the model's dtype when read")
    cache.add_argument("--kv-cache-gib", type=float, default=d.kv_cache_gib, help="KV cache size per engine (GiB)")
    cache.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks,
                       help="exact number of KV blocks, overriding --kv-cache-gib")
    cache.add_argument("--prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching, help="reuse the KV of shared prompt prefixes")
    cache.add_argument("--max-num-seqs", type=_positive, default=d.max_num_seqs, help="requests in one batch")
    cache.add_argument("--max-num-batched-tokens", type=_positive, default=d.max_num_batched_tokens,
                       help="tokens in one step, prefill chunks and decodes (default: 512 on a CPU, 2048 on a GPU, "
                       "at least --max-num-seqs): running streams wait out each step")
    cache.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=get_args(SchedulingPolicy),
                       help="fcfs: arrival order (a request's priority must be 0); priority: lowest "
                       "`priority` first, then arrival")
    cache.add_argument("--max-waiting-requests", type=_non_negative, default=d.max_waiting_requests,
                       help="answer 429 rather than let more requests wait for a running slot")
    compute = p.add_argument_group("compute")
    compute.add_argument("--data-parallel-size", type=int, default=d.data_parallel_size,
                         help="EngineCore processes behind this frontend")
    compute.add_argument("--num-threads", type=int, default=d.num_threads,
                         help="torch threads per EngineCore; None: the CPUs this process may use, split "
                              "among the EngineCores")
    compute.add_argument("--attention-backend", default=d.attention_backend,
                         choices=get_args(AttentionBackendName), help="auto: triton on a GPU, else torch")
    compute.add_argument("--cpu-attention-kernel", action=argparse.BooleanOptionalAction,
                         default=d.cpu_attention_kernel,
                         help="the torch backend's C attention kernels for decode rows and float32 prefill chunks "
                              "(built on first use)")
    compute.add_argument("--cpu-fused-kernels", action=argparse.BooleanOptionalAction,
                         default=d.cpu_fused_kernels,
                         help="C kernels for the residual add + RMSNorm, SiLU * up and RoPE of a float32 model "
                              "on the CPU (built on first use)")
    compute.add_argument("--onednn-pack", action=argparse.BooleanOptionalAction, default=d.onednn_pack,
                         help="oneDNN-prepacked weights for batched CPU matmuls")
    compute.add_argument("--cpu-amx-float32", action=argparse.BooleanOptionalAction, default=d.cpu_amx_float32,
                         help="a float32 model from a GGUF file runs its matmuls of 32 rows or more on AMX tiles, "
                              "in float32 arithmetic (a CPU with AMX; off: the same sums at every batch size)")
    compute.add_argument("--cpu-float-panels", action=argparse.BooleanOptionalAction, default=d.cpu_float_panels,
                         help="a float32 model from a GGUF file keeps float32 copies of its weights beside their "
                              "blocks for matmuls of 16 rows or more, where the panel kernel is the AVX2 build "
                              "(faster batches for 4 more bytes of memory a weight; off: the blocks alone)")


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {number}")  # 0 would schedule nothing, ever
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {number}")
    return number


def _add_kv_events_flags(p: argparse.ArgumentParser, d: EngineConfig) -> None:
    ev = p.add_argument_group("KV events (what the prefix cache holds, for routers)")
    ev.add_argument("--kv-events-port", type=int, default=d.kv_events_port,
                    help="publish KV events on this port (DP rank i: port + 2i) and answer replay "
                    "requests on the next one; 0: off")
    ev.add_argument("--kv-events-host", default=d.kv_events_host, help="address the KV event sockets bind")
    ev.add_argument("--kv-events-buffer-steps", type=int, default=d.kv_events_buffer_steps,
                    help="batches kept for replay to late or reconnecting subscribers")


def _add_kv_transfer_flags(p: argparse.ArgumentParser, d: EngineConfig) -> None:
    kv = p.add_argument_group("prefill/decode disaggregation")
    kv.add_argument("--role", default=d.role, choices=get_args(EngineRole),
                    help="both: a colocated engine; prefill or decode: one side of a P/D pair")
    kv.add_argument("--kv-connector", default=d.kv_connector, choices=get_args(KVConnectorName),
                    help="how a prefill or decode engine moves KV blocks")
    kv.add_argument("--kv-side-channel-port", type=int, default=d.kv_side_channel_port,
                    help="port a prefill engine serves its KV metadata on")
    kv.add_argument("--kv-host", default=d.kv_host, help="address decode engines use to reach this one")
    kv.add_argument("--kv-lease-seconds", type=float, default=d.kv_lease_seconds,
                    help="how long a prefill engine holds blocks for a decode engine to read")
    kv.add_argument("--kv-failure-policy", default=d.kv_failure_policy, choices=get_args(KVFailurePolicy),
                    help="a decode engine's answer to a failed KV read: fail the request or recompute it")
    kv.add_argument("--kv-transfer-threads", type=int, default=d.kv_transfer_threads,
                    help="UCX threads that split one KV read into parallel copies (0: the progress thread only)")


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig named by the parsed flags (the server flags --host, --port, --log-level aside)."""
    return EngineConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(EngineConfig)})


async def serve(config: EngineConfig, host: str, port: int, log_level: str) -> int:
    from tandem_engine.frontend.core_client import CoreClient, EngineStartupError

    t0 = time.perf_counter()
    # The EngineCores start before this process imports torch and transformers (seconds): both import
    # at once, and the engines load the model meanwhile.
    core = CoreClient.start(config)
    try:
        import uvicorn

        from tandem_engine.entrypoints.api_server import build_app
        from tandem_engine.frontend.async_llm import AsyncLLM
        from tandem_engine.frontend.interface import EngineDeadError

        server_class = make_server_class()
        engine = await AsyncLLM.create(core)
    except EngineStartupError as e:
        logger.error("[startup] %s", e)
        return 1
    except BaseException:
        core.terminate()  # the engines must not outlive a frontend that failed to start
        raise
    app = build_app(engine, engine.metrics.registry, config.kv_events_info(), config.revision)
    # Idle connections live longer here than in the router's pool (60 s): a server that closes first races
    # the router's next request on that connection, which then fails as ServerDisconnectedError.
    server = server_class(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                         timeout_graceful_shutdown=config.drain_seconds, access_log=False,
                                         timeout_keep_alive=KEEP_ALIVE_SECONDS))
    exit_code = 0

    def on_dead(error: EngineDeadError) -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    engine.add_death_callback(on_dead)
    logger.info("[startup] ready in %.1fs: http://%s:%d (model %s)", time.perf_counter() - t0, host, port,
                engine.model_name)
    try:
        await server.serve()
    finally:
        engine.begin_drain()
        # The HTTP drain (uvicorn's graceful shutdown) spent part of the budget; the EngineCores get the rest.
        spent = time.monotonic() - server.exit_requested_at if server.exit_requested_at else 0.0
        await engine.shutdown(max(0.0, config.drain_seconds - spent) if exit_code == 0 else 0.0)
    if exit_code:
        logger.error("[shutdown] exiting with an error: the engine died (%s)", engine.dead_error)
    return exit_code if not server.started or exit_code else 0


def make_server_class() -> Any:  # a subclass of uvicorn.Server, imported late
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises the captured SIGTERM after a graceful shutdown, which would kill us before
        the engines are shut down and turn a clean exit into -15: handle the signals ourselves. Records when
        the first one came, the start of the drain."""

        exit_requested_at: float | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.exit_requested_at is None:
                self.exit_requested_at = time.monotonic()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    return Server


def _gguf_error(config: EngineConfig) -> str | None:
    """Why --model cannot be served with --quantization gguf (not a GGUF, or a tensor type the kernel does
    not read), or None. Reads the GGUF header only."""
    from tandem_engine.models.gguf_weights import type_error
    from tandem_engine.models.loader import resolve_model

    try:
        src = resolve_model(config.model, config.cache_path)
    except FileNotFoundError as e:
        return str(e)
    if src.kind != "gguf":
        return f"--quantization gguf serves a GGUF file's own blocks: --model {config.model} is not a .gguf file"
    return type_error(src.path, f"--model {config.model}")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(args)
    error = config.quantization_error() or (_gguf_error(config) if config.quantization == "gguf" else None)
    if error:
        parser.error(error)  # exit 2, like any other bad flag
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s [APIServer] %(name)s: %(message)s")
    try:
        return asyncio.run(serve(config, args.host, args.port, args.log_level))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
