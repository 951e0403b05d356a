"""Router overhead: p50 latency through `tandem route` minus direct access, measured in one run.

Two backends, each behind its own router process:
  - stub:   an instant OpenAI upstream (answers at once), so the difference is the router alone;
  - engine: a real `tandem serve` on the embedded model, max_tokens=1 (docs/benchmarks.md, "Targets").
Requests are sequential, each pair (direct, routed) in random order, so that machine noise hits
both sides alike. Results: bench/results/router_overhead.{json,md,png}.

    .venv/bin/python bench/router_overhead.py [--requests 300] [--no-engine]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from harness import MODEL, RESULTS

from tandem_router.procs import Child, free_port, metric, stop_all, tandem_child


def serve_stub(port: int) -> None:
    from aiohttp import web

    body = {
        "id": "x",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    }

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(body)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def measure(direct: str, routed: str, n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    body = {"model": MODEL, "prompt": "Say hi.", "max_tokens": 1, "temperature": 0.0}
    lat: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client(timeout=60) as client:  # one keep-alive connection per base URL
        for _ in range(20):  # warm-up: connections, caches, the router's prefix index
            client.post(direct + "/v1/completions", json=body).raise_for_status()
            client.post(routed + "/v1/completions", json=body).raise_for_status()
        for _ in range(n):
            order = [("direct", direct), ("router", routed)]
            rng.shuffle(order)
            for name, base in order:
                t = time.perf_counter()
                client.post(base + "/v1/completions", json=body).raise_for_status()
                lat[name].append(time.perf_counter() - t)
    paired = [r - d for r, d in zip(lat["router"], lat["direct"], strict=True)]

    def q(xs: list[float], p: float) -> float:
        return statistics.quantiles(xs, n=100, method="inclusive")[int(p) - 1] * 1000

    out: dict[str, Any] = {"requests_per_side": n, "latencies_s": lat}
    for name, xs in lat.items():
        out[name] = {
            "mean_ms": statistics.fmean(xs) * 1000,
            "p50_ms": statistics.median(xs) * 1000,
            "p90_ms": q(xs, 90),
            "p99_ms": q(xs, 99),
        }
    out["p50_overhead_ms"] = out["router"]["p50_ms"] - out["direct"]["p50_ms"]
    out["paired_median_overhead_ms"] = statistics.median(paired) * 1000
    return out


def router_overhead_histogram(router: str) -> dict[str, float]:
    text = httpx.get(router + "/metrics").text
    count = metric(text, "tandem:router_overhead_seconds_count")
    return {"mean_pre_dispatch_ms": 1000 * metric(text, "tandem:router_overhead_seconds_sum") / count} if count else {}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (backend, r) in zip(axes[0], results.items(), strict=True):
        for name, color in (("direct", "tab:blue"), ("router", "tab:orange")):
            xs = sorted(x * 1000 for x in r["latencies_s"][name])
            ax.plot(
                xs,
                [(i + 1) / len(xs) for i in range(len(xs))],
                color=color,
                label=f"{name} (p50 {r[name]['p50_ms']:.2f} ms)",
            )
        ax.set(
            title=f"{backend}: p50 overhead {r['p50_overhead_ms']:+.2f} ms",
            xlabel="latency (ms)",
            ylabel="fraction of requests",
        )
        hi = max(r["router"]["p99_ms"], r["direct"]["p99_ms"]) * 1.2
        ax.set_xlim(0, hi)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_markdown(meta: dict[str, Any]) -> None:
    load = meta["load_average"]
    lines = [
        "# Router overhead",
        "",
        f"`{meta['command']}` at {meta['time']} ({meta['machine']}; load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end).",
        "Sequential non-streamed completions (max_tokens=1), direct and through `tandem route` (its own "
        "process, uvloop) in random order per pair, in one run.",
        "",
        "| backend | direct p50 (ms) | router p50 (ms) | p50 overhead (ms) | paired median (ms) | "
        "std. error (ms) | router p99 (ms) | direct p99 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in meta["results"].items():
        lines.append(
            f"| {name} | {r['direct']['p50_ms']:.2f} | {r['router']['p50_ms']:.2f} | "
            f"{r['p50_overhead_ms']:+.2f} | {r['paired_median_overhead_ms']:+.2f} | "
            f"{r['p50_standard_error_ms']:.2f} | {r['router']['p99_ms']:.2f} | {r['direct']['p99_ms']:.2f} |"
        )
    lines += [
        "",
        "Target ([docs/benchmarks.md](../../docs/benchmarks.md#targets)): at most 2 ms p50 above direct access. "
        "The stub row is the router's own cost (an upstream that answers at once); behind a real engine the "
        "difference is within the noise of the engine's latency on this shared machine (std. error column).",
        "",
        "![latency CDFs](router_overhead.png)",
        "",
    ]
    (RESULTS / "router_overhead.md").write_text("\n".join(lines))


def backends(a: argparse.Namespace, logs: Path, children: list[Child]) -> dict[str, Child]:
    """The stub upstream and (unless --no-engine) a `tandem serve`, started and appended to `children`."""
    port = free_port()
    argv = [sys.executable, __file__, "--serve-stub", str(port)]
    out = {"stub": Child("stub", f"http://127.0.0.1:{port}", argv, logs / "stub.log")}
    if not a.no_engine:
        out["engine"] = tandem_child("engine", "serve", ["--model", MODEL, "--num-threads", "1"], logs / "engine.log")
    for c in out.values():
        children.append(c.start())
    return out


def measure_backend(name: str, upstream: Child, a: argparse.Namespace, logs: Path,
                    children: list[Child]) -> dict[str, Any]:
    """Direct against routed latencies of one backend, through a router of its own."""
    upstream.wait_healthy(600)
    args = ["--decode", upstream.url, "--log-level", "WARNING"]
    router = tandem_child(f"router-{name}", "route", args, logs / f"router-{name}.log")
    children.append(router.start())
    router.wait_healthy(60)
    print(f"measuring {name}: {a.requests} requests each way ...", flush=True)
    r = measure(upstream.url, router.url, a.requests, a.seed)
    r.update(router_overhead_histogram(router.url))
    print(
        f"  direct p50 {r['direct']['p50_ms']:.2f} ms, router p50 {r['router']['p50_ms']:.2f} ms, "
        f"overhead p50 {r['p50_overhead_ms']:+.2f} ms (paired median "
        f"{r['paired_median_overhead_ms']:+.2f} ms)",
        flush=True,
    )
    return r


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--serve-stub", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    load_before = os.getloadavg()[0]
    if a.serve_stub is not None:
        serve_stub(a.serve_stub)
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    print(f"process logs in {logs}", flush=True)
    children: list[Child] = []
    results: dict[str, Any] = {}
    try:
        for name, upstream in backends(a, logs, children).items():
            results[name] = measure_backend(name, upstream, a, logs, children)
    finally:
        stop_all(children, 15)
    plot(results, RESULTS / "router_overhead.png")
    summary = {k: {kk: vv for kk, vv in v.items() if kk != "latencies_s"} for k, v in results.items()}
    for name, r in results.items():
        # Resolution of the p50 difference: ~1.25 sigma / sqrt(n) per side for a median.
        sd = statistics.stdev(r["latencies_s"]["direct"]) * 1000
        summary[name]["p50_standard_error_ms"] = 1.25 * sd * (2 / len(r["latencies_s"]["direct"])) ** 0.5
    meta = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "requests_per_side": a.requests,
        "command": "python bench/router_overhead.py " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPUs, shared",
        "load_average": [load_before, os.getloadavg()[0]],
        "results": summary,
    }
    (RESULTS / "router_overhead.json").write_text(json.dumps({**meta, "raw": results}, indent=1))
    write_markdown(meta)
    print("wrote bench/results/router_overhead.{json,md,png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
