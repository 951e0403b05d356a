"""`tandem route`: flags -> RouterConfig -> serve until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal

from tandem_router.config import RouterConfig
from tandem_router.policies import POLICIES
from tandem_router.server import start_server

logger = logging.getLogger(__name__)

API_KEY_ENV = "TANDEM_API_KEY"
ROLE_LABEL = "serving.tandem.dev/role"  # on every engine pod and Service (docs/contracts.md, "Labels, annotations")


def _urls(value: str) -> list[str]:
    return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]


def build_parser() -> argparse.ArgumentParser:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="tandem route", description="Route OpenAI requests to tandem engines.")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    # Every dest is a RouterConfig field: config_from_args copies flags to fields by name.
    p.add_argument("--decode", dest="decode_urls", type=_urls, action="extend", default=[], metavar="URLS",
                   help="decode (or colocated) engine URLs, comma-separated (or the flag repeated)")
    p.add_argument("--prefill", dest="prefill_urls", type=_urls, action="extend", default=[], metavar="URLS",
                   help="prefill engine URLs, comma-separated (or the flag repeated); enables the P/D flow")
    p.add_argument("--policy", choices=POLICIES, default=None, help="policy for both pools")
    p.add_argument("--decode-policy", choices=POLICIES, default=None)
    p.add_argument("--prefill-policy", choices=POLICIES, default=None)
    p.add_argument("--discovery", choices=("static", "kubernetes"), default=d.discovery)
    p.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", d.namespace))
    p.add_argument(
        "--selector",
        default="",
        help=f"EndpointSlice selector of both pools; {ROLE_LABEL}=decode or =prefill is added per pool",
    )
    p.add_argument("--decode-selector", default="", help="EndpointSlice label selector of the decode pool")
    p.add_argument("--prefill-selector", default="", help="EndpointSlice label selector of the prefill pool")
    p.add_argument("--port-name", default=d.port_name, help="EndpointSlice port name to use")
    p.add_argument("--target-port", type=int, default=d.target_port, help="port when a slice names none")
    p.add_argument("--kubeconfig", default=None)
    p.add_argument("--api-key", default=None, help=f"require this Bearer key (or set ${API_KEY_ENV})")
    p.add_argument("--session-header", default=d.session_header)
    p.add_argument(
        "--remote-prefill-threshold",
        type=int,
        default=d.remote_prefill_threshold,
        help="decode prefills locally when at most this many prompt tokens are uncached there",
    )
    p.add_argument(
        "--load-factor",
        type=float,
        default=d.load_factor,
        help="bounded load: an endpoint takes at most this times the mean in-flight requests",
    )
    score = p.add_argument_group('prefix-aware scoring (docs/operations.md, "Routing")')
    score.add_argument("--prefix-weight", type=float, default=d.prefix_weight,
                       help="score per unit of the prompt's cached fraction on a candidate")
    score.add_argument("--queue-weight", type=float, default=d.queue_weight,
                       help="score lost per request queued beyond the least loaded candidate")
    score.add_argument("--kv-usage-weight", type=float, default=d.kv_usage_weight,
                       help="score lost per unit of the engine's KV-cache usage (from its /metrics)")
    score.add_argument("--min-prefix-fraction", type=float, default=d.min_prefix_fraction,
                       help="a prompt cached less than this anywhere is cold: consistent-hash placement")
    score.add_argument("--cold-queue-slack", type=int, default=d.cold_queue_slack,
                       help="a cold prompt goes to the first engine in its ring order within this many "
                       "requests of the least loaded")
    score.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=d.kv_events,
                       help="follow engines' KV events into an exact index (else: what the router sent)")
    p.add_argument("--block-chars", type=int, default=d.block_chars)
    p.add_argument("--index-capacity-blocks", type=int, default=d.index_capacity_blocks)
    p.add_argument("--max-attempts", type=int, default=d.max_attempts,
                   help="endpoints tried per request before the first byte")
    p.add_argument("--max-migrations", type=int, default=d.max_migrations,
                   help="times a broken answer is resumed on another engine (0: never)")
    adm = p.add_argument_group('overload control (docs/operations.md, "Overload")')
    adm.add_argument("--admission-control", action=argparse.BooleanOptionalAction, default=d.admission_control,
                     help="bound requests per decode endpoint, queue the rest by priority, answer 429 beyond")
    adm.add_argument("--max-in-flight-per-endpoint", type=int, default=d.max_in_flight_per_endpoint,
                     help="requests a decode endpoint runs at once (0: the engine's own --max-num-seqs)")
    adm.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                     help="requests waiting for room; one more is answered 429 at once")
    adm.add_argument("--queue-timeout", type=float, default=d.queue_timeout,
                     help="seconds a request waits for room before it is answered 429")
    adm.add_argument("--cold-start-timeout", type=float, default=d.cold_start_timeout,
                     help="seconds a request is held while no decode endpoint exists (scale from zero) "
                     "before it is answered 503 (0: answer 503 at once)")
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout)
    p.add_argument("--read-timeout", type=float, default=d.read_timeout)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout)
    p.add_argument("--health-interval", type=float, default=d.health_interval, help="0 disables")
    p.add_argument("--load-interval", type=float, default=d.load_interval,
                   help="prefix-aware policy: seconds between reads of each engine's queue and KV usage "
                        "from its /metrics, for engines whose KV events do not carry them (0: with the "
                        "health checks)")
    p.add_argument("--health-failures", type=int, default=d.health_failures)
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(argv: list[str]) -> RouterConfig:
    """Flags are named after RouterConfig's fields; the few that are not (--policy, --selector, --log-level)
    fill the fields they stand for here."""
    a = build_parser().parse_args(argv)
    if a.discovery == "static" and not a.decode_urls:
        raise SystemExit("tandem route: --decode URL[,URL...] is required with static discovery")
    if a.selector:
        a.decode_selector = a.decode_selector or f"{a.selector},{ROLE_LABEL}=decode"
        a.prefill_selector = a.prefill_selector or f"{a.selector},{ROLE_LABEL}=prefill"
    if a.discovery == "kubernetes" and not a.decode_selector:
        raise SystemExit("tandem route: --selector or --decode-selector is required with kubernetes discovery")
    a.decode_policy = a.decode_policy or a.policy or RouterConfig.decode_policy
    a.prefill_policy = a.prefill_policy or a.policy or RouterConfig.prefill_policy
    a.api_key = a.api_key or os.environ.get(API_KEY_ENV) or None
    a.session_header = a.session_header.lower()
    if min(a.max_in_flight_per_endpoint, a.max_queued_requests, a.cold_start_timeout) < 0 or a.queue_timeout <= 0:
        raise SystemExit("tandem route: --max-in-flight-per-endpoint, --max-queued-requests and "
                         "--cold-start-timeout must be >= 0, --queue-timeout > 0")
    flags = vars(a)
    return RouterConfig(**{f.name: flags[f.name] for f in dataclasses.fields(RouterConfig) if f.name in flags})


async def serve(config: RouterConfig) -> None:
    runner, port = await start_server(config)
    print(f"tandem router listening on http://{config.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        logger.info("[shutdown] stopping the router")
        await runner.cleanup()


def main(argv: list[str]) -> int:
    log_level = "INFO"
    if "--log-level" in argv:
        log_level = argv[argv.index("--log-level") + 1]
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency, but the router works without it
            asyncio.run(serve(config))
        else:
            uvloop.run(serve(config))
    return 0
