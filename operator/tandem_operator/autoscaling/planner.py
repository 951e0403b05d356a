"""The autoscaling planner's decisions: `Signals` and the current replicas in, a `Decision` per role out.

Pure: no I/O and no clock; the time is the scrape's. The model (docs/architecture.md, "P/D
autoscaling"): every load signal of a role is a ratio of observed to target; the role's recommendation
is the current size times the largest ratio (like the HorizontalPodAutoscaler), unchanged while that
ratio is within the tolerance band; recommendations pass through the stabilization windows (up: the
lowest of the window, down: the highest), then the role's bounds, then the prefill:decode ratio
bounds. A pool whose scrapes failed is never scaled down, and zero is reached only through the idle
rule, measured while the router's metrics were readable.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from tandem_operator.autoscaling.signals import PoolSignals, Signals
from tandem_operator.autoscaling.spec import AutoscalingSpec, RoleBounds

TOLERANCE = 0.1  # ratios within 10% of 1 change nothing (the HPA's default)
PREFILL_UTILIZATION = 0.8  # share of a prefill replica's measured throughput the plan fills


@dataclass(frozen=True)
class Load:
    """One signal of a role: `ratio` is observed / target; `text` and `target` explain it."""

    text: str
    target: str
    ratio: float


@dataclass(frozen=True)
class Replicas:
    decode: int
    prefill: int | None = None  # None: not autoscaled (colocated, or left at spec.prefill.replicas)


@dataclass(frozen=True)
class Decision:
    role: str  # "prefill" or "decode"
    current: int
    recommended: int  # this tick's recommendation, before the windows and bounds
    desired: int
    reason: str

    @property
    def scaling(self) -> bool:
        return self.desired != self.current


@dataclass(frozen=True)
class Plan:
    decode: Decision
    prefill: Decision | None = None

    @property
    def decisions(self) -> tuple[Decision, ...]:
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)


class _Window:
    """Recommendations of one role over time, for the stabilization windows."""

    def __init__(self) -> None:
        self.history: deque[tuple[float, int]] = deque()
        self.started: float | None = None

    def stabilize(self, now: float, current: int, recommended: int, up_seconds: int, down_seconds: int) -> int:
        if self.started is None:
            self.started = now
        self.history.append((now, recommended))
        while self.history[0][0] < now - max(up_seconds, down_seconds):
            self.history.popleft()
        up = min(r for t, r in self.history if t >= now - up_seconds)
        down = max(r for t, r in self.history if t >= now - down_seconds)
        # A new (or restarted) planner has no history: it counts as having recommended `current`.
        if now - self.started < up_seconds:
            up = min(up, current)
        if now - self.started < down_seconds:
            down = max(down, current)
        desired = current
        if desired < up:
            desired = up
        if desired > down:
            desired = down
        return desired

    def clear(self) -> None:
        self.history.clear()
        self.started = None


def _seconds(value: float) -> str:
    return f"{value:.2f} s"


def _latency(name: str, observed: float | None, target: float, percentile: int) -> list[Load]:
    if observed is None:
        return []
    return [Load(f"{name} p{percentile} {_seconds(observed)}", f"target {_seconds(target)}", observed / target)]


def _queue(pool: PoolSignals, config: AutoscalingSpec) -> Load:
    target = config.fallback.queue_depth_per_replica
    per = pool.waiting / pool.pods
    return Load(f"waiting {per:.1f} per replica", f"target {target:g}", per / target)


def _kv(pool: PoolSignals, config: AutoscalingSpec) -> list[Load]:
    if pool.kv_usage_mean is None:
        return []
    target = config.fallback.kv_cache_usage
    return [Load(f"KV usage {pool.kv_usage_mean:.2f}", f"target {target:.2f}", pool.kv_usage_mean / target)]


def _recommend(current: int, pods: int, loads: list[Load]) -> tuple[int, Load | None]:
    """The replicas the largest ratio asks for, and that load; `current` while it is in the band."""
    if not loads:
        return current, None
    top = max(loads, key=lambda load: load.ratio)
    if abs(top.ratio - 1.0) <= TOLERANCE:
        return current, top
    wanted = math.ceil(pods * top.ratio - 1e-9)
    # Pods still starting are not in `pods`: while the load asks for more, keep them.
    return (max(wanted, current), top) if top.ratio > 1.0 else (min(wanted, current), top)


class Planner:
    """One per autoscaled InferenceService; `plan()` once per tick with that tick's signals."""

    def __init__(self, config: AutoscalingSpec) -> None:
        self.config = config
        self.windows = {"prefill": _Window(), "decode": _Window()}
        self.prefill_capacity: float | None = None  # prompt tokens/s one saturated prefill replica did
        self.idle_since: float | None = None

    def plan(self, signals: Signals, current: Replicas) -> Plan:
        self._track_idle(signals)
        self._learn_prefill_capacity(signals)
        if self._at_zero(current):
            return self._from_zero(signals, current)
        if self._idle_long_enough(signals.time):
            return self._to_zero(signals, current)
        decode = self._role("decode", signals, current.decode)
        prefill = None
        if self.config.prefill is not None and current.prefill is not None:
            prefill = self._role("prefill", signals, current.prefill)
        return self._apply_ratio(prefill, decode)

    # Load signals per role.

    def _decode_loads(self, signals: Signals, pool: PoolSignals) -> list[Load]:
        """ITL (and TTFT when colocated), batch capacity and KV usage; the queue when no request finished."""
        targets = self.config.targets
        loads = _latency("ITL", pool.itl_seconds, targets.itl_seconds, signals.percentile)
        if signals.prefill is None:  # colocated: decode engines also prefill
            loads += self._ttft(signals, pool)
        if not loads:
            loads.append(_queue(pool, self.config))
        if pool.max_num_seqs:
            per = (pool.running + pool.waiting) / pool.pods
            loads.append(Load(f"running+waiting {per:.1f} per replica", f"max_num_seqs {pool.max_num_seqs:g}",
                              per / pool.max_num_seqs))
            if signals.router.readable:
                # Leading: under admission control the backlog waits in the router, not in the engines,
                # and shows there before any late first token does.
                per = signals.router.in_flight / pool.pods
                loads.append(Load(f"router in flight {per:.1f} per replica", f"max_num_seqs {pool.max_num_seqs:g}",
                                  per / pool.max_num_seqs))
        return loads + _kv(pool, self.config)

    def _prefill_loads(self, signals: Signals, pool: PoolSignals) -> list[Load]:
        """TTFT and prompt tokens against measured throughput; queue and KV usage when no TTFT."""
        loads = self._ttft(signals, pool)
        if not loads:
            loads += [_queue(pool, self.config), *_kv(pool, self.config)]
        if self.prefill_capacity and pool.prompt_tokens_per_second is not None:
            per = pool.prompt_tokens_per_second / pool.pods
            planned = self.prefill_capacity * PREFILL_UTILIZATION
            loads.append(Load(f"prompt tokens {per:.0f}/s per replica",
                              f"{PREFILL_UTILIZATION:.0%} of measured {self.prefill_capacity:.0f}/s", per / planned))
        return loads

    def _ttft(self, signals: Signals, pool: PoolSignals) -> list[Load]:
        return _latency("TTFT", self._observed_ttft(signals, pool), self.config.targets.ttft_seconds,
                        signals.percentile)

    @staticmethod
    def _observed_ttft(signals: Signals, pool: PoolSignals) -> float | None:
        """Prefill engines' own TTFT (their queue and compute: the router's TTFT also holds the decode
        leg, which decode's signals answer for); colocated, the router's, as clients see it."""
        if signals.prefill is None and signals.router.ttft_seconds is not None:
            return signals.router.ttft_seconds
        return pool.ttft_seconds

    def _learn_prefill_capacity(self, signals: Signals) -> None:
        """Per-replica prompt-token throughput of a prefill pool that had more work than it could do."""
        pool = signals.prefill
        if pool is None or not pool.pods or pool.dead or pool.prompt_tokens_per_second is None:
            return
        ttft = pool.ttft_seconds
        saturated = pool.waiting >= pool.pods or (ttft is not None and ttft > self.config.targets.ttft_seconds)
        if saturated:
            per = pool.prompt_tokens_per_second / pool.pods
            self.prefill_capacity = max(self.prefill_capacity or 0.0, per)

    # One role, from signals to a bounded, stabilized decision.

    def _role(self, role: str, signals: Signals, current: int) -> Decision:
        pool = signals.prefill if role == "prefill" else signals.decode
        bounds = self.config.prefill if role == "prefill" else self.config.decode
        assert pool is not None and bounds is not None
        hold = ""
        if pool.dead:
            hold = f"no metrics from {pool.missing} of {pool.pods + pool.missing} pods"
        elif pool.pods == 0 and current > 0:
            hold = "no pod ready to read metrics from"
        loads = []
        if pool.pods:
            loads = (self._prefill_loads if role == "prefill" else self._decode_loads)(signals, pool)
        unbounded, driver = _recommend(current, pool.pods, loads)
        if pool.dead:  # unknown load: may still scale up on what the other pods say, never down
            unbounded = max(unbounded, current)
        recommended = _clamp(unbounded, bounds)
        desired = self.windows[role].stabilize(
            signals.time, current, recommended, self.config.scale_up_seconds, self.config.scale_down_seconds
        )
        desired = _clamp(desired, bounds)
        return Decision(role, current, recommended, desired,
                        self._reason(role, current, (unbounded, recommended, desired), driver, hold, bounds))

    def _reason(
        self, role: str, current: int, steps: tuple[int, int, int], driver: Load | None, hold: str,
        bounds: RoleBounds,
    ) -> str:
        """`steps`: the recommendation unbounded, then bounded, then the stabilized desired replicas."""
        unbounded, recommended, desired = steps
        head = f"{role} {current}->{desired}" if desired != current else f"{role} {current}"
        if hold and unbounded <= current:
            why = f"holding: {hold}"
        elif driver is None:
            why = "no load signal"
        else:
            sign = ">" if driver.ratio > 1.0 + TOLERANCE else "<" if driver.ratio < 1.0 - TOLERANCE else "within 10% of"
            why = f"{driver.text} {sign} {driver.target}" + (f"; {hold}" if hold else "")
        if desired == current and recommended != current:
            window = self.config.scale_up_seconds if recommended > current else self.config.scale_down_seconds
            why += f"; {recommended} recommended, waiting out the {window} s window"
        elif desired != recommended:
            why += f"; recommended {recommended} over the last window"
        if unbounded != recommended:
            why += f" ({unbounded} kept within bounds {bounds.min_replicas}-{bounds.max_replicas})"
        return f"{head}: {why}"

    # The prefill:decode ratio bounds: the pool that falls short is raised, never the other lowered.

    def _apply_ratio(self, prefill: Decision | None, decode: Decision) -> Plan:
        ratio, config = self.config.ratio, self.config
        if prefill is None or config.prefill is None:
            return Plan(decode, prefill)
        p, d = prefill.desired, decode.desired
        if ratio.min is not None and p < d * ratio.min - 1e-9:
            raised = min(config.prefill.max_replicas, math.ceil(d * ratio.min - 1e-9))
            if raised > p:
                prefill = _raised(prefill, raised, f"prefill:decode ratio {p}:{d} < min {ratio.min:g}")
        if ratio.max is not None and p > d * ratio.max + 1e-9:
            raised = min(config.decode.max_replicas, math.ceil(p / ratio.max - 1e-9))
            if raised > d:
                decode = _raised(decode, raised, f"prefill:decode ratio {p}:{d} > max {ratio.max:g}")
        return Plan(decode, prefill)

    # Scale to zero and back.

    def _track_idle(self, signals: Signals) -> None:
        router = signals.router
        busy = [p for p in (signals.prefill, signals.decode) if p is not None and (p.running or p.waiting or p.dead)]
        if router.readable and router.arrivals_per_second is not None and not router.demand and not busy:
            if self.idle_since is None:
                self.idle_since = signals.time
        else:
            self.idle_since = None

    def _idle_long_enough(self, now: float) -> bool:
        return (
            self.config.scale_to_zero
            and self.idle_since is not None
            and now - self.idle_since >= self.config.idle_seconds
        )

    @staticmethod
    def _at_zero(current: Replicas) -> bool:
        """Decode at zero serves nothing, whatever prefill has: wake both or keep both down."""
        return current.decode == 0

    def _to_zero(self, signals: Signals, current: Replicas) -> Plan:
        assert self.idle_since is not None
        why = f"idle for {signals.time - self.idle_since:.0f} s (no arrivals, no held requests)"
        return self._everyone(current, 0, why)

    def _from_zero(self, signals: Signals, current: Replicas) -> Plan:
        router = signals.router
        decode_min = self.config.decode.min_replicas
        prefill_min = 0 if self.config.prefill is None else self.config.prefill.min_replicas
        if router.held > 0:
            return self._everyone(current, None, f"{router.held:.0f} requests held at the router")
        if router.in_flight > 0 or router.arrivals_per_second:
            return self._everyone(current, None, "requests arriving at the router")
        if decode_min > 0 or prefill_min > 0:
            return self._everyone(current, None, "minReplicas is above 0")
        why = "idle" if router.readable else "router metrics unreadable, no demand seen"
        return self._everyone(current, 0, why)

    def _everyone(self, current: Replicas, to: int | None, why: str) -> Plan:
        """Every autoscaled role to `to` (None: max(1, minReplicas)), past the windows."""
        for window in self.windows.values():
            window.clear()
        decisions: dict[str, Decision] = {}
        for role, bounds, now in (("decode", self.config.decode, current.decode),
                                  ("prefill", self.config.prefill, current.prefill)):
            if bounds is None or now is None:
                continue
            target = max(1, bounds.min_replicas) if to is None else to
            head = f"{role} {now}->{target}" if target != now else f"{role} {now}"
            decisions[role] = Decision(role, now, target, target, f"{head}: {why}")
        return Plan(decisions["decode"], decisions.get("prefill"))


def _clamp(replicas: int, bounds: RoleBounds) -> int:
    """Into the role's bounds; never below 1: zero only through the idle rule."""
    return min(bounds.max_replicas, max(bounds.min_replicas, 1, replicas))


def _raised(decision: Decision, to: int, why: str) -> Decision:
    reason = f"{decision.role} {decision.current}->{to}: {why}" if to != decision.current else decision.reason
    return Decision(decision.role, decision.current, decision.recommended, to, reason)
