"""Start-up of `tandem serve`, from launch to a healthy /health, cold and warm.

- cold: an empty `--cache-dir`, as a first run: the GGUF is parsed, dequantized and cached, the CPU
  attention kernel built; every cold trial gets a fresh empty directory;
- warm: the cache the first cold trial left, complete: nothing is built, only read.

`--trials` of each (median reported), with the CPU seconds the server and its EngineCores spent and the
phases the server logs ([startup] lines: the cache build, the model load, the engine ready, all engines
ready). Wants a quiet machine (bench/harness.py records the
load average); docs/benchmarks.md, "startup.py".

    .venv/bin/python bench/startup.py [--trials 3 --model smollm2-135m-instruct --server-args "..."] [--name startup]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from harness import MODEL, bench_main

from tandem_router.procs import cpu_seconds, engine_pids, tandem_child

# [startup] log lines -> the phase they time (seconds: the first number after "in").
PHASES = {
    "cache build": re.compile(r"built the model cache of .* in ([\d.]+)s"),
    "model load": re.compile(r"loaded \S+ \(.*\) in ([\d.]+)s"),
    "engine ready": re.compile(r"\[startup\] engine 0 ready in ([\d.]+)s"),
    "engines ready": re.compile(r"\[startup\] \d+ engine\(s\) ready in ([\d.]+)s"),
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--trials", type=int, default=3, help="starts of each kind")
    ap.add_argument("--server-args", default="", help="extra `tandem serve` flags")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one start may take")
    ap.add_argument("--name", default="startup", help="result file stem in bench/results/ (one per machine kind)")
    return ap.parse_args()


def start_once(a: argparse.Namespace, cache: Path, log: Path) -> dict[str, Any]:
    """One `tandem serve` on `cache`: seconds to healthy and the logged phases, then stopped."""
    server = tandem_child("serve", "serve", ["--model", a.model, "--cache-dir", str(cache), *a.server_args.split()],
                          log).start()
    try:
        healthy_s = server.wait_healthy(a.timeout, interval=0.05)
        assert server.proc is not None
        # CPU seconds the server and its EngineCores spent to get there: what the start costs, less
        # sensitive to other load than the wall time (on a quiet machine of N cores, wall >= cpu / N).
        cpu_s = cpu_seconds([server.proc.pid, *engine_pids(server.proc.pid)])
    finally:
        server.stop(60)
    text = server.log()
    phases = {name: float(m.group(1)) for name, rx in PHASES.items() if (m := rx.search(text))}
    return {"healthy_s": healthy_s, "cpu_s": cpu_s, "phases": phases}


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    trials: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    warm_cache = work / "cache-0"
    for i in range(a.trials):
        cache = work / f"cache-{i}"
        trials["cold"].append(start_once(a, cache, work / f"cold-{i}.log"))
        print(f"cold {i}: {trials['cold'][-1]}", flush=True)
        if i:  # the first one's cache serves the warm starts
            shutil.rmtree(cache, ignore_errors=True)
    for i in range(a.trials):
        trials["warm"].append(start_once(a, warm_cache, work / f"warm-{i}.log"))
        print(f"warm {i}: {trials['warm'][-1]}", flush=True)
    summary = {kind: {"median_s": statistics.median(t["healthy_s"] for t in ts),
                      "cpu_median_s": statistics.median(t["cpu_s"] for t in ts),
                      "phases_median_s": {p: statistics.median(t["phases"][p] for t in ts)
                                          for p in PHASES if all(p in t["phases"] for t in ts)}}
               for kind, ts in trials.items()}
    return {"trials": trials, "summary": summary}


def table(res: dict[str, Any]) -> str:
    cfg, s = res["config"], res["summary"]
    command = " ".join(["tandem serve --model", cfg["model"], *cfg["server_args"].split()])
    load = res["load_average"]
    rows = [f"`{command}` to a healthy /health, {cfg['trials']} trials each, load average {load[0]:.2f} -> "
            f"{load[1]:.2f}.", "",
            "| start | median s | trials s | CPU s (median) | " + " | ".join(f"{p} s (median)" for p in PHASES) + " |",
            "|---|---|---|---|" + "---|" * len(PHASES)]
    for kind, ts in res["trials"].items():
        phases = " | ".join(f"{s[kind]['phases_median_s'][p]:.1f}" if p in s[kind]["phases_median_s"] else "-"
                            for p in PHASES)
        each = ", ".join(f"{t['healthy_s']:.1f}" for t in ts)
        rows.append(f"| {kind} | {s[kind]['median_s']:.1f} | {each} | {s[kind]['cpu_median_s']:.1f} | {phases} |")
    return "\n".join(rows) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    kinds = list(res["trials"])
    for x, kind in enumerate(kinds):
        median = res["summary"][kind]["median_s"]
        ax.bar(x, median, 0.6, label=None)
        ax.text(x, median, f"{median:.1f} s", ha="center", va="bottom")
        ax.plot([x] * len(res["trials"][kind]), [t["healthy_s"] for t in res["trials"][kind]], "k.")
    ax.axhline(10, color="grey", linestyle="--", linewidth=1)
    ax.text(len(kinds) - 0.5, 10, "10 s target (warm)", ha="right", va="bottom", fontsize=8)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_ylabel("seconds to healthy (median, dots: trials)")
    ax.set_title(f"tandem serve start-up, load {res['load_average'][0]:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    args = parse_args()
    sys.exit(bench_main(args.name, args, run, table, plot))
