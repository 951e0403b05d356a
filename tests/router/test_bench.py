"""`tandem bench`: statistics, workloads, and a run against a test upstream with known timings."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest

from tandem_router.bench import main as bench_main
from tandem_router.bench.client import Record
from tandem_router.bench.stats import describe, percentile, summarize
from tandem_router.bench.workload import random_sessions, shared_prefix_sessions


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.random(n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_summary_of_known_records() -> None:
    recs = [
        Record(
            start=0,
            group=0,
            turn=0,
            ok=True,
            ttft=0.1,
            e2e=1.1,
            itl=[0.5, 0.5],
            output_tokens=3,
            prompt_tokens=10,
        ),
        Record(start=0, group=0, turn=0, ok=True, ttft=0.3, e2e=0.3, output_tokens=1, prompt_tokens=10),
        Record(start=0, group=0, turn=0, ok=False, error="x"),
    ]
    s = summarize(recs, duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["ttft_ms"] == pytest.approx({"mean": 200.0, "p50": 200.0, "p99": 298.0})
    assert s["tpot_ms"]["mean"] == pytest.approx(500.0)  # only the request with >1 token has a TPOT
    assert s["itl_ms"]["p50"] == pytest.approx(500.0)
    assert s["output_throughput"] == pytest.approx(2.0) and s["total_token_throughput"] == pytest.approx(12.0)
    assert describe([])["p50"] != describe([])["p50"]  # NaN when empty


def test_workloads_are_deterministic_and_share_prefixes() -> None:
    assert random_sessions(5, 20, seed=1) == random_sessions(5, 20, seed=1)
    assert random_sessions(5, 20, seed=1) != random_sessions(5, 20, seed=2)
    assert all(len(s.turns[0].split()) == 20 for s in random_sessions(5, 20, seed=1))
    sess = shared_prefix_sessions(num_groups=3, users_per_group=4, turns=2, prefix_len=50, turn_len=5, seed=0)
    assert len(sess) == 12 and all(len(s.turns) == 2 for s in sess)
    systems = {s.group: s.system for s in sess}
    assert len(set(systems.values())) == 3
    assert all(s.system == systems[s.group] for s in sess)
    assert len({tuple(s.turns) for s in sess}) == 12


async def test_bench_run_against_a_test_upstream(upstream, tmp_path: Path) -> None:
    up = await upstream(name="a", tokens=8, token_delay=0.02)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    t0 = time.monotonic()
    code = await asyncio.to_thread(
        bench_main,
        [
            "--url",
            up.url,
            "--workload",
            "shared-prefix",
            "--num-groups",
            "2",
            "--users-per-group",
            "2",
            "--turns",
            "2",
            "--prefix-len",
            "30",
            "--output-len",
            "8",
            "--concurrency",
            "2",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--label",
            "test",
        ],
    )
    wall = time.monotonic() - t0
    assert code == 0
    result = json.loads(out.read_text())
    s = result["summary"]
    assert (s["completed"], s["failed"]) == (8, 0)
    assert s["total_output_tokens"] == 64
    # Bounds that hold however loaded the machine is: the upstream sleeps 20 ms before each of its 8
    # tokens, and every request lies within the run, two at a time.
    reqs = result["requests"]
    assert len(reqs) == 8
    assert all(0.019 <= r["ttft"] < r["e2e"] and 8 * 0.019 <= r["e2e"] for r in reqs), reqs
    assert all(r["start"] + r["e2e"] <= wall for r in reqs) and sum(r["e2e"] for r in reqs) <= 2 * wall
    assert s["e2e_ms"]["p50"] == pytest.approx(1000 * float(np.median([r["e2e"] for r in reqs])))
    # The gaps between a request's tokens fit between its first token and its end.
    assert 0 < s["itl_ms"]["mean"] <= s["tpot_ms"]["mean"]
    assert result["config"]["endpoint"] == "chat" and result["config"]["model"] == "test-model"
    # Turn 2 carries the system prompt, turn 1 and the assistant's answer.
    second = [x for x in up.seen if len(x.body["messages"]) == 4]
    assert len(second) == 4 and all(m.body["messages"][2]["content"].startswith(" a-0") for m in second)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_bench_random_workload_at_a_request_rate(upstream, tmp_path: Path) -> None:
    up = await upstream(name="a", tokens=4)
    out = tmp_path / "r.json"
    argv = [
        "--url",
        up.url,
        "--model",
        "m",
        "--num-prompts",
        "6",
        "--input-len",
        "12",
        "--output-len",
        "4",
        "--request-rate",
        "50",
        "--json",
        str(out),
    ]
    assert await asyncio.to_thread(bench_main, argv) == 0
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 6 and result["config"]["endpoint"] == "completions"
    prompts = [s.body["prompt"] for s in up.seen]
    assert len(set(prompts)) == 6 and all(len(p.split()) == 12 for p in prompts)
    assert all(s.body["max_tokens"] == 4 and s.body["ignore_eos"] and s.body["stream"] for s in up.seen)
    starts = sorted(r["start"] for r in result["requests"])
    assert starts[-1] > 0.01  # spread over time by the Poisson arrivals, not all at once
