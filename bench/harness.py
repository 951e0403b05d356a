"""What the benchmark scripts share: the model, prompts of random words, and writing a result set to
bench/results/. Servers are started and stopped with tandem_router.procs, as the tests do."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m-instruct"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa ".split()


def text(n_words: int, seed: int) -> str:
    """`n_words` random words, the same for the same seed."""
    return " ".join(np.random.default_rng(seed).choice(WORDS, n_words))


def write_results(name: str, res: dict[str, Any], table: str, plot: Callable[[dict[str, Any], Path], None]) -> None:
    """Print `res` and write bench/results/<name>.json, .md (`table`) and .png (`plot(res, path)`)."""
    print(json.dumps(res, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(table)
    plot(res, RESULTS / f"{name}.png")


Runner = Callable[[argparse.Namespace, Path], Awaitable[dict[str, Any]]]


def bench_main(name: str, args: argparse.Namespace, run: Runner, table: Callable[[dict[str, Any]], str],
               plot: Callable[[dict[str, Any], Path], None]) -> int:
    """What every bench's main does around `run(args, scratch folder)`: the 1-minute load average before and
    after (a benchmark on a loaded machine is noise: it goes into the result), the command, the time and the
    configuration, then `write_results`."""
    load = [os.getloadavg()[0]]
    work = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    print(f"scratch and logs in {work}; 1-minute load average {load[0]:.2f}", flush=True)
    res = asyncio.run(run(args, work))
    load.append(os.getloadavg()[0])
    res = {"command": " ".join(["python", f"bench/{name}.py", *sys.argv[1:]]),
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average": load,
           "config": vars(args), **res}
    write_results(name, res, table(res), plot)
    return 0
