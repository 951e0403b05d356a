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
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TANDEM = [sys.executable, "-c", "import sys; from tandem_cli import main; sys.exit(main())"]
MODEL = "smollm2-135m-instruct"
POLICIES = ("round-robin", "prefix-aware")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(url)


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


def main() -> int:
    p = argparse.ArgumentParser()
    # 4 system prompts of ~27 blocks each: one engine's 64 blocks hold two of them, not four.
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--prefix-len", type=int, default=400)
    p.add_argument("--turn-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--kv-blocks", type=int, default=64, help="KV blocks (of 16 tokens) per engine")
    p.add_argument("--max-model-len", type=int, default=640)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    load_before = os.getloadavg()[0]
    RESULTS.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="prefix-routing-"))
    print(f"process logs in {logs}", flush=True)
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str], name: str) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    engine_args = [
        "--num-threads",
        "1",
        "--max-model-len",
        str(a.max_model_len),
        "--num-kv-blocks",
        str(a.kv_blocks),
    ]
    runs: dict[str, dict[str, Any]] = {}
    try:
        # One engine pair per policy, run at the same time on the same prompts (same seed): machine
        # noise hits both alike and neither finds the other's prompts in its cache.
        engines: dict[str, list[str]] = {}
        eprocs: list[tuple[str, subprocess.Popen[bytes]]] = []
        for policy in POLICIES:
            ports = [free_port(), free_port()]
            engines[policy] = [f"http://127.0.0.1:{port}" for port in ports]
            for i, port in enumerate(ports):
                argv = [*TANDEM, "serve", "--model", MODEL, "--port", str(port), *engine_args]
                eprocs.append((f"http://127.0.0.1:{port}", spawn(argv, f"{policy}-engine-{i}")))
        for url, proc in eprocs:
            wait_ready(url, proc)
        benches = []
        routers = {}
        for policy in POLICIES:
            rport = free_port()
            routers[policy] = f"http://127.0.0.1:{rport}"
            argv = [*TANDEM, "route", "--port", str(rport), "--decode", ",".join(engines[policy])]
            rp = spawn([*argv, "--policy", policy], f"router-{policy}")
            wait_ready(routers[policy], rp, timeout=60)
        for policy in POLICIES:
            out = RESULTS / f"prefix_routing_{policy}.json"
            argv = [
                "bench",
                "--url",
                routers[policy],
                "--workload",
                "shared-prefix",
                "--num-groups",
                str(a.groups),
            ]
            argv += [
                "--users-per-group",
                str(a.users),
                "--turns",
                str(a.turns),
                "--prefix-len",
                str(a.prefix_len),
            ]
            argv += ["--turn-len", str(a.turn_len), "--output-len", str(a.output_len), "--seed", str(a.seed)]
            argv += ["--concurrency", str(a.concurrency), "--engine-metrics", ",".join(engines[policy])]
            argv += ["--label", policy, "--json", str(out)]
            print(f"== {policy}: {routers[policy]} over {', '.join(engines[policy])}", flush=True)
            with open(logs / f"bench-{policy}.log", "wb") as log:
                benches.append((policy, out, subprocess.Popen([*TANDEM, *argv], cwd=ROOT, stdout=log)))
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
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            proc.wait(30)
    plot(runs, RESULTS / "prefix_routing.png")
    cmd = "python bench/prefix_routing.py " + " ".join(sys.argv[1:])
    summary = {n: runs[n]["summary"] for n in POLICIES}
    meta = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": cmd,
        "config": vars(a),
        "engine_args": engine_args,
        "load_average": [load_before, os.getloadavg()[0]],
        "summary": summary,
    }
    (RESULTS / "prefix_routing.json").write_text(json.dumps(meta, indent=1))
    rr, pa = summary["round-robin"], summary["prefix-aware"]
    lines = [
        "# prefix-aware vs round-robin routing",
        "",
        f"`{cmd}` at {meta['time']}: per policy, two colocated `tandem serve` engines "
        f"({' '.join(engine_args)}) on the embedded SmolLM2-135M behind one `tandem route`; both policies "
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
    (RESULTS / "prefix_routing.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
