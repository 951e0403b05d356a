"""prefix-aware vs round-robin on a shared-prefix multi-turn workload over two colocated engines.

Each policy gets its own pair of `tandem serve` engines (embedded model, small KV caches so that one
engine cannot hold every group's prefix but two can) behind its own `tandem route`, and both run at
the same time on the same prompts (`tandem bench --workload shared-prefix`, same seed), so that noise
on the shared machine hits both alike. The engines' `vllm:prefix_cache_hits/queries` counters give
the hit rate. Results: bench/results/prefix_routing.{json,md,png} and
bench/results/prefix_routing_<policy>.json.

    .venv/bin/python bench/prefix_routing.py [--groups 6 --users 3 --turns 3 --concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from harness import MODEL, RESULTS

from tandem_router.procs import TANDEM, Child, stop_all, tandem_child

POLICIES = ("round-robin", "prefix-aware")
# This script's workload flags: the `tandem bench` flag each one is passed on as, and its default.
# 4 system prompts of ~27 blocks each: one engine's 64 blocks hold two of them, not four.
WORKLOAD = {
    "groups": ("--num-groups", 4),
    "users": ("--users-per-group", 4),
    "turns": ("--turns", 2),
    "prefix_len": ("--prefix-len", 400),
    "turn_len": ("--turn-len", 16),
    "output_len": ("--output-len", 8),
    "concurrency": ("--concurrency", 2),
    "seed": ("--seed", 1),
}


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = list(runs)
    colors = ["tab:gray", "tab:green"]
    hit = [runs[n]["summary"]["prefix_cache_hit_rate"] * 100 for n in names]
    axes[0].bar(names, hit, color=colors)
    axes[0].set(title="engine prefix-cache hit rate", ylabel="% of prompt tokens")
    for i, v in enumerate(hit):
        axes[0].text(i, v, f"{v:.1f}%", ha="center", va="bottom")
    width = 0.35
    for j, stat in enumerate(("p50", "p99")):
        vals = [runs[n]["summary"]["ttft_ms"][stat] for n in names]
        xs = [i + (j - 0.5) * width for i in range(len(names))]
        axes[1].bar(xs, vals, width, label=stat, color=["tab:blue", "tab:orange"][j])
    axes[1].set_xticks(range(len(names)), names)
    axes[1].set(title="TTFT", ylabel="ms")
    axes[1].legend()
    for n, c in zip(names, colors, strict=True):
        ttft = sorted(r["ttft"] * 1000 for r in runs[n]["requests"] if r["ok"])
        axes[2].plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=n, color=c)
    axes[2].set(title="TTFT CDF", xlabel="ms", ylabel="fraction of requests")
    axes[2].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name, (_, default) in WORKLOAD.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    p.add_argument("--kv-blocks", type=int, default=64, help="KV blocks (of 16 tokens) per engine")
    p.add_argument("--max-model-len", type=int, default=640)
    return p.parse_args()


def engine_args(a: argparse.Namespace) -> list[str]:
    return ["--num-threads", "1", "--max-model-len", str(a.max_model_len), "--num-kv-blocks", str(a.kv_blocks)]


def start_stack(a: argparse.Namespace, logs: Path,
                children: list[Child]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Per policy, two engines behind one router (appended to `children` as they start); the engine URLs
    and the router URL of each policy. One engine pair per policy, run at the same time on the same
    prompts (same seed): machine noise hits both alike and neither finds the other's prompts in its cache."""
    engines: dict[str, list[str]] = {}
    for policy in POLICIES:
        pair = [tandem_child(f"{policy}-engine-{i}", "serve", ["--model", MODEL, *engine_args(a)],
                             logs / f"{policy}-engine-{i}.log").start() for i in range(2)]
        children += pair
        engines[policy] = [c.url for c in pair]
    for c in children:
        c.wait_healthy(600)
    routers: dict[str, str] = {}
    for policy in POLICIES:
        args = ["--decode", ",".join(engines[policy]), "--policy", policy]
        router = tandem_child(f"router-{policy}", "route", args, logs / f"router-{policy}.log").start()
        children.append(router)
        router.wait_healthy(60)
        routers[policy] = router.url
    return engines, routers


def run_benches(a: argparse.Namespace, logs: Path, engines: dict[str, list[str]],
                routers: dict[str, str]) -> dict[str, dict[str, Any]]:
    """`tandem bench --workload shared-prefix` against both routers at once; each policy's results."""
    benches = []
    for policy in POLICIES:
        out = RESULTS / f"prefix_routing_{policy}.json"
        argv = ["bench", "--url", routers[policy], "--workload", "shared-prefix"]
        argv += [x for name, (flag, _) in WORKLOAD.items() for x in (flag, str(getattr(a, name)))]
        argv += ["--engine-metrics", ",".join(engines[policy]), "--label", policy, "--json", str(out)]
        print(f"== {policy}: {routers[policy]} over {', '.join(engines[policy])}", flush=True)
        with open(logs / f"bench-{policy}.log", "wb") as log:
            benches.append((policy, out, subprocess.Popen([*TANDEM, *argv], stdout=log)))
    runs: dict[str, dict[str, Any]] = {}
    for policy, out, proc in benches:
        if proc.wait() not in (0, 1):
            raise RuntimeError(f"tandem bench for {policy} failed; see {logs}")
        print((logs / f"bench-{policy}.log").read_text(), flush=True)
        runs[policy] = json.loads(out.read_text())
        runs[policy]["router_metrics"] = [
            ln
            for ln in httpx.get(routers[policy] + "/metrics").text.splitlines()
            if ln.startswith("tandem:router_routing_decisions_total") and not ln.endswith(" 0.0")
        ]
        out.write_text(json.dumps(runs[policy], indent=1))
    return runs


def report(a: argparse.Namespace, runs: dict[str, dict[str, Any]], load_before: float) -> list[str]:
    """Write prefix_routing.json; the lines of prefix_routing.md."""
    cmd = "python bench/prefix_routing.py " + " ".join(sys.argv[1:])
    summary = {n: runs[n]["summary"] for n in POLICIES}
    meta = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": cmd,
        "config": vars(a),
        "engine_args": engine_args(a),
        "load_average": [load_before, os.getloadavg()[0]],
        "summary": summary,
    }
    (RESULTS / "prefix_routing.json").write_text(json.dumps(meta, indent=1))
    rr, pa = summary["round-robin"], summary["prefix-aware"]
    lines = [
        "# prefix-aware vs round-robin routing",
        "",
        f"`{cmd}` at {meta['time']}: per policy, two colocated `tandem serve` engines "
        f"({' '.join(engine_args(a))}) on the embedded SmolLM2-135M behind one `tandem route`; both policies "
        "at once on the same prompts, `tandem bench --workload shared-prefix` "
        f"({a.groups} system prompts of ~{a.prefix_len} words, {a.users} conversations each, "
        f"{a.turns} turns, "
        f"{a.output_len} output tokens, concurrency {a.concurrency}). Hit rate = engine "
        "`vllm:prefix_cache_hits / vllm:prefix_cache_queries` over the run.",
        "",
        "| policy | hit rate | TTFT mean (ms) | TTFT p50 (ms) | TTFT p99 (ms) | e2e p50 (ms) | output tok/s | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, s in summary.items():
        lines.append(
            f"| {n} | {s['prefix_cache_hit_rate']:.1%} | {s['ttft_ms']['mean']:.0f} | "
            f"{s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p99']:.0f} | {s['e2e_ms']['p50']:.0f} | "
            f"{s['output_throughput']:.1f} | {s['failed']} |"
        )
    lines += [
        "",
        f"prefix-aware: hit rate {pa['prefix_cache_hit_rate']:.1%} vs {rr['prefix_cache_hit_rate']:.1%}, "
        f"TTFT p50 {pa['ttft_ms']['p50']:.0f} ms vs {rr['ttft_ms']['p50']:.0f} ms.",
        "",
        f"Machine: {os.cpu_count()} cores shared with other jobs, load average {load_before:.1f} at the start "
        f"and {os.getloadavg()[0]:.1f} at the end, so absolute latencies are inflated; the two policies ran "
        "side by side on the same prompts, which is what makes them comparable.",
        "",
        "![hit rate and TTFT](prefix_routing.png)",
        "",
    ]
    return lines


def main() -> int:
    a = parse_args()
    load_before = os.getloadavg()[0]
    RESULTS.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="prefix-routing-"))
    print(f"process logs in {logs}", flush=True)
    children: list[Child] = []
    try:
        engines, routers = start_stack(a, logs, children)
        runs = run_benches(a, logs, engines, routers)
    finally:
        stop_all(children)
    plot(runs, RESULTS / "prefix_routing.png")
    lines = report(a, runs, load_before)
    (RESULTS / "prefix_routing.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
