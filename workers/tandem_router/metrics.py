"""The router's Prometheus metrics, in their own registry (one router per process, several per test)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1)


M = TypeVar("M", Counter, Gauge, Histogram)


class Labelled(Generic[M]):
    """A labelled metric whose children are memoised: `labels()` on the hot path is one dict lookup
    instead of prometheus_client's validation and locking (about a tenth of the router's CPU)."""

    def __init__(self, metric: M) -> None:
        self.metric: M = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Labelled(
            Counter(
                "tandem:router_requests_total",
                "Requests answered by the router, by the endpoint that served them and the outcome",
                ["route", "endpoint", "status"],
                registry=r,
            )
        )
        self.upstream_requests = Labelled(
            Counter(
                "tandem:router_upstream_requests_total",
                "Requests sent to engines, by role, endpoint and outcome",
                ["role", "endpoint", "outcome"],
                registry=r,
            )
        )
        self.routing_decisions = Labelled(
            Counter(
                "tandem:router_routing_decisions_total",
                "Routing decisions by pool, policy, chosen endpoint and reason",
                ["role", "policy", "endpoint", "reason"],
                registry=r,
            )
        )
        self.pd_decisions = Labelled(
            Counter(
                "tandem:router_pd_decisions_total",
                "P/D decisions: remote prefill, local prefill on decode (short uncached prompt), or fallback",
                ["decision"],
                registry=r,
            )
        )
        self.retries = Labelled(
            Counter(
                "tandem:router_retries_total",
                "Upstream attempts retried on another endpoint",
                ["role"],
                registry=r,
            )
        )
        self.client_disconnects = Counter(
            "tandem:router_client_disconnects_total", "Requests whose client went away", registry=r
        )
        self.ttft = Labelled(
            Histogram(
                "tandem:router_time_to_first_token_seconds",
                "Time from request arrival to the first byte of the answer, per endpoint",
                ["endpoint"],
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.latency = Labelled(
            Histogram(
                "tandem:router_request_latency_seconds",
                "End-to-end request latency through the router, per endpoint",
                ["endpoint"],
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.prefill_latency = Labelled(
            Histogram(
                "tandem:router_prefill_latency_seconds",
                "Time spent on the remote prefill leg, per prefill endpoint",
                ["endpoint"],
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.overhead = Histogram(
            "tandem:router_overhead_seconds",
            "Router time before the upstream request is sent (parse, hash, pick)",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.in_flight = Labelled(
            Gauge(
                "tandem:router_in_flight_requests",
                "Requests in flight per endpoint",
                ["role", "endpoint"],
                registry=r,
            )
        )
        self.in_flight_tokens = Labelled(
            Gauge(
                "tandem:router_in_flight_tokens",
                "Estimated prompt + max output tokens in flight per endpoint",
                ["role", "endpoint"],
                registry=r,
            )
        )
        self.healthy = Labelled(
            Gauge(
                "tandem:router_endpoint_healthy",
                "1 when the endpoint is admitted",
                ["role", "endpoint"],
                registry=r,
            )
        )
        self.prefix_hit_ratio = Labelled(
            Histogram(
                "tandem:router_prefix_match_ratio",
                "Share of the prompt's blocks the index places on the chosen endpoint",
                ["role"],
                buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
                registry=r,
            )
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
