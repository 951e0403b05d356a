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
        counter, gauge, histogram = self._counter, self._gauge, self._histogram
        # Requests and what became of them.
        self.requests = counter("tandem:router_requests_total", ("route", "endpoint", "status"),
                                "Requests answered by the router, by the endpoint that served them and the outcome")
        self.upstream_requests = counter("tandem:router_upstream_requests_total", ("role", "endpoint", "outcome"),
                                         "Requests sent to engines, by role, endpoint and outcome")
        self.retries = counter("tandem:router_retries_total", ("role",),
                               "Upstream attempts retried on another endpoint")
        self.client_disconnects = Counter(
            "tandem:router_client_disconnects_total", "Requests whose client went away", registry=r
        )
        # Where they were sent, and why.
        self.routing_decisions = counter(
            "tandem:router_routing_decisions_total", ("role", "policy", "endpoint", "reason"),
            "Routing decisions by pool, policy, chosen endpoint and reason",
        )
        self.pd_decisions = counter(
            "tandem:router_pd_decisions_total", ("decision",),
            "P/D decisions: remote prefill, or local prefill on decode and why",
        )
        self.prefix_hit_ratio = histogram(
            "tandem:router_prefix_match_ratio", ("role",),
            "Share of the prompt's tokens the index places on the chosen endpoint",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
        )
        self.prefix_lookups = counter(
            "tandem:router_prefix_index_lookups_total", ("role", "index"),
            "Routing decisions that read a prefix index: exact (engines' KV events) or approximate",
        )
        # The exact index (KV events).
        self.kv_index_resyncs = counter(
            "tandem:router_kv_index_resyncs_total", ("endpoint", "reason"),
            "Times an engine's KV events had to be caught up again: gap, restart or error",
        )
        self.kv_index_blocks = Gauge(
            "tandem:router_kv_index_blocks", "Block hashes in the exact KV index, over every engine", registry=r,
        )
        self.migrations = counter(
            "tandem:router_migrations_total", ("reason",),
            "Streams resumed on another engine after theirs broke (connection, error_event, timeout, eof), or replayed "
            "whole with local prefill after an error before their first token (replay)",
        )
        # Admission control (admission.py).
        self.queued = Gauge("tandem:router_queued_requests", "Requests waiting for an admission slot", registry=r)
        self.admitted = Gauge("tandem:router_admitted_requests",
                              "Requests holding an admission slot: dispatched, or being answered", registry=r)
        self.admission_capacity = Gauge("tandem:router_admission_capacity",
                                        "Admission slots: the caps of the healthy decode endpoints", registry=r)
        self.rejected = counter("tandem:router_rejected_requests_total", ("reason",),
                                "Requests refused while waiting: queue_full, queue_timeout or "
                                "queue_timeout_foreseen (429), cold_start_timeout (503)")
        # Demand while the pools are at zero, read by the operator's planner (docs/operations.md,
        # "Scale from zero").
        self.held = Gauge("tandem:router_requests_held",
                          "Requests held because no decode endpoint exists (--cold-start-timeout)", registry=r)
        self.last_request = Gauge("tandem:router_last_request_timestamp_seconds",
                                  "Unix time the last completions or chat request arrived (0: none yet)", registry=r)
        self.queue_wait = Histogram(
            "tandem:router_queue_wait_seconds",
            "Time admitted requests waited for a slot, or held for an engine (0: there was room)",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        # How long they took.
        self.ttft = histogram("tandem:router_time_to_first_token_seconds", ("endpoint",),
                              "Time from request arrival to the first byte of the answer, per endpoint")
        self.latency = histogram("tandem:router_request_latency_seconds", ("endpoint",),
                                 "End-to-end request latency through the router, per endpoint")
        self.prefill_latency = histogram("tandem:router_prefill_latency_seconds", ("endpoint",),
                                         "Time spent on the remote prefill leg, per prefill endpoint")
        self.migration_resume = Histogram(
            "tandem:router_migration_resume_seconds",
            "From a stream's break to the first chunk of its continuation on another engine",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.overhead = Histogram(
            "tandem:router_overhead_seconds", "Router time before the upstream request is sent (parse, hash, pick)",
            buckets=OVERHEAD_BUCKETS, registry=r,
        )
        # Each endpoint's state.
        self.in_flight = gauge("tandem:router_in_flight_requests", "Requests in flight per endpoint")
        self.in_flight_tokens = gauge("tandem:router_in_flight_tokens",
                                      "Estimated prompt + max output tokens in flight per endpoint")
        self.healthy = gauge("tandem:router_endpoint_healthy", "1 when the endpoint is admitted")
        # Revisions (an engine's /health X-Tandem-Revision; "" when it sends none): what serves while a rollout
        # runs, and the share of requests each takes.
        self.revision_endpoints = Labelled(Gauge(
            "tandem:router_revision_endpoints", "Admitted endpoints per pool role and engine revision",
            ("role", "revision"), registry=r))
        self.revision_requests = counter(
            "tandem:router_revision_requests_total", ("revision",),
            "Requests (and resumed streams) sent to a decode or colocated engine, by the engine's revision")

    def _counter(self, name: str, labels: tuple[str, ...], doc: str) -> Labelled[Counter]:
        return Labelled(Counter(name, doc, labels, registry=self.registry))

    def _gauge(self, name: str, doc: str) -> Labelled[Gauge]:
        """Per-endpoint gauges, all labelled by pool role and endpoint."""
        return Labelled(Gauge(name, doc, ("role", "endpoint"), registry=self.registry))

    def _histogram(
        self, name: str, labels: tuple[str, ...], doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS
    ) -> Labelled[Histogram]:
        return Labelled(Histogram(name, doc, labels, buckets=buckets, registry=self.registry))

    def render(self) -> bytes:
        return generate_latest(self.registry)
