"""Engines that share a machine: thread sizing, CPU pinning and OpenMP waiting, measured.

Part 1 (engines): one `tandem serve` alone does REQUESTS completions; then two engines each do as many at
once. Ratio = pair time / alone time (2x is a fair split of the cores). Variants:
  before              unpinned, --num-threads = os.cpu_count() (the old default), libgomp's default waiting
  unpinned-spin300k   unpinned, default flags, libgomp's default waiting (spin 300k iterations, then sleep)
  unpinned-spin10k    the same with GOMP_SPINCOUNT=10000
  unpinned-PASSIVE    the same with OMP_WAIT_POLICY=PASSIVE (sleep at once; the engine's default now)
  unpinned-now        unpinned, default flags and the engine's default waiting
  pinned-now          disjoint CPU shares (what `tandem up` and the tests do), default flags
Part 2 (`make run`'s P/D stack through the router): STREAMS answers of 200 tokens stream while two long
prompts (~2,000 tokens) arrive; inter-token latency of the streams and TTFT of the long prompts, with
`tandem up` as before (no pinning, --num-threads os.cpu_count()) and as now (defaults).

    .venv/bin/python bench/cpu_sharing.py [--part engines|stack|both]

Run it on a quiet machine (1-minute load under 0.5); the load is recorded in the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from harness import MODEL, RESULTS, text

from tandem_router.bench.stats import percentile
from tandem_router.local_stack import split_cpus
from tandem_router.procs import Child, free_port, stop_all, tandem_child

REQUESTS = 4
BODY = {"model": MODEL, "prompt": "Write a long story about a lighthouse keeper and the sea.", "max_tokens": 96,
        "ignore_eos": True, "temperature": 0}
# libgomp's own default waits by spinning 300,000 iterations (GOMP_SPINCOUNT) before sleeping.
LIBGOMP_DEFAULT = {"GOMP_SPINCOUNT": "300000"}
VARIANTS: dict[str, dict[str, Any]] = {
    "before": {"pinned": False, "args": ["--num-threads", str(os.cpu_count())], "env": LIBGOMP_DEFAULT},
    "unpinned-spin300k": {"pinned": False, "args": [], "env": LIBGOMP_DEFAULT},
    "unpinned-spin10k": {"pinned": False, "args": [], "env": {"GOMP_SPINCOUNT": "10000"}},
    "unpinned-PASSIVE": {"pinned": False, "args": [], "env": {"OMP_WAIT_POLICY": "PASSIVE"}},
    "unpinned-now": {"pinned": False, "args": [], "env": {}},
    "pinned-now": {"pinned": True, "args": [], "env": {}},
}


def wait_quiet(limit: float = 0.5, timeout: float = 300) -> float:
    """Wait until the 1-minute load average is under `limit` (the previous variant's engines decay out of
    it); returns the load the next variant starts at."""
    deadline = time.monotonic() + timeout
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def engines(n: int, variant: dict[str, Any], logs: Path) -> list[Child]:
    shares = split_cpus(n) if variant["pinned"] else [None] * n
    ports = [free_port() for _ in range(n)]
    out = [tandem_child(f"engine-{i}", "serve", ["--model", MODEL, *variant["args"]], logs / f"engine-{port}.log",
                        port=port, cpus=shares[i], env=variant["env"] or None).start() for i, port in enumerate(ports)]
    for c in out:
        c.wait_healthy(600)
    return out


def load(urls: list[str], requests: int = REQUESTS, max_tokens: int = BODY["max_tokens"]) -> float:
    def one(url: str) -> None:
        r = httpx.post(url + "/v1/completions", json={**BODY, "max_tokens": max_tokens}, timeout=900)
        r.raise_for_status()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(urls) * requests) as pool:
        list(pool.map(one, [u for u in urls for _ in range(requests)]))
    return time.perf_counter() - t0


def timed(n: int, variant: dict[str, Any], logs: Path, reps: int) -> list[float]:
    children = engines(n, variant, logs)
    try:
        urls = [c.url for c in children]
        load(urls, requests=2, max_tokens=8)  # warm-up: first-request costs stay out of the timings
        return [load(urls) for _ in range(reps)]
    finally:
        stop_all(children)


def part_engines(logs: Path, reps: int, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        variant = VARIANTS[name]
        load_before = wait_quiet()
        alone = timed(1, {**variant, "pinned": False}, logs, reps)
        pair = timed(2, variant, logs, reps)
        a, p = float(np.median(alone)), float(np.median(pair))
        out[name] = {"alone_s": alone, "pair_s": pair, "alone_median_s": a, "pair_median_s": p, "ratio": p / a,
                     "load_before": load_before, "env": variant["env"], "args": variant["args"],
                     "pinned": variant["pinned"]}
        print(f"[engines] {name}: alone {a:.1f}s pair {p:.1f}s ratio {p / a:.2f}x", flush=True)
    return out


async def stream(c: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> list[float]:
    """Arrival time of every streamed chunk, from the request's start."""
    t0 = time.perf_counter()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times: list[float] = []
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter() - t0)
    return times


async def stack_load(url: str, streams: int, long_words: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=900) as c:
        await stream(c, url, text(50, 999), 4)  # warm-up and the P/D handshake
        answers = [asyncio.create_task(stream(c, url, text(20, 200 + i), 200)) for i in range(streams)]
        await asyncio.sleep(3.0)
        longs = [asyncio.create_task(stream(c, url, text(long_words, 300 + i), 1)) for i in range(2)]
        long_times = await asyncio.gather(*longs)
        answer_times = await asyncio.gather(*answers)
    itl = np.concatenate([np.diff(ts[1:]) for ts in answer_times]).tolist()
    return {"itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99), "itl_max_s": max(itl),
            "answer_s": [ts[-1] for ts in answer_times], "long_ttft_s": [ts[0] for ts in long_times]}


def part_stack(logs: Path, streams: int, long_words: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # before: no pinning, every engine sized to all the cores, libgomp's default spinning.
    variants = {"before": (["--no-pin-cpus", "--engine-args", f"--num-threads {os.cpu_count()}"], LIBGOMP_DEFAULT),
                "now": ([], {})}
    for name, (extra, env) in variants.items():
        up = tandem_child("up", "up", ["--log-dir", str(logs / f"up-{name}"), *extra], logs / f"up-{name}.log",
                          env=env or None)
        load_before = wait_quiet()
        up.start()
        try:
            up.wait_healthy(600)
            r = asyncio.run(stack_load(up.url, streams, long_words))
        finally:
            up.stop(60)
        r["command"] = " ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(["tandem", "up", *extra])])
        r["load_before"] = load_before
        out[name] = r
        print(f"[stack] {name}: ITL p50 {r['itl_p50_s'] * 1e3:.0f} ms p99 {r['itl_p99_s'] * 1e3:.0f} ms, long-prompt "
              f"TTFT {', '.join(f'{t:.1f}' for t in r['long_ttft_s'])} s", flush=True)
    return out


def table(res: dict[str, Any]) -> str:
    m = res["machine"]
    rows = [f"# Engines sharing a machine\n\n{m['cpus']} CPUs, load average {m['load_before']:.2f} at the start. "
            f"Command: `{res['command']}`.\n"]
    if "engines" in res:
        rows += [f"## Two engines, {REQUESTS} completions of {BODY['max_tokens']} tokens each, against one alone\n",
                 "Load: the 1-minute load average when the variant started; the script waits for it to fall under 0.5 "
                 "first. One run per variant (`--reps 1`): a single engine alone varies by a few seconds between "
                 "runs; waiting passively costs it some speed, which the pair's ratio is about.\n",
                 "| variant | one engine alone, half the work (s) | pair (s) | ratio | load before |",
                 "|---|---|---|---|---|"]
        for name, r in res["engines"].items():
            rows.append(f"| {name} | {r['alone_median_s']:.1f} | {r['pair_median_s']:.1f} | {r['ratio']:.2f}x | "
                        f"{r['load_before']:.2f} |")
        rows.append("")
    if "stack" in res:
        rows += ["## `make run`'s P/D stack: streams while long prompts arrive\n",
                 "| stack | ITL p50 (ms) | ITL p99 (ms) | p99/p50 | answer (s) | long-prompt TTFT (s) | load before |",
                 "|---|---|---|---|---|---|---|"]
        for r in res["stack"].values():
            rows.append(f"| `{r['command']}` | {r['itl_p50_s'] * 1e3:.0f} | {r['itl_p99_s'] * 1e3:.0f} | "
                        f"{r['itl_p99_s'] / r['itl_p50_s']:.1f} | {np.median(r['answer_s']):.1f} | "
                        f"{', '.join(f'{t:.1f}' for t in r['long_ttft_s'])} | {r.get('load_before', 0):.2f} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["engines", "stack", "both"], default="both")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="engine variants to run; the others keep their results from an earlier run")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--long-words", type=int, default=1500, help="words per long prompt (~2,000 tokens)")
    a = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="cpu_sharing_"))
    print("logs in", logs, flush=True)
    previous = RESULTS / "cpu_sharing.json"
    res: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {}
    res.update({"command": shlex.join(["python", "bench/cpu_sharing.py", *sys.argv[1:]]),
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "load_before": os.getloadavg()[0]}})
    if a.part in ("engines", "both"):
        # Each variant's ratio is against its own baseline measured in the same invocation, so variants
        # measured in separate invocations (--variants) stay comparable; each records its load.
        kept = res.get("engines", {})
        names = a.variants.split(",")
        res["engines"] = {**{k: v for k, v in kept.items() if k not in names and k in VARIANTS},
                          **part_engines(logs, a.reps, names)}
        res["engines"] = {k: res["engines"][k] for k in VARIANTS if k in res["engines"]}
    if a.part in ("stack", "both"):
        res["stack"] = part_stack(logs, a.streams, a.long_words)
    res["machine"]["load_after"] = os.getloadavg()[0]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_sharing.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "cpu_sharing.md").write_text(table(res))
    print(table(res))


if __name__ == "__main__":
    main()
