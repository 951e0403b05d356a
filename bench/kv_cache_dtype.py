"""What a 16-bit KV cache (`--kv-cache-dtype`) costs and saves against float32, on the same engine and model.

One in-process EngineCore per cache dtype (float32, bfloat16, float16; the model in `--dtype`, float32 by
default), built the same way: the KV blocks its `--kv-cache-gib` holds, then decode tok/s at each batch
size (`--batches`: that many requests of `--prompt-len` random tokens, timed from the step where every
request has its first token to the last step), then quality over a fixed set of 16 prompts x
`--tokens` greedy steps, run straight through the engine's model runner (tandem_engine.worker.greedy_probe):

- greedy agreement: the share of positions where the cache's own greedy continuation equals float32's;
- teacher-forced top-1: fed float32's greedy tokens, the share of steps whose argmax is float32's token;
- logprob drift: fed float32's greedy tokens, mean and max |logprob(16-bit) - logprob(float32)| of them.

Speed wants a quiet machine (bench/harness.py records the load average); quality numbers do not.

    .venv/bin/python bench/kv_cache_dtype.py [--batches 1,32 --prompt-len 256 --decode-len 128 --tokens 64]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from harness import MODEL, bench_main

from tandem_engine.config import EngineConfig
from tandem_engine.core.engine_core import EngineCore
from tandem_engine.models.loader import load_config_and_tokenizer, resolve_model
from tandem_engine.request import Request
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.worker.greedy_probe import GreedyRun, greedy_decode, logprob_drift, token_agreement
from tandem_engine.worker.model_runner import ModelRunner

KV_DTYPES = ["float32", "bfloat16", "float16"]
# The fixed quality prompts: prose, code, lists, facts and a long context, so drift is seen over varied text.
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "def quicksort(items):\n",
    "The three primary colours are",
    "Photosynthesis is the process by which",
    "Here is a recipe for a simple tomato soup. Ingredients:",
    "In 1969, the Apollo 11 mission",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The main differences between a list and a tuple in Python are",
    "Dear hiring manager, I am writing to apply for",
    "To be, or not to be, that is the question:",
    "The quick brown fox jumps over the lazy dog. " * 12 + "Summarise the text above:",
    "A haiku about autumn leaves:\n",
    "Step-by-step instructions to change a flat tyre:\n1.",
    "The French Revolution began in 1789 when",
    "SELECT name, COUNT(*) FROM orders",
]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--dtype", default="float32", help="the model's dtype (--dtype); the cache varies")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--batches", default="1,32", help="decode batch sizes to time")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-len", type=int, default=128, help="tokens each timed request generates")
    ap.add_argument("--tokens", type=int, default=64, help="greedy steps per quality prompt")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args()
    a.batches = [int(b) for b in a.batches.split(",")]
    return a


def decode_tok_s(core: EngineCore, batch: int, prompt_len: int, decode_len: int) -> float:
    """Generated tok/s once every request of the batch is decoding."""
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
        core.add_request(Request(f"b{batch}-{i}", prompt, SamplingParams(max_tokens=decode_len, temperature=0,
                                                                         ignore_eos=True), [0]))
    started: set[str] = set()
    t0, tokens = 0.0, 0
    while core.has_requests:
        outs = core.step()
        if len(started) == batch:
            tokens += sum(len(o.new_token_ids) for o in outs)
        else:
            started.update(o.request_id for o in outs)
            if len(started) == batch:
                t0 = time.perf_counter()
    return tokens / (time.perf_counter() - t0)


def quality(run: GreedyRun, forced: GreedyRun, ref: GreedyRun) -> dict[str, float]:
    """`run`: the cache's own greedy decode; `forced`: fed `ref`'s (float32's) greedy tokens."""
    drift = logprob_drift(forced, ref)
    return {"greedy_agreement": token_agreement(run.greedy, ref.greedy),
            "forced_top1": token_agreement(forced.greedy, ref.greedy),
            "logprob_drift_mean": sum(drift) / len(drift), "logprob_drift_max": max(drift)}


def measure(a: argparse.Namespace) -> dict[str, Any]:
    if a.threads:
        torch.set_num_threads(a.threads)
    _, tok, _ = load_config_and_tokenizer(resolve_model(a.model))
    prompts = [tok.encode(p) for p in PROMPTS]
    max_len = max(a.prompt_len + a.decode_len, max(map(len, prompts)) + a.tokens) + 16
    res: dict[str, Any] = {"threads": torch.get_num_threads(), "kv": {}}
    ref: GreedyRun | None = None
    for kv in KV_DTYPES:
        core = EngineCore(EngineConfig(model=a.model, dtype=a.dtype, kv_cache_dtype=kv, kv_cache_gib=a.kv_cache_gib,
                                       max_model_len=max_len, max_num_seqs=max(64, *a.batches),
                                       max_num_batched_tokens=4096), runner=ModelRunner)
        row: dict[str, Any] = {"num_blocks": core.runner.num_blocks, "block_bytes": core.runner.block_bytes,
                               "decode_tok_s": {}}
        for b in a.batches:
            row["decode_tok_s"][str(b)] = decode_tok_s(core, b, a.prompt_len, a.decode_len)
            print(f"{kv}: batch {b}: {row['decode_tok_s'][str(b)]:.1f} tok/s", flush=True)
        # Quality last: the probe writes blocks from 1 up, under the scheduler's feet.
        run = greedy_decode(core.runner, prompts, a.tokens)
        ref = ref or run
        row.update(quality(run, greedy_decode(core.runner, prompts, a.tokens, forced=ref.kept), ref))
        print(f"{kv}: {row}", flush=True)
        res["kv"][kv] = row
        core.shutdown()
        del core
    res["prompts"], res["prompt_tokens"] = len(prompts), [len(p) for p in prompts]
    return res


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    return measure(a)


def table(res: dict[str, Any]) -> str:
    cfg, kv = res["config"], res["kv"]
    batches = list(kv["float32"]["decode_tok_s"])
    rows = [f"KV cache dtype on {cfg['model']} ({cfg['dtype']} model), {res['threads']} threads, load average "
            f"{res['load_average'][0]:.2f} -> {res['load_average'][1]:.2f}. Decode: {cfg['prompt_len']}-token "
            f"prompts, {cfg['decode_len']} tokens each. Quality: {res['prompts']} prompts x {cfg['tokens']} greedy "
            "tokens against the float32 cache.", "",
            "| KV cache | blocks in " + f"{cfg['kv_cache_gib']:g} GiB | "
            + " | ".join(f"decode tok/s, batch {b}" for b in batches)
            + " | greedy agreement | teacher-forced top-1 | logprob drift mean | max |",
            "|---|---|" + "---|" * len(batches) + "---|---|---|---|"]
    for name, r in kv.items():
        speeds = " | ".join(f"{r['decode_tok_s'][b]:.1f}" for b in batches)
        rows.append(f"| {name} | {r['num_blocks']} | {speeds} | {r['greedy_agreement']:.1%} | "
                    f"{r['forced_top1']:.1%} | {r['logprob_drift_mean']:.4f} | {r['logprob_drift_max']:.3f} |")
    return "\n".join(rows) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kv = res["kv"]
    names = list(kv)
    batches = list(kv["float32"]["decode_tok_s"])
    fig, (speed, drift) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        xs = [n + (i - (len(batches) - 1) / 2) * width for n in range(len(names))]
        vals = [kv[n]["decode_tok_s"][b] for n in names]
        speed.bar(xs, vals, width, label=f"batch {b}")
        for x, v in zip(xs, vals, strict=True):
            speed.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    speed.set_xticks(range(len(names)), [f"{n}\n{kv[n]['num_blocks']} blocks" for n in names])
    speed.set_ylabel("decode tok/s")
    speed.legend(fontsize=8)
    speed.set_title(f"Decode speed (load {res['load_average'][0]:.2f})", fontsize=10)
    xs = list(range(len(names)))
    drift.bar(xs, [kv[n]["logprob_drift_mean"] for n in names], color="#2a7", label="mean |logprob drift|")
    drift.scatter(xs, [kv[n]["logprob_drift_max"] for n in names], color="k", marker="_", s=300, label="max")
    for x, n in zip(xs, names, strict=True):
        drift.text(x, kv[n]["logprob_drift_max"], f"agree {kv[n]['greedy_agreement']:.0%}", ha="center",
                   va="bottom", fontsize=8)
    drift.set_xticks(xs, names)
    drift.set_yscale("symlog", linthresh=1e-3)
    drift.set_ylim(0, 5 * max(max(kv[n]["logprob_drift_max"] for n in names), 1e-3))  # room for the labels
    drift.set_ylabel("|logprob - float32 logprob| of float32's greedy tokens")
    drift.legend(fontsize=8)
    drift.set_title("Quality against the float32 cache", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    return bench_main("kv_cache_dtype", parse_args(), run, table, plot)


if __name__ == "__main__":
    sys.exit(main())
