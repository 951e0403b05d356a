"""What the planner sees each tick: the router's and the engines' `/metrics` turned into `Signals`.

A `Scrape` holds one parsed sample per pod (None for a pod whose scrape failed); `signals(prev, now)`
compares two scrapes. Latency percentiles come from histogram bucket deltas between the two, so they
describe the last interval, not the time since boot; rates come from counter deltas, and a counter
that went down (a restarted container) counts from zero. A pod first seen in `now` only sets its
baseline. Metric names: docs/contracts.md ("Metrics").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

# [(upper bound, cumulative count)] sorted by bound, ending with +Inf
Buckets = tuple[tuple[float, float], ...]

ENGINE_TTFT = "vllm:time_to_first_token_seconds"
ENGINE_ITL = "vllm:inter_token_latency_seconds"
ROUTER_TTFT = "tandem:router_time_to_first_token_seconds"

T = TypeVar("T")
S = TypeVar("S")


@dataclass(frozen=True)
class EngineSample:
    running: float
    waiting: float
    kv_usage: float
    max_num_seqs: float | None
    prompt_tokens: float  # counter
    ttft: Buckets
    itl: Buckets
    held_blocks: float = 0.0  # prefill: KV blocks held under a lease for decode engines to read
    kv_received_blocks: float = 0.0  # decode: counter, blocks read from prefill engines
    kv_failures: float = 0.0  # decode: counter, KV loads that failed


@dataclass(frozen=True)
class RouterSample:
    requests: float  # counter: answers to clients
    in_flight: float  # admitted + waiting for admission
    held: float  # requests held while no engine is ready (0 when the router does not export it)
    ttft: Buckets
    pd_decisions: tuple[tuple[str, float], ...] = ()  # counters: P/D decision -> requests
    revision_endpoints: tuple[tuple[str, str, float], ...] = ()  # (role, revision, admitted endpoints)
    revision_requests: tuple[tuple[str, float], ...] = ()  # counters: revision -> requests sent to decode

    def decisions(self, *names: str) -> float:
        return sum(v for k, v in self.pd_decisions if k in names)


@dataclass(frozen=True)
class Scrape:
    """One round of scrapes: pod name -> its parsed metrics, or None when the scrape failed."""

    time: float
    router: Mapping[str, RouterSample | None]
    decode: Mapping[str, EngineSample | None]
    prefill: Mapping[str, EngineSample | None] | None = None  # None: colocated


@dataclass(frozen=True)
class PoolSignals:
    pods: int  # pods that answered
    missing: int  # pods whose scrape failed: unknown load, never zero load
    running: float = 0.0  # summed over the pods that answered
    waiting: float = 0.0
    kv_usage_mean: float | None = None
    kv_usage_max: float | None = None
    max_num_seqs: float | None = None  # per pod (mean)
    prompt_tokens_per_second: float | None = None  # over the pods seen in both scrapes
    ttft_seconds: float | None = None  # engine-side, at the target percentile; None: no samples
    itl_seconds: float | None = None

    @property
    def dead(self) -> bool:
        """Some pods exist but their load is unknown."""
        return self.missing > 0


    def as_status(self) -> dict[str, float | int]:
        """camelCase and rounded, for `status.autoscaling`; values that are not known are left out."""
        return _status({
            "pods": self.pods, "missing": self.missing, "running": self.running, "waiting": self.waiting,
            "kvUsage": self.kv_usage_mean, "promptTokensPerSecond": self.prompt_tokens_per_second,
            "ttftSeconds": self.ttft_seconds, "itlSeconds": self.itl_seconds,
        })


@dataclass(frozen=True)
class RouterSignals:
    readable: bool  # every router pod answered
    arrivals_per_second: float | None = None  # None: no previous scrape to compare with
    in_flight: float = 0.0
    held: float = 0.0
    ttft_seconds: float | None = None

    def as_status(self) -> dict[str, float | int]:
        return _status({
            "readable": self.readable, "arrivalsPerSecond": self.arrivals_per_second,
            "inFlight": self.in_flight, "held": self.held, "ttftSeconds": self.ttft_seconds,
        })

    @property
    def demand(self) -> bool:
        """Requests arrived, are being served or are held."""
        return bool(self.arrivals_per_second) or self.in_flight > 0 or self.held > 0


@dataclass(frozen=True)
class Signals:
    time: float
    interval_seconds: float | None  # since the previous scrape; None for the first
    router: RouterSignals
    decode: PoolSignals
    prefill: PoolSignals | None = None
    percentile: int = 90

    def as_status(self) -> dict[str, dict[str, float | int]]:
        """What `status.autoscaling.signals` shows: one map per pool and one for the router."""
        out = {"router": self.router.as_status(), "decode": self.decode.as_status()}
        if self.prefill is not None:
            out["prefill"] = self.prefill.as_status()
        return out


def _status(values: dict[str, float | int | None]) -> dict[str, float | int]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in values.items() if v is not None}


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] of one exposition text."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not math.isnan(s.value):  # a gauge with nothing to average over says nothing
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, ()))


def _buckets(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> Buckets:
    """A histogram's cumulative buckets, summed over its label sets (models, endpoints)."""
    by_bound: dict[float, float] = {}
    for labels, value in samples.get(f"{name}_bucket", ()):
        if "le" not in labels:
            continue
        bound = float(labels["le"])
        by_bound[bound] = by_bound.get(bound, 0.0) + value
    return tuple(sorted(by_bound.items()))


def parse_engine(text: str) -> EngineSample:
    """An engine's `/metrics` text; raises ValueError when it is not the exposition format."""
    s = _samples(text)
    if "vllm:num_requests_running" not in s:
        raise ValueError("not an engine's metrics: no vllm:num_requests_running")
    kv = [v for _, v in s.get("vllm:kv_cache_usage_perc", ())]
    seqs = s.get("tandem:engine_max_num_seqs")
    return EngineSample(
        running=_total(s, "vllm:num_requests_running"),
        waiting=_total(s, "vllm:num_requests_waiting"),
        kv_usage=max(kv, default=0.0),
        max_num_seqs=_total(s, "tandem:engine_max_num_seqs") if seqs else None,
        prompt_tokens=_total(s, "vllm:prompt_tokens_total"),
        ttft=_buckets(s, ENGINE_TTFT),
        itl=_buckets(s, ENGINE_ITL),
        held_blocks=_total(s, "tandem:kv_blocks_held_for_transfer"),
        kv_received_blocks=_total(s, "tandem:kv_transfer_received_blocks_total"),
        kv_failures=_total(s, "tandem:kv_transfer_failures_total"),
    )


def parse_router(text: str) -> RouterSample:
    """A router's `/metrics` text; raises ValueError when it is not the exposition format."""
    s = _samples(text)
    if "tandem:router_admitted_requests" not in s:
        raise ValueError("not a router's metrics: no tandem:router_admitted_requests")
    return RouterSample(
        requests=_total(s, "tandem:router_requests_total"),
        in_flight=_total(s, "tandem:router_admitted_requests") + _total(s, "tandem:router_queued_requests"),
        held=_total(s, "tandem:router_requests_held"),
        ttft=_buckets(s, ROUTER_TTFT),
        pd_decisions=tuple(sorted((labels.get("decision", ""), v)
                                  for labels, v in s.get("tandem:router_pd_decisions_total", ()))),
        revision_endpoints=tuple(sorted((labels.get("role", ""), labels.get("revision", ""), v)
                                        for labels, v in s.get("tandem:router_revision_endpoints", ()))),
        revision_requests=tuple(sorted((labels.get("revision", ""), v)
                                       for labels, v in s.get("tandem:router_revision_requests_total", ()))),
    )


def read_pods(texts: Mapping[str, str | None], parse: Callable[[str], T]) -> dict[str, T | None]:
    """Parse each pod's `/metrics` text; a failed scrape (None) or an unreadable text is None."""
    out: dict[str, T | None] = {}
    for pod, text in texts.items():
        try:
            out[pod] = None if text is None else parse(text)
        except ValueError:
            out[pod] = None
    return out


def _increase(prev: float, now: float) -> float:
    """A counter's increase; one that went down restarted from zero."""
    return now - prev if now >= prev else now


def _bucket_increase(prev: Buckets, now: Buckets) -> Buckets:
    """Per-bucket increase between two scrapes of one pod's histogram."""
    before = dict(prev)
    count_before, count_now = (prev[-1][1] if prev else 0.0), (now[-1][1] if now else 0.0)
    if count_now < count_before:  # restarted: everything it holds is new
        return now
    return tuple((bound, max(0.0, value - before.get(bound, 0.0))) for bound, value in now)


def _merge(histograms: Iterable[Buckets]) -> Buckets:
    total: dict[float, float] = {}
    for buckets in histograms:
        for bound, value in buckets:
            total[bound] = total.get(bound, 0.0) + value
    return tuple(sorted(total.items()))


def quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile (0-1) of cumulative buckets, interpolated linearly inside its bucket as
    Prometheus' `histogram_quantile` does; in the +Inf bucket, the largest finite bound. None: empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank and cumulative > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (cumulative - below)
        lower, below = bound, cumulative
    return lower


def _deltas(
    prev: Mapping[str, S | None] | None, now: Mapping[str, S | None]
) -> list[tuple[S, S]]:
    """(previous, current) of every pod that answered both scrapes."""
    if prev is None:
        return []
    pairs = []
    for pod, sample in now.items():
        before = prev.get(pod)
        if sample is not None and before is not None:
            pairs.append((before, sample))
    return pairs


def increase(prev: Mapping[str, S | None] | None, now: Mapping[str, S | None], counter: Callable[[S], float]) -> float:
    """A counter's increase between two scrapes, summed over the pods that answered both."""
    return sum(_increase(counter(a), counter(b)) for a, b in _deltas(prev, now))


def _rate(pairs: list[tuple[S, S]], counter: Callable[[S], float], seconds: float | None) -> float | None:
    """Increase per second of a counter over the pods seen in both scrapes."""
    if not seconds or not pairs:
        return None
    return sum(_increase(counter(a), counter(b)) for a, b in pairs) / seconds


def _interval_quantile(q: float, pairs: list[tuple[S, S]], histogram: Callable[[S], Buckets]) -> float | None:
    return quantile(q, _merge(_bucket_increase(histogram(a), histogram(b)) for a, b in pairs))


def _pool(
    prev: Mapping[str, EngineSample | None] | None,
    now: Mapping[str, EngineSample | None],
    seconds: float | None,
    q: float,
) -> PoolSignals:
    live = [s for s in now.values() if s is not None]
    pairs = _deltas(prev, now)
    kv = [s.kv_usage for s in live]
    seqs = [s.max_num_seqs for s in live if s.max_num_seqs is not None]
    return PoolSignals(
        pods=len(live),
        missing=len(now) - len(live),
        running=sum(s.running for s in live),
        waiting=sum(s.waiting for s in live),
        kv_usage_mean=sum(kv) / len(kv) if kv else None,
        kv_usage_max=max(kv, default=None),
        max_num_seqs=sum(seqs) / len(seqs) if seqs else None,
        prompt_tokens_per_second=_rate(pairs, lambda s: s.prompt_tokens, seconds),
        ttft_seconds=_interval_quantile(q, pairs, lambda s: s.ttft),
        itl_seconds=_interval_quantile(q, pairs, lambda s: s.itl),
    )


def _router(
    prev: Mapping[str, RouterSample | None] | None,
    now: Mapping[str, RouterSample | None],
    seconds: float | None,
    q: float,
) -> RouterSignals:
    live = [s for s in now.values() if s is not None]
    pairs = _deltas(prev, now)
    every_pod = len(pairs) == len(now)  # a router pod missing from either scrape hides its arrivals
    return RouterSignals(
        readable=bool(now) and len(live) == len(now),
        arrivals_per_second=_rate(pairs, lambda s: s.requests, seconds) if every_pod else None,
        in_flight=sum(s.in_flight for s in live),
        held=sum(s.held for s in live),
        ttft_seconds=_interval_quantile(q, pairs, lambda s: s.ttft),
    )


def signals(prev: Scrape | None, now: Scrape, percentile: int) -> Signals:
    """What changed between two scrapes (`prev` None: only the gauges of `now`)."""
    seconds = now.time - prev.time if prev is not None and now.time > prev.time else None
    q = percentile / 100
    prefill = None
    if now.prefill is not None:
        prefill = _pool(None if prev is None else prev.prefill, now.prefill, seconds, q)
    return Signals(
        time=now.time,
        interval_seconds=seconds,
        router=_router(None if prev is None else prev.router, now.router, seconds, q),
        decode=_pool(None if prev is None else prev.decode, now.decode, seconds, q),
        prefill=prefill,
        percentile=percentile,
    )
