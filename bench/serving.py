"""Serving benchmark: `tandem serve` under 32 concurrent streamed requests against transformers' best
batched `generate` on the same prompts, measured in the same run on the same machine.

    .venv/bin/python bench/serving.py                 # or: make bench
    .venv/bin/python bench/serving.py --skip-hf       # only the server
    .venv/bin/python bench/serving.py --skip-hf --server-env OMP_WAIT_POLICY=ACTIVE \
        --out bench/results/serving_omp_active.json   # engine threads spin at barriers (a machine to itself)

tandem runs in float32 unless --dtype says otherwise: the numerics of the target. Writes
bench/results/serving.json, .md and .png (or --out and its .md and .png); `--from-json PATH` writes the .md
and .png of a result again without running anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from harness import MODEL, RESULTS, describe, machine, save_plot
from roofline import EACH_SHAPE

from tandem_router.procs import tandem_child


def run_bench(url: str, a: argparse.Namespace, label: str, seed: int) -> dict[str, Any]:
    from tandem_router.bench import bench as run
    from tandem_router.bench import build_parser

    args = build_parser().parse_args([
        "--url", url, "--workload", "random", "--concurrency", str(a.concurrency),
        "--num-prompts", str(a.num_prompts), "--input-len", str(a.input_len),
        "--output-len", str(a.output_len), "--seed", str(seed), "--label", label])
    result, _ = asyncio.run(run(args))
    return dict(result["summary"])


def hf_prompts(a: argparse.Namespace, seed: int) -> list[str]:
    """The prompts of tandem's run with this seed (run_bench's random workload)."""
    from tandem_router.bench.workload import random_sessions

    return [s.turns[0] for s in random_sessions(a.num_prompts, a.input_len, seed)]


def hf_generate(dtype: torch.dtype, prompts: list[str], output_len: int) -> dict[str, Any]:
    """transformers' batched greedy generate, batch = all prompts, left padded, every token forced."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem_engine.models.loader import resolve_model, weights_dir

    d = weights_dir(resolve_model(MODEL))
    tok = AutoTokenizer.from_pretrained(d)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
    model.eval()
    batch = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
              pad_token_id=tok.pad_token_id)
    with torch.inference_mode():
        model.generate(**batch, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        out = model.generate(**batch, **kw)
        dt = time.perf_counter() - t0
    n = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return {"dtype": str(dtype), "batch": len(prompts), "prompt_tokens_padded": int(batch["input_ids"].shape[1]),
            "output_tokens": int(n), "seconds": dt, "output_tok_s": n / dt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    # float32: the numerics the target is set in (`auto` is bfloat16 with AMX, docs/operations.md)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--server-args", default="", help="extra `tandem serve` flags")
    ap.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for `tandem serve` (e.g. OMP_WAIT_POLICY=ACTIVE), repeatable")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-dtypes", default="float32,bfloat16", help="transformers baselines to run")
    ap.add_argument("--out", default=str(RESULTS / "serving.json"))
    ap.add_argument("--reps", type=int, default=1,
                    help="rounds, each a tandem run on the same server and then transformers' best dtype; "
                         "the median round is reported")
    ap.add_argument("--from-json", metavar="PATH", help="write PATH's .md and .png again from PATH; run nothing")
    a = ap.parse_args()
    if a.from_json:
        saved = json.loads(Path(a.from_json).read_text())
        write_markdown(saved, Path(a.from_json).with_suffix(".md"))
        plot(saved, Path(a.from_json).with_suffix(".png"))
        return
    RESULTS.mkdir(parents=True, exist_ok=True)

    from roofline import measure as roofline

    load_start = os.getloadavg()[0]  # the 1-minute load before anything of this run (quiet: under 0.5)
    ceiling = roofline(a.concurrency, a.input_len, a.output_len)  # before anything else runs
    # the rooflines measured again between runs: tandem's dtype only (`auto`: both)
    dtypes = (getattr(torch, a.dtype),) if a.dtype in ("float32", "bfloat16") else (torch.float32, torch.bfloat16)
    print(json.dumps(ceiling, indent=1), flush=True)
    extra = ["--dtype", a.dtype, "--max-num-seqs", str(max(a.concurrency, 32)), *a.server_args.split()]
    env = dict(kv.split("=", 1) for kv in a.server_env)
    runs: list[dict[str, Any]] = []
    hf: list[dict[str, Any]] = []
    server = tandem_child("serve", "serve", ["--model", MODEL, *extra], Path("/tmp") / f"tandem-bench-{a.port}.log",
                          port=a.port, env=env or None).start()
    try:
        startup_s = server.wait_healthy(3600)
        print(f"server ready in {startup_s:.1f}s", flush=True)
        url = server.url
        httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=120)
        # This VM's speed drifts by a fifth from minute to minute, so the workload runs in --reps rounds on the
        # same server (new prompts of the same lengths, seed + i, so that none is found in the prefix cache),
        # and every ratio is taken within a round:
        # - tandem's run against a roofline of its dtype measured just before it (the first: the one above);
        #   the run of median share of its own ceiling is the reported one (all of them are kept);
        # - tandem's run against transformers' best batched generate run just after it, on the same prompts
        #   (every --hf-dtypes in the first round, then the fastest of them), the server idle meanwhile; the
        #   speed-up is the median round's.
        hf_dtypes = [getattr(torch, d) for d in a.hf_dtypes.split(",")] if not a.skip_hf else []
        for i in range(a.reps):
            own = ceiling if i == 0 else roofline(a.concurrency, a.input_len, a.output_len, dtypes=dtypes)
            r = run_bench(url, a, "tandem", a.seed + i)
            run: dict[str, Any] = {
                "summary": r, "roofline_gflops": {k: v for k, v in own["gflops"].items() if not k.startswith("int8")},
                "ceiling_output_tok_s": own["ceiling_output_tok_s"],
                "share": {k: r["output_throughput"] / v for k, v in own["ceiling_output_tok_s"].items()
                          if k.startswith(a.dtype + ",")}}
            print(f"round {i + 1}: tandem {r['output_throughput']:.1f} tok/s", flush=True)
            this_round = []
            for dtype in hf_dtypes:
                h = hf_generate(dtype, hf_prompts(a, a.seed + i), a.output_len) | {"round": i + 1}
                print(f"round {i + 1}: transformers {dtype}: {h['output_tok_s']:.1f} tok/s", flush=True)
                this_round.append((dtype, h))
            if this_round:
                fastest, best = max(this_round, key=lambda pair: pair[1]["output_tok_s"])
                run["transformers"] = {"dtype": best["dtype"], "output_tok_s": best["output_tok_s"]}
                run["speedup"] = r["output_throughput"] / best["output_tok_s"]
                hf += [h for _, h in this_round]
                hf_dtypes = [fastest]
            runs.append(run)
        chosen = sorted(runs, key=lambda run: run["share"].get(f"{a.dtype}, {EACH_SHAPE}", 0.0))[len(runs) // 2]
        serving = chosen["summary"]
    finally:
        server.stop(60)
    print(json.dumps(serving, indent=1), flush=True)

    speedups = [run["speedup"] for run in runs if "speedup" in run]
    same = [run["summary"]["output_throughput"] / h["output_tok_s"] for i, run in enumerate(runs) for h in hf
            if h["round"] == i + 1 and h["dtype"] == f"torch.{a.dtype}"]
    result = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "config": vars(a) | {"server_flags": extra},
        "load_average": {"start": load_start, "end": os.getloadavg()[0]},
        "server_startup_s": startup_s,
        "tandem": serving,
        "tandem_runs_output_tok_s": [run["summary"]["output_throughput"] for run in runs],
        "tandem_runs": runs,
        "tandem_share_of_ceiling": chosen["share"],
        "transformers": hf,
        # medians over the rounds of each round's own ratio
        "speedup_vs_best_transformers": statistics.median(speedups) if speedups else None,
        "speedup_vs_transformers_same_dtype": statistics.median(same) if same else None,
        "roofline": ceiling,
    }
    Path(a.out).write_text(json.dumps(result, indent=1))
    write_markdown(result, Path(a.out).with_suffix(".md"))
    plot(result, Path(a.out).with_suffix(".png"))
    print(f"wrote {a.out}")


def plot(r: dict[str, Any], path: Path) -> None:
    """Each round's tandem rate beside the ceiling measured just before it and the transformers run just
    after it, with tandem's share of that ceiling and its speed-up written over its bar."""
    runs = r.get("tandem_runs") or [{"summary": r["tandem"],
                                     "ceiling_output_tok_s": r["roofline"]["ceiling_output_tok_s"]}]
    each = f"{r['config']['dtype']}, {EACH_SHAPE}"

    def draw(ax: Any) -> None:
        xs = range(len(runs))
        ceilings = [run["ceiling_output_tok_s"].get(each, 0.0) for run in runs]
        ax.bar([x - 0.27 for x in xs], ceilings, 0.27, color="0.85", label=f"ceiling ({each})")
        rates = [run["summary"]["output_throughput"] for run in runs]
        ax.bar(list(xs), rates, 0.27, label=f"tandem serve ({r['config']['dtype']})")
        paired = all("transformers" in run for run in runs)  # rounds of tandem then transformers
        if paired:
            ax.bar([x + 0.27 for x in xs], [run["transformers"]["output_tok_s"] for run in runs], 0.27,
                   label="transformers generate (best dtype)")
        # the targets (docs/benchmarks.md) as dashes across tandem's bar: 70% of the ceiling, 2x transformers
        ax.hlines([0.7 * c for c in ceilings], [x - 0.14 for x in xs], [x + 0.14 for x in xs], colors="k",
                  linestyles="dashed", label="70% of the ceiling")
        if paired:
            ax.hlines([2 * run["transformers"]["output_tok_s"] for run in runs], [x - 0.14 for x in xs],
                      [x + 0.14 for x in xs], colors="tab:red", linestyles="dotted", label="2x transformers")
        elif r.get("transformers"):  # before paired rounds: transformers ran once, after all of tandem's runs
            best = max(r["transformers"], key=lambda h: h["output_tok_s"])
            ax.axhline(best["output_tok_s"], color="tab:orange", label=f"transformers generate ({best['dtype']})")
            ax.axhline(2 * best["output_tok_s"], color="tab:red", linestyle="dotted", label="2x transformers")
        for x, run, rate, ceiling in zip(xs, runs, rates, ceilings, strict=True):
            note = f"{rate / ceiling:.0%}" if ceiling else ""
            if "speedup" in run:
                note += f"\n{run['speedup']:.2f}x"
            ax.text(x, rate, note, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [f"round {x + 1}" for x in xs])
        ax.set_ylim(0, max(ceilings + rates) * 1.6)

    load = r.get("load_average", {})
    m = r["machine"]
    title = f"{r['config']['concurrency']} streams, {m['cpus']} CPUs ({m.get('cpu_model', '?')})\n{r['time']}"
    save_plot(path, (6.5, 4), title
              + (f", 1-minute load {load['start']:.2f} before" if "start" in load else ""), "output tok/s", draw)


def write_markdown(r: dict[str, Any], path: Path) -> None:
    s = r["tandem"]
    lines = [
        f"# Serving benchmark ({r['time']})",
        "",
        f"{r['config']['num_prompts']} streamed requests, concurrency {r['config']['concurrency']}, "
        f"~{r['config']['input_len']} prompt tokens, {r['config']['output_len']} output tokens (ignore_eos), "
        f"SmolLM2-135M-Instruct, {describe(r['machine'])}. Reproduce: `.venv/bin/python bench/serving.py"
        + (f" --dtype {r['config']['dtype']}" if r["config"]["dtype"] != "float32" else "")
        + (f" --server-args={shlex.quote(r['config']['server_args'])}" if r["config"].get("server_args") else "")
        + "".join(f" --server-env {kv}" for kv in r["config"].get("server_env", []))
        + (" --skip-hf" if r["config"].get("skip_hf") else "")
        + (f" --reps {r['config']['reps']}" if r["config"].get("reps", 1) > 1 else "")
        + (f" --out bench/results/{Path(r['config']['out']).name}" if Path(r["config"]["out"]).name != "serving.json"
           else "") + "`."
        + (f" 1-minute load average {r['load_average']['start']:.2f} before the run, "
           f"{r['load_average']['end']:.2f} after." if "load_average" in r else ""),
        "",
        "| system | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |",
        "|---|---|---|---|",
        f"| tandem serve ({' '.join([r['config']['dtype'], *r['config'].get('server_env', [])])}) | "
        f"{s['output_throughput']:.1f} | "
        f"{s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f} | "
        f"{s['itl_ms']['p50']:.1f} / {s['itl_ms']['p99']:.1f} |",
    ]
    for dtype in dict.fromkeys(h["dtype"] for h in r["transformers"]):
        each_round = [h for h in r["transformers"] if h["dtype"] == dtype]
        rate = statistics.median(h["output_tok_s"] for h in each_round)
        lines.append(f"| transformers generate, batch {each_round[0]['batch']}, {dtype}"
                     + (f" (median of {len(each_round)} rounds)" if len(each_round) > 1 else "")
                     + f" | {rate:.1f} | | |")
    runs = r.get("tandem_runs", [])
    paired = bool(runs) and all("speedup" in run for run in runs)  # rounds of tandem then transformers
    if len(runs) > 1:
        each = f"{r['config']['dtype']}, {EACH_SHAPE}"
        lines += ["", f"The workload ran in {len(runs)} rounds on the same server (the VM's speed drifts between "
                  "minutes, so every ratio is taken within a round): a roofline, then tandem's run"
                  + (", then transformers' best dtype on the same prompts" if paired else "")
                  + f". tandem's row is the run whose share of the {each} ceiling is the median"
                  + ("; the speed-up below is the median round's." if paired else "."), "",
                  "| round | tandem tok/s | ceiling measured before it (tok/s) | share |"
                  + (" transformers tok/s | tandem / transformers |" if paired else ""),
                  "|---|---|---|---|" + ("---|---|" if paired else "")]
        lines += [f"| {i + 1} | {run['summary']['output_throughput']:.1f} | {run['ceiling_output_tok_s'][each]:.0f} "
                  f"| {run['share'][each]:.1%} |"
                  + (f" {run['transformers']['output_tok_s']:.1f} ({run['transformers']['dtype']}) "
                     f"| {run['speedup']:.2f}x |" if paired else "") for i, run in enumerate(runs)]
    if r["speedup_vs_best_transformers"]:
        lines += ["", "Speed-up over the best transformers run"
                  + (" (the median round's)" if paired else "")
                  + f": **{r['speedup_vs_best_transformers']:.2f}x**."]
    if r.get("speedup_vs_transformers_same_dtype"):
        lines[-1] += (f" Over transformers in tandem's dtype ({r['config']['dtype']}): "
                      f"**{r['speedup_vs_transformers_same_dtype']:.2f}x**.")
    lines += ["", f"Server start to healthy: {r['server_startup_s']:.1f} s."]
    c = r.get("roofline")
    if c:
        best = max(c["ceiling_output_tok_s"].items(), key=lambda kv: kv[1])
        lines += ["", "## What this machine allows (`bench/roofline.py`, measured first in the same run)", "",
                  f"The workload is {c['workload_tflop']:.2f} TFLOP ({c['gflop_per_prompt_token'] * 1e3:.0f} MFLOP "
                  f"per prompt token, {c['gflop_per_output_token'] * 1e3:.0f} per output token). Matmul rates at "
                  f"the model's shapes, {c['threads']} threads:", "", "| matmuls | GFLOP/s |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in c["gflops"].items()]
        lines += ["", "Fastest possible output tok/s if every projection ran at those rates (attention, norms "
                  "and sampling free): " + ", ".join(f"{k} {v:.0f}" for k, v in c["ceiling_output_tok_s"].items())
                  + f". tandem reaches {s['output_throughput'] / best[1]:.0%} of the highest ceiling ({best[0]})."]
        own = next((run["ceiling_output_tok_s"] for run in r.get("tandem_runs", []) if run["summary"] == s),
                   c["ceiling_output_tok_s"])
        same = {k: v for k, v in own.items() if k.startswith(r["config"]["dtype"] + ",")}
        if same:
            lines[-1] += " Of the ceilings in tandem's dtype, measured just before its reported run: " + ", ".join(
                f"**{s['output_throughput'] / v:.0%}** of {k} ({v:.0f})" for k, v in same.items()) + "."
        first = [h for h in r["transformers"] if h.get("round", 1) == 1]  # the round of the roofline above
        for h in first:
            lines[-1] += f" transformers {h['dtype']} {h['output_tok_s'] / best[1]:.0%}."
        if first:
            # the target (docs/benchmarks.md): twice the best transformers run, set against the highest ceiling
            need = 2 * max(h["output_tok_s"] for h in first)
            lines += ["", f"2x the best transformers run of the first round is {need:.0f} tok/s: {need / best[1]:.0%} "
                      "of the highest ceiling measured before it."]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
