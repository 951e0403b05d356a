"""Dense against `--quantization int8` on the same engine: what int8 buys in speed and costs in quality.

Speed (a real `tandem serve` per mode, float32 activations both): single-stream decode (one request at a
time, 128 tokens after a 256-token prompt) with TTFT, and batch-32 serving (64 requests, concurrency 32).
Quality: greedy answers of both servers to a fixed prompt set (one request at a time), compared token by
token; then, in this process on the engine's own model code, the dense answers read teacher-forced by
both models (top-1 agreement and logprob drift) and the perplexity of both on a fixed public-domain text
(bench/data/alice_chapter1.txt: chapter I of Lewis Carroll's "Alice's Adventures in Wonderland", 1865,
~2,900 tokens).

    .venv/bin/python bench/quantization.py                  # on a quiet machine (speed is noise otherwise)
    .venv/bin/python bench/quantization.py --skip-speed     # quality only; any machine

Writes bench/results/quantization.{json,md,png}.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch
from harness import MODEL, bench_main

from tandem_engine.attention.cpu_backend import CpuAttentionBackend
from tandem_engine.attention.interface import AttentionMetadata
from tandem_engine.models.llama import LlamaForCausalLM
from tandem_engine.models.loader import load_config_and_tokenizer, load_model, resolve_model
from tandem_router.procs import tandem_child

MODES = ("none", "int8")
TEXT = Path(__file__).resolve().parent / "data" / "alice_chapter1.txt"
PROMPTS = [
    "The three primary colors are", "Water boils at a temperature of", "The capital of France is",
    "Here is a short poem about the sea:\n", "def fibonacci(n):\n    ", "To make a cup of tea, first",
    "The largest planet in the solar system is", "Once upon a time, in a small village,",
    "Photosynthesis is the process by which", "The main causes of the First World War were",
    "A good way to learn a new language is", "import numpy as np\n\n# Compute the mean of",
    "The difference between weather and climate is", "In 1969, the first humans",
    "Three tips for a healthy lifestyle:\n1.", "The recipe for pancakes needs",
]


async def speed(url: str, a: argparse.Namespace) -> dict[str, Any]:
    """Single-stream and batch-32 runs of the shared load generator (tandem_router.bench)."""
    from tandem_router.bench import bench, build_parser

    out: dict[str, Any] = {}
    for name, concurrency, requests in (("single", 1, a.single_requests), ("batch", a.batch, 2 * a.batch)):
        args = build_parser().parse_args([
            "--url", url, "--workload", "random", "--concurrency", str(concurrency), "--num-prompts",
            str(requests), "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--seed", "0"])
        s = (await bench(args))[0]["summary"]
        out[name] = {"output_tok_s": s["output_throughput"], "ttft_p50_ms": s["ttft_ms"]["p50"],
                     "itl_p50_ms": s["itl_ms"]["p50"], "decode_tok_s": 1000 / s["itl_ms"]["p50"],
                     "failed": s["failed"]}
    return out


async def greedy(url: str, max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy token ids, one request at a time."""
    answers = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        for p in PROMPTS:
            r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                                      "ignore_eos": True, "return_token_ids": True})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            answers.append(choice["prompt_token_ids"] + choice["token_ids"])
    return answers


async def serve_mode(mode: str, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    server = tandem_child(f"serve-{mode}", "serve", [
        "--model", MODEL, "--dtype", "float32", "--quantization", mode, "--max-num-seqs", str(max(a.batch, 32))],
        work / f"serve-{mode}.log").start()
    try:
        res: dict[str, Any] = {"startup_s": server.wait_healthy(3600)}
        res["answers"] = await greedy(server.url, a.max_tokens)  # also the warm-up of the speed runs
        if not a.skip_speed:
            res.update(await speed(server.url, a))
    finally:
        server.stop(60)
    return res


def next_token_logprobs(model: LlamaForCausalLM, ids: list[int], chunk: int = 512) -> Iterator[torch.Tensor]:
    """Log-probabilities [n, vocab] of the token after each position of `ids`, chunk by chunk: one sequence
    prefilled through a paged KV cache in chunks of `chunk` tokens, as the engine's chunked prefill does."""
    spec, bs = model.kv_cache_spec(model.config), 16
    blocks = -(-len(ids) // bs)
    caches = [(torch.zeros(blocks, bs, spec.num_kv_heads, spec.head_dim),
               torch.zeros(blocks, bs, spec.num_kv_heads, spec.head_dim)) for _ in range(spec.num_layers)]
    backend, table = CpuAttentionBackend(), torch.arange(blocks, dtype=torch.int32)[None]
    for s in range(0, len(ids), chunk):
        e = min(s + chunk, len(ids))
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, e - s], dtype=torch.int32), seq_lens=torch.tensor([e], dtype=torch.int32),
            block_table=table, slot_mapping=torch.arange(s, e), max_query_len=e - s, max_seq_len=e,
            query_lens_cpu=[e - s], seq_lens_cpu=[e])
        hidden = model(torch.tensor(ids[s:e]), torch.arange(s, e), caches, meta, backend)
        yield model.compute_logits(hidden).log_softmax(-1)


def compare(dense: LlamaForCausalLM, int8: LlamaForCausalLM, ids: list[int], start: int) -> dict[str, Any]:
    """Both models read `ids` teacher-forced; sums over the tokens from position `start` on (row r of a
    chunk's log-probabilities predicts token r + 1), accumulated chunk by chunk to bound the memory."""
    out: dict[str, Any] = {"tokens": 0, "dense_nll": 0.0, "int8_nll": 0.0, "dense_top1_is_target": 0,
                           "top1_agree": 0, "abs_logprob_drift": [], "kl_sum": 0.0}
    pos = 0
    for d, q in zip(next_token_logprobs(dense, ids), next_token_logprobs(int8, ids), strict=True):
        n = d.shape[0]
        lo, hi = max(start - 1 - pos, 0), min(n, len(ids) - 1 - pos)
        if lo < hi:
            d, q, target = d[lo:hi], q[lo:hi], torch.tensor(ids[pos + 1 + lo : pos + 1 + hi])
            rows = torch.arange(hi - lo)
            out["tokens"] += hi - lo
            out["dense_nll"] -= float(d[rows, target].sum())
            out["int8_nll"] -= float(q[rows, target].sum())
            out["dense_top1_is_target"] += int((d.argmax(-1) == target).sum())
            out["top1_agree"] += int((d.argmax(-1) == q.argmax(-1)).sum())
            out["abs_logprob_drift"] += (d[rows, target] - q[rows, target]).abs().tolist()
            out["kl_sum"] += float((d.exp() * (d - q)).sum())
        pos += n
    return out


def quality(answers: dict[str, list[list[int]]], max_tokens: int) -> dict[str, Any]:
    src = resolve_model(MODEL)
    dense = load_model(src, torch.float32).model
    t0 = time.perf_counter()
    int8 = load_model(src, torch.float32, quantization="int8").model
    load_int8_s = time.perf_counter() - t0
    prompts = [compare(dense, int8, ids, len(ids) - max_tokens) for ids in answers["none"]]
    drift = [x for p in prompts for x in p["abs_logprob_drift"]]
    n = sum(p["tokens"] for p in prompts)
    free = [free_running(a, b, max_tokens) for a, b in zip(answers["none"], answers["int8"], strict=True)]
    tok = load_config_and_tokenizer(src)[1]
    text = compare(dense, int8, tok.encode(TEXT.read_text()), 1)
    return {
        "load_int8_s": load_int8_s,
        "prompt_set": {"prompts": len(prompts), "tokens": n,
                       "dense_reproduces_server": sum(p["dense_top1_is_target"] for p in prompts) / n,
                       "teacher_forced_top1_agreement": sum(p["top1_agree"] for p in prompts) / n,
                       "mean_abs_logprob_drift": sum(drift) / n, "max_abs_logprob_drift": max(drift),
                       "mean_kl": sum(p["kl_sum"] for p in prompts) / n},
        "free_running": {"identical_answers": sum(f["identical"] for f in free),
                         "mean_common_prefix": sum(f["prefix"] for f in free) / len(free),
                         "positionwise_agreement": sum(f["same"] for f in free) / (len(free) * max_tokens)},
        "perplexity": {"tokens": text["tokens"], "dense": math.exp(text["dense_nll"] / text["tokens"]),
                       "int8": math.exp(text["int8_nll"] / text["tokens"]),
                       "top1_agreement": text["top1_agree"] / text["tokens"],
                       "mean_abs_logprob_drift": sum(text["abs_logprob_drift"]) / text["tokens"],
                       "mean_kl": text["kl_sum"] / text["tokens"]},
    }


def free_running(dense: list[int], int8: list[int], max_tokens: int) -> dict[str, int]:
    """Two greedy answers (prompt ids + `max_tokens` generated ids) to the same prompt, side by side."""
    a, b = dense[-max_tokens:], int8[-max_tokens:]
    prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), max_tokens)
    return {"identical": int(a == b), "prefix": prefix, "same": sum(x == y for x, y in zip(a, b, strict=True))}


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    served = {mode: await serve_mode(mode, a, work) for mode in MODES}
    res: dict[str, Any] = {"modes": {m: {k: v for k, v in r.items() if k != "answers"} for m, r in served.items()}}
    res["quality"] = quality({m: r["answers"] for m, r in served.items()}, a.max_tokens)
    return res


def table(res: dict[str, Any]) -> str:
    c, q = res["config"], res["quality"]
    rows = [f"SmolLM2-135M-Instruct, `tandem serve --dtype float32` with and without `--quantization int8`; "
            f"1-minute load average {res['load_average'][0]:.2f} before, {res['load_average'][1]:.2f} after.", ""]
    if not c["skip_speed"]:
        rows += [f"Single stream: one request at a time, {c['output_len']} tokens after a {c['input_len']}-token "
                 f"prompt. Batch: {2 * c['batch']} requests, concurrency {c['batch']}.", "",
                 "| quantization | single-stream decode tok/s | single TTFT p50 (ms) | batch output tok/s | "
                 "batch TTFT p50 (ms) | start to healthy (s) |", "|---|---|---|---|---|---|"]
        for m, r in res["modes"].items():
            rows.append(f"| {m} | {r['single']['decode_tok_s']:.1f} | {r['single']['ttft_p50_ms']:.0f} | "
                        f"{r['batch']['output_tok_s']:.1f} | {r['batch']['ttft_p50_ms']:.0f} | {r['startup_s']:.1f} |")
        rows.append("")
    p, f, t = q["prompt_set"], q["free_running"], q["perplexity"]
    rows += [f"Quality: {p['prompts']} prompts x {c['max_tokens']} greedy tokens, and perplexity on "
             f"{t['tokens']} tokens of bench/data/alice_chapter1.txt.", "",
             "| measure | value |", "|---|---|",
             f"| teacher-forced top-1 agreement with dense | {p['teacher_forced_top1_agreement']:.1%} |",
             f"| free-running: identical answers | {f['identical_answers']} / {p['prompts']} |",
             f"| free-running: mean tokens before the first difference | {f['mean_common_prefix']:.1f} |",
             f"| mean / max abs logprob drift of dense's token (nats) | {p['mean_abs_logprob_drift']:.4f} / "
             f"{p['max_abs_logprob_drift']:.3f} |",
             f"| mean KL(dense, int8) per token (nats) | {p['mean_kl']:.5f} |",
             f"| perplexity dense / int8 | {t['dense']:.3f} / {t['int8']:.3f} ({t['int8'] / t['dense'] - 1:+.2%}) |",
             f"| text: top-1 agreement, mean KL | {t['top1_agreement']:.1%}, {t['mean_kl']:.5f} |",
             f"| load with int8 quantization (s) | {q['load_int8_s']:.1f} |"]
    return "\n".join(rows) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(res["modes"])
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    if not res["config"]["skip_speed"]:
        for ax, (key, metric, title) in zip(axes[:2], (("single", "decode_tok_s", "single-stream decode tok/s"),
                                                     ("batch", "output_tok_s", "batch output tok/s")), strict=True):
            ax.bar(modes, [res["modes"][m][key][metric] for m in modes], color=["#888", "#2a7"])
            ax.set_title(title, fontsize=10)
    t = res["quality"]["perplexity"]
    axes[2].bar(modes, [t["dense"], t["int8"]], color=["#888", "#2a7"])
    axes[2].set_title(f"perplexity, {t['tokens']} tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens of the speed runs (~)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens of the speed runs")
    ap.add_argument("--single-requests", type=int, default=4, help="single-stream requests, one at a time")
    ap.add_argument("--batch", type=int, default=32, help="concurrency of the batch run (2x as many requests)")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per quality prompt")
    ap.add_argument("--skip-speed", action="store_true", help="quality only")
    ap.add_argument("--name", default="quantization", help="result name: another machine's beside this one")
    a = ap.parse_args()
    return bench_main(a.name, a, run, table, plot)


if __name__ == "__main__":
    raise SystemExit(main())
