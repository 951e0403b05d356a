"""The float32 AMX kernel over the GGUF file's blocks (kernels/amx_matmul.py) against the float32 panels and
oneDNN's packed float32 matmul, on SmolLM2's 30 layers of projections, weights streamed from memory.

    .venv/bin/python bench/amx_float32.py [--rows 1,8,16,24,32,64,128,512 --reps 7]

The weights are the embedded model's own: each projection's Q4_1 blocks from the GGUF file, packed for the AMX
kernel and for the panels (panel_matmul.py's block panels), and the float32 weights they dequantize to for
oneDNN. One pass calls one kernel on every layer's four projections in turn for `rows` rows of x (30 layers'
weights do not stay in cache between a layer's turns); the three kernels take turns pass by pass, so all
three see the same load. Writes bench/results/amx_float32.{json,md,png} (docs/benchmarks.md,
"amx_float32.py"). Needs a CPU with AMX and a quiet machine (`uptime` under 0.5).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import MODEL, bench_main, describe, save_plot

from tandem_engine.kernels.amx_matmul import AmxBlockLinear, amx_unfit, block_values, load_amx_kernel
from tandem_engine.kernels.panel_matmul import PanelLinear, load_panel_kernel
from tandem_engine.models import packed_linear
from tandem_engine.models.gguf_quantized import dense_blocks
from tandem_engine.models.loader import load_config_and_tokenizer, resolve_model

KERNELS = ("AMX float32", "panels", "oneDNN packed")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,16,24,32,64,128,512", help="rows of x, comma-separated")
    ap.add_argument("--reps", type=int, default=7, help="timed passes per kernel and row count")
    ap.add_argument("--threads", type=int, default=None, help="threads (default: torch's)")
    return ap.parse_args()


def projections() -> list[tuple[AmxBlockLinear, PanelLinear, torch.Tensor, torch.Tensor]]:
    """Every layer's four projections as (AMX copy, block panels, oneDNN packed copy, float32 weight)."""
    src = resolve_model(MODEL)
    cfg, _, _ = load_config_and_tokenizer(src)
    cache = Path(tempfile.gettempdir()) / "tandem-bench-amx"
    amx, dense = load_amx_kernel(cache), load_panel_kernel(cache)
    assert amx is not None and dense is not None
    blocks = dense_blocks(src.path, cfg.num_hidden_layers, bool(cfg.tie_word_embeddings))
    out = []
    for layer in blocks.layers:
        for parts in layer.values():
            data = torch.cat([p.data for p in parts])
            q, d, m = block_values(data, parts[0].qtype)
            weight = (q.view(q.shape[0], -1, 32) * d[..., None] + m[..., None]).reshape(q.shape)
            out.append((AmxBlockLinear(parts, amx), PanelLinear(weight, dense, parts),
                        packed_linear.pack(weight), weight))
    return out


def one_pass(kernel: str, projs: list[tuple[AmxBlockLinear, PanelLinear, torch.Tensor, torch.Tensor]],
             xs: dict[int, torch.Tensor]) -> None:
    """Every projection once on `kernel`, in layer order."""
    for amx, panels, packed, w in projs:
        x = xs[w.shape[1]]
        if kernel == "AMX float32":
            amx(x)
        elif kernel == "panels":
            panels(x)
        else:
            packed_linear.linear(x, w, None, packed)


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    if (why := amx_unfit()) is not None:
        raise SystemExit(f"{why}: the AMX kernel cannot run here")
    if a.threads:
        torch.set_num_threads(a.threads)
    projs = projections()
    per_row = sum(2.0 * w.shape[0] * w.shape[1] for *_, w in projs)  # FLOPs per row of x
    res: dict[str, Any] = {"threads": torch.get_num_threads(), "layers": len(projs) // 4, "rows": {}}
    for m in [int(r) for r in a.rows.split(",")]:
        xs = {k: torch.randn(m, k) for k in {w.shape[1] for *_, w in projs}}
        times: dict[str, list[float]] = {n: [] for n in KERNELS}
        for n in KERNELS:  # warm up
            one_pass(n, projs, xs)
        for _ in range(a.reps):
            for n in KERNELS:
                t = time.perf_counter()
                one_pass(n, projs, xs)
                times[n].append(time.perf_counter() - t)
        row: dict[str, Any] = {}
        for n, ts in times.items():
            med = statistics.median(ts)
            row[n] = {"ms_median": med * 1e3, "ms_p99": max(ts) * 1e3, "gflop_s": per_row * m / med / 1e9}
        for n in ("panels", "oneDNN packed"):
            row[f"speedup over {n}"] = row[n]["ms_median"] / row["AMX float32"]["ms_median"]
        res["rows"][str(m)] = row
        print(m, {n: round(row[n]["ms_median"], 2) for n in KERNELS}, flush=True)
    return res


def table(res: dict[str, Any]) -> str:
    lines = [f"# float32 matmuls on AMX against the panels and oneDNN ({res['time']})", "",
             f"SmolLM2-135M's {res['layers']} layers x 4 projections, the GGUF file's Q4_1 blocks, weights streamed "
             f"from memory, {res['threads']} threads, {describe(res['machine'])}. 1-minute load "
             f"{res['load_average'][0]:.2f} -> {res['load_average'][1]:.2f}. The kernels take turns pass by pass; "
             f"ms per pass over every layer, median / slowest of {res['config']['reps']}. "
             f"Reproduce: `.venv/bin/{res['command']}`.", "",
             "| rows | AMX float32 | panels | oneDNN packed | AMX GFLOP/s | over panels | over oneDNN |",
             "|---:|---|---|---|---:|---:|---:|"]
    for m, row in res["rows"].items():
        cells = [f"{row[n]['ms_median']:.1f} / {row[n]['ms_p99']:.1f}" for n in KERNELS]
        lines.append(f"| {m} | {' | '.join(cells)} | {row['AMX float32']['gflop_s']:.0f} | "
                     f"{row['speedup over panels']:.2f}x | {row['speedup over oneDNN packed']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    rows = [int(m) for m in res["rows"]]

    def draw(ax: Any) -> None:
        for n in KERNELS:
            ax.plot(rows, [res["rows"][str(m)][n]["gflop_s"] for m in rows], marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows of x")

    save_plot(path, (7, 3.4), "SmolLM2's projections, float32 arithmetic, weights streamed",
              "GFLOP/s (median pass)", draw)


def main() -> int:
    args = parse_args()
    return bench_main("amx_float32", args, run, table, plot)


if __name__ == "__main__":
    sys.exit(main())
