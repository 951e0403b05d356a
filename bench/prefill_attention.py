"""The C kernel's prefill attention alone (`tandem_prefill_attention`), this tree's source
(kernels/prefill_attention.c) against another revision's (that file, or where the prefill code was before:
kernels/paged_attention.c, attention/paged_attention.c), on the embedded model's shapes, for the native build
and an AVX2 (x86-64-v3) build.

    .venv/bin/python bench/prefill_attention.py [--baseline d5ccb39 --iters 9]

One step is the kernel called once per layer (30 for SmolLM2-135M) on a step's prefill chunks, in three
cases: two 256-token prompts (a CPU server's 512-token step, the serving benchmark's prefill), one
512-token prompt, and the last 512 tokens of a 2,048-token prompt (a chunk after 1,536 cached tokens: the
softmax carried over many key chunks). Keys and values sit in scattered cache blocks, as an engine's are.
The two sources run alternately, step by step, so that both see the same load. Writes
bench/results/prefill_attention.{json,md,png}. Needs a quiet machine (`uptime` under 0.5).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from attention_kernel import SOURCES, build_pair, model_shapes, shapes_entry
from harness import bench_main, describe, save_plot

from tandem_engine.kernels.build import KERNEL_MARCH_ENV
from tandem_engine.kernels.prefill_attention import build_kernel

# name: (query tokens, tokens in all) of each prefill in the step
CASES = {"2 x 256 prompts": [(256, 256), (256, 256)], "1 x 512 prompt": [(512, 512)],
         "512 after 1,536 cached": [(512, 2048)]}
BUILDS = ("native", "x86-64-v3")
# Where a revision may hold the prefill kernel: this tree's file, then the decode kernel's (one file before).
PREFILL_SOURCES = ("workers/tandem_engine/kernels/prefill_attention.c", *SOURCES)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="d5ccb39", help="git revision whose kernel source is the baseline")
    ap.add_argument("--iters", type=int, default=9, help="timed steps per source, build and case")
    ap.add_argument("--threads", type=int, default=None, help="threads (default: torch's)")
    return ap.parse_args()


def flops(case: list[tuple[int, int]], layers: int, nq: int, d: int) -> float:
    """Multiply-adds of QK^T and P x V (two FLOPs each) over the causal part: a query at position p sees
    p + 1 keys."""
    keys = sum(sum(range(s - q + 1, s + 1)) for q, s in case)
    return 2.0 * 2 * keys * nq * d * layers


def timed_steps(libs: dict[str, Any], case: list[tuple[int, int]], iters: int, shapes: tuple[int, int, int, int, int]
                ) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    layers, nq, nkv, d, bs = shapes
    need = [-(-s // bs) for _, s in case]
    order = list(range(sum(need)))
    random.Random(0).shuffle(order)
    table = torch.zeros(len(case), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(order[at:at + n], dtype=torch.int32)
        at += n
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(sum(need), bs, nkv, d, generator=gen)
    v = torch.randn(sum(need), bs, nkv, d, generator=gen)
    q = torch.randn(sum(ql for ql, _ in case), nq, d, generator=gen)
    i64 = {name: torch.tensor(col, dtype=torch.int64) for name, col in (
        ("seq_ids", list(range(len(case)))), ("q_lens", [ql for ql, _ in case]), ("seq_lens", [s for _, s in case]),
        ("q_starts", [sum(ql for ql, _ in case[:i]) for i in range(len(case))]))}
    threads = torch.get_num_threads()
    outs = {n: torch.empty_like(q) for n in libs}
    scratch = {n: torch.empty(threads * lib.tandem_prefill_scratch(nq // nkv, d)) for n, lib in libs.items()}

    def step(name: str) -> float:
        lib, out = libs[name], outs[name]
        t0 = time.perf_counter()
        for _ in range(layers):
            rc = lib.tandem_prefill_attention(
                q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), table.data_ptr(), table.stride(0),
                i64["seq_ids"].data_ptr(), i64["q_starts"].data_ptr(), i64["q_lens"].data_ptr(),
                i64["seq_lens"].data_ptr(), len(case), out.data_ptr(), scratch[name].data_ptr(), nq, nkv, d, bs,
                d ** -0.5, threads)
            if rc != 0:
                raise RuntimeError(f"{name}: tandem_prefill_attention refused the shapes")
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {n: [] for n in libs}
    for i in range(2 + iters):  # two warm steps each
        for n in libs:
            t = step(n)
            if i >= 2:
                times[n].append(t)
    return times, outs


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    if a.threads:
        torch.set_num_threads(a.threads)
    shapes = model_shapes()
    _, nq, nkv, d, _ = shapes
    res: dict[str, Any] = {"threads": torch.get_num_threads(), "shapes": shapes_entry(shapes), "builds": {}}
    for build in BUILDS:
        cache = Path(tempfile.mkdtemp(prefix=f"prefill-attention-{build}-", dir=work))
        if build != "native":
            os.environ[KERNEL_MARCH_ENV] = build
        try:
            libs = build_pair(a.baseline, cache, build_kernel, PREFILL_SOURCES)
        finally:
            os.environ.pop(KERNEL_MARCH_ENV, None)
        per_case: dict[str, Any] = {}
        for name, case in CASES.items():
            times, outs = timed_steps(libs, case, a.iters, shapes)
            first, other = outs.values()
            fl = flops(case, shapes[0], nq, d)
            per: dict[str, Any] = {"max_abs_difference": (first - other).abs().max().item(), "gflop": fl / 1e9}
            for n, ts in times.items():
                med = statistics.median(ts)
                per[n] = {"ms_median": med * 1e3, "ms_p99": sorted(ts)[min(len(ts) - 1, int(0.99 * len(ts)))] * 1e3,
                          "gflop_s": fl / med / 1e9}
            per["speedup"] = per[f"baseline {a.baseline}"]["ms_median"] / per["this tree"]["ms_median"]
            per_case[name] = per
            print(f"{build} {name}: {per['speedup']:.2f}x", flush=True)
        res["builds"][build] = per_case
    return res


def table(res: dict[str, Any]) -> str:
    s = res["shapes"]
    base = f"baseline {res['config']['baseline']}"
    lines = [f"# The C kernel's prefill attention alone ({res['time']})", "",
             f"One step: `tandem_prefill_attention` once per layer ({s['layers']} layers, {s['query_heads']} query "
             f"heads, {s['kv_heads']} KV heads, head dim {s['head_dim']}, block size {s['block_size']}, blocks "
             f"scattered), float32, {res['threads']} threads, {describe(res['machine'])}. 1-minute load "
             f"{res['load_average'][0]:.2f} -> {res['load_average'][1]:.2f}. "
             f"Reproduce: `.venv/bin/{res['command']}`.", "",
             f"| build | step | this tree, ms median / p99 (GFLOP/s) | {base}, ms median / p99 (GFLOP/s) "
             "| speed-up | largest difference |", "|---|---|---|---|---:|---:|"]
    for build, cases in res["builds"].items():
        for name, per in cases.items():
            cells = [f"{per[n]['ms_median']:.1f} / {per[n]['ms_p99']:.1f} ({per[n]['gflop_s']:.0f})"
                     for n in ("this tree", base)]
            lines.append(f"| {build} | {name} | {cells[0]} | {cells[1]} | {per['speedup']:.2f}x | "
                         f"{per['max_abs_difference']:.1e} |")
    return "\n".join(lines + [""])


def plot(res: dict[str, Any], path: Path) -> None:
    base = f"baseline {res['config']['baseline']}"
    labels = [f"{b}\n{c}" for b, cases in res["builds"].items() for c in cases]
    width = 0.4

    def draw(ax: Any) -> None:
        for i, n in enumerate(("this tree", base)):
            vals = [per[n]["ms_median"] for cases in res["builds"].values() for per in cases.values()]
            ax.bar([j + i * width for j in range(len(vals))], vals, width, label=n)
        ax.set_xticks([j + width / 2 for j in range(len(labels))], labels, fontsize=7)

    save_plot(path, (9, 3.4), "Prefill attention kernel, float32", "ms per step, all layers (median)", draw)


def main() -> int:
    args = parse_args()
    return bench_main("prefill_attention", args, run, table, plot)


if __name__ == "__main__":
    sys.exit(main())
