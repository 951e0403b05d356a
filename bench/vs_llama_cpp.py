"""tandem's `--quantization gguf` against llama.cpp on the same GGUF file (SmolLM2-135M-Instruct, Q4_1
projections and a Q8_0 embedding/head), through PyPI's `llama-cpp-python`.

Quality: perplexity of bench/data/alice_chapter1.txt (chapter I of "Alice's Adventures in Wonderland",
~2,900 tokens) in windows of --ctx tokens advanced by --stride: each window scores its last `stride`
tokens given the ones before them (the first window all but its first token). Both read the same token
ids (the model's own tokenizer), so the numbers differ only by how each computes. Acceptance: tandem gguf
within 1% of llama.cpp. tandem dense (transformers' dequantization of the same file) is there for scale.

Speed (a quiet machine only, else noise): single-stream decode (one request, --output-len tokens after a
--input-len-token prompt) and TTFT for tandem dense, tandem gguf (float32 and float16 KV cache), tandem int8
(each a real `tandem serve --num-threads T`), transformers' `generate` and llama.cpp (float16 KV cache, its
default), all with T threads.

Kernel: the gguf projections' time per call at 1..64 rows, C kernel against dequantize + torch's matmul,
on SmolLM2's shapes (where kernels/gguf_matmul.py's DENSE_FROM_ROWS comes from).

    make bench-deps                              # once: builds llama-cpp-python into .venv (cmake, minutes)
    .venv/bin/python bench/vs_llama_cpp.py                      # everything, on a quiet machine
    .venv/bin/python bench/vs_llama_cpp.py --parts quality      # perplexity only; any machine
    .venv/bin/python bench/vs_llama_cpp.py --smoke              # tiny sizes: checks that it runs

Writes bench/results/vs_llama_cpp.{json,md,png}, or `--name`'s (not named llama_cpp.py: that would shadow the library).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import MODEL, bench_main, describe, text
from quantization import TEXT, next_token_logprobs

from tandem_engine.cpu_budget import plan_threads
from tandem_engine.kernels.gguf_matmul import GGUFLinear
from tandem_engine.models.llama import DecoderLayer, LlamaForCausalLM
from tandem_engine.models.loader import load_config_and_tokenizer, load_model, resolve_model, weights_dir
from tandem_router.procs import tandem_child

PARTS = ("quality", "speed", "in_process", "kernel")
# tandem's single-stream runs: name -> (--quantization, other flags). llama.cpp keeps its KV cache in float16
# by default (llama-cpp-python's Llama() as called here), so "gguf f16 KV" is tandem set up as it is.
TANDEM_RUNS = {"none": ("none", []), "gguf": ("gguf", []), "gguf f16 KV": ("gguf", ["--kv-cache-dtype", "float16"]),
               "int8": ("int8", [])}


def llama(a: argparse.Namespace, n_ctx: int, logits_all: bool) -> Any:
    """llama.cpp on the model's GGUF file. Without --llama-extra-bufts its weights stay in plain CPU
    buffers: the extra buffer types (AMX tiles on CPUs that list amx_int8) crashed llama.cpp's Q4_1 matmul
    with a segmentation fault on our VMs, and llama-cpp-python's Llama() has no argument for them."""
    try:
        import llama_cpp.llama_cpp as lib
        from llama_cpp import Llama
    except ImportError as e:
        raise SystemExit("llama-cpp-python is not installed: run `make bench-deps` first") from e
    if not a.llama_extra_bufts and not getattr(lib.llama_model_default_params, "plain_buffers", False):
        default = lib.llama_model_default_params

        def plain() -> Any:
            params = default()
            params.use_extra_bufts = False
            return params
        plain.plain_buffers = True  # type: ignore[attr-defined]
        lib.llama_model_default_params = plain
    return Llama(model_path=str(resolve_model(MODEL).path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=a.threads,
                 n_threads_batch=a.threads, logits_all=logits_all, verbose=False)


def windows(n: int, ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) of each window over n tokens: position p is scored as the
    prediction of token p from tokens start..p-1, each token once."""
    out, scored = [], 1
    for start in range(0, n, stride):
        end = min(start + ctx, n)
        if end > scored:
            out.append((start, end, scored))
            scored = end
        if end == n:
            break
    return out


def nll_of_window(logprobs: np.ndarray, window: list[int], start: int, first: int) -> float:
    """-log p of the window's tokens from absolute position `first` on; the window holds tokens
    start..start + len(window) - 1, and row r of `logprobs` [len(window), vocab] predicts token start + r + 1."""
    pos = np.arange(first, start + len(window))
    return float(-logprobs[pos - 1 - start, np.array(window)[pos - start]].sum())


def tandem_perplexity(model: LlamaForCausalLM, ids: list[int], ctx: int, stride: int) -> float:
    nll = 0.0
    for s, e, first in windows(len(ids), ctx, stride):
        lp = torch.cat(list(next_token_logprobs(model, ids[s:e], chunk=ctx))).numpy()
        nll += nll_of_window(lp, ids[s:e], s, first)
    return math.exp(nll / (len(ids) - 1))


def llama_cpp_perplexity(llm: Any, ids: list[int], ctx: int, stride: int) -> float:
    nll = 0.0
    for s, e, first in windows(len(ids), ctx, stride):
        llm.reset()
        llm.eval(ids[s:e])
        logits = torch.from_numpy(np.array(llm.scores[: e - s], dtype=np.float32))
        nll += nll_of_window(logits.log_softmax(-1).numpy(), ids[s:e], s, first)
    return math.exp(nll / (len(ids) - 1))


def quality(a: argparse.Namespace) -> dict[str, Any]:
    src = resolve_model(MODEL)
    ids = load_config_and_tokenizer(src)[1].encode(TEXT.read_text())[: a.text_tokens]
    torch.set_num_threads(a.threads)
    res: dict[str, Any] = {"tokens": len(ids), "ctx": a.ctx, "stride": a.stride}
    for mode in ("gguf", "none"):
        model = load_model(src, torch.float32, quantization=mode).model
        res[f"tandem_{mode}"] = tandem_perplexity(model, ids, a.ctx, a.stride)
        if mode == "gguf":
            # A window is one prefill, whose projections dequantize and run float32 GEMMs; decode steps (under
            # DENSE_FROM_ROWS rows) quantize each row's activations to int8 instead. That is per row, so
            # sending every row of the window through the kernel scores each token as a decode step would.
            for proj in kernel_projections(model):
                proj.dense_from_rows = 1 << 30
            res["tandem_decode_step"] = tandem_perplexity(model, ids, a.ctx, a.stride)
        del model
    res["llama_cpp"] = llama_cpp_perplexity(llama(a, a.ctx, logits_all=True), ids, a.ctx, a.stride)
    res["gguf_vs_llama_cpp"] = res["tandem_gguf"] / res["llama_cpp"] - 1
    res["gguf_decode_vs_llama_cpp"] = res["tandem_decode_step"] / res["llama_cpp"] - 1
    return res


def kernel_projections(model: LlamaForCausalLM) -> list[GGUFLinear]:
    """Every projection of a `--quantization gguf` model that runs the C kernel, the head included."""
    projs = [p for layer in model.layers if isinstance(layer, DecoderLayer) for p in layer.quantized.values()]
    return [p for p in [*projs, model.quantized_head] if isinstance(p, GGUFLinear)]


def prompt_ids(a: argparse.Namespace) -> list[int]:
    tok = load_config_and_tokenizer(resolve_model(MODEL))[1]
    ids: list[int] = tok.encode(text(a.input_len * 2, seed=0))[: a.input_len]
    return ids


def tandem_server(name: str, a: argparse.Namespace, work: Path) -> tuple[Any, float]:
    """A real `tandem serve` for run `name` of TANDEM_RUNS, healthy, and its start-up seconds."""
    mode, flags = TANDEM_RUNS[name]
    tag = name.replace(" ", "-")
    server = tandem_child(f"serve-{tag}", "serve", [
        "--model", MODEL, "--dtype", "float32", "--quantization", mode, "--num-threads", str(a.threads),
        "--max-num-seqs", "4", "--kv-cache-gib", "0.5", *flags], work / f"serve-{tag}.log").start()
    try:
        return server, server.wait_healthy(3600)
    except BaseException:
        server.stop(60)
        raise


async def tandem_once(url: str, a: argparse.Namespace, seed: int) -> tuple[float, float, int]:
    """One streamed request through the HTTP API: (TTFT ms, decode tok/s from its median inter-token gap,
    failed requests)."""
    from tandem_router.bench import bench, build_parser

    args = build_parser().parse_args([
        "--url", url, "--workload", "random", "--concurrency", "1", "--num-prompts", "1",
        "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--seed", str(seed)])
    s = (await bench(args))[0]["summary"]
    return s["ttft_ms"]["p50"], 1000 / s["itl_ms"]["p50"], s["failed"]


def transformers_once(hf: Any, a: argparse.Namespace, ids: list[int]) -> tuple[float, float]:
    """(TTFT ms, decode tok/s) of transformers' greedy `generate`: a 1-token run, then the whole one."""
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    hf.generate(x, max_new_tokens=1, do_sample=False, pad_token_id=0)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf.generate(x, max_new_tokens=a.output_len, min_new_tokens=a.output_len, do_sample=False, pad_token_id=0)
    return 1000 * ttft, (a.output_len - 1) / (time.perf_counter() - t0 - ttft)


def llama_cpp_once(llm: Any, a: argparse.Namespace, ids: list[int]) -> tuple[float, float]:
    """(TTFT ms, decode tok/s) of one greedy llama.cpp generation."""
    llm.reset()  # else generate() reuses the previous run's evaluated prompt
    t0 = time.perf_counter()
    stamps = []
    for _tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):  # greedy, past any end-of-text
        stamps.append(time.perf_counter())
        if len(stamps) == a.output_len:
            break
    return 1000 * (stamps[0] - t0), (len(stamps) - 1) / (stamps[-1] - stamps[0])


async def speed(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every engine up at once (idle ones take no CPU), then rounds of one request each, in turn: a machine
    whose speed drifts over minutes (a shared VM's does, by 10-30%) moves every engine of a round alike, and
    the ratio to llama.cpp is taken round by round. Round 0 warms up and is not counted."""
    from transformers import AutoModelForCausalLM

    ids = prompt_ids(a)
    torch.set_num_threads(a.threads)
    servers: dict[str, Any] = {}
    startup: dict[str, float] = {}
    try:
        for name in TANDEM_RUNS:
            servers[name], startup[name] = tandem_server(name, a, work)
        hf = AutoModelForCausalLM.from_pretrained(weights_dir(resolve_model(MODEL)), dtype=torch.float32).eval()
        llm = llama(a, a.input_len + a.output_len + 16, logits_all=False)
        runs: dict[str, list[tuple[float, float]]] = {}
        failed = dict.fromkeys(TANDEM_RUNS, 0)
        for r in range(a.requests + 1):
            for name, server in servers.items():
                ttft, tok_s, bad = await tandem_once(server.url, a, seed=r)
                failed[name] += bad
                runs.setdefault(f"tandem {name}", []).append((ttft, tok_s))
            runs.setdefault("transformers", []).append(transformers_once(hf, a, ids))
            runs.setdefault("llama.cpp", []).append(llama_cpp_once(llm, a, ids))
    finally:
        for server in servers.values():
            server.stop(60)
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        counted = rs[1:]
        out[name] = {"ttft_ms": float(np.median([r[0] for r in counted])),
                     "decode_tok_s": float(np.median([r[1] for r in counted])),
                     "rounds_decode_tok_s": [r[1] for r in counted]}
        tandem = name.removeprefix("tandem ")
        if tandem in TANDEM_RUNS:
            out[name] |= {"startup_s": startup[tandem], "failed": failed[tandem]}
    for name in (n for n, (mode, _) in TANDEM_RUNS.items() if mode == "gguf"):
        ratios = [t / ll for t, ll in zip(out[f"tandem {name}"]["rounds_decode_tok_s"],
                                          out["llama.cpp"]["rounds_decode_tok_s"], strict=True)]
        out[f"tandem {name}"]["vs_llama_cpp_rounds"] = ratios
        out[f"tandem {name}"]["vs_llama_cpp"] = float(np.median(ratios))
    return out


def in_process(a: argparse.Namespace) -> dict[str, Any]:
    """The engine alone, without HTTP: an in-process EngineCore (--quantization gguf, float32 and float16 KV)
    decoding one sequence, a step at a time, in turn with llama.cpp producing one token, on the same prompt,
    so that both see the same moment of the machine. ms per token, medians over --output-len tokens."""
    from tandem_engine.config import EngineConfig
    from tandem_engine.core.engine_core import EngineCore
    from tandem_engine.request import Request
    from tandem_engine.sampling_params import SamplingParams
    from tandem_engine.worker.model_runner import ModelRunner

    torch.set_num_threads(a.threads)
    ids = prompt_ids(a)
    cores = {kv: EngineCore(EngineConfig(model=MODEL, dtype="float32", quantization="gguf", num_threads=a.threads,
                                         max_num_seqs=4, kv_cache_dtype=kv, kv_cache_gib=0.5), runner=ModelRunner)
             for kv in ("float32", "float16")}
    try:
        llm = llama(a, a.input_len + a.output_len + 16, logits_all=False)
        for c in cores.values():
            c.add_request(Request("a", ids, SamplingParams(max_tokens=a.output_len + 8, temperature=0,
                                                           ignore_eos=True), [0]))
            while not c.step():  # the prefill, to its first token
                pass
        llm.reset()
        tokens = llm.generate(ids, top_k=1, temp=0.0, reset=True)
        next(tokens)  # the prefill, to its first token
        ms: dict[str, list[float]] = {"tandem gguf": [], "tandem gguf f16 KV": [], "llama.cpp": []}
        for _ in range(a.output_len - 1):
            for name, step in (("tandem gguf", cores["float32"].step), ("llama.cpp", lambda: next(tokens)),
                               ("tandem gguf f16 KV", cores["float16"].step)):
                t0 = time.perf_counter()
                step()
                ms[name].append(1000 * (time.perf_counter() - t0))
    finally:
        for c in cores.values():
            c.shutdown()
    out: dict[str, Any] = {n: {"ms_per_token": float(np.median(v)), "p99_ms": float(np.percentile(v, 99))}
                           for n, v in ms.items()}
    for n in ("tandem gguf", "tandem gguf f16 KV"):
        out[n]["vs_llama_cpp"] = out["llama.cpp"]["ms_per_token"] / out[n]["ms_per_token"]
    return out


def kernel_rows(a: argparse.Namespace) -> dict[str, Any]:
    """ms per call of one layer's four projections and the head, kernel vs dequantize + matmul, by rows."""
    torch.set_num_threads(a.threads)
    model = load_model(resolve_model(MODEL), torch.float32, quantization="gguf").model
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer)
    projs = {**{n: p for n, p in layer.quantized.items() if isinstance(p, GGUFLinear)},
             "head": model.quantized_head}
    out: dict[str, Any] = {}
    for rows in a.kernel_rows:
        for path, threshold in (("kernel", 10**9), ("dense", 0)):
            times = {}
            for name, p in projs.items():
                assert isinstance(p, GGUFLinear)
                p.dense_from_rows = threshold  # force one path
                x = torch.randn(rows, p.in_features)
                p(x)
                t0, n = time.perf_counter(), 0
                while time.perf_counter() - t0 < a.kernel_seconds:
                    p(x)
                    n += 1
                times[name] = 1000 * (time.perf_counter() - t0) / n
            out.setdefault(str(rows), {})[path] = times
    return out


# OpenMP settings that llama.cpp's threads, in this process, obey as much as tandem's: passive waiting at its
# many barriers a token cost llama.cpp three quarters of its speed on the AMD EPYC (2026-12-06).
OPENMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"threads": a.threads,
                           "openmp_env": {k: os.environ[k] for k in OPENMP_VARS if k in os.environ}}
    if res["openmp_env"]:
        print(f"warning: {res['openmp_env']} in the environment also applies to llama.cpp in this process",
              flush=True)
    if "quality" in a.parts:
        res["quality"] = quality(a)
    if "speed" in a.parts:
        res["speed"] = await speed(a, work)
    if "in_process" in a.parts:
        res["in_process"] = in_process(a)
    if "kernel" in a.parts:
        res["kernel"] = kernel_rows(a)
    return res


def table(res: dict[str, Any]) -> str:
    c = res["config"]
    where = f", {describe(res['machine'])}" if "machine" in res else ""
    rows = [f"SmolLM2-135M-Instruct Q4_1 GGUF, {res['threads']} threads{where}; 1-minute load average "
            f"{res['load_average'][0]:.2f} before, {res['load_average'][1]:.2f} after."
            + (f" OpenMP environment: {res['openmp_env']} (llama.cpp obeys it too)." if res.get("openmp_env") else ""),
            ""]
    if "quality" in res:
        q = res["quality"]
        rows += [f"Perplexity of {q['tokens']} tokens of bench/data/alice_chapter1.txt, windows of {q['ctx']} "
                 f"tokens advanced by {q['stride']}.", "", "| engine | perplexity |", "|---|---|",
                 f"| llama.cpp (llama-cpp-python) | {q['llama_cpp']:.3f} |",
                 f"| tandem --quantization gguf, prefill path (float32 activations) | {q['tandem_gguf']:.3f} "
                 f"({q['gguf_vs_llama_cpp']:+.2%}) |",
                 *([f"| tandem --quantization gguf, decode path (int8 activations at every token) | "
                    f"{q['tandem_decode_step']:.3f} ({q['gguf_decode_vs_llama_cpp']:+.2%}) |"]
                   if "tandem_decode_step" in q else []),
                 f"| tandem dense (dequantized file) | {q['tandem_none']:.3f} |", ""]
    if "speed" in res:
        rows += [f"Single stream: {c['output_len']} tokens after a {c['input_len']}-token prompt, medians of "
                 f"{c['requests']} rounds (each engine one request per round, in turn, after a warm-up round); "
                 "decode tok/s against llama.cpp's of the same round, median (range).", "",
                 "| engine | decode tok/s | TTFT (ms) | vs llama.cpp |", "|---|---|---|---|"]
        for n, r in res["speed"].items():
            vs = (f"{r['vs_llama_cpp']:.3f}x ({min(r['vs_llama_cpp_rounds']):.3f}-"
                  f"{max(r['vs_llama_cpp_rounds']):.3f})" if "vs_llama_cpp" in r else "")
            rows.append(f"| {n} | {r['decode_tok_s']:.1f} | {r['ttft_ms']:.0f} | {vs} |")
        rows.append("")
    if "in_process" in res:
        rows += ["In process, without HTTP: an EngineCore's decode step and llama.cpp's next token in turn, "
                 f"{c['output_len'] - 1} tokens each after the same {c['input_len']}-token prompt (medians).", "",
                 "| engine | ms per token | p99 ms | tok/s | vs llama.cpp |", "|---|---|---|---|---|"]
        for n, r in res["in_process"].items():
            vs = f"{r['vs_llama_cpp']:.3f}x" if "vs_llama_cpp" in r else ""
            rows.append(f"| {n} | {r['ms_per_token']:.2f} | {r['p99_ms']:.2f} | {1000 / r['ms_per_token']:.1f} "
                        f"| {vs} |")
        rows.append("")
    if "kernel" in res:
        names = list(next(iter(res["kernel"].values()))["kernel"])
        rows += ["ms per call, C kernel / dequantize + matmul, by rows:", "",
                 "| rows | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for r, v in res["kernel"].items():
            rows.append(f"| {r} | " + " | ".join(f"{v['kernel'][n]:.3f} / {v['dense'][n]:.3f}" for n in names) + " |")
    return "\n".join(rows) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    if "speed" in res:
        names = list(res["speed"])
        axes[0].bar(names, [res["speed"][n]["decode_tok_s"] for n in names], color="#2a7")
        axes[0].set_title("single-stream decode tok/s", fontsize=10)
        axes[0].tick_params(axis="x", labelrotation=20, labelsize=8)
    if "quality" in res:
        q = res["quality"]
        axes[1].bar(["llama.cpp", "tandem gguf", "tandem dense"], [q["llama_cpp"], q["tandem_gguf"], q["tandem_none"]],
                    color=["#888", "#2a7", "#57a"])
        axes[1].set_title(f"perplexity, {q['tokens']} tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--threads", type=int, default=plan_threads(1, None).threads, help="for every engine")
    ap.add_argument("--ctx", type=int, default=512, help="perplexity window (tokens)")
    ap.add_argument("--stride", type=int, default=256, help="perplexity window advance (tokens)")
    ap.add_argument("--text-tokens", type=int, default=100_000, help="score at most this many tokens of the text")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens of the speed runs")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens of the speed runs")
    ap.add_argument("--requests", type=int, default=5,
                    help="single-stream rounds (a request per engine each), after a warm-up")
    ap.add_argument("--kernel-rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 64])
    ap.add_argument("--kernel-seconds", type=float, default=1.0, help="timing per projection and path")
    ap.add_argument("--llama-extra-bufts", action="store_true",
                    help="let llama.cpp use its extra weight buffer types (AMX, repacking)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check that everything runs")
    ap.add_argument("--name", default="vs_llama_cpp", help="result name: another machine's beside this one")
    a = ap.parse_args()
    if a.smoke:
        a.ctx, a.stride, a.text_tokens, a.input_len, a.output_len, a.requests = 64, 32, 160, 32, 8, 1
        a.kernel_rows, a.kernel_seconds = [1, 16], 0.05
    return bench_main(a.name, a, run, table, plot)


if __name__ == "__main__":
    raise SystemExit(main())
