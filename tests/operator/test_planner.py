"""The planner on synthetic load series: replicas follow load within the windows, never flap, keep
their bounds and the prefill:decode ratio, and reach zero only through the idle rule."""

from __future__ import annotations

import dataclasses

from planner_utils import INTERVAL, Offered, System, at, config, direction_changes, run, series

from tandem_operator.autoscaling.planner import Planner, Replicas
from tandem_operator.autoscaling.signals import PoolSignals, RouterSignals, Signals

QUIET = Offered(streams=4, prompt_rate=500)


def test_step_up_after_the_up_window_and_back_down_after_the_down_window() -> None:
    busy = Offered(streams=40, prompt_rate=500)
    steps = run(Planner(config()), System(), lambda t: busy if 300 <= t < 1200 else QUIET, 2000, Replicas(1, 1))
    decode = series(steps)
    assert at(steps, 299) == 1
    assert at(steps, 300 + 30 - 1) == 1  # the up window: a step must last 30 s
    assert at(steps, 300 + 30 + INTERVAL) == 3  # 40 streams / max_num_seqs 16
    assert at(steps, 1200 + 300 - INTERVAL) == 3  # the down window: 300 s of lower recommendations
    assert at(steps, 1200 + 300 + INTERVAL) == 1
    assert direction_changes(decode) == 1
    assert set(series(steps, "prefill")) == {1}  # prefill's load never changed
    up = next(s.plan.decode for s in steps if s.plan.decode.scaling)
    assert up.reason == "decode 1->3: running+waiting 40.0 per replica > max_num_seqs 16"


def test_requests_queued_in_the_router_scale_decode_before_latency_shows_them() -> None:
    """Under the router's admission control the engines never hold more than their slots (running 16,
    waiting 0, ITL within target): the backlog waits in the router, whose in-flight count is the signal."""
    busy = Offered(streams=40, prompt_rate=500)
    steps = run(Planner(config()), System(router_admission=True), lambda t: busy, 300, Replicas(1, 1))
    up = next(s.plan.decode for s in steps if s.plan.decode.scaling)
    assert up.reason == "decode 1->3: router in flight 40.0 per replica > max_num_seqs 16"
    assert series(steps)[-1] == 3 and direction_changes(series(steps)) == 0


def test_itl_over_target_scales_decode_and_says_so() -> None:
    system = System(max_num_seqs=64)  # the batch never fills: only ITL tells
    steps = run(Planner(config()), system, lambda t: Offered(streams=30, prompt_rate=100), 300, Replicas(1, 1))
    up = next(s.plan.decode for s in steps if s.plan.decode.scaling)
    # ITL = 0.03 + 0.012 x 30 = 0.39 s at one replica
    assert up.reason == "decode 1->2: ITL p90 0.39 s > target 0.25 s"
    assert series(steps)[-1] == 2  # 15 streams each: 0.21 s, under target
    assert direction_changes(series(steps)) == 0


def test_ramp_only_rises_and_ends_within_target() -> None:
    def ramp(t: float) -> Offered:
        return Offered(streams=2 + 100 * min(t, 1200) / 1200, prompt_rate=500)

    steps = run(Planner(config()), System(noise=0.1), ramp, 1800, Replicas(1, 1))
    decode = series(steps)
    assert decode == sorted(decode)  # never a step down while load grows
    assert decode[-1] == 7  # 102 streams / 16 per replica
    last = System().decode(ramp(1800), decode[-1])
    assert last.itl_seconds is not None and last.itl_seconds <= 0.25 and last.waiting == 0


def test_a_spike_shorter_than_the_up_window_changes_nothing() -> None:
    spike = Offered(streams=120, prompt_rate=20000)
    steps = run(Planner(config()), System(), lambda t: spike if t == 600 else QUIET, 1200, Replicas(1, 1))
    assert set(series(steps)) == {1} and set(series(steps, "prefill")) == {1}
    spiked = next(s.plan.decode for s in steps if s.time == 600)
    assert spiked.recommended == 8 and spiked.desired == 1
    assert "8 recommended, waiting out the 30 s window" in spiked.reason


def test_noise_around_a_steady_load_does_not_flap() -> None:
    steady = Offered(streams=40, prompt_rate=3000)
    steps = run(Planner(config()), System(noise=0.3), lambda t: steady, 3600, Replicas(1, 1))
    for role in ("decode", "prefill"):
        assert direction_changes(series(steps, role)) == 0, series(steps, role)
        settled = series(steps, role)[len(steps) // 2:]
        assert len(set(settled)) == 1, settled  # one size for the second half hour


def test_prefill_follows_prompt_tokens_against_measured_throughput() -> None:
    steps = run(Planner(config()), System(), lambda t: Offered(streams=4, prompt_rate=500 if t < 300 else 6000),
                1500, Replicas(1, 1))
    prefill = series(steps, "prefill")
    assert prefill[-1] == 4  # 6000 tokens/s at 80% of 2000/s per replica
    assert direction_changes(prefill) == 0
    assert any("prompt tokens 2000/s per replica > 80% of measured 2000/s" in s.plan.prefill.reason
               for s in steps if s.plan.prefill is not None and s.plan.prefill.scaling)
    assert set(series(steps)) == {1}  # decode had nothing more to do


def test_a_dead_metrics_endpoint_holds_and_never_scales_down_or_to_zero() -> None:
    planner = Planner(config(decode=(0, 8), prefill=(0, 8), idle_seconds=60))

    def load(t: float) -> Offered:
        if t < 300:
            return Offered(streams=40, prompt_rate=500)
        return Offered(dead=frozenset({"decode"}))  # load gone, but decode's scrapes fail

    steps = run(planner, System(), load, 1800, Replicas(1, 1))
    decode = series(steps)
    assert max(decode) == 3
    assert decode[decode.index(3):] == [3] * (len(decode) - decode.index(3))  # held, not lowered
    assert steps[-1].plan.decode.reason == "decode 3: holding: no metrics from 3 of 3 pods"
    assert min(series(steps, "prefill")) == 1  # idle never counted while a pool was unreadable


def test_pods_that_answer_can_raise_a_partly_dead_pool_but_never_lower_it() -> None:
    planner = Planner(config(down=0, up=0))
    quiet = System().signals(0, QUIET, Replicas(3, 1))
    partly = dataclasses.replace(quiet, decode=dataclasses.replace(quiet.decode, pods=1, missing=2))
    plan = planner.plan(partly, Replicas(3, 1))
    assert plan.decode.desired == 3 and plan.decode.recommended == 3
    assert plan.decode.reason == "decode 3: holding: no metrics from 2 of 3 pods"
    # the one pod that answers runs a full batch and has as many waiting
    partly = dataclasses.replace(quiet, time=15, decode=dataclasses.replace(partly.decode, running=16, waiting=16))
    plan = planner.plan(partly, Replicas(3, 1))
    assert plan.decode.desired == 3  # one answering pod at 2x its batch: ceil(1 x 2) = 2, never below 3
    partly = dataclasses.replace(partly, decode=dataclasses.replace(partly.decode, running=16, waiting=80))
    plan = planner.plan(dataclasses.replace(partly, time=30), Replicas(3, 1))
    assert plan.decode.desired == 6
    assert plan.decode.reason.endswith("; no metrics from 2 of 3 pods")
    assert planner.plan(dataclasses.replace(quiet, time=45), Replicas(6, 1)).decode.desired == 1  # all answer


def test_an_unreadable_router_never_lets_the_pools_reach_zero() -> None:
    planner = Planner(config(decode=(0, 8), prefill=(0, 8), idle_seconds=60))
    steps = run(planner, System(), lambda t: Offered(dead=frozenset({"router"})), 1800, Replicas(2, 1))
    assert min(series(steps)) == 1 and min(series(steps, "prefill")) == 1


def test_bounds_cap_and_floor_each_role() -> None:
    planner = Planner(config(decode=(2, 4), prefill=(1, 2)))
    flood = Offered(streams=500, prompt_rate=50000)
    steps = run(planner, System(), lambda t: flood if t < 900 else Offered(), 2000, Replicas(2, 1))
    assert max(series(steps)) == 4 and max(series(steps, "prefill")) == 2
    assert series(steps)[-1] == 2 and series(steps, "prefill")[-1] == 1  # idle: min, not zero
    capped = next(s.plan.decode for s in steps if s.plan.decode.scaling)
    assert capped.reason.endswith("(32 kept within bounds 2-4)"), capped.reason
    # a current size outside the bounds (the user just narrowed them) is corrected at once
    plan = Planner(config(decode=(2, 4))).plan(System().signals(0, QUIET, Replicas(9, 1)), Replicas(9, 1))
    assert plan.decode.desired == 4


def test_a_restarted_planner_waits_a_full_window_before_scaling_down() -> None:
    planner = Planner(config())
    steps = run(planner, System(), lambda t: QUIET, 600, Replicas(5, 3))
    assert at(steps, 300 - INTERVAL) == 5 and at(steps, 300 - INTERVAL, "prefill") == 3
    assert at(steps, 300 + INTERVAL) == 1 and at(steps, 300 + INTERVAL, "prefill") == 1


def test_ratio_bounds_raise_the_pool_that_falls_short() -> None:
    planner = Planner(config(ratio=(0.5, 2.0)))
    steps = run(planner, System(), lambda t: Offered(streams=90, prompt_rate=500), 600, Replicas(1, 1))
    assert series(steps)[-1] == 6  # 90 / 16
    assert series(steps, "prefill")[-1] == 3  # prefill's own load asks for 1; min ratio 0.5 asks for 3
    raised = next(s.plan.prefill for s in steps if s.plan.prefill is not None and s.plan.prefill.scaling)
    assert raised.reason == "prefill 1->3: prefill:decode ratio 1:6 < min 0.5"
    for step in steps:
        assert step.replicas.prefill is not None and step.replicas.prefill * 2 >= step.replicas.decode
    # the max bound raises decode when prefill is the busy pool
    planner = Planner(config(ratio=(None, 1.0)))
    steps = run(planner, System(), lambda t: Offered(streams=4, prompt_rate=6000), 1500, Replicas(1, 1))
    assert series(steps, "prefill")[-1] == 4 and series(steps)[-1] == 4


def test_idle_to_zero_only_after_the_idle_period_then_back_on_held_requests() -> None:
    planner = Planner(config(decode=(0, 8), prefill=(0, 8), idle_seconds=120, down=60))

    def load(t: float) -> Offered:
        if t < 300:
            return QUIET
        if t < 900:
            return Offered()  # nobody
        return Offered(held=2)  # a request arrives and the router holds it

    steps = run(planner, System(), load, 1000, Replicas(1, 1))
    assert at(steps, 300 + 120 - INTERVAL) == 1  # not before the idle period
    assert at(steps, 300 + 120) == 0 and at(steps, 300 + 120, "prefill") == 0
    zero = next(s.plan.decode for s in steps if s.replicas.decode == 0)
    assert zero.reason == "decode 1->0: idle for 120 s (no arrivals, no held requests)"
    assert set(series(steps)[series(steps).index(0):steps.index(next(s for s in steps if s.time == 900))]) == {0}
    woke = next(s.plan for s in steps if s.time == 900)
    assert (woke.decode.desired, woke.prefill.desired if woke.prefill else None) == (1, 1)
    assert woke.decode.reason == "decode 0->1: 2 requests held at the router"


def test_from_zero_goes_to_min_and_waits_for_demand() -> None:
    planner = Planner(config(decode=(0, 8), prefill=(0, 8)))
    idle = Signals(time=0, interval_seconds=INTERVAL, router=RouterSignals(readable=True, arrivals_per_second=0.0),
                   decode=PoolSignals(pods=0, missing=0), prefill=PoolSignals(pods=0, missing=0))
    assert planner.plan(idle, Replicas(0, 0)).decode.desired == 0
    arriving = dataclasses.replace(idle, time=15, router=RouterSignals(readable=True, arrivals_per_second=0.5))
    plan = planner.plan(arriving, Replicas(0, 0))
    assert (plan.decode.desired, plan.prefill.desired if plan.prefill else None) == (1, 1)
    # a router that cannot be read shows no demand: stay down rather than guess
    blind = dataclasses.replace(idle, time=30, router=RouterSignals(readable=False))
    assert planner.plan(blind, Replicas(0, 0)).decode.reason == (
        "decode 0: router metrics unreadable, no demand seen"
    )
    # with minReplicas above 0 the pools come back even without demand
    awake = Planner(config(decode=(2, 8), prefill=(1, 8)))
    plan = awake.plan(idle, Replicas(0, 0))
    assert (plan.decode.desired, plan.prefill.desired if plan.prefill else None) == (2, 1)


def test_a_slow_decode_leg_does_not_grow_prefill() -> None:
    """The router's TTFT holds the decode leg too; prefill answers only for its own queue and compute."""
    planner = Planner(config(up=0))
    signals = System().signals(0, Offered(streams=100, prompt_rate=500), Replicas(1, 1))
    slow = dataclasses.replace(signals, router=dataclasses.replace(signals.router, ttft_seconds=9.0))
    plan = planner.plan(slow, Replicas(1, 1))
    assert plan.prefill is not None and plan.prefill.desired == 1
    assert plan.prefill.reason == "prefill 1: TTFT p90 0.40 s < target 2.00 s"
    assert plan.decode.desired == 7  # 100 streams / 16


def test_colocated_decode_scales_on_ttft_too() -> None:
    planner = Planner(config(prefill=None))
    system = System(disaggregated=False, max_num_seqs=64)
    signals = system.signals(0, Offered(streams=4), Replicas(1))
    slow = dataclasses.replace(signals, router=dataclasses.replace(signals.router, ttft_seconds=5.0))
    plan = None
    for tick in range(4):
        plan = planner.plan(dataclasses.replace(slow, time=tick * INTERVAL), Replicas(1))
    assert plan is not None and plan.prefill is None
    assert plan.decode.reason == "decode 1->3: TTFT p90 5.00 s > target 2.00 s"
