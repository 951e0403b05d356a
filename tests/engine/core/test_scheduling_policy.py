"""`--scheduling-policy priority`: the waiting queue in (priority, arrival) order, the least urgent
running request preempted first, and admission order only (a waiting request never preempts)."""

from __future__ import annotations

from tandem_engine.config import SchedulingPolicy
from tandem_engine.core.kv_cache_manager import KVCacheManager
from tandem_engine.core.scheduler import Scheduler
from tandem_engine.request import Request
from tandem_engine.sampling_params import SamplingParams
from tests.engine.core.test_scheduler import BS, EOS, all_free, step


def make_sched(policy: SchedulingPolicy, num_blocks: int = 64, max_seqs: int = 8) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), max_seqs, 64, 128, policy=policy)


def req(rid: str, n_prompt: int, priority: int, arrival: float, max_tokens: int = 4, base: int = 1) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, [base + i for i in range(n_prompt)], sp, [EOS], arrival, priority=priority)


def test_priority_then_arrival_orders_admission() -> None:
    s = make_sched("priority", max_seqs=1)
    for rid, prio, arrival in [("low", 5, 1.0), ("mid", 0, 2.0), ("high", -1, 3.0), ("mid2", 0, 4.0)]:
        s.add_request(req(rid, 3, prio, arrival, base=10 * int(arrival)))
    out, _ = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["high"]
    assert [r.request_id for r in s.waiting] == ["mid", "mid2", "low"]
    order = []
    while s.has_requests:
        out, _ = step(s)
        order += [x.request.request_id for x in out.scheduled if x.request.request_id not in order]
    assert order == ["high", "mid", "mid2", "low"]
    assert all_free(s)


def test_fcfs_ignores_priority() -> None:
    s = make_sched("fcfs", max_seqs=1)
    s.add_request(req("first", 3, 5, 1.0))
    s.add_request(req("second", 3, -5, 2.0, base=20))
    out, _ = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["first"]


def test_the_least_urgent_running_request_is_preempted_and_keeps_its_place() -> None:
    # 4 usable blocks of 4 tokens: each 8-token prompt takes 2, and the next token needs a third.
    s = make_sched("priority", num_blocks=5)
    s.add_request(req("urgent_late", 8, 0, 2.0, max_tokens=8, base=50))
    s.add_request(req("relaxed_early", 8, 1, 1.0, max_tokens=8))
    out, _ = step(s)
    assert [(x.request.request_id, x.block_ids) for x in out.scheduled] == [
        ("urgent_late", [1, 2]), ("relaxed_early", [3, 4])]
    out, _ = step(s)
    # fcfs would preempt the newest (urgent_late); priority preempts the least urgent.
    assert out.preempted == ["relaxed_early"]
    assert [(x.request.request_id, x.block_ids) for x in out.scheduled] == [("urgent_late", [1, 2, 4])]
    s.add_request(req("later_same_priority", 2, 1, 3.0, max_tokens=1, base=90))
    s.add_request(req("later_urgent", 2, 0, 4.0, max_tokens=1, base=95))
    assert [r.request_id for r in s.waiting] == ["later_urgent", "relaxed_early", "later_same_priority"]
    while s.has_requests:
        step(s)
    assert all_free(s)


def test_a_waiting_request_does_not_preempt_a_running_one() -> None:
    s = make_sched("priority", max_seqs=1)
    s.add_request(req("running", 3, 5, 1.0, max_tokens=3))
    step(s)
    s.add_request(req("urgent", 3, -5, 2.0, max_tokens=1, base=20))
    out, _ = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["running"]
    out, _ = step(s)  # running finishes by length in this step
    out, _ = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["urgent"]
