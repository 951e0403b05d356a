"""Routing policies: pick one endpoint of a pool for a request.

Every policy sees only healthy candidates not yet tried for this request, and the pool's prefix index.
Load is what the router itself counts at dispatch (in-flight requests and tokens), so it is exact for a
single router replica and needs no scraping.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem_router.hashing import HashRing, hash64
from tandem_router.pool import Endpoint


@dataclass
class RoutingRequest:
    block_hashes: list[int]  # of the prompt text (hashing.block_hashes): always there when hashed
    prompt_tokens: int  # exact when `kv_hashes` is set, else estimated from the text
    max_tokens: int
    session: str | None = None
    kv_hashes: list[int] | None = None  # the engines' block hashes of the prompt's tokens, when tokenized

    @property
    def load_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


@dataclass
class Decision:
    endpoint: Endpoint
    reason: str  # round_robin | least_load | prefix_hit | cold_hash | overflow | session
    matched_blocks: int = 0
    matches: dict[str, int] = field(default_factory=dict, repr=False)
    view: PrefixView | None = field(default=None, repr=False)  # what the decision saw (Router.choose)
    # The scored policy's inputs and score per candidate URL (`POST /route/...` shows them).
    scores: dict[str, dict[str, float]] = field(default_factory=dict, repr=False)


@dataclass
class PrefixView:
    """What an index knows about one request's prompt: its leading blocks held per endpoint."""

    matches: dict[str, int]  # endpoint URL -> leading blocks held (endpoints with none omitted)
    tokens_per_block: float
    num_blocks: int  # blocks of the request's chain
    exact: bool  # from the engines' KV events (else the router's record of what it sent)
    sizes: dict[str, int] = field(default_factory=dict)  # blocks the index holds per endpoint

    def cached_fraction(self, url: str, prompt_tokens: int) -> float:
        return min(1.0, self.matches.get(url, 0) * self.tokens_per_block / max(1, prompt_tokens))

    def cached_tokens(self, url: str) -> int:
        return int(self.matches.get(url, 0) * self.tokens_per_block)

    def size(self, url: str) -> int:
        return self.sizes.get(url, 0)


NO_PREFIX = PrefixView({}, 1.0, 0, False)


@dataclass(frozen=True)
class ScoreWeights:
    """The prefix-aware policy's weights (`tandem route --prefix-weight ...`; docs/operations.md)."""

    prefix: float = 3.0  # per unit of cached-prefix fraction (0-1)
    queue: float = 1.0  # per request queued beyond the least loaded candidate
    kv_usage: float = 1.0  # per unit of the engine's KV-cache usage (0-1), from its /metrics
    min_prefix_fraction: float = 0.1  # below this nowhere, a prompt is cold
    cold_queue_slack: int = 0  # a cold prompt's ring place is skipped when this far above the least loaded


def queue_depth(e: Endpoint) -> int:
    """Requests on the endpoint. When the engine publishes its queue in its KV events, that queue
    (running + waiting, every router's requests): every replica reads the same number at the same
    moment, so a request one replica has just sent, and the engine has not yet reported, does not
    split their choices. It lags by at most one engine step. Otherwise what this router has in flight
    there, or what the engine's last scraped metrics said, whichever is more."""
    if e.load_from_events and e.engine_queue is not None:
        return e.engine_queue
    return max(e.in_flight_requests, e.engine_queue or 0)


class Policy(ABC):
    name: str

    @abstractmethod
    def choose(self, candidates: list[Endpoint], req: RoutingRequest, prefix: PrefixView) -> Decision:
        """`candidates` is non-empty and sorted by URL."""


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: list[Endpoint], req: RoutingRequest, prefix: PrefixView) -> Decision:
        ep = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(ep, "round_robin")


class LeastLoad(Policy):
    name = "least-load"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: list[Endpoint], req: RoutingRequest, prefix: PrefixView) -> Decision:
        # Rotate the start so that ties do not always land on the first URL.
        n = len(candidates)
        start = self._next % n
        self._next += 1
        rotated = candidates[start:] + candidates[:start]
        ep = min(rotated, key=lambda e: (e.in_flight_requests, e.in_flight_tokens))
        return Decision(ep, "least_load")


def load_bound(candidates: list[Endpoint], load_factor: float) -> int:
    """Consistent hashing with bounded loads: an endpoint may take a request while its in-flight count,
    including this request, is at most max(ceil(mean), floor(load_factor * mean)). The floor keeps a
    small pool from taking 3 requests on one endpoint and 1 on the other; large pools get the slack."""
    mean = (sum(e.in_flight_requests for e in candidates) + 1) / len(candidates)
    return max(1, math.ceil(mean), math.floor(load_factor * mean))


class _RingMixin:
    def __init__(self, vnodes: int) -> None:
        self._ring = HashRing(vnodes)

    @staticmethod
    def _cold_key(req: RoutingRequest, cold_key_blocks: int) -> int:
        """A prompt's place on the ring: the hash of its first `cold_key_blocks` text blocks."""
        return req.block_hashes[min(len(req.block_hashes), cold_key_blocks) - 1]

    def _ring_pick(
        self, candidates: list[Endpoint], key: int, bound: int, fits: Callable[[Endpoint], bool] | None = None
    ) -> Endpoint:
        """The first endpoint clockwise from `key` under the load bound (and `fits`, when given)."""
        self._ring.set_members({e.url for e in candidates})
        by_url = {e.url: e for e in candidates}
        order = [by_url[u] for u in self._ring.walk(key)]
        for ep in order:
            if ep.in_flight_requests + 1 <= bound and (fits is None or fits(ep)):
                return ep
        for ep in order:
            if ep.in_flight_requests + 1 <= bound:
                return ep
        return order[0]


class PrefixAware(_RingMixin, Policy):
    """Scores every candidate: cached-prefix fraction, minus queue depth beyond the least loaded
    candidate, minus KV-cache usage (docs/architecture.md, "Routing"). The cached fraction comes from
    the exact KV index when every candidate publishes KV events, else from the router's own record of
    what it sent. A prompt cached nowhere (less than `min_prefix_fraction`) is cold: it goes to its
    place on a consistent-hash ring (keyed by its first `cold_key_blocks` blocks, so replicas agree and
    a new prefix's followers meet it), or to the next one clockwise among the least loaded (within
    `cold_queue_slack` requests of them). Ties go to the earliest candidate in ring order, again so that
    replicas agree."""

    name = "prefix-aware"

    def __init__(self, weights: ScoreWeights | None = None, cold_key_blocks: int = 8, vnodes: int = 64) -> None:
        super().__init__(vnodes)
        self.w = weights or ScoreWeights()
        self.cold_key_blocks = cold_key_blocks
        self._fallback = LeastLoad()

    def choose(self, candidates: list[Endpoint], req: RoutingRequest, prefix: PrefixView) -> Decision:
        hashes = req.block_hashes
        if not hashes:
            return self._fallback.choose(candidates, req, prefix)
        by_url = {e.url: e for e in candidates}
        order = [by_url[u] for u in self._ring_order(candidates, req)]
        depth = {e.url: queue_depth(e) for e in order}
        least = min(depth.values())
        hit = {e.url: prefix.cached_fraction(e.url, req.prompt_tokens) for e in order}
        if max(hit.values()) < self.w.min_prefix_fraction:
            ep = next(e for e in order if depth[e.url] <= least + self.w.cold_queue_slack)
            return Decision(ep, "cold_hash", 0, prefix.matches)

        def score(e: Endpoint) -> float:
            load = depth[e.url] - least
            return self.w.prefix * hit[e.url] - self.w.queue * load - self.w.kv_usage * (e.kv_usage or 0.0)

        scores = {e.url: score(e) for e in order}
        best = max(order, key=lambda e: scores[e.url])  # the first of equal scores in ring order
        reason = "prefix_hit" if hit[best.url] == max(hit.values()) else "overflow"
        detail = {e.url: {"score": round(scores[e.url], 4), "cached_fraction": round(hit[e.url], 4),
                          "queue": depth[e.url], "kv_usage": round(e.kv_usage or 0.0, 4)} for e in order}
        return Decision(best, reason, prefix.matches.get(best.url, 0), prefix.matches, scores=detail)

    def _ring_order(self, candidates: list[Endpoint], req: RoutingRequest) -> list[str]:
        """Candidate URLs clockwise from the prompt's place (its first `cold_key_blocks` text blocks)."""
        self._ring.set_members({e.url for e in candidates})
        return list(self._ring.walk(self._cold_key(req, self.cold_key_blocks)))


class BoundedPrefix(_RingMixin, Policy):
    """The previous prefix-aware policy, kept for comparison (bench/prefix_routing.py) and for routers
    without KV events: longest recorded prefix wins among endpoints under the load bound; a prefix seen nowhere goes to
    its place on a consistent-hash ring (keyed by its first `cold_key_blocks` blocks), so replicas
    without shared state agree, skipping endpoints over the load bound or holding far more than their
    share of the index; prompts shorter than one block go to the least loaded endpoint."""

    name = "bounded-prefix"

    def __init__(self, load_factor: float = 1.25, cold_key_blocks: int = 8, vnodes: int = 64) -> None:
        super().__init__(vnodes)
        self.load_factor = load_factor
        self.cold_key_blocks = cold_key_blocks
        self._fallback = LeastLoad()

    def choose(self, candidates: list[Endpoint], req: RoutingRequest, prefix: PrefixView) -> Decision:
        hashes = req.block_hashes
        if not hashes:
            return self._fallback.choose(candidates, req, prefix)
        matches = prefix.matches
        bound = load_bound(candidates, self.load_factor)
        eligible = [e for e in candidates if e.in_flight_requests + 1 <= bound] or candidates
        best = max(eligible, key=lambda e: (matches.get(e.url, 0), -e.in_flight_requests))
        best_blocks = matches.get(best.url, 0)
        if best_blocks > 0:
            top = max(matches.values(), default=0)
            reason = "prefix_hit" if best_blocks == top else "overflow"
            return Decision(best, reason, best_blocks, matches)
        key = self._cold_key(req, self.cold_key_blocks)
        # Bounded in cache footprint too: a new prefix skips an endpoint that already holds much more
        # than its share of the blocks routed so far, else a few hot ring arcs overfill one cache.
        sizes = {e.url: prefix.size(e.url) for e in candidates}
        n = prefix.num_blocks
        limit = self.load_factor * (sum(sizes.values()) + n) / len(candidates)
        ep = self._ring_pick(candidates, key, bound, lambda e: sizes[e.url] + n <= limit)
        reason = "overflow" if matches else "cold_hash"
        return Decision(ep, reason, matches.get(ep.url, 0), matches)


class SessionAffinity(_RingMixin, Policy):
    """Requests carrying the session header go to the session's place on the ring (bounded by load);
    the others are balanced by least load."""

    name = "session-affinity"

    def __init__(self, load_factor: float = 1.25, vnodes: int = 64) -> None:
        super().__init__(vnodes)
        self.load_factor = load_factor
        self._fallback = LeastLoad()

    def choose(self, candidates: list[Endpoint], req: RoutingRequest, prefix: PrefixView) -> Decision:
        if req.session is None:
            return self._fallback.choose(candidates, req, prefix)
        bound = load_bound(candidates, self.load_factor)
        ep = self._ring_pick(candidates, hash64(req.session.encode()), bound)
        return Decision(ep, "session")


POLICIES = ("round-robin", "least-load", "prefix-aware", "bounded-prefix", "session-affinity")


def make_policy(name: str, load_factor: float = 1.25, cold_key_blocks: int = 8,
                weights: ScoreWeights | None = None) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "prefix-aware":
        return PrefixAware(weights, cold_key_blocks=cold_key_blocks)
    if name == "bounded-prefix":
        return BoundedPrefix(load_factor=load_factor, cold_key_blocks=cold_key_blocks)
    if name == "session-affinity":
        return SessionAffinity(load_factor=load_factor)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
