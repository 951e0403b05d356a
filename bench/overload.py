"""Overload: goodput and TTFT of admitted requests from half to ten times capacity, with and without the
router's overload control.

Two colocated engines (each pinned to its own share of the cores, `--max-num-seqs` slots each) behind
two `tandem route` processes over the same engines: one with admission control (a bounded queue of
`--max-queued-requests` waiting at most `--queue-timeout`, 429 beyond), one with `--no-admission-control`
(every request goes to an engine and waits in its scheduler). Capacity (requests/s) is measured first: as
many closed-loop clients as there are slots. Then, per load multiple and arm, requests arrive for
`--duration` seconds at Poisson times (multiple x capacity per second); each streams `--max-tokens` tokens
and gives up after `--client-timeout` seconds, as an impatient client does. Goodput = requests per second
of the arrival window that completed with TTFT within `--slo-ttft`. Results: bench/results/overload.*.

    .venv/bin/python bench/overload.py [--loads 0.5,1,2,4,10 --duration 20 --slo-ttft 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from harness import MODEL, bench_main, text

from tandem_router.bench.client import Record, Target, one_request
from tandem_router.bench.stats import describe
from tandem_router.local_stack import split_cpus
from tandem_router.procs import Child, scrape, stop_all, tandem_child

ARMS = ("overload-control", "no-control")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--loads", default="0.5,1,2,4,10", help="arrival rates as multiples of capacity")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per load")
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=4, help="slots per engine")
    # The controlled router's queue, sized to about one TTFT target's worth of this machine's work (the
    # router's defaults, 256 and 30 s, suit engines that answer hundreds of requests a second).
    p.add_argument("--max-queued-requests", type=int, default=4, help="the controlled router's queue")
    p.add_argument("--queue-timeout", type=float, default=2.0, help="the controlled router's queue wait")
    p.add_argument("--client-timeout", type=float, default=30.0, help="a client gives up after this")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds; goodput counts requests within it")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def target(url: str, a: argparse.Namespace) -> Target:
    return Target(url, MODEL, "completions", a.max_tokens, timeout=a.client_timeout)


async def capacity(router: str, a: argparse.Namespace, slots: int) -> float:
    """Requests per second with every slot busy (closed loop, `slots` clients, 4 requests each)."""
    records: list[Record] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def client(k: int) -> None:
            for j in range(4):
                rec = Record(start=0.0, group=k, turn=j)
                records.append(rec)
                prompt = text(a.prompt_words, seed=10_000 + 10 * k + j)
                await one_request(http, target(router, a), [], prompt, rec, t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(slots)))
        duration = time.perf_counter() - t0
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]
    return len(records) / duration


async def open_loop(router: str, a: argparse.Namespace, rate: float, seed: int) -> tuple[list[Record], float]:
    """Poisson arrivals at `rate` for `a.duration` seconds; every request runs to its end or timeout."""
    rng = random.Random(seed)
    records: list[Record] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        t0 = time.perf_counter()
        tasks = []
        while time.perf_counter() - t0 < a.duration:
            rec = Record(start=0.0, group=len(records), turn=0)
            records.append(rec)
            prompt = text(a.prompt_words, seed=seed * 100_000 + len(records))
            tasks.append(asyncio.create_task(one_request(http, target(router, a), [], prompt, rec, t0)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - t0


def outcome(records: list[Record], a: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    errors = [r.error for r in records if not r.ok]
    good = [r for r in ok if r.ttft <= a.slo_ttft]
    return {
        "requests": len(records),
        "completed": len(ok),
        "rejected_429": sum(e.startswith("HTTP 429") for e in errors),
        "server_errors_5xx": sum(e.startswith("HTTP 5") for e in errors),
        "client_timeouts": sum(e.startswith(("TimeoutError", "ServerTimeoutError")) for e in errors),
        "other_errors": sum(not e.startswith(("HTTP 429", "HTTP 5", "TimeoutError", "ServerTimeoutError"))
                            for e in errors),
        "goodput_rps": len(good) / a.duration,
        "throughput_rps": len(ok) / a.duration,
        "ttft_admitted_ms": describe([r.ttft for r in ok]),
    }


async def settle(engines: list[Child]) -> None:
    """Until no engine runs or queues anything (a no-control run can leave aborted work behind)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        busy = [await asyncio.to_thread(scrape, c.url, "vllm:num_requests_running") +
                await asyncio.to_thread(scrape, c.url, "vllm:num_requests_waiting") for c in engines]
        if not any(busy):
            return
        await asyncio.sleep(1)
    raise RuntimeError("the engines never went idle")


async def run(a: argparse.Namespace, logs: Path) -> dict[str, Any]:
    children: list[Child] = []
    try:
        engine_args = ["--model", MODEL, "--max-model-len", "512", "--max-num-seqs", str(a.max_num_seqs)]
        for i, cpus in enumerate(split_cpus(2)):
            c = tandem_child(f"engine-{i}", "serve", engine_args, logs / f"engine-{i}.log")
            c.cpus = cpus
            children.append(c.start())
        engines = list(children)
        for c in engines:
            c.wait_healthy(600)
        urls = ",".join(c.url for c in engines)
        arm_args = {"overload-control": ["--max-queued-requests", str(a.max_queued_requests),
                                         "--queue-timeout", str(a.queue_timeout)],
                    "no-control": ["--no-admission-control"]}
        routers = {}
        for arm in ARMS:
            r = tandem_child(f"router-{arm}", "route", ["--decode", urls, "--policy", "least-load",
                                                        "--health-interval", "1", *arm_args[arm]],
                             logs / f"router-{arm}.log").start()
            children.append(r)
            routers[arm] = r
        for r in routers.values():
            r.wait_healthy(60)
        slots = a.max_num_seqs * len(engines)
        await capacity(routers["overload-control"].url, a, slots)  # warm-up
        cap = await capacity(routers["overload-control"].url, a, slots)
        print(f"capacity {cap:.2f} requests/s", flush=True)
        points = []
        for k, load in enumerate(float(x) for x in a.loads.split(",")):
            for arm in (ARMS if k % 2 == 0 else ARMS[::-1]):  # neither arm always runs first
                await settle(engines)
                records, wall = await open_loop(routers[arm].url, a, load * cap, a.seed + k)
                point = {"load": load, "arm": arm, "rate_rps": load * cap, "wall_s": wall, **outcome(records, a)}
                print(point, flush=True)
                points.append(point)
        return {"capacity_rps": cap, "slots": slots, "points": points}
    finally:
        stop_all(children)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (g, t) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, color in zip(ARMS, ("tab:green", "tab:red"), strict=True):
        pts = [p for p in res["points"] if p["arm"] == arm]
        loads = [p["load"] for p in pts]
        g.plot(loads, [p["goodput_rps"] for p in pts], "o-", color=color, label=f"{arm}: goodput")
        g.plot(loads, [p["throughput_rps"] for p in pts], "x:", color=color, label=f"{arm}: completed/s")
        t.plot(loads, [p["ttft_admitted_ms"]["p99"] / 1000 for p in pts], "o-", color=color, label=f"{arm}: p99")
        t.plot(loads, [p["ttft_admitted_ms"]["p50"] / 1000 for p in pts], "x:", color=color, label=f"{arm}: p50")
    g.axhline(res["capacity_rps"], color="gray", ls="--", label="capacity")
    t.axhline(res["config"]["slo_ttft"], color="gray", ls="--", label="TTFT target")
    for ax in (g, t):
        ax.set_xscale("log")
        ax.set_xticks(sorted({p["load"] for p in res["points"]}), [f"{x:g}x" for x in sorted(
            {p["load"] for p in res["points"]})])
        ax.set_xlabel("offered load (x capacity)")
        ax.legend(fontsize=8)
    g.set(title=f"goodput (TTFT <= {res['config']['slo_ttft']:g} s), requests/s", ylabel="requests/s")
    t.set(title="TTFT of completed requests", ylabel="s", yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [
        "# Overload: goodput and TTFT from 0.5x to 10x capacity",
        "",
        f"`{res['command']}` at {res['time']}, 1-minute load average {res['load_average'][0]:.2f} before, "
        f"{res['load_average'][1]:.2f} after, {os.cpu_count()} cores. Two colocated engines (one pinned core "
        f"each, `--max-num-seqs {c['max_num_seqs']}`) behind `tandem route --policy least-load`; capacity "
        f"{res['capacity_rps']:.2f} requests/s measured with {res['slots']} closed-loop clients. Requests "
        f"(~{c['prompt_words']}-word prompts, {c['max_tokens']} streamed tokens) arrive for {c['duration']:g} s "
        f"at Poisson times; a client gives up after {c['client_timeout']:g} s. overload-control: "
        f"`--max-queued-requests {c['max_queued_requests']} --queue-timeout {c['queue_timeout']:g}`; "
        f"no-control: `--no-admission-control`. Goodput: completed with TTFT <= {c['slo_ttft']:g} s, per "
        "second of arrivals. TTFT over completed (admitted) requests only.",
        "",
        "| load | arm | offered (req/s) | goodput (req/s) | completed/s | TTFT p50 (ms) | TTFT p99 (ms) | 429 "
        "| 5xx | client timeouts | other |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in res["points"]:
        lines.append(f"| {p['load']:g}x | {p['arm']} | {p['rate_rps']:.2f} | {p['goodput_rps']:.2f} | "
                     f"{p['throughput_rps']:.2f} | {p['ttft_admitted_ms']['p50']:.0f} | "
                     f"{p['ttft_admitted_ms']['p99']:.0f} | {p['rejected_429']} | {p['server_errors_5xx']} | "
                     f"{p['client_timeouts']} | {p['other_errors']} |")
    lines += ["", "![goodput and TTFT against load](overload.png)", ""]
    return "\n".join(lines)


def main() -> int:
    return bench_main("overload", parse_args(), run, table, plot)


if __name__ == "__main__":
    sys.exit(main())
