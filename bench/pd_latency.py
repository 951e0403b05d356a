"""P/D against colocated: TTFT at low load, and inter-token latency of running decodes while long prompts
arrive (the interference disaggregation removes). Starts real `tandem serve` processes: one colocated
engine with `--num-threads 2`, then a prefill and a decode engine with `--num-threads 1` each (the same
two cores in total), and drives P/D the way docs/architecture.md describes it (prefill with max_tokens=1, then
decode with the returned kv_transfer_params). Results and a plot go to bench/results/.

    .venv/bin/python bench/pd_latency.py [--long-len 1500 --streams 3 --arrivals 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
from harness import MODEL, text, write_results

from tandem_engine.kv_transfer.messages import RemoteDecodeParams
from tandem_router.procs import Child, free_port, stop_all, tandem_child


class Target:
    """Colocated (`prefill` is None) or P/D; `ttft` and `stream` return latencies in seconds."""

    def __init__(self, decode: str, prefill: str | None) -> None:
        self.decode, self.prefill = decode, prefill

    async def params(self, c: httpx.AsyncClient, prompt: str) -> dict[str, Any]:
        if self.prefill is None:
            return {}
        r = await c.post(self.prefill + "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": False,
            "kv_transfer_params": msgspec.to_builtins(RemoteDecodeParams())})
        p = r.json().get("kv_transfer_params")
        return {"kv_transfer_params": p} if p else {}

    async def stream(self, c: httpx.AsyncClient, prompt: str, max_tokens: int) -> list[float]:
        """Arrival times of each streamed token, from the request's start (prefill included)."""
        t0 = time.perf_counter()
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, **(await self.params(c, prompt))}
        times = []
        async with c.stream("POST", self.decode + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.perf_counter() - t0)
        return times


async def measure(t: Target, long_len: int, streams: int, arrivals: int, ttft_runs: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as c:
        await t.stream(c, text(50, 999), 2)  # warm-up (and the P/D handshake)
        ttft = []
        for i in range(ttft_runs):  # low load: one request at a time, a fresh 500-word prompt
            ttft.append((await t.stream(c, text(500, 100 + i), 1))[0])
        # Interference: short-prompt decodes stream while long prompts arrive one after another.
        decodes = [asyncio.create_task(t.stream(c, text(20, 200 + i), 96)) for i in range(streams)]
        await asyncio.sleep(3.0)
        for i in range(arrivals):
            await t.stream(c, text(long_len, 300 + i), 1)
        token_times = await asyncio.gather(*decodes)
    itl = np.concatenate([np.diff(ts[1:]) for ts in token_times])  # gaps after each stream's first token
    return {"ttft_s": ttft, "ttft_p50_s": float(np.median(ttft)),
            "itl_p50_s": float(np.percentile(itl, 50)), "itl_p99_s": float(np.percentile(itl, 99)),
            "itl_max_s": float(itl.max()), "itl_count": int(itl.size)}


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["colocated", "pd"]
    axes[0].bar(names, [res[n]["ttft_p50_s"] * 1000 for n in names], color=["#888", "#2a7"])
    axes[0].set_title("TTFT p50, low load (ms)", fontsize=10)
    x = np.arange(2)
    for j, (k, lbl) in enumerate((("itl_p50_s", "p50"), ("itl_p99_s", "p99"))):
        axes[1].bar(x + j * 0.38, [res[n][k] * 1000 for n in names], 0.38, label=lbl)
    axes[1].set_xticks(x + 0.19, names)
    axes[1].set_title("ITL of running decodes while long prompts arrive (ms)", fontsize=10)
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(res: dict[str, Any]) -> str:
    a = res["args"]
    rows = [f"P/D (prefill and decode engines, 1 torch thread each) against one colocated engine (2 threads) on "
            f"the same 2 cores. TTFT: one request at a time, 500-word prompts, {a['ttft_runs']} runs. ITL: "
            f"{a['streams']} streams decoding while {a['arrivals']} prompts of {a['long_len']} words arrive. "
            f"Engines at their default step budget. {res['time']}, 1-minute load "
            f"{res['load_average'][0]:.2f} before, {res['load_average'][1]:.2f} after.", "",
            "| mode | TTFT p50 (s) | ITL p50 (ms) | ITL p99 (ms) | ITL max (ms) |", "|---|---|---|---|---|"]
    for n in ("colocated", "pd"):
        r = res[n]
        rows.append(f"| {n} | {r['ttft_p50_s']:.2f} | {r['itl_p50_s'] * 1e3:.0f} | {r['itl_p99_s'] * 1e3:.0f} | "
                    f"{r['itl_max_s'] * 1e3:.0f} |")
    return "\n".join(rows) + "\n"


def engine(name: str, args: list[str], logs: Path) -> Child:
    """A `tandem serve` on the embedded model, started (not waited for)."""
    return tandem_child(name, "serve", ["--model", MODEL, *args], logs / f"{name}.log").start()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--long-len", type=int, default=1500, help="words in each arriving long prompt")
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--arrivals", type=int, default=4)
    ap.add_argument("--ttft-runs", type=int, default=5)
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="pd_latency_"))
    print("engine logs in", logs)
    load = os.getloadavg()[0]  # a benchmark on a loaded machine is noise: the load goes into the result
    res: dict[str, Any] = {"args": vars(args), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    c = engine("colocated", ["--num-threads", "2"], logs)
    try:
        c.wait_healthy(300)
        res["colocated"] = asyncio.run(measure(Target(c.url, None), args.long_len, args.streams, args.arrivals,
                                               args.ttft_runs))
    finally:
        c.stop()
    p = engine("prefill", ["--role", "prefill", "--num-threads", "1", "--kv-side-channel-port", str(free_port())],
               logs)
    d = engine("decode", ["--role", "decode", "--num-threads", "1"], logs)
    try:
        p.wait_healthy(300)
        d.wait_healthy(300)
        res["pd"] = asyncio.run(measure(Target(d.url, p.url), args.long_len, args.streams, args.arrivals,
                                        args.ttft_runs))
    finally:
        stop_all([d, p])
    res["load_average"] = [load, os.getloadavg()[0]]
    write_results("pd_latency", res, table(res), plot)


if __name__ == "__main__":
    main()
