"""Structured outputs: what a JSON schema costs, on one `tandem serve` of the embedded model.

Every request's prompt is new to the engine (no prefix-cache hit favours either side), and the TTFT is that of
the first chunk with text.

1. Grammar compile time for the schemas used, in process: the frontend's check (llguidance's JSON-schema
   compiler and validation, once per schema) and the engine's compile (the matcher, once per schema), and the
   per-token mask (computing the allowed tokens at each step of a valid answer), median and p99.
2. Time to first token of one request at a time: unconstrained, with a schema the engine has never seen
   (cold: compiled on the grammar thread before its first step), and with one it has (cached).
3. Throughput: `--streams` streamed chat requests at once (sampled, `--max-tokens` each, ignore_eos), without
   a schema and with one (a list of at least 50 records: no answer completes inside the budget, so both
   sides generate the same tokens), in alternating rounds; generated tokens per second of the whole batch,
   TTFT and ITL per stream. The ratio is the median round's with / without.

    .venv/bin/python bench/structured_outputs.py [--streams 32 --max-tokens 128 --rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
from harness import MODEL, bench_main, describe, save_plot

from tandem_router.bench.stats import describe as stats
from tandem_router.procs import stop_all, tandem_child

RECORD = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}}, "city": {"type": "string"}},
    "required": ["name", "age", "role", "tags", "city"], "additionalProperties": False}
LONG = {"type": "object", "properties": {"people": {"type": "array", "items": RECORD, "minItems": 50}},
        "required": ["people"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "role": {"enum": ["admin", "user", "guest"]},
    "hobbies": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                "required": ["city", "country"], "additionalProperties": False},
    "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    "required": ["name", "age", "role", "hobbies", "address", "nickname"], "additionalProperties": False}
SCHEMAS = {"person": PERSON, "long_list": LONG}
INSTANCES = {"person": {"name": "Ada Lovelace", "age": 36, "role": "admin", "hobbies": ["math", "poetry"],
                        "address": {"city": "London", "country": "UK"}, "nickname": None},
             "long_list": {"people": [{"name": f"P{i}", "age": 20 + i, "role": "user", "tags": ["a", "b"],
                                       "city": "Oslo"} for i in range(50)]}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="rounds of (without, with) the schema")
    p.add_argument("--ttft-repeats", type=int, default=5)
    return p.parse_args()


def compile_times() -> dict[str, Any]:
    """Per schema: the frontend's check and the engine's compile (ms), and the per-token mask (us)."""
    import llguidance
    import llguidance.numpy
    from transformers import AutoTokenizer

    from tandem_engine.config import EngineConfig
    from tandem_engine.entrypoints.structured import JSON_OPTIONS
    from tandem_engine.models.loader import resolve_model, weights_dir

    cfg = EngineConfig()
    model_dir = weights_dir(resolve_model(cfg.model, cfg.cache_path))
    hf = AutoTokenizer.from_pretrained(model_dir)
    tok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=49152, eos_token=[2])
    out: dict[str, Any] = {}
    for name, schema in SCHEMAS.items():
        checks, builds = [], []
        for k in range(5):
            fresh = {**schema, "title": f"{name} {k}"}  # a new grammar each time: nothing cached
            t0 = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(fresh, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
            assert llguidance.LLMatcher.validate_grammar(grammar) == ""
            t1 = time.perf_counter()
            matcher = llguidance.LLMatcher(tok, grammar)
            mask = llguidance.numpy.allocate_token_bitmask(1, 49152)
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            t2 = time.perf_counter()
            checks.append(t1 - t0)
            builds.append(t2 - t1)
        ids = hf.encode(json.dumps(INSTANCES[name], separators=(",", ":")), add_special_tokens=False)
        fills = []
        for t in ids:
            t0 = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            fills.append(time.perf_counter() - t0)
            assert matcher.consume_token(t), name
        out[name] = {"frontend_check_ms": stats(checks), "engine_compile_ms": stats(builds),
                     "mask_us": stats(fills, 1e6), "answer_tokens": len(ids)}
    return out


async def stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat request: its TTFT, its inter-token gaps, its generated tokens."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any((c.get("delta") or {}).get("content") for c in event.get("choices", [])):
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)], "tokens": tokens,
            "end": stamps[-1]}


def body(i: int, max_tokens: int, schema: dict[str, Any] | None, prompt: str) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                         "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True,
                         "stream_options": {"include_usage": True}}
    if schema is not None:
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    return b


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    compiled = compile_times()
    print(json.dumps(compiled, indent=1), flush=True)
    engine = tandem_child("engine", "serve", ["--model", MODEL], work / "engine.log", die_with_parent=True).start()
    try:
        await asyncio.to_thread(engine.wait_healthy, 300)
        url = engine.url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
            for i in range(2):  # warm-up: both paths, and the grammar library's tokenizer in the engine
                await stream(http, url, body(i, 16, None, "Hello"))
                await stream(http, url, body(i, 16, {**PERSON, "title": "warm"}, "A person as JSON."))
            ttft: dict[str, list[float]] = {"unconstrained": [], "cold schema": [], "cached schema": []}
            for k in range(a.ttft_repeats):
                # A prompt of its own for each request (none hits the prefix cache), all of one length.
                def prompt(tag: str, k: int = k) -> str:
                    return f"Request {tag}{k}: describe a person as JSON."
                ttft["unconstrained"].append((await stream(http, url, body(k, 8, None, prompt("u"))))["ttft"])
                cold = {**PERSON, "title": f"cold {k}"}  # a grammar the engine has not compiled
                ttft["cold schema"].append((await stream(http, url, body(k, 8, cold, prompt("c"))))["ttft"])
                ttft["cached schema"].append((await stream(http, url, body(k, 8, PERSON, prompt("h"))))["ttft"])
            rounds: list[dict[str, Any]] = []
            for r in range(a.rounds):
                for mode, schema in (("unconstrained", None), ("json_schema", LONG)):
                    t0 = time.perf_counter()
                    # Prompts of one length, none seen before (no prefix-cache hit on either side).
                    prompts = [f"Round {mode[0]}{r}, list {i}: people as JSON." for i in range(a.streams)]
                    got = await asyncio.gather(*[stream(http, url, body(1000 * r + i, a.max_tokens, schema, p))
                                                 for i, p in enumerate(prompts)])
                    wall = max(g["end"] for g in got) - t0
                    tokens = sum(g["tokens"] for g in got)
                    rounds.append({"round": r, "mode": mode, "tokens": tokens, "seconds": wall,
                                   "tok_s": tokens / wall, "ttft_ms": stats([g["ttft"] for g in got]),
                                   "itl_ms": stats([x for g in got for x in g["itl"]])})
                    print(f"round {r} {mode}: {tokens / wall:.1f} tok/s", flush=True)
    finally:
        stop_all([engine])
    ratios = [s["tok_s"] / u["tok_s"] for u, s in zip(rounds[::2], rounds[1::2], strict=True)]
    return {"compile": compiled, "ttft_single_ms": {k: stats(v) for k, v in ttft.items()}, "rounds": rounds,
            "throughput_ratio": {"per_round": ratios, "median": statistics.median(ratios)}}


def table(res: dict[str, Any]) -> str:
    c = res["config"]
    med = res["throughput_ratio"]["median"]
    lines = [f"# Structured outputs ({describe(res['machine'])}, load {res['load_average'][0]:.2f} at start)", "",
             f"`{res['command']}`, {res['time']}", "",
             f"{c['streams']} streams x {c['max_tokens']} tokens, with a JSON schema against without, "
             f"{c['rounds']} alternating rounds: **throughput ratio {med:.3f}** (median round; target >= 0.90)", "",
             "| round | mode | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |", "| --- | --- | --- | --- | --- |"]
    for r in res["rounds"]:
        lines.append(f"| {r['round']} | {r['mode']} | {r['tok_s']:.1f} | {r['ttft_ms']['p50']:.0f} / "
                     f"{r['ttft_ms']['p99']:.0f} | {r['itl_ms']['p50']:.1f} / {r['itl_ms']['p99']:.1f} |")
    lines += ["", "One request at a time (8 tokens), TTFT:", "", "| request | p50 ms | p99 ms |", "| --- | --- | --- |"]
    for k, v in res["ttft_single_ms"].items():
        lines.append(f"| {k} | {v['p50']:.1f} | {v['p99']:.1f} |")
    lines += ["", "Grammar compile (new grammar each time) and per-token mask, in process:", "",
              "| schema | frontend check ms p50 | engine compile ms p50 | mask us p50 / p99 | answer tokens |",
              "| --- | --- | --- | --- | --- |"]
    for k, v in res["compile"].items():
        lines.append(f"| {k} | {v['frontend_check_ms']['p50']:.2f} | {v['engine_compile_ms']['p50']:.2f} | "
                     f"{v['mask_us']['p50']:.0f} / {v['mask_us']['p99']:.0f} | {v['answer_tokens']} |")
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    def draw(ax: Any) -> None:
        for mode, colour in (("unconstrained", "tab:blue"), ("json_schema", "tab:orange")):
            rs = [r for r in res["rounds"] if r["mode"] == mode]
            ax.bar([r["round"] + (0.2 if mode == "json_schema" else -0.2) for r in rs], [r["tok_s"] for r in rs],
                   width=0.4, color=colour, label=mode)
        ax.set_xlabel("round")

    save_plot(path, (6, 3.5), f"{res['config']['streams']} streams: generated tok/s", "tok/s", draw)


if __name__ == "__main__":
    raise SystemExit(bench_main("structured_outputs", parse_args(), run, table, plot))
