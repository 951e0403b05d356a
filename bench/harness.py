"""What the benchmark scripts share: the model, prompts of random words, and writing a result set to
bench/results/. Servers are started and stopped with tandem_router.procs, as the tests do."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m-instruct"
# The CPU features that decide which kernels and rates a machine gets (oneDNN's and fbgemm's code paths, AMX
# for bfloat16): the machines here change kind between sessions (2026-12: Intel Xeon with AMX, AMD EPYC
# with AVX2 only), and a result means little without them.
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa ".split()


def text(n_words: int, seed: int) -> str:
    """`n_words` random words, the same for the same seed."""
    return " ".join(np.random.default_rng(seed).choice(WORDS, n_words))


def machine() -> dict[str, Any]:
    """What the machine of a result was: its CPUs, the CPU's model, the vector extensions in VECTOR_FLAGS it
    has, the platform and torch (imported here only if the benchmark has already)."""
    from tandem_engine.kernels.build import cpu_flags, cpu_id

    model = next((ln.split(":", 1)[1].strip() for ln in cpu_id().splitlines() if ln.startswith("model name")), "")
    flags = cpu_flags()
    torch = sys.modules.get("torch")
    return {"cpus": os.cpu_count(), "cpu_model": model, "vector_extensions": [f for f in VECTOR_FLAGS if f in flags],
            "platform": platform.platform(), **({"torch": torch.__version__} if torch else {})}


def describe(m: dict[str, Any]) -> str:
    """`machine()` in a few words: "2 CPUs (AMD EPYC: avx2, fma)"; only the count for results written before
    machine() named the CPU."""
    if "vector_extensions" not in m:
        return f"{m['cpus']} CPUs"
    exts = ", ".join(m["vector_extensions"]) or "none of " + ", ".join(VECTOR_FLAGS)
    return f"{m['cpus']} CPUs ({m.get('cpu_model') or 'model not given'}: {exts})"


def write_results(name: str, res: dict[str, Any], table: str, plot: Callable[[dict[str, Any], Path], None]) -> None:
    """Print `res` and write bench/results/<name>.json, .md (`table`) and .png (`plot(res, path)`)."""
    print(json.dumps(res, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(table)
    plot(res, RESULTS / f"{name}.png")


def save_plot(path: Path, size: tuple[float, float], title: str, ylabel: str, draw: Callable[[Any], None]) -> None:
    """One matplotlib axes, drawn by `draw(ax)`, titled and labelled, with the legend of what it drew, saved as
    `path` (no pyplot: no GUI backend, no global figure state)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    ax = fig.subplots()
    draw(ax)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
    res = {"command": " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average": load,
           "machine": machine(), "config": vars(args), **res}
    write_results(name, res, table(res), plot)
    return 0
