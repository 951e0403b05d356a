"""Mid-stream migration: what a stream pays when its engine dies under it.

Two colocated engines, each pinned to its own share of the cores, behind one `tandem route`
(least-load). Per trial, streams with prompts no engine has seen start together; once every one has
`--kill-after` tokens, the engine running the most of them is killed with SIGKILL and its streams
resume on the other engine (the router logs each migration with the client's X-Request-Id, which names
the migrated streams). Per migrated stream: the pause the client saw (its longest gap between chunks: the
break, the continuation's prefill of prompt + tokens so far on the survivor, which holds none of its KV,
and its queueing there) against that same request's TTFT, and the survivors' inter-token latency
(ITL) as a yardstick. Token-for-token equality after a migration is proved by the tests
(tests/router/test_migration_e2e.py); here each migrated stream must end whole. The killed engine is
restarted between trials; a first trial warms every path up and is not counted. Results:
bench/results/migration.*.

    .venv/bin/python bench/migration.py [--streams 6 --prompt-words 200 --max-tokens 96 --kill-after 16,64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
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

MIGRATED = re.compile(r"\[migration\] request (\S+): \S+ broke after (\d+) tokens")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=6, help="concurrent streams, half chat, half completions")
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--kill-after", type=lambda v: [int(k) for k in v.split(",")], default=[16, 64],
                   help="tokens every stream has when the engine dies, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="trials per kill point")
    return p.parse_args()


def prompts(a: argparse.Namespace, trial: int) -> list[tuple[str, str]]:
    """(endpoint, prompt) per stream: alternately chat and completions, words no other trial uses (so no
    engine holds them in its prefix cache)."""
    return [("chat" if i % 2 else "completions", text(a.prompt_words, seed=1000 * trial + i))
            for i in range(a.streams)]


async def stream_all(router: str, a: argparse.Namespace, trial: int, during: Any) -> list[Record]:
    """Every stream at once; `during(records)` runs beside them (the kill)."""
    records = [Record(start=0.0, group=i, turn=0, request_id=f"t{trial}-{i}") for i in range(a.streams)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        t0 = time.perf_counter()
        tasks = [one_request(http, Target(router, MODEL, endpoint, a.max_tokens, timeout=300),
                             [{"role": "user", "content": prompt}], prompt, rec, t0)
                 for (endpoint, prompt), rec in zip(prompts(a, trial), records, strict=True)]
        tasks.append(during(records))
        await asyncio.gather(*tasks)
    return records


async def kill_busiest(engines: list[Child], records: list[Record], after: int) -> Child:
    while not all(len(r.itl) + 1 >= after or r.error for r in records):
        await asyncio.sleep(0.01)
    running = [await asyncio.to_thread(scrape, c.url, "vllm:num_requests_running") for c in engines]
    victim = engines[running.index(max(running))]
    await asyncio.to_thread(victim.kill)
    return victim


async def trial(a: argparse.Namespace, router: Child, engines: list[Child], n: int, after: int) -> dict[str, Any]:
    killed: list[Child] = []

    async def kill(records: list[Record]) -> None:
        killed.append(await kill_busiest(engines, records, after))

    log_before = len(router.log())
    records = await stream_all(router.url, a, n, kill)
    migrated = {m.group(1): int(m.group(2)) for m in MIGRATED.finditer(router.log()[log_before:])}
    streams = []
    for rec in records:
        if rec.request_id not in migrated:
            continue
        streams.append({"id": rec.request_id, "tokens_before_break": migrated[rec.request_id],
                        "pause_s": max(rec.itl), "ttft_s": rec.ttft,
                        "whole": rec.ok and rec.output_tokens == a.max_tokens, "error": rec.error})
    survivors = [x for rec in records if rec.request_id not in migrated for x in rec.itl]
    victim = killed[0]
    victim.start()
    await asyncio.to_thread(victim.wait_healthy, 600)
    await asyncio.sleep(2)  # the router's health check admits it again
    return {"kill_after": after, "killed": victim.name, "migrated": len(streams),
            "failed": sum(not r.ok for r in records), "streams": streams, "ttft_s": [r.ttft for r in records],
            "survivor_itl_p50_s": describe(survivors, 1.0)["p50"]}


def summarize(trials: list[dict[str, Any]], resume: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {"ttft_ms": describe([x for t in trials for x in t["ttft_s"]]),
                           "survivor_itl_p50_ms": describe([t["survivor_itl_p50_s"] for t in trials])["p50"],
                           "router_resume_mean_ms": resume["sum"] / resume["count"] * 1000 if resume["count"] else None}
    for after in sorted({t["kill_after"] for t in trials}):
        streams = [s for t in trials if t["kill_after"] == after for s in t["streams"]]
        out[f"kill_after_{after}"] = {
            "migrated": len(streams), "whole": sum(s["whole"] for s in streams),
            "failed": sum(t["failed"] for t in trials if t["kill_after"] == after),
            "pause_ms": describe([s["pause_s"] for s in streams]),
            "pause_over_ttft": describe([s["pause_s"] / s["ttft_s"] for s in streams], 1.0)}
    return out


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = [("TTFT", [x * 1000 for t in res["trials"] for x in t["ttft_s"]])]
    for after in res["config"]["kill_after"]:
        pauses = [s["pause_s"] * 1000 for t in res["trials"] if t["kill_after"] == after for s in t["streams"]]
        groups.append((f"migration pause\n(killed after {after} tokens)", pauses))
    ax.boxplot([g[1] for g in groups], whis=(0, 100))
    ax.set_xticks(range(1, len(groups) + 1), [g[0] for g in groups])
    ax.axhline(res["summary"]["survivor_itl_p50_ms"], color="gray", ls="--", label="ITL p50 (unmigrated streams)")
    ax.set(ylabel="ms", title="What a migrated stream waits vs a request's normal TTFT")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(res: dict[str, Any]) -> str:
    s, c = res["summary"], res["config"]
    lines = [
        "# Mid-stream migration: the pause a migrated stream sees",
        "",
        f"`{res['command']}` at {res['time']}, 1-minute load average {res['load_average'][0]:.2f} before, "
        f"{res['load_average'][1]:.2f} after, {os.cpu_count()} cores. Two colocated engines (one pinned "
        f"core each) behind `tandem route --policy least-load`; {c['streams']} streams (half chat, half "
        f"completions) of ~{c['prompt_words']}-word prompts and {c['max_tokens']} greedy tokens start together; "
        "once each has the given number of tokens, the engine running the most is killed -9 and its streams "
        "resume on the other (which holds none of their KV and never saw their prompts: it prefills prompt + "
        "tokens so far). Pause = the migrated stream's longest gap between chunks, against the same request's "
        f"TTFT. {c['repeats']} trials per kill point after one uncounted warm-up trial.",
        "",
        f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, p99 {s['ttft_ms']['p99']:.0f} ms; ITL p50 of the streams that "
        f"were not migrated {s['survivor_itl_p50_ms']:.0f} ms; the router's "
        "`tandem:router_migration_resume_seconds` (break to first resumed chunk) mean "
        f"{s['router_resume_mean_ms'] or 0:.0f} ms.",
        "",
        "| killed after (tokens) | migrated streams | ended whole | pause p50 (ms) | pause p99 (ms) "
        "| pause / TTFT, p50 | p99 | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for after in c["kill_after"]:
        k = s[f"kill_after_{after}"]
        lines.append(f"| {after} | {k['migrated']} | {k['whole']} | {k['pause_ms']['p50']:.0f} | "
                     f"{k['pause_ms']['p99']:.0f} | {k['pause_over_ttft']['p50']:.2f} | "
                     f"{k['pause_over_ttft']['p99']:.2f} | {k['failed']} |")
    lines += ["", "![pause vs TTFT](migration.png)", ""]
    return "\n".join(lines)


async def run(a: argparse.Namespace, logs: Path) -> dict[str, Any]:
    children: list[Child] = []
    try:
        for i, cpus in enumerate(split_cpus(2)):
            c = tandem_child(f"engine-{i}", "serve", ["--model", MODEL, "--max-model-len", "1024"],
                             logs / f"engine-{i}.log")
            c.cpus = cpus
            children.append(c.start())
        engines = list(children)
        for c in engines:
            c.wait_healthy(600)
        router = tandem_child("router", "route", ["--decode", ",".join(c.url for c in engines),
                                                  "--policy", "least-load", "--health-interval", "0.5"],
                              logs / "router.log").start()
        children.append(router)
        router.wait_healthy(60)
        points = a.kill_after
        print("warm-up", await trial(a, router, engines, 0, points[0]), flush=True)
        warm = {k: scrape(router.url, f"tandem:router_migration_resume_seconds_{k}") for k in ("sum", "count")}
        trials = []
        for n, after in enumerate((k for _ in range(a.repeats) for k in points), start=1):
            trials.append(await trial(a, router, engines, n, after))
            print(trials[-1], flush=True)
        resume = {k: scrape(router.url, f"tandem:router_migration_resume_seconds_{k}") - warm[k]
                  for k in ("sum", "count")}
        return {"trials": trials, "summary": summarize(trials, resume)}
    finally:
        stop_all(children)


def main() -> int:
    return bench_main("migration", parse_args(), run, table, plot)


if __name__ == "__main__":
    sys.exit(main())
