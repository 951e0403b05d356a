"""The C paged-attention kernel alone, this tree's source against another revision's, on the embedded
model's decode shapes, reading the KV cache from DRAM.

    .venv/bin/python bench/attention_kernel.py [--baseline 3a3492b --batch 32 --context 256 --iters 12]

One step is the kernel called once per layer (30 for SmolLM2-135M, each layer with its own K and V pool,
so that a step streams every sequence's keys and values from memory as an engine step does) for `--batch`
decode rows of `--context` to `--context + 63` keys. Two block tables: `contiguous` (each sequence's
blocks one after another: a fresh engine's prompt blocks) and `scattered` (blocks in a random order over
the pool: a long-running engine, whose LRU free queue hands out blocks freed by earlier requests). The two
sources run alternately, step by step, so that both see the same load; the read rate of a streamed sum of
the same number of bytes is measured in the same run. Writes bench/results/attention_kernel.{json,md,png},
or `--name`'s (docs/benchmarks.md, "attention_kernel.py"). Needs a quiet machine (`uptime` under 0.5).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from harness import MODEL, bench_main, describe, save_plot
from profile_step import read_rate

from tandem_engine.config import EngineConfig
from tandem_engine.kernels.paged_attention import build_kernel, kernel_scratch
from tandem_engine.models.loader import load_config_and_tokenizer, resolve_model

SOURCE = "workers/tandem_engine/kernels/paged_attention.c"
# Where a revision may hold the decode kernel: this tree's place, then attention/ (before the kernels moved).
SOURCES = (SOURCE, "workers/tandem_engine/attention/paged_attention.c")
REPO = Path(__file__).resolve().parent.parent
LAYOUTS = ("contiguous", "scattered")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="3a3492b", help="git revision whose kernel source is the baseline")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256, help="fewest keys a row attends (up to 63 more)")
    ap.add_argument("--iters", type=int, default=12, help="timed steps per source and layout")
    ap.add_argument("--threads", type=int, default=None, help="threads (default: torch's)")
    ap.add_argument("--name", default="attention_kernel", help="result name: another machine's beside this one")
    return ap.parse_args()


def timed_steps(libs: dict[str, Any], a: argparse.Namespace, layout: str, shapes: tuple[int, int, int, int, int]
                ) -> tuple[dict[str, list[float]], int, dict[str, torch.Tensor]]:
    """Seconds per step of each kernel over `layout`'s block table, the KV bytes a step reads, and each
    kernel's output of the last step."""
    layers, nq, nkv, d, bs = shapes
    rng = random.Random(0)
    klens = [a.context + rng.randrange(64) for _ in range(a.batch)]
    need = [-(-k // bs) for k in klens]
    n_blocks = sum(need) + 1
    order = list(range(1, n_blocks))
    if layout == "scattered":
        rng.shuffle(order)
    table = torch.zeros(a.batch, max(need), dtype=torch.int32)
    at = 0
    for r, n in enumerate(need):
        table[r, :n] = torch.tensor(order[at:at + n], dtype=torch.int32)
        at += n
    gen = torch.Generator().manual_seed(1)
    pools = [(torch.randn(n_blocks, bs, nkv, d, generator=gen), torch.randn(n_blocks, bs, nkv, d, generator=gen))
             for _ in range(layers)]
    q = torch.randn(a.batch, nq, d, generator=gen)
    rows = torch.arange(a.batch, dtype=torch.int64)
    lens = torch.tensor(klens, dtype=torch.int64)
    threads = torch.get_num_threads()
    per = kernel_scratch(nq, nkv, d, bs, max(klens))
    scratch = torch.empty(threads * per)
    outs = {n: torch.empty(a.batch, nq, d) for n in libs}

    def step(lib: Any, out: torch.Tensor) -> float:
        t0 = time.perf_counter()
        for k, v in pools:
            lib.tandem_paged_attention(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), 0, table.data_ptr(),
                                       table.stride(0), rows.data_ptr(), rows.data_ptr(), lens.data_ptr(),
                                       out.data_ptr(), scratch.data_ptr(), per, a.batch, nq, nkv, d, bs, d ** -0.5,
                                       threads)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {n: [] for n in libs}
    for i in range(2 + a.iters):  # two warm steps each
        for n, lib in libs.items():
            t = step(lib, outs[n])
            if i >= 2:
                times[n].append(t)
    kv_bytes = sum(klens) * nkv * d * 4 * 2 * layers
    return times, kv_bytes, outs


def model_shapes() -> tuple[int, int, int, int, int]:
    """(layers, query heads, KV heads, head dim, block size) of the embedded model in a default engine."""
    cfg, _, _ = load_config_and_tokenizer(resolve_model(MODEL))
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // nq
    return cfg.num_hidden_layers, nq, nkv, d, EngineConfig(model=MODEL).block_size


def shapes_entry(shapes: tuple[int, int, int, int, int]) -> dict[str, int]:
    return dict(zip(("layers", "query_heads", "kv_heads", "head_dim", "block_size"), shapes, strict=True))


def source_at(revision: str, paths: Sequence[str]) -> str:
    """The text of the first of `paths` (relative to the repository) that git revision `revision` holds."""
    for path in paths:
        shown = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=REPO, capture_output=True, text=True)
        if shown.returncode == 0:
            return shown.stdout
    raise RuntimeError(f"{revision} holds none of {', '.join(paths)}")


def build_pair(baseline: str, cache: Path, build: Callable[..., Any] = build_kernel,
               paths: Sequence[str] = SOURCES) -> dict[str, Any]:
    """This tree's kernel (`paths[0]`) and the one at git revision `baseline` (the first of `paths` it holds),
    built by `build` (a wrapper's build_kernel) under `cache` with the current flags (kernels/build.py:
    `TANDEM_CPU_KERNEL_MARCH` picks the ISA level), by name."""
    name = Path(paths[0]).stem
    libs = {"this tree": build((REPO / paths[0]).read_text(), cache),
            f"baseline {baseline}": build(source_at(baseline, paths), cache, name=f"{name}_baseline")}
    if any(lib is None for lib in libs.values()):
        raise RuntimeError("a kernel did not build (see the warning above)")
    return libs


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    if a.threads:
        torch.set_num_threads(a.threads)
    shapes = model_shapes()
    _, nq, nkv, d, _ = shapes
    libs = build_pair(a.baseline, Path(tempfile.mkdtemp(prefix="attention-kernel-", dir=work)))
    res: dict[str, Any] = {"threads": torch.get_num_threads(), "shapes": shapes_entry(shapes), "layouts": {}}
    for layout in LAYOUTS:
        times, kv_bytes, outs = timed_steps(libs, a, layout, shapes)
        first, *rest = outs.values()
        per: dict[str, Any] = {"kv_bytes_per_step": kv_bytes,
                               "max_abs_difference": max((first - o).abs().max().item() for o in rest)}
        for n, ts in times.items():
            med = statistics.median(ts)
            per[n] = {"ms_median": med * 1e3, "ms_p99": sorted(ts)[min(len(ts) - 1, int(0.99 * len(ts)))] * 1e3,
                      "kv_read_gb_s": kv_bytes / med / 1e9}
        base = per[list(libs)[1]]["ms_median"]
        per["speedup"] = base / per["this tree"]["ms_median"]
        res["layouts"][layout] = per
    res["streamed_sum_gb_s"] = read_rate()
    return res


def kernel_names(res: dict[str, Any]) -> list[str]:
    """The kernels a result compares (this tree's first), as its per-layout entries name them."""
    return [n for n in next(iter(res["layouts"].values()))
            if n not in ("kv_bytes_per_step", "max_abs_difference", "speedup")]


def table(res: dict[str, Any]) -> str:
    names = kernel_names(res)
    s = res["shapes"]
    lines = [f"# The C paged-attention kernel alone ({res['time']})", "",
             f"One step: {s['layers']} layers x batch {res['config']['batch']} decode rows of "
             f"{res['config']['context']}-{res['config']['context'] + 63} keys ({s['query_heads']} query heads, "
             f"{s['kv_heads']} KV heads, head dim {s['head_dim']}, block size {s['block_size']}), float32 KV from "
             f"DRAM, {res['threads']} threads, {describe(res['machine'])}. 1-minute load "
             f"{res['load_average'][0]:.2f} -> {res['load_average'][1]:.2f}. A streamed sum reads "
             f"{res['streamed_sum_gb_s']:.1f} GB/s. "
             f"Reproduce: `.venv/bin/{res['command']}`.", "",
             "| block table | kernel | ms per step, median / p99 | KV read GB/s | speed-up |",
             "|---|---|---|---:|---:|"]
    for layout, per in res["layouts"].items():
        for n in names:
            sp = f"{per['speedup']:.2f}x" if n == "this tree" else ""
            lines.append(f"| {layout} ({per['kv_bytes_per_step'] / 1e6:.0f} MB) | {n} | "
                         f"{per[n]['ms_median']:.1f} / {per[n]['ms_p99']:.1f} | {per[n]['kv_read_gb_s']:.1f} | {sp} |")
    lines += ["", "Largest difference between the two kernels' outputs: "
              + ", ".join(f"{layout} {per['max_abs_difference']:.1e}" for layout, per in res["layouts"].items()), ""]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    layouts = list(res["layouts"])
    names = kernel_names(res)
    width = 0.8 / len(names)

    def draw(ax: Any) -> None:
        for i, n in enumerate(names):
            xs = [j + i * width for j in range(len(layouts))]
            ax.bar(xs, [res["layouts"][lo][n]["ms_median"] for lo in layouts], width, label=n)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(layouts))], layouts)

    save_plot(path, (7, 3), "Paged attention, all layers, batch 32, float32 KV", "ms per decode step (median)",
              draw)


def main() -> int:
    args = parse_args()
    return bench_main(args.name, args, run, table, plot)


if __name__ == "__main__":
    sys.exit(main())
