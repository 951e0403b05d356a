"""llguidance against xgrammar on the embedded model's tokenizer (why tandem's structured outputs use
llguidance: docs/architecture.md, "Structured outputs"). Per library: building its tokenizer, compiling a
JSON schema (a new grammar each time, and the first mask), and the per-token mask and advance along a valid
answer, median and p99.

xgrammar is not a dependency of tandem; install it beside the venv for this script:

    .venv/bin/pip install --target /tmp/xgr --no-deps xgrammar==0.2.9 apache-tvm-ffi
    PYTHONPATH=/tmp/xgr .venv/bin/python bench/grammar_libraries.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from harness import bench_main, describe, save_plot
from structured_outputs import INSTANCES, PERSON

from tandem_router.bench.stats import describe as stats

VOCAB = 49152  # SmolLM2's


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--compiles", type=int, default=5)
    return p.parse_args()


def measure(build_tokenizer: Any, compile_schema: Any, fill: Any, consume: Any, ids: list[int],
            compiles: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    tok = build_tokenizer()
    tokenizer_s = time.perf_counter() - t0
    times = []
    for k in range(compiles):
        t0 = time.perf_counter()
        state = compile_schema(tok, {**PERSON, "title": f"person {k}"})
        fill(state)
        times.append(time.perf_counter() - t0)
    fills, consumes = [], []
    for t in ids:
        t0 = time.perf_counter()
        allowed = fill(state)
        fills.append(time.perf_counter() - t0)
        assert allowed(t), t
        t0 = time.perf_counter()
        assert consume(state, t)
        consumes.append(time.perf_counter() - t0)
    return {"tokenizer_s": tokenizer_s, "first_compile_ms": times[0] * 1e3, "compile_ms": stats(times[1:]),
            "mask_us": stats(fills, 1e6), "advance_us": stats(consumes, 1e6)}


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    import numpy as np
    from transformers import AutoTokenizer

    from tandem_engine.config import EngineConfig
    from tandem_engine.entrypoints.structured import JSON_OPTIONS
    from tandem_engine.models.loader import resolve_model, weights_dir

    cfg = EngineConfig()
    model_dir = weights_dir(resolve_model(cfg.model, cfg.cache_path))
    hf = AutoTokenizer.from_pretrained(model_dir)
    ids = hf.encode(json.dumps(INSTANCES["person"], separators=(",", ":")), add_special_tokens=False)
    out: dict[str, Any] = {"answer_tokens": len(ids)}

    import llguidance
    import llguidance.numpy

    mask = llguidance.numpy.allocate_token_bitmask(1, VOCAB)

    def llg_fill(m: Any) -> Any:
        llguidance.numpy.fill_next_token_bitmask(m, mask, 0)
        return lambda t: bool((int(mask[0, t // 32]) >> (t % 32)) & 1)

    from importlib.metadata import version

    out["llguidance " + version("llguidance")] = measure(
        lambda: llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=VOCAB, eos_token=[2]),
        lambda tok, s: llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(
            s, defaults=JSON_OPTIONS)),  # type: ignore[arg-type]
        llg_fill, lambda m, t: m.consume_token(t), ids, a.compiles)
    try:
        import xgrammar as xgr
    except ImportError:
        out["xgrammar"] = "not installed (see the docstring)"
        return out
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)

    def xgr_fill(m: Any) -> Any:
        m.fill_next_token_bitmask(bitmask, 0)
        row = np.asarray(bitmask[0])
        return lambda t: bool((int(row[t // 32]) >> (t % 32)) & 1)

    out["xgrammar " + version("xgrammar")] = measure(
        lambda: xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB), max_threads=1),
        lambda comp, s: xgr.GrammarMatcher(comp.compile_json_schema(json.dumps(s), any_whitespace=False,
                                                                    separators=(",", ":"))),
        xgr_fill, lambda m, t: m.accept_token(t), ids, a.compiles)
    return out


def table(res: dict[str, Any]) -> str:
    libs = {k: v for k, v in res.items() if isinstance(v, dict) and "mask_us" in v}
    lines = [f"# Grammar libraries ({describe(res['machine'])}, load {res['load_average'][0]:.2f} at start)", "",
             f"`{res['command']}`, {res['time']}; the person schema, an answer of {res['answer_tokens']} tokens", "",
             "| library | tokenizer s | first compile ms | compile ms p50 | mask us p50 / p99 | advance us p50 / p99 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, v in libs.items():
        lines.append(f"| {name} | {v['tokenizer_s']:.2f} | {v['first_compile_ms']:.1f} | {v['compile_ms']['p50']:.2f} "
                     f"| {v['mask_us']['p50']:.0f} / {v['mask_us']['p99']:.0f} "
                     f"| {v['advance_us']['p50']:.0f} / {v['advance_us']['p99']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    libs = {k: v for k, v in res.items() if isinstance(v, dict) and "mask_us" in v}

    def draw(ax: Any) -> None:
        names = list(libs)
        ax.bar([i - 0.2 for i in range(len(names))], [libs[n]["mask_us"]["p50"] for n in names], 0.4, label="p50")
        ax.bar([i + 0.2 for i in range(len(names))], [libs[n]["mask_us"]["p99"] for n in names], 0.4, label="p99")
        ax.set_xticks(range(len(names)), names)

    save_plot(path, (5, 3.5), "per-token mask", "microseconds", draw)


if __name__ == "__main__":
    raise SystemExit(bench_main("grammar_libraries", parse_args(), run, table, plot))
