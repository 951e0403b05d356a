"""`tandem bench`: drive any OpenAI-compatible endpoint and report TTFT/TPOT/ITL/e2e and throughput."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tandem_router.bench.client import Record, Target, first_model, run, scrape_prefix_cache
from tandem_router.bench.stats import format_summary, summarize
from tandem_router.bench.trace import read_trace, trace_sessions
from tandem_router.bench.workload import Session, random_sessions, shared_prefix_sessions


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench", description="Benchmark an OpenAI-compatible endpoint.")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first id of /v1/models")
    p.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default=None,
        help="default: chat for shared-prefix, else completions",
    )
    p.add_argument("--workload", choices=("random", "shared-prefix", "trace"), default="random")
    p.add_argument("--concurrency", type=int, default=None,
                   help="sessions in flight (default 1 without a rate; with a rate or a trace: unbounded)")
    p.add_argument("--request-rate", type=float, default=None, help="sessions started per second (Poisson)")
    p.add_argument("--num-prompts", type=int, default=50, help="random: number of requests")
    p.add_argument("--input-len", type=int, default=128, help="random: prompt length (~tokens)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in [(1-r)*len, len]")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix: distinct system prompts")
    p.add_argument("--users-per-group", type=int, default=4, help="shared-prefix: conversations per prompt")
    p.add_argument("--turns", type=int, default=3, help="shared-prefix: turns per conversation")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt length (~tokens)")
    p.add_argument("--turn-len", type=int, default=32, help="shared-prefix: user message length (~tokens)")
    p.add_argument("--trace", default=None,
                   help="trace: a Mooncake JSONL trace (bench/data/mooncake/conversation_trace.jsonl)")
    p.add_argument("--length-scale", type=float, default=1.0, help="trace: prompt, block and output lengths times this")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: arrivals this many times faster")
    p.add_argument("--max-requests", type=int, default=None, help="trace: replay at most this many requests")
    p.add_argument("--max-model-len", type=int, default=None, help="trace: drop requests that would not fit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--engine-metrics",
        default="",
        help="engine URLs whose vllm:prefix_cache_* counters to diff for the hit rate, comma-separated",
    )
    p.add_argument("--label", default="", help="a name for this run in the JSON and the plot")
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="draw a PNG here")
    return p


def make_sessions(a: argparse.Namespace) -> tuple[list[Session], dict[str, Any]]:
    """The workload's sessions, and what the summary should say of it (a trace's dropped requests and ideal
    prefix-cache share)."""
    if a.workload == "random":
        return random_sessions(a.num_prompts, a.input_len, a.seed, a.range_ratio), {}
    if a.workload == "trace":
        if a.trace is None:
            raise SystemExit("tandem bench: --workload trace needs --trace FILE")
        w = trace_sessions(read_trace(Path(a.trace)), a.seed, a.length_scale, a.time_scale,
                           max_model_len=a.max_model_len, max_requests=a.max_requests)
        return w.sessions, {"trace_dropped": w.dropped, "trace_ideal_cached_share": w.ideal_cached_share}
    return shared_prefix_sessions(a.num_groups, a.users_per_group, a.turns, a.prefix_len, a.turn_len, a.seed), {}


async def bench(a: argparse.Namespace) -> tuple[dict[str, Any], list[Record]]:
    url = a.url.rstrip("/")
    model = a.model or await first_model(url, a.api_key)
    endpoint = a.endpoint or ("chat" if a.workload == "shared-prefix" else "completions")
    if a.workload == "trace" and endpoint != "completions":
        raise SystemExit("tandem bench: a trace's prompts are token ids: --endpoint completions")
    sessions, about = make_sessions(a)
    target = Target(url=url, model=model, endpoint=endpoint, output_len=a.output_len, api_key=a.api_key)
    engines = [u.strip().rstrip("/") for u in a.engine_metrics.split(",") if u.strip()]
    before = await scrape_prefix_cache(engines) if engines else None
    records, duration = await run(target, sessions, a.concurrency, a.request_rate, a.seed)
    summary = {**summarize(records, duration), **about}
    if before is not None:
        after = await scrape_prefix_cache(engines)
        queries = after["queries"] - before["queries"]
        summary["prefix_cache_hits"] = after["hits"] - before["hits"]
        summary["prefix_cache_queries"] = queries
        summary["prefix_cache_hit_rate"] = summary["prefix_cache_hits"] / queries if queries else 0.0
    config = {k: v for k, v in vars(a).items() if k not in ("api_key",)}
    config.update(model=model, endpoint=endpoint, url=url)
    return {
        "label": a.label,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
        "summary": summary,
    }, records


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    if a.concurrency is None and a.request_rate is None and a.workload != "trace":
        a.concurrency = 1  # a trace's requests come at its times, as many in flight as that makes
    result, records = asyncio.run(bench(a))
    print(format_summary(result["summary"]), flush=True)
    if a.json_path:
        errors = sorted({r.error for r in records if r.error})[:10]
        result["errors"] = errors
        result["requests"] = [{k: v for k, v in asdict(r).items() if k not in ("itl", "text", "body")} for r in records]
        with open(a.json_path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {a.json_path}")
    if a.plot:
        from tandem_router.bench.plot import plot_run

        plot_run(records, result["summary"], a.plot, a.label or a.url)
        print(f"wrote {a.plot}")
    return 0 if result["summary"]["failed"] == 0 else 1
