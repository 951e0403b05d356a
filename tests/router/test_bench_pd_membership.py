"""bench/pd_membership.py's pure parts: what counts as a failed stream, router counters per label and their
increments, and the window's statistics and ratios to the steady window."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def pdm() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # the script imports its sibling `harness`
    try:
        return importlib.import_module("pd_membership")
    finally:
        sys.path.remove(str(BENCH))


def test_a_stream_fails_on_status_error_event_missing_done_or_early_finish(pdm: ModuleType) -> None:
    assert pdm.failure(200, "", True, "length") == ""
    assert pdm.failure(503, "draining", False, None) == "HTTP 503: draining"
    assert pdm.failure(0, "ClientConnectorError: refused", False, None) == "ClientConnectorError: refused"
    assert pdm.failure(200, "SSE error: KV load failed", True, "length") == "SSE error: KV load failed"
    assert pdm.failure(200, "", False, "length") == "no [DONE]"
    assert pdm.failure(200, "", True, "stop") == "finish_reason stop"
    assert pdm.failure(200, "", True, None) == "finish_reason None"


PROM = """# TYPE tandem:router_migrations_total counter
tandem:router_migrations_total{reason="replay"} 3.0
tandem:router_migrations_total{reason="engine_died"} 1.0
tandem:router_pd_decisions_total{decision="remote"} 40.0
tandem:router_pd_decisions_total{decision="local_fallback"} 2.0
tandem:router_requests_total{route="/v1/completions",endpoint="a",status="200"} 30.0
tandem:router_requests_total{route="/v1/completions",endpoint="b",status="200"} 12.0
tandem:router_requests_total{route="/v1/completions",endpoint="b",status="503"} 1.0
"""


def test_counters_per_label_and_their_increments(pdm: ModuleType) -> None:
    assert pdm.by_label(PROM, "tandem:router_migrations_total", "reason") == {"replay": 3.0, "engine_died": 1.0}
    assert pdm.by_label(PROM, "tandem:router_requests_total", "status") == {"200": 42.0, "503": 1.0}
    assert pdm.by_label(PROM, "tandem:router_retries_total", "role") == {}
    before = {"remote": 30.0, "local_fallback": 2.0}
    after = pdm.by_label(PROM, "tandem:router_pd_decisions_total", "decision")
    assert pdm.delta(after, before) == {"remote": 10.0}  # local_fallback did not move


def test_window_statistics_count_only_requests_started_in_it(pdm: ModuleType) -> None:
    req = pdm.Req
    records = [req(start=-1.0, ok=False, error="HTTP 503: x"),  # in the lead: whole-run failures only
               req(start=0.0, ok=True, ttft=0.1, itl=[0.01, 0.03]),
               req(start=5.0, ok=True, ttft=0.3, itl=[0.02]),
               req(start=9.0, ok=False, error="no [DONE]"),
               req(start=10.0, ok=True, ttft=9.0)]  # after the window
    s = pdm.summarize(records, 10.0)
    assert (s["requests"], s["failed"], s["requests_whole_run"], s["failed_whole_run"]) == (3, 1, 5, 2)
    assert s["errors"] == {"HTTP 503: x": 1, "no [DONE]": 1}
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0) and s["ttft_ms"]["p99"] == pytest.approx(298.0)
    assert s["itl_ms"]["p50"] == pytest.approx(20.0) and s["itl_ms"]["max"] == pytest.approx(30.0)
    assert s["ttft_ms"]["max"] == pytest.approx(300.0)  # the one after the window is not counted

    steady = {"ttft_ms": {"p99": 200.0}, "itl_ms": {"p99": 20.0}}
    rollout = {"ttft_ms": {"p99": 500.0}, "itl_ms": {"p99": 30.0}}
    assert pdm.ratios({"steady": steady, "rollout": rollout}) == {"rollout": {"ttft_ms": 2.5, "itl_ms": 1.5}}
    assert pdm.ratios({"rollout": rollout}) == {"rollout": {"ttft_ms": None, "itl_ms": None}}
