"""Fit the simulated engine's timing model (workers/tandem_engine/sim/timing.py) to the real engine's steps on
this machine: an EngineCore in-process with the real model runner, a prefill sweep (prompts of 32 to 4,096
tokens, chunked as the server chunks them) and a decode grid (batches of 1 to 32 at contexts of 128 to
2,048 tokens), every forward pass timed with the features the scheduler gave it. The fit is non-negative least
squares on relative error (a 40 ms decode step counts as much as a 1 s prefill step).

    .venv/bin/python bench/sim_calibrate.py      # a quiet machine: a few minutes

Writes bench/results/sim_calibrate.{json,md,png} and workers/tandem_engine/sim/timing_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import bench_main, describe, machine, save_plot

from tandem_engine.config import EngineConfig
from tandem_engine.core.engine_core import EngineCore
from tandem_engine.request import Request
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.scheduler_output import SchedulerOutput
from tandem_engine.sim.timing import DEFAULT_TIMING, FEATURES, StepTiming, step_features
from tandem_engine.worker.model_runner import ModelRunner

PREFILL = (32, 128, 256, 512, 1024, 2048, 4096)
DECODE = {128: (1, 2, 4, 8, 16, 32), 1024: (1, 4, 16, 32), 2048: (1, 8, 32)}  # context -> batches


def run_steps(core: EngineCore, prompts: list[list[int]], max_tokens: int, tag: str,
              rows: list[dict[str, Any]]) -> None:
    """Serve `prompts` to the end, each forward pass recorded as a row: its features, seconds and `tag`."""
    execute = core.runner.execute

    def timed(sched: SchedulerOutput) -> Any:
        t0 = time.perf_counter()
        out = execute(sched)
        rows.append({"tag": tag, "features": list(step_features(sched)), "seconds": time.perf_counter() - t0})
        return out

    core.runner.execute = timed
    try:
        for i, p in enumerate(prompts):
            core.add_request(Request(f"{tag}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                      ignore_eos=True), [0]))
        while core.has_requests:
            core.step()
    finally:
        core.runner.execute = execute


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |x c - y| over c >= 0: least squares, dropping the most negative coefficient until none is."""
    active = list(range(x.shape[1]))
    while True:
        c, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (c >= 0).all():
            out = np.zeros(x.shape[1])
            out[active] = c
            return out
        del active[int(np.argmin(c))]


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    config = EngineConfig(model=a.model, max_model_len=8192, max_num_seqs=64, enable_prefix_caching=False,
                          kv_cache_gib=2.0)
    torch.set_num_threads(config.thread_plan().threads)
    core = EngineCore(config, runner=ModelRunner)
    rng = random.Random(0)
    vocab = int(core.runner.model.vocab_size)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    rows: list[dict[str, Any]] = []
    for _ in range(2):
        for n in PREFILL:
            run_steps(core, [prompt(n)], 1, f"prefill {n}", rows)
        for ctx, batches in DECODE.items():
            for b in batches:
                run_steps(core, [prompt(ctx) for _ in range(b)], 12, f"decode b{b} ctx{ctx}", rows)
    core.shutdown()
    x = np.array([r["features"] for r in rows])
    y = np.array([r["seconds"] for r in rows])
    coef = nnls(x / y[:, None], np.ones_like(y))  # relative error: each step's residual over its own time
    pred = x @ coef
    rel = pred / y - 1
    for r, p in zip(rows, pred, strict=True):
        r["predicted"] = float(p)
    groups: dict[str, list[float]] = {}
    for r, e in zip(rows, rel, strict=True):
        kind = "decode" if r["features"][1] == 0 else "prefill" if r["features"][3] == 0 else "mixed"
        groups.setdefault(kind, []).append(float(e))
    where = describe(machine())
    c0, c1, c2, c3, c4 = map(float, coef)
    timing = StepTiming((c0, c1, c2, c3, c4), where, a.model,
                        f"bench/sim_calibrate.py on {where}, {len(rows)} steps, load {os.getloadavg()[0]:.2f} after")
    DEFAULT_TIMING.write_text(json.dumps(timing.to_json(), indent=1) + "\n")
    ss_res, ss_tot = float(((pred - y) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    return {"coefficients": dict(zip(FEATURES, map(float, coef), strict=True)), "r2": 1 - ss_res / ss_tot,
            "relative_error": {k: {"median": float(np.median(np.abs(v))), "p90": float(np.quantile(np.abs(v), 0.9)),
                                   "steps": len(v)} for k, v in groups.items()},
            "steps": rows, "timing_file": str(DEFAULT_TIMING.relative_to(Path(__file__).resolve().parents[1]))}


def table(res: dict[str, Any]) -> str:
    c = res["coefficients"]
    lines = [f"# Simulated engine's timing model, fitted on {describe(res['machine'])}", "",
             f"`{res['command']}`; 1-minute load {res['load_average'][0]:.2f} before, "
             f"{res['load_average'][1]:.2f} after.",
             "", "step seconds = c0 + c1 Tp + c2 Ap + c3 B + c4 C (sim/timing.py)", "",
             "| feature | coefficient |", "|---|---:|"]
    lines += [f"| {k} | {v:.3e} |" for k, v in c.items()]
    lines += ["", f"R^2 {res['r2']:.3f}. |predicted / measured - 1| per kind of step:", "",
              "| steps | count | median | p90 |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v['steps']} | {v['median']:.1%} | {v['p90']:.1%} |" for k, v in res["relative_error"].items()]
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    def draw(ax: Any) -> None:
        for kind, marker in (("prefill", "o"), ("decode", "x"), ("mixed", "s")):
            pts = [(r["seconds"], r["predicted"]) for r in res["steps"]
                   if ("decode" if r["features"][1] == 0 else "prefill" if r["features"][3] == 0 else "mixed") == kind]
            if pts:
                ax.scatter(*zip(*pts, strict=True), marker=marker, label=kind, s=12)
        top = max(r["seconds"] for r in res["steps"])
        ax.plot([0, top], [0, top], color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured step seconds")

    save_plot(path, (6, 5), "timing model: predicted against measured steps", "predicted seconds", draw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    a = ap.parse_args()
    return bench_main("sim_calibrate", a, run, table, plot)


if __name__ == "__main__":
    raise SystemExit(main())
