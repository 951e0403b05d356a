"""The simulated engine's own parts (docs/simulation.md): the timing model's features and its file, the
flags it refuses, and a fleet whose engines each admit and refuse as a real engine does. Its HTTP, KV-event
and exact-index contracts are the real engine's tests, run on both (test_http_e2e.py, test_kv_events_e2e.py,
tests/router/test_kv_index_e2e.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tandem_engine.request import Request
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.scheduler_output import ScheduledRequest, SchedulerOutput
from tandem_engine.sim import server
from tandem_engine.sim.timing import DEFAULT_TIMING, FEATURES, StepTiming, step_features
from tests.engine.engine_server import MODEL, launch_sim


def row(prompt: int, start: int, n: int) -> ScheduledRequest:
    req = Request("r", list(range(prompt)), SamplingParams(max_tokens=8), [0])
    return ScheduledRequest(req, start, n, [], True)


def test_a_step_is_priced_by_its_prompt_tokens_their_attention_and_its_decoding_rows() -> None:
    # A 100-token chunk from position 50 of a 300-token prompt, its last token at position 149; two rows
    # decoding at positions 300 and 1000.
    sched = SchedulerOutput([row(300, 50, 100), row(300, 300, 1), row(1000, 1000, 1)])
    assert step_features(sched) == (1.0, 100.0, 100 * (50 + 99 / 2), 2.0, 1300.0)
    # The last token of a prompt is a prompt token, not a decode row.
    assert step_features(SchedulerOutput([row(10, 9, 1)])) == (1.0, 1.0, 9.0, 0.0, 0.0)
    timing = StepTiming((0.01, 1e-3, 1e-6, 2e-3, 1e-6))
    expected = 0.01 + 0.1 + 100 * 99.5 * 1e-6 + 4e-3 + 1.3e-3
    assert timing.seconds(sched) == pytest.approx(expected)
    assert timing.seconds(sched, speedup=4) == pytest.approx(expected / 4)


def test_the_committed_timing_model_loads_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    timing = StepTiming.load(DEFAULT_TIMING)
    assert all(c >= 0 for c in timing.coefficients) and timing.machine and "sim_calibrate" in timing.source
    assert StepTiming.load(_write(tmp_path, timing.to_json())) == timing
    bad = {**timing.to_json(), "coefficients": dict(zip(FEATURES, [0.01, -1e-3, 0, 0, 0], strict=True))}
    with pytest.raises(ValueError, match=">= 0"):
        StepTiming.load(_write(tmp_path, bad))


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "timing.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("argv", "message"), [
    (["--role", "prefill"], "not simulated yet"),
    (["--engines", "0"], "at least 1"),
    (["--speedup", "0"], "positive"),
    (["--timing", "/nonexistent.json"], "--timing"),
])
def test_flags_it_cannot_honour_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        server.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
async def test_each_engine_of_a_fleet_admits_and_refuses_on_its_own(tmp_path: Path) -> None:
    """Three engines of one process: a request fills the first one's only seat and its queue of one, so the
    next is refused with a 429 and Retry-After as a real engine's admission does, while the other engines,
    each its own scheduler and metrics, answer."""
    sim = launch_sim(tmp_path, ["--max-num-seqs", "1", "--max-waiting-requests", "1"], engines=3)
    try:
        await asyncio.to_thread(sim.wait_healthy, 120)
        port = int(sim.url.rsplit(":", 1)[1])
        urls = [f"http://127.0.0.1:{port - 2 + i}" for i in range(3)]
        long = {"model": MODEL, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=60) as client:
            busy = [asyncio.create_task(client.post(urls[0] + "/v1/completions", json=long)) for _ in range(2)]
            await asyncio.sleep(1.0)
            refused = await client.post(urls[0] + "/v1/completions", json=long)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
            for url in urls[1:]:
                ok = await client.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
                assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
            metrics = [(await client.get(u + "/metrics")).text for u in urls]
            assert 'vllm:num_requests_running{model_name="smollm2-135m-instruct"} 1.0' in metrics[0]
            assert all('vllm:num_requests_running{model_name="smollm2-135m-instruct"} 0.0' in m for m in metrics[1:])
            for task in busy:
                task.cancel()
    finally:
        sim.stop()
