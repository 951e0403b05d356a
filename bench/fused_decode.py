"""A decode step under `--quantization gguf` in one C call (worker/decode_step.py) against op by op, in
process on the embedded model.

    .venv/bin/python bench/fused_decode.py [--batches 1 4 --context 128 --steps 200 --threads N]

An EngineCore runs in-process (no HTTP, no ZMQ) with the OpenMP waiting an EngineCore process gets
(cpu_budget.openmp_env: passive unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set). For each batch size,
that many requests with `--context`-token prompts are prefilled, then `--steps` whole EngineCore steps
(scheduler, forward, head, sampler) are timed per variant, fused and op by op alternating step by step so
that both see the same load and context. Writes bench/results/fused_decode.{json,md,png}
(docs/benchmarks.md, "fused_decode.py"). Needs a quiet machine (`uptime` under 0.5).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tandem_engine.cpu_budget import openmp_env

os.environ.update(openmp_env())  # before torch loads libgomp, as for an EngineCore process

import torch  # noqa: E402
from harness import MODEL, bench_main  # noqa: E402

from tandem_engine.config import EngineConfig  # noqa: E402
from tandem_engine.core.engine_core import EngineCore  # noqa: E402
from tandem_engine.request import Request  # noqa: E402
from tandem_engine.sampling_params import SamplingParams  # noqa: E402
from tandem_engine.worker.model_runner import ModelRunner

VARIANTS = ("fused", "op_by_op")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of each sequence")
    ap.add_argument("--steps", type=int, default=200, help="decode steps timed per variant and batch")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return ap.parse_args()


def time_batch(core: EngineCore, a: argparse.Namespace, batch: int) -> dict[str, list[float]]:
    """Prefill `batch` requests, then time `a.steps` steps per variant, alternating; seconds per step."""
    model = core.runner.model
    fused = model.decode_step
    rng = random.Random(batch)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = [rng.randrange(100, 40000) for _ in range(a.context)]
        core.add_request(Request(rid, prompt, SamplingParams(max_tokens=2 * a.steps + 8, temperature=0,
                                                             ignore_eos=True), [0]))
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in core.step())
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(2 + 2 * a.steps):  # two warm-up steps
        variant = VARIANTS[i % 2]
        model.decode_step = fused if variant == "fused" else None
        t0 = time.perf_counter()
        outs = core.step()
        if i >= 2:
            times[variant].append(time.perf_counter() - t0)
        if sum(len(o.new_token_ids) for o in outs) != batch:
            raise RuntimeError("a timed step did not decode the whole batch")
    model.decode_step = fused
    core.abort_requests(ids)
    return times


def summary(ts: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in ts)
    return {"median_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
            "mean_ms": statistics.mean(ms), "min_ms": ms[0]}


def measure(a: argparse.Namespace) -> dict[str, Any]:
    if a.threads:
        torch.set_num_threads(a.threads)
    core = EngineCore(EngineConfig(model=a.model, quantization="gguf", kv_cache_gib=0.25,
                                   max_model_len=a.context + 2 * a.steps + 16, max_num_seqs=max(a.batches)),
                      runner=ModelRunner)
    if core.runner.model.decode_step is None:
        raise RuntimeError("decode steps do not run fused here (see the engine's start-up log)")
    res: dict[str, Any] = {"threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                           "batches": {}}
    try:
        for b in a.batches:
            times = time_batch(core, a, b)
            res["batches"][str(b)] = {v: summary(ts) | {"steps_ms": [t * 1e3 for t in ts]} for v, ts in times.items()}
    finally:
        core.shutdown()
    return res


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    return measure(a)


def table(res: dict[str, Any]) -> str:
    lines = ["# A decode step under --quantization gguf: fused (one C call) against op by op, in process",
             "", f"1-minute load {res['load_average'][0]:.2f} -> {res['load_average'][1]:.2f}, {res['threads']} "
             f"threads, OMP_WAIT_POLICY={res['omp_wait_policy']}, {res['config']['context']}-token prompts, "
             f"{res['config']['steps']} steps per variant, alternating", "",
             "| batch | fused median ms | fused p99 ms | op by op median ms | op by op p99 ms | speed-up (median) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for b, v in res["batches"].items():
        f, o = v["fused"], v["op_by_op"]
        lines.append(f"| {b} | {f['median_ms']:.2f} | {f['p99_ms']:.2f} | {o['median_ms']:.2f} | {o['p99_ms']:.2f} "
                     f"| {o['median_ms'] / f['median_ms']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure state

    batches = list(res["batches"])
    fig = Figure(figsize=(4 + 2 * len(batches), 3))
    ax = fig.subplots()
    data = [res["batches"][b][v]["steps_ms"] for b in batches for v in VARIANTS]
    ax.boxplot(data, whis=(1, 99), showfliers=False)
    ax.set_xticks(range(1, len(data) + 1), [f"{v}\nbatch {b}" for b in batches for v in VARIANTS], fontsize=8)
    ax.set_ylabel("ms per EngineCore step")
    ax.set_title(f"gguf decode step, fused vs op by op (load {res['load_average'][0]:.2f})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    return bench_main("fused_decode", parse_args(), run, table, plot)


if __name__ == "__main__":
    sys.exit(main())
