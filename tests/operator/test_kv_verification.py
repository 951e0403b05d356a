"""KVTransferVerified, judged from two scrapes of the router and the engines (operator/tandem_operator/
kv_verification.py), and kept by reconciles. The condition on a real cluster: tests/operator/test_cluster_e2e.py."""

from __future__ import annotations

from typing import Any

from isvc_utils import example

from tandem_operator.autoscaling.signals import EngineSample, RouterSample, Scrape, parse_engine, parse_router
from tandem_operator.kv_verification import judge, revisions
from tandem_operator.spec import parse_spec
from tandem_operator.status import KV_CONDITION, compute_status, invalid_status, kv_condition


def decode(received: float = 0.0, failures: float = 0.0) -> EngineSample:
    return EngineSample(running=0.0, waiting=0.0, kv_usage=0.0, max_num_seqs=64.0, prompt_tokens=0.0, ttft=(),
                        itl=(), kv_received_blocks=received, kv_failures=failures)


def router(**decisions: float) -> RouterSample:
    return RouterSample(requests=0.0, in_flight=0.0, held=0.0, ttft=(), pd_decisions=tuple(sorted(decisions.items())))


def scrape(t: float, decodes: dict[str, EngineSample | None], **decisions: float) -> Scrape:
    return Scrape(time=t, router={"r": router(**decisions)}, decode=decodes, prefill={"p": decode()})


BASE = scrape(0.0, {"d0": decode(100), "d1": decode(50)}, remote=10, local_short_uncached=4)


def test_blocks_received_make_it_true_and_an_idle_interval_says_nothing() -> None:
    moved = judge(BASE, scrape(15.0, {"d0": decode(130), "d1": decode(50)}, remote=12, local_short_uncached=9))
    assert moved is not None and (moved.ok, moved.reason) == (True, "KVReceived")
    assert "received 30 KV blocks" in moved.message and "in the last 15 s" in moved.message
    assert judge(BASE, scrape(15.0, {"d0": decode(100), "d1": decode(50)}, remote=10, local_short_uncached=20)) is None
    assert judge(None, BASE) is None  # the first scrape only sets the baseline


def test_failed_loads_make_it_false_even_when_some_blocks_moved() -> None:
    failed = judge(BASE, scrape(15.0, {"d0": decode(120, failures=3), "d1": decode(50)}, remote=14))
    assert failed is not None and (failed.ok, failed.reason) == (False, "TransferFailed")
    assert failed.message.startswith("3 KV loads failed") and "(20 blocks received)" in failed.message


def test_prompts_that_went_remote_but_moved_nothing_are_decode_only_in_disguise() -> None:
    silent = judge(BASE, scrape(15.0, {"d0": decode(100), "d1": decode(50)}, remote=13))
    assert silent is not None and (silent.ok, silent.reason) == (False, "NoKVReceived")
    # One such prompt may be a full prefix hit on decode: it takes two to say so.
    assert judge(BASE, scrape(15.0, {"d0": decode(100), "d1": decode(50)}, remote=11)) is None


def test_prefill_falling_back_or_missing_is_named() -> None:
    back = judge(BASE, scrape(15.0, {"d0": decode(110), "d1": decode(50)}, remote=12, local_fallback=3))
    assert back is not None and (back.ok, back.reason) == (False, "PrefillFallingBack")
    assert back.message.startswith("3 of 5 prompts")
    few = judge(BASE, scrape(15.0, {"d0": decode(190), "d1": decode(50)}, remote=30, local_fallback=2))
    assert few is not None and few.ok  # 2 of 22 is below the threshold
    none = judge(BASE, scrape(15.0, {"d0": decode(100), "d1": decode(50)}, remote=10, local_no_prefill=6))
    assert none is not None and (none.ok, none.reason) == (False, "NoPrefillEngine")
    paired = judge(BASE, scrape(15.0, {"d0": decode(100), "d1": decode(50)}, remote=10,
                                local_no_prefill_of_revision=2))
    assert paired is not None and paired.reason == "NoPrefillEngine"


def test_restarted_and_unreadable_pods_do_not_fake_a_verdict() -> None:
    # d0 restarted (its counter went down: counted from zero), d1 did not answer (left out), d2 is new
    # (baseline only): 5 blocks received, from d0's new life.
    later = scrape(15.0, {"d0": decode(5), "d1": None, "d2": decode(500)}, remote=11)
    moved = judge(BASE, later)
    assert moved is not None and moved.ok and "received 5 KV blocks" in moved.message


def test_the_counters_are_read_from_the_real_metric_names() -> None:
    engine = parse_engine("vllm:num_requests_running 0\ntandem:kv_transfer_received_blocks_total 42\n"
                          "tandem:kv_transfer_failures_total 1\n")
    assert (engine.kv_received_blocks, engine.kv_failures) == (42, 1)
    r = parse_router('tandem:router_admitted_requests 0\ntandem:router_pd_decisions_total{decision="remote"} 7\n'
                     'tandem:router_pd_decisions_total{decision="local_fallback"} 2\n')
    assert r.decisions("remote") == 7 and r.decisions("remote", "local_fallback") == 9


def status_of(obj: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
    return compute_status(parse_spec(obj), 3, {}, previous)


def test_reconciles_keep_the_condition_the_verifier_wrote() -> None:
    obj = example("disaggregated")
    fresh = {c["type"]: c for c in status_of(obj, {})["conditions"]}
    assert fresh[KV_CONDITION]["status"] == "Unknown" and fresh[KV_CONDITION]["reason"] == "AwaitingTransfers"
    written = kv_condition(False, "TransferFailed", "2 KV loads failed", 3, fresh[KV_CONDITION])
    current = {"conditions": [*(c for c in fresh.values() if c["type"] != KV_CONDITION), written]}
    kept = {c["type"]: c for c in status_of(obj, current)["conditions"]}
    assert kept[KV_CONDITION] == written
    assert {c["type"]: c for c in invalid_status(["bad"], 4, current)["conditions"]}[KV_CONDITION] == written
    colocated = {c["type"] for c in status_of(example("colocated"), current)["conditions"]}
    assert KV_CONDITION not in colocated


def router_at(endpoints: dict[tuple[str, str], int], requests: dict[str, float]) -> RouterSample:
    return RouterSample(requests=0.0, in_flight=0.0, held=0.0, ttft=(),
                        revision_endpoints=tuple(sorted((role, rev, float(n)) for (role, rev), n in endpoints.items())),
                        revision_requests=tuple(sorted(requests.items())))


def test_revisions_show_what_serves_during_a_rollout_and_each_ones_share() -> None:
    old = {("prefill", "r1"): 1, ("decode", "r1"): 2}
    before = Scrape(time=0.0, router={"a": router_at(old, {"r1": 100}), "b": router_at(old, {"r1": 40})}, decode={})
    assert revisions(None, before) == [{"revision": "r1", "prefill": 1, "decode": 2}]  # no interval: no share
    rolling = {("prefill", "r1"): 1, ("decode", "r1"): 1, ("prefill", "r2"): 1, ("decode", "r2"): 1}
    mid = Scrape(time=15.0, router={"a": router_at(rolling, {"r1": 110, "r2": 10}),
                                    "b": router_at(rolling, {"r1": 45, "r2": 25})}, decode={})
    assert revisions(before, mid) == [{"revision": "r1", "prefill": 1, "decode": 1, "requestShare": 0.3},
                                      {"revision": "r2", "prefill": 1, "decode": 1, "requestShare": 0.7}]
    done = {("prefill", "r1"): 0, ("decode", "r1"): 0, ("prefill", "r2"): 1, ("decode", "r2"): 2}
    after = Scrape(time=30.0, router={"a": router_at(done, {"r1": 110, "r2": 40}),
                                      "b": router_at(done, {"r1": 45, "r2": 35})}, decode={})
    assert revisions(mid, after) == [{"revision": "r2", "prefill": 1, "decode": 2, "requestShare": 1.0}]
    text = ('tandem:router_admitted_requests 0\n'
            'tandem:router_revision_endpoints{role="decode",revision="r2"} 2\n'
            'tandem:router_revision_requests_total{revision="r2"} 9\n')
    assert parse_router(text).revision_endpoints == (("decode", "r2", 2.0),)
    assert parse_router(text).revision_requests == (("r2", 9.0),)
