"""autoscaling/signals.py on the exposition text the engines and the router really write (their own metric classes)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import Gauge, generate_latest

from tandem_engine.frontend.metrics import EngineMetrics
from tandem_operator.autoscaling.signals import (
    Scrape,
    parse_engine,
    parse_router,
    quantile,
    read_pods,
    signals,
)
from tandem_router.metrics import RouterMetrics

MODEL = "smollm2"


def engine(running: int = 0, waiting: int = 0, kv: float = 0.0, seqs: int = 16) -> EngineMetrics:
    m = EngineMetrics(MODEL)
    m.running.labels(MODEL).set(running)
    m.waiting.labels(MODEL).set(waiting)
    m.kv_usage.labels(MODEL).set(kv)
    m.max_num_seqs.labels(MODEL).set(seqs)
    return m


def text(m: EngineMetrics | RouterMetrics) -> str:
    return generate_latest(m.registry).decode()


def held_gauge(router: RouterMetrics) -> Gauge:
    """The router's held-requests gauge: its own when it has one, else one registered the same way."""
    existing = router.registry._names_to_collectors.get("tandem:router_requests_held")  # noqa: SLF001
    if isinstance(existing, Gauge):
        return existing
    return Gauge("tandem:router_requests_held", "Requests held while no engine is ready", registry=router.registry)


def scrape(t: float, decode: dict[str, str | None], router: dict[str, str | None] | None = None,
           prefill: dict[str, str | None] | None = None) -> Scrape:
    return Scrape(
        time=t,
        router=read_pods(router or {}, parse_router),
        decode=read_pods(decode, parse_engine),
        prefill=None if prefill is None else read_pods(prefill, parse_engine),
    )


def test_latency_percentiles_describe_the_interval_not_the_time_since_boot() -> None:
    a, b = engine(), engine()
    for m in (a, b):
        for _ in range(100):  # a fast past
            m.itl.labels(MODEL).observe(0.01)
            m.ttft.labels(MODEL).observe(0.05)
    before = scrape(0, {"a": text(a), "b": text(b)})
    for _ in range(10):  # then a slow interval, on one pod only
        a.itl.labels(MODEL).observe(0.35)
        a.ttft.labels(MODEL).observe(3.0)
    now = signals(before, scrape(15, {"a": text(a), "b": text(b)}), percentile=90)
    assert now.decode.itl_seconds is not None and 0.3 < now.decode.itl_seconds <= 0.4  # the (0.3, 0.4] bucket
    assert now.decode.ttft_seconds is not None and 2.5 < now.decode.ttft_seconds <= 5.0
    since_boot = signals(None, scrape(15, {"a": text(a), "b": text(b)}), percentile=90)
    assert since_boot.decode.itl_seconds is None  # nothing to compare with yet
    quiet = signals(scrape(15, {"a": text(a), "b": text(b)}), scrape(30, {"a": text(a), "b": text(b)}), 90)
    assert quiet.decode.itl_seconds is None  # no request in the interval: no samples, not zero latency


def test_prompt_token_rate_from_counter_deltas_survives_a_restart() -> None:
    p1, p2 = engine(), engine()
    p1.prompt_tokens.labels(MODEL).inc(10_000)
    p2.prompt_tokens.labels(MODEL).inc(4_000)
    before = scrape(0, {}, prefill={"p1": text(p1), "p2": text(p2)})
    p1.prompt_tokens.labels(MODEL).inc(3_000)
    restarted = engine()  # p2's container restarted: its counter starts again from 0
    restarted.prompt_tokens.labels(MODEL).inc(600)
    now = signals(before, scrape(10, {}, prefill={"p1": text(p1), "p2": text(restarted)}), 90)
    assert now.prefill is not None
    assert now.prefill.prompt_tokens_per_second == pytest.approx((3_000 + 600) / 10)
    assert now.interval_seconds == 10


def test_gauges_per_pool_and_a_failed_scrape_is_missing_not_idle() -> None:
    d1, d2 = engine(running=8, waiting=2, kv=0.5), engine(running=4, waiting=0, kv=0.9)
    now = signals(None, scrape(0, {"d1": text(d1), "d2": text(d2), "d3": None, "d4": "<html>502</html>"}), 90)
    pool = now.decode
    assert (pool.pods, pool.missing, pool.dead) == (2, 2, True)
    assert (pool.running, pool.waiting, pool.max_num_seqs) == (12, 2, 16)
    assert pool.kv_usage_mean == pytest.approx(0.7) and pool.kv_usage_max == pytest.approx(0.9)
    assert now.prefill is None  # colocated


def test_a_new_pod_only_sets_its_baseline() -> None:
    old, new = engine(), engine()
    old.prompt_tokens.labels(MODEL).inc(100)
    new.prompt_tokens.labels(MODEL).inc(50_000)  # tokens since its boot, outside the interval
    new.itl.labels(MODEL).observe(2.0)
    before = scrape(0, {"old": text(old)})
    old.prompt_tokens.labels(MODEL).inc(150)
    old.itl.labels(MODEL).observe(0.02)
    now = signals(before, scrape(5, {"old": text(old), "new": text(new)}), 50)
    assert now.decode.prompt_tokens_per_second == pytest.approx(30)
    assert now.decode.itl_seconds is not None and now.decode.itl_seconds <= 0.02
    assert now.decode.pods == 2


def test_router_arrivals_ttft_held_and_readability() -> None:
    r1, r2 = RouterMetrics(), RouterMetrics()
    for r in (r1, r2):
        r.requests.labels("/v1/completions", "http://d1:8000", "200").inc(20)
    before_text = {"r1": text(r1), "r2": text(r2)}
    r1.requests.labels("/v1/completions", "http://d1:8000", "200").inc(30)
    r2.requests.labels("/v1/chat/completions", "http://d2:8000", "200").inc(10)
    r1.ttft.labels("http://d1:8000").observe(0.4)
    r2.ttft.labels("http://d2:8000").observe(0.4)
    r1.admitted.set(3)
    r2.queued.set(2)
    assert parse_router(text(r1)).held == 0  # a router that does not export the gauge holds nothing
    held_gauge(r2).set(4)
    now = signals(scrape(0, {}, router=before_text), scrape(20, {}, router={"r1": text(r1), "r2": text(r2)}), 90)
    router = now.router
    assert router.readable and router.demand
    assert router.arrivals_per_second == pytest.approx(40 / 20)
    assert (router.in_flight, router.held) == (5, 4)
    assert router.ttft_seconds is not None and 0.25 < router.ttft_seconds <= 0.5
    # one router pod gone: not readable, and no arrival rate to trust
    partial = signals(scrape(0, {}, router=before_text), scrape(20, {}, router={"r1": text(r1), "r2": None}), 90)
    assert not partial.router.readable and partial.router.arrivals_per_second is None
    assert not signals(None, scrape(0, {}), 90).router.readable  # no router pod at all
    status = now.as_status()["router"]
    assert status == {"readable": True, "arrivalsPerSecond": 2.0, "inFlight": 5.0, "held": 4.0,
                      "ttftSeconds": round(router.ttft_seconds, 3)}
    assert "arrivalsPerSecond" not in partial.as_status()["router"]  # unknown, not 0


def test_parsers_refuse_other_texts() -> None:
    with pytest.raises(ValueError, match="engine"):
        parse_engine(text(RouterMetrics()))
    with pytest.raises(ValueError, match="router"):
        parse_router(text(engine()))


def test_odd_texts_are_missing_pods_or_skipped_values() -> None:
    pods = read_pods({"html": "<html>502 Bad Gateway</html>", "empty": "", "nan": "vllm:num_requests_running 2\n"
                      "vllm:kv_cache_usage_perc NaN\n"}, parse_engine)
    assert pods["html"] is None and pods["empty"] is None
    nan = pods["nan"]
    assert nan is not None and (nan.running, nan.kv_usage) == (2, 0)


def test_quantile_interpolates_within_the_bucket_like_histogram_quantile() -> None:
    buckets = ((0.1, 50.0), (0.2, 90.0), (0.4, 100.0), (math.inf, 100.0))
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.7, buckets) == pytest.approx(0.15)
    assert quantile(0.95, buckets) == pytest.approx(0.3)
    assert quantile(0.99, ((0.1, 1.0), (math.inf, 10.0))) == pytest.approx(0.1)  # past the last bound
    assert quantile(0.9, ((0.1, 0.0), (math.inf, 0.0))) is None and quantile(0.9, ()) is None
