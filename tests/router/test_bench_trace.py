"""`tandem bench --workload trace`: a Mooncake trace becomes token-id prompts that share exactly the blocks
the trace's hash ids share, arrive at the trace's times, and, replayed against simulated engines, hit the
prefix cache as the trace's reuse says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.engine.engine_server import launch_sim

from tandem_router.bench import main as bench_main
from tandem_router.bench.trace import TRACE_BLOCK_TOKENS, TraceRequest, read_trace, trace_sessions

CONVERSATION = Path(__file__).resolve().parents[2] / "bench" / "data" / "mooncake" / "conversation_trace.jsonl"


def test_shared_hash_ids_are_shared_tokens_and_times_and_lengths_scale() -> None:
    trace = [TraceRequest(0, 1100, 40, [0, 1, 2]), TraceRequest(3000, 700, 20, [0, 3]),
             TraceRequest(3000, 1536, 10, [0, 1, 4]), TraceRequest(6000, 9000, 10, list(range(5, 23)))]
    w = trace_sessions(trace, seed=1, length_scale=0.25, time_scale=2.0, max_model_len=2048)
    a, b, c = (next(s for s in w.sessions if s.group == i) for i in range(3))
    assert a.token_prompt is not None and b.token_prompt is not None and c.token_prompt is not None
    block = TRACE_BLOCK_TOKENS // 4
    assert (len(a.token_prompt), a.output_len) == (275, 10)  # lengths times 0.25
    assert a.token_prompt[:2 * block] == c.token_prompt[:2 * block]  # ids 0 and 1: the same tokens
    assert a.token_prompt[2 * block:3 * block] != c.token_prompt[2 * block:3 * block]
    assert b.token_prompt[:block] == a.token_prompt[:block] and b.token_prompt[block:] != a.token_prompt[block:175]
    # The fourth (2,250 + 3 tokens after scaling) does not fit 2,048 tokens: dropped.
    assert w.dropped == 1 and len(w.sessions) == 3
    # Arrivals: the trace's milliseconds spread over their 3-second tick, twice as fast, in order.
    assert 0 <= a.arrival < 1.5 and 1.5 <= b.arrival < 3.0 and 1.5 <= c.arrival < 3.0  # type: ignore[operator]
    assert [s.arrival for s in w.sessions] == sorted(s.arrival for s in w.sessions)  # type: ignore[type-var]
    # Ideal: b holds block 0 of a (128 of 175 tokens), c blocks 0 and 1 (256 of 384).
    assert w.ideal_cached_share == pytest.approx((128 + 256) / (275 + 175 + 384))
    # The same seed, the same prompts; another seed, others.
    again = trace_sessions(trace, seed=1, length_scale=0.25, time_scale=2.0, max_model_len=2048)
    assert [s.token_prompt for s in again.sessions] == [s.token_prompt for s in w.sessions]
    other = trace_sessions(trace, seed=2, length_scale=0.25, time_scale=2.0, max_model_len=2048)
    assert other.sessions[0].token_prompt != w.sessions[0].token_prompt


def test_the_committed_conversation_trace_reads_whole() -> None:
    """bench/data/mooncake's trace as published: 12,031 requests over 59 minutes, a hash id per 512 prompt
    tokens, and 37.4% of prompt tokens in blocks an infinite cache would hold."""
    trace = read_trace(CONVERSATION)
    assert len(trace) == 12031 and trace[-1].timestamp_ms == 3536999
    assert all(len(r.hash_ids) == -(-r.input_length // TRACE_BLOCK_TOKENS) for r in trace)
    w = trace_sessions(trace[:2000], length_scale=1 / 64)
    assert w.dropped == 0 and 0.2 < w.ideal_cached_share < 0.6


def test_a_malformed_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [0]}) + "\n{}\n")
    with pytest.raises(ValueError, match="t.jsonl:2"):
        read_trace(path)


@pytest.mark.slow
def test_a_replay_against_simulated_engines_hits_where_the_trace_reuses(tmp_path: Path) -> None:
    """The first 60 requests of the conversation trace, 1/16 of their lengths, 20 times faster, against a
    simulated engine 50 times this machine's speed: all answer, and the engine's prefix cache holds about
    what an infinite cache would (the trace's reuse survives the mapping of hash ids to tokens)."""
    sim = launch_sim(tmp_path, ["--max-model-len", "8192", "--num-kv-blocks", "4096", "--speedup", "50"], engines=1)
    try:
        sim.wait_healthy(120)
        out = tmp_path / "trace.json"
        code = bench_main(["--url", sim.url, "--workload", "trace", "--trace", str(CONVERSATION),
                           "--length-scale", str(1 / 16), "--time-scale", "20", "--max-requests", "60",
                           "--max-model-len", "8192", "--engine-metrics", sim.url, "--json", str(out)])
        result = json.loads(out.read_text())
    finally:
        sim.stop()
    s = result["summary"]
    assert code == 0 and s["completed"] == 60 and s["trace_dropped"] == 0
    assert s["prefix_cache_hit_rate"] > 0.5 * s["trace_ideal_cached_share"] > 0, s
