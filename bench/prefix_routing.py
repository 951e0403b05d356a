"""Prefix-aware routing on the exact KV index vs round-robin, least-load and the old bounded policy.

Workload: many multi-turn chat conversations that share long system prompts (`tandem bench`'s
shared-prefix sessions: each turn carries the whole history), interleaved, several in flight. For each
pool size (2 and 4 colocated engines, KV events on, KV caches small enough that one engine cannot hold
every prefix) and each policy, fresh engines and router(s) run the same sessions one policy after the
other. Every run goes through two router replicas: conversations start at Poisson times, and each
request goes to one replica at random, as behind a load balancer that spreads requests. (An earlier
version kept each conversation on one replica: with about two conversations per replica, round-robin
and least-load then alternated in step with them, and on two engines 49 of 54 later turns found their
history by that lockstep, a pattern no real arrival stream keeps.) Before every request both replicas
are asked where they would send it (`POST /route/...`), which gives their agreement.

Reported per run: the engines' prefix-cache hit rate (`vllm:prefix_cache_hits / queries`), TTFT
p50/p99 and e2e; per pool size the ideal hit rate: one engine with an unbounded cache seeing the same
prompts in the same order (tokenized and hashed exactly as the engines do). Results:
bench/results/prefix_routing.{json,md,png}.

    .venv/bin/python bench/prefix_routing.py [--engines 2,4 --groups 6 --users 3 --turns 4 --kv-blocks 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from harness import MODEL, RESULTS

from tandem_router.bench.client import Record, Target, run_session, scrape_prefix_cache
from tandem_router.bench.stats import summarize
from tandem_router.bench.workload import Session, shared_prefix_sessions
from tandem_router.procs import Child, free_port_pair, stop_all, tandem_child
from tandem_router.tokenizer import PromptTokenizer, fetch_tokenizer

POLICIES = ("round-robin", "least-load", "bounded-prefix", "prefix-aware")
REPLICAS = 2  # router replicas per policy, as a deployment would run them; their agreement is measured


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--engines", default="2,4", help="pool sizes, comma-separated")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--groups", type=int, default=6, help="distinct system prompts")
    p.add_argument("--users", type=int, default=3, help="conversations per system prompt")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=300, help="system prompt, ~tokens")
    p.add_argument("--turn-len", type=int, default=40, help="user message, ~tokens")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight at most")
    p.add_argument("--request-rate", type=float, default=0.6, help="conversations starting per second (Poisson)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kv-blocks", type=int, default=128,
                   help="KV blocks (of 16 tokens) per engine: less than all system prompts and conversations")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--name", default="prefix_routing", help="result files bench/results/NAME.{json,md,png}")
    return p.parse_args()


def engine_args(a: argparse.Namespace) -> list[str]:
    return ["--max-model-len", str(a.max_model_len), "--num-kv-blocks", str(a.kv_blocks), "--dtype", "float32"]


def start(a: argparse.Namespace, n: int, policy: str, logs: Path, children: list[Child]) -> tuple[list[str], list[str]]:
    """`n` engines (each pinned to its share of the CPUs) and the policy's router replicas."""
    from tandem_router.local_stack import split_cpus

    engines = []
    for i, cpus in enumerate(split_cpus(n)):
        args = ["--model", MODEL, *engine_args(a), "--kv-events-port", str(free_port_pair())]
        c = tandem_child(f"engine-{i}", "serve", args, logs / f"{policy}-{n}-engine-{i}.log")
        c.cpus = cpus
        engines.append(c.start())
    children += engines
    for c in engines:
        c.wait_healthy(600)
    urls = [c.url for c in engines]
    routers = []
    for r in range(REPLICAS):
        argv = ["--decode", ",".join(urls), "--policy", policy, "--health-interval", "1"]
        router = tandem_child(f"router-{r}", "route", argv, logs / f"{policy}-{n}-router-{r}.log").start()
        children.append(router)
        routers.append(router)
    for router in routers:
        router.wait_healthy(60)
    return urls, [r.url for r in routers]


async def wait_following(routers: list[str], engines: list[str]) -> None:
    """Until every router indexes every engine exactly (its KV events followed and caught up)."""
    probe = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40}]}
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as http:
        for url in routers:
            while True:
                async with http.post(url + "/route/v1/chat/completions", json=probe) as resp:
                    if (await resp.json()).get("exact"):
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"router {url} does not index {engines} exactly after 60 s")
                await asyncio.sleep(0.5)


async def drive(a: argparse.Namespace, routers: list[str], engines: list[str]) -> tuple[list[Record], float, list]:
    """The sessions start at Poisson times, at most `concurrency` in flight; each request goes to a router
    replica at random (a load balancer that spreads requests, not conversations); with two replicas both
    are asked before each request."""
    sessions = shared_prefix_sessions(a.groups, a.users, a.turns, a.prefix_len, a.turn_len, a.seed)
    agreement: list[list[dict[str, Any]]] = []  # per request, each replica's `POST /route` answer
    records: list[Record] = []
    rng = random.Random(a.seed)
    limit = asyncio.Semaphore(a.concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def ask(path: str, body: dict[str, Any], rec: Record) -> None:
            async def route(url: str) -> dict[str, Any]:
                async with http.post(url + "/route" + path, json=body) as resp:
                    return dict(await resp.json())

            agreement.append(list(await asyncio.gather(*(route(url) for url in routers))))  # the same moment

        before = ask if len(routers) > 1 else None
        targets = [Target(url, MODEL, "chat", a.output_len, before=before) for url in routers]
        t0 = time.perf_counter()

        balance = random.Random(a.seed + 1)  # not `rng`: every policy must see the same arrival times

        def balancer() -> Target:
            return balance.choice(targets)

        async def one(session: Session) -> None:
            async with limit:
                await run_session(http, balancer, session, t0, records)

        tasks = []
        for session in sessions:
            tasks.append(asyncio.create_task(one(session)))
            await asyncio.sleep(rng.expovariate(a.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return sorted(records, key=lambda r: r.start), duration, agreement


def ideal_hit_rate(records: list[Record], tok: PromptTokenizer, block_size: int) -> float:
    """One engine with an unbounded cache, the requests in the order they started: each hits the
    longest run of leading blocks cached before it (the last prompt token is always computed), and
    leaves its prompt and its answer cached (a next turn's history holds that answer)."""
    seen: set[int] = set()
    hits = queries = 0
    for r in records:
        ids = tok.chat_ids(r.body["messages"])
        hashes = tok.block_hashes(ids)
        matched = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        hits += min(matched, (len(ids) - 1) // block_size) * block_size
        queries += len(ids)
        seen.update(tok.block_hashes(ids + tok.prompt_ids(r.text, add_special_tokens=False)))
    return hits / queries


async def one_run(a: argparse.Namespace, n: int, policy: str, logs: Path) -> dict[str, Any]:
    children: list[Child] = []
    try:
        engines, routers = start(a, n, policy, logs, children)
        if policy in ("prefix-aware",):
            await wait_following(routers, engines)
        before = await scrape_prefix_cache(engines)
        records, duration, agreement = await drive(a, routers, engines)
        after = await scrape_prefix_cache(engines)
        tok = await fetch_tokenizer(engines[0])
    finally:
        stop_all(children)
    summary = summarize(records, duration)
    queries = after["queries"] - before["queries"]
    summary["prefix_cache_hit_rate"] = (after["hits"] - before["hits"]) / queries if queries else 0.0
    summary["ideal_hit_rate"] = ideal_hit_rate([r for r in records if r.ok], tok, tok.block_size)
    if agreement:
        split = [x for x in agreement if len({a["endpoint"] for a in x}) > 1]
        summary["replica_agreement"] = 1 - len(split) / len(agreement)
        # What each replica saw when they chose differently: reason, and per candidate score and inputs.
        summary["disagreements"] = [[{k: a.get(k) for k in ("endpoint", "reason", "candidates")} for a in x]
                                    for x in split]
    summary["slowest"] = slowest(records)
    print(f"== {n} engines, {policy}: hit {summary['prefix_cache_hit_rate']:.3f} "
          f"(ideal {summary['ideal_hit_rate']:.3f}), TTFT p50 {summary['ttft_ms']['p50']:.0f} ms "
          f"p99 {summary['ttft_ms']['p99']:.0f} ms, failed {summary['failed']}", flush=True)
    return {"engines": n, "policy": policy, "summary": summary,
            "requests": [{"start": r.start, "group": r.group, "turn": r.turn, "ok": r.ok, "ttft": r.ttft,
                          "e2e": r.e2e, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                          "route": r.route}
                         for r in records]}


def slowest(records: list[Record], share: float = 0.02) -> list[dict[str, Any]]:
    """The slowest `share` of requests by TTFT, with the router's reason (X-Tandem-Route) and what the
    engine then had cached: a tail of `overflow` is the load bound spilling a conversation, a tail of
    `prefix_hit` with cached_tokens 0 is an engine that evicted what the index said it held."""
    done = sorted((r for r in records if r.ok), key=lambda r: r.ttft, reverse=True)
    return [{"ttft": round(r.ttft, 3), "turn": r.turn, "route": r.route, "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens} for r in done[:max(1, round(len(done) * share))]]


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["engines"] for r in runs})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = {"round-robin": "tab:gray", "least-load": "tab:blue", "bounded-prefix": "tab:orange",
              "prefix-aware": "tab:green"}
    width = 0.8 / len(colors)
    for j, policy in enumerate(colors):
        mine = {r["engines"]: r["summary"] for r in runs if r["policy"] == policy}
        xs = [i + (j - 1.5) * width for i in range(len(sizes))]
        for ax, key in zip(axes, ("hit", "p50", "p99"), strict=True):
            vals = [(mine[s]["prefix_cache_hit_rate"] * 100 if key == "hit" else mine[s]["ttft_ms"][key])
                    if s in mine else 0 for s in sizes]
            ax.bar(xs, vals, width, label=policy, color=colors[policy])
    ideal = [next(r["summary"]["ideal_hit_rate"] for r in runs if r["engines"] == s) * 100 for s in sizes]
    axes[0].scatter(range(len(sizes)), ideal, marker="_", s=2000, color="black", label="ideal", zorder=3)
    for ax, title, unit in zip(axes, ("prefix-cache hit rate", "TTFT p50", "TTFT p99"), ("%", "ms", "ms"),
                               strict=True):
        ax.set_xticks(range(len(sizes)), [f"{s} engines" for s in sizes])
        ax.set(title=title, ylabel=unit)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(a: argparse.Namespace, runs: list[dict[str, Any]], load: list[float]) -> str:
    cmd = "python bench/prefix_routing.py " + " ".join(sys.argv[1:])
    lines = [
        "# Prefix-aware routing on the exact KV index",
        "",
        f"`{cmd}` at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, 1-minute load average "
        f"{load[0]:.2f} before and {load[1]:.2f} after, {os.cpu_count()} cores. Per pool size and policy, fresh "
        f"colocated engines ({' '.join(engine_args(a))}, KV events on, each pinned to its share of the cores) "
        f"behind `tandem route`; {a.groups} system prompts of ~{a.prefix_len} words, {a.users} conversations each, "
        f"{a.turns} turns of ~{a.turn_len} words carrying the history, {a.output_len} output tokens, "
        f"conversations starting at {a.request_rate}/s (Poisson), at most {a.concurrency} in flight, "
        "each request to one of two router replicas of the policy at random; agreement = both answer the same "
        "engine to `POST /route/...` just before each request. Ideal = one "
        "engine with an unbounded cache on the same prompts in the same order.",
        "",
        "| engines | policy | hit rate | ideal | TTFT p50 (ms) | TTFT p99 (ms) | e2e p50 (ms) | replicas agree "
        "| failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r["summary"]
        agree = f"{s['replica_agreement']:.1%}" if "replica_agreement" in s else ""
        lines.append(f"| {r['engines']} | {r['policy']} | {s['prefix_cache_hit_rate']:.3f} | "
                     f"{s['ideal_hit_rate']:.3f} | {s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p99']:.0f} | "
                     f"{s['e2e_ms']['p50']:.0f} | {agree} | {s['failed']} |")
    lines += ["", "TTFT p50 (ms) by turn (turn 0 opens a conversation: only its system prompt can be cached; later "
              "turns carry the history):", "", "| engines | policy | " + " | ".join(
                  f"turn {t}" for t in range(a.turns)) + " |", "|---|---|" + "---|" * a.turns]
    for r in runs:
        by_turn = [sorted(q["ttft"] for q in r["requests"] if q["ok"] and q["turn"] == t) for t in range(a.turns)]
        cells = [f"{1000 * v[len(v) // 2]:.0f}" if v else "" for v in by_turn]
        lines.append(f"| {r['engines']} | {r['policy']} | " + " | ".join(cells) + " |")
    lines += ["", f"![hit rate and TTFT per policy]({a.name}.png)", ""]
    return "\n".join(lines)


def main() -> int:
    a = parse_args()
    load = [os.getloadavg()[0]]
    logs = Path(tempfile.mkdtemp(prefix="prefix-routing-"))
    print(f"process logs in {logs}; load average {load[0]:.2f}", flush=True)
    runs = [asyncio.run(one_run(a, int(n), policy, logs))
            for n in a.engines.split(",") for policy in a.policies.split(",")]
    load.append(os.getloadavg()[0])
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python bench/prefix_routing.py " + " ".join(sys.argv[1:]), "config": vars(a),
            "engine_args": engine_args(a), "load_average": load, "runs": runs}
    (RESULTS / f"{a.name}.json").write_text(json.dumps(meta, indent=1))
    plot(runs, RESULTS / f"{a.name}.png")
    table = report(a, runs, load)
    (RESULTS / f"{a.name}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
