"""A toy P/D service for the planner tests: what its metrics would say at a given offered load and size.

Decode: requests streaming at once are shared by the ready decode replicas; ITL grows with each
replica's batch, requests beyond `max_num_seqs` wait. Prefill: prompt tokens arrive at a rate, each
replica processes up to `prefill_capacity` tokens/s, TTFT grows with utilisation and a queue forms
past it. New replicas become ready `lag_ticks` ticks after the planner asked for them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem_operator.autoscaling.planner import Plan, Planner, Replicas
from tandem_operator.autoscaling.signals import PoolSignals, RouterSignals, Signals
from tandem_operator.autoscaling.spec import AutoscalingSpec, Fallback, RatioBounds, RoleBounds, Targets

INTERVAL = 15.0


def config(
    decode: tuple[int, int] = (1, 8),
    prefill: tuple[int, int] | None = (1, 8),
    ratio: tuple[float | None, float | None] = (None, None),
    idle_seconds: int = 600,
    up: int = 30,
    down: int = 300,
) -> AutoscalingSpec:
    """The defaults a user who sets only min/max gets (as `autoscaling.parse_autoscaling` makes them)."""
    return AutoscalingSpec(
        prefill=None if prefill is None else RoleBounds(*prefill),
        decode=RoleBounds(*decode),
        targets=Targets(percentile=90, ttft_seconds=2.0, itl_seconds=0.25),
        fallback=Fallback(queue_depth_per_replica=4.0, kv_cache_usage=0.8),
        scale_up_seconds=up,
        scale_down_seconds=down,
        ratio=RatioBounds(*ratio),
        idle_seconds=idle_seconds,
        interval_seconds=int(INTERVAL),
        hold_seconds=300,
    )


@dataclass(frozen=True)
class Offered:
    streams: float = 0.0  # requests decoding at once
    prompt_rate: float = 0.0  # prompt tokens/s arriving
    dead: frozenset[str] = frozenset()  # "router", "prefill", "decode": their scrapes fail
    held: float = 0.0  # requests the router holds (also counted when no decode replica is ready)


@dataclass
class System:
    max_num_seqs: int = 16
    prefill_capacity: float = 2000.0
    lag_ticks: int = 1
    noise: float = 0.0  # relative, uniform, seeded
    disaggregated: bool = True
    # The router's admission control holds what the engines' slots cannot take: engines never queue,
    # the backlog waits in the router (still counted in its in-flight requests).
    router_admission: bool = False
    rng: random.Random = field(default_factory=lambda: random.Random(14))

    def _jitter(self, value: float) -> float:
        return value * (1.0 + self.rng.uniform(-self.noise, self.noise))

    def decode(self, offered: Offered, ready: int) -> PoolSignals:
        if "decode" in offered.dead:
            return PoolSignals(pods=0, missing=max(ready, 1))
        if ready == 0:
            return PoolSignals(pods=0, missing=0)
        per = self._jitter(offered.streams) / ready
        running = min(per, self.max_num_seqs)
        return PoolSignals(
            pods=ready,
            missing=0,
            running=running * ready,
            waiting=0.0 if self.router_admission else max(0.0, per - self.max_num_seqs) * ready,
            kv_usage_mean=min(1.0, 0.02 * per),
            kv_usage_max=min(1.0, 0.02 * per),
            max_num_seqs=self.max_num_seqs,
            itl_seconds=0.03 + 0.012 * running if offered.streams else None,
        )

    def prefill(self, offered: Offered, ready: int) -> PoolSignals:
        if "prefill" in offered.dead:
            return PoolSignals(pods=0, missing=max(ready, 1))
        if ready == 0:
            return PoolSignals(pods=0, missing=0)
        rate = self._jitter(offered.prompt_rate)
        use = rate / (ready * self.prefill_capacity)
        return PoolSignals(
            pods=ready,
            missing=0,
            waiting=max(0.0, use - 1.0) * 4.0 * ready,
            kv_usage_mean=min(1.0, 0.1 * use),
            prompt_tokens_per_second=min(rate, ready * self.prefill_capacity),
            ttft_seconds=0.2 + 0.8 * use if rate else None,
        )

    def signals(self, t: float, offered: Offered, ready: Replicas) -> Signals:
        prefill = self.prefill(offered, ready.prefill or 0) if self.disaggregated else None
        busy = offered.streams > 0 or offered.prompt_rate > 0
        held = offered.held + (offered.streams if busy and ready.decode == 0 else 0.0)
        router = (
            RouterSignals(readable=False)
            if "router" in offered.dead
            else RouterSignals(readable=True, arrivals_per_second=offered.streams / 4, in_flight=offered.streams,
                               held=held)
        )
        return Signals(time=t, interval_seconds=INTERVAL, router=router, decode=self.decode(offered, ready.decode),
                       prefill=prefill)


@dataclass(frozen=True)
class Step:
    time: float
    replicas: Replicas  # set after this tick's plan
    plan: Plan


def run(
    planner: Planner,
    system: System,
    load: Callable[[float], Offered],
    seconds: float,
    start: Replicas,
) -> list[Step]:
    """Tick every INTERVAL seconds for `seconds`, applying each plan to the toy service."""
    replicas, asked = start, [start] * (system.lag_ticks + 1)
    steps: list[Step] = []
    t = 0.0
    while t <= seconds:
        ready = asked[0]
        ready = Replicas(decode=min(ready.decode, replicas.decode),
                         prefill=None if replicas.prefill is None else min(ready.prefill or 0, replicas.prefill))
        plan = planner.plan(system.signals(t, load(t), ready), replicas)
        replicas = Replicas(decode=plan.decode.desired,
                            prefill=replicas.prefill if plan.prefill is None else plan.prefill.desired)
        asked = [*asked[1:], replicas]
        steps.append(Step(t, replicas, plan))
        t += INTERVAL
    return steps


def series(steps: list[Step], role: str = "decode") -> list[int]:
    return [s.replicas.decode if role == "decode" else (s.replicas.prefill or 0) for s in steps]


def direction_changes(values: list[int]) -> int:
    """How often the replicas turned from rising to falling or back: flapping shows up here."""
    moves = [b - a for a, b in zip(values, values[1:], strict=False) if b != a]
    return sum(1 for a, b in zip(moves, moves[1:], strict=False) if (a > 0) != (b > 0))


def at(steps: list[Step], t: float, role: str = "decode") -> int:
    """Replicas after the last tick at or before `t`."""
    last = [s for s in steps if s.time <= t][-1]
    return last.replicas.decode if role == "decode" else (last.replicas.prefill or 0)
