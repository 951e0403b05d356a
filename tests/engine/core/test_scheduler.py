"""Scheduler behaviour: token budget, chunked prefill, preemption, aborts, block accounting."""

from __future__ import annotations

from tandem_engine.core.kv_cache_manager import KVCacheManager
from tandem_engine.core.scheduler import Scheduler
from tandem_engine.request import Request, RequestStatus
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.scheduler_output import SampledToken, SchedulerOutput

BS = 4
EOS = 0


def make_sched(num_blocks: int = 64, budget: int = 64, max_seqs: int = 8, max_len: int = 128) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), max_seqs, budget, max_len)


def req(rid: str, n_prompt: int, max_tokens: int = 4, base: int = 1, **kw: object) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]
    return Request(rid, [base + i for i in range(n_prompt)], sp, eos_token_ids=[EOS])


def step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list]:
    out = s.schedule()
    sampled = {x.request.request_id: SampledToken(token) for x in out.scheduled if x.sample}
    return out, s.update_from_output(out, sampled)


def all_free(s: Scheduler) -> bool:
    pool = s.kv.pool
    return pool.num_free_blocks == pool.num_blocks - 1 and pool.ref_cnt[1:] == [0] * (pool.num_blocks - 1)


def test_prefill_then_decode_and_finish_by_length() -> None:
    s = make_sched()
    s.add_request(req("a", 6, max_tokens=3))
    out, outs = step(s)
    [item] = out.scheduled
    assert (item.start, item.num_tokens, item.sample, item.block_ids) == (0, 6, True, [1, 2])
    assert outs[0].new_token_ids == [7] and outs[0].finish_reason is None
    out, _ = step(s)
    assert [(x.start, x.num_tokens) for x in out.scheduled] == [(6, 1)]
    out, outs = step(s)
    assert outs[0].finish_reason == "length"
    assert not s.has_requests and all_free(s)


def test_chunked_prefill_respects_budget_and_samples_only_at_the_end() -> None:
    s = make_sched(budget=5)
    s.add_request(req("a", 12, max_tokens=1))
    chunks = []
    while s.has_requests:
        out, outs = step(s)
        chunks.append([(x.start, x.num_tokens, x.sample) for x in out.scheduled])
    assert chunks == [[(0, 5, False)], [(5, 5, False)], [(10, 2, True)]]
    assert all_free(s)


def test_running_requests_go_first_and_share_the_budget() -> None:
    s = make_sched(budget=8)
    s.add_request(req("a", 4, max_tokens=5))
    step(s)
    s.add_request(req("b", 20, max_tokens=1, base=100))
    out, _ = step(s)
    assert [(x.request.request_id, x.num_tokens) for x in out.scheduled] == [("a", 1), ("b", 7)]


def test_max_num_seqs_limits_admission() -> None:
    s = make_sched(max_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 3, base=10 * i + 1))
    out, _ = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_eos_stops_unless_ignored_and_min_tokens_defers_it() -> None:
    s = make_sched()
    s.add_request(req("stops", 3, max_tokens=10))
    s.add_request(req("ignores", 3, max_tokens=2, base=50, ignore_eos=True))
    s.add_request(req("min", 3, max_tokens=10, base=90, min_tokens=2))
    _, outs = step(s, token=EOS)
    by_id = {o.request_id: o for o in outs}
    assert by_id["stops"].finish_reason == "stop"
    assert by_id["ignores"].finish_reason is None
    assert by_id["min"].finish_reason is None
    _, outs = step(s, token=EOS)
    by_id = {o.request_id: o for o in outs}
    assert by_id["ignores"].finish_reason == "length"
    assert by_id["min"].finish_reason == "stop"
    assert all_free(s)


def test_stop_token_ids_report_the_matched_id() -> None:
    s = make_sched()
    s.add_request(req("a", 3, max_tokens=10, stop_token_ids=[7]))
    _, [o] = step(s, token=7)
    assert (o.finish_reason, o.stop_reason) == ("stop", 7)


def test_preemption_takes_the_newest_and_admits_nothing_that_step() -> None:
    # 4 usable blocks of 4 tokens. a and b each take 2 blocks (prompt 8 => full), then need a 3rd.
    s = make_sched(num_blocks=5, budget=64)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8, base=50))
    out, _ = step(s)
    assert [x.block_ids for x in out.scheduled] == [[1, 2], [3, 4]]
    s.add_request(req("c", 2, max_tokens=1, base=90))
    out, _ = step(s)
    # a needs a block for token 9: b (newest running) is preempted, c is not admitted.
    assert out.preempted == ["b"]
    assert [(x.request.request_id, x.block_ids) for x in out.scheduled] == [("a", [1, 2, 4])]
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    b = s.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [7]  # generated tokens survive preemption
    # Everything completes eventually and all blocks come back.
    while s.has_requests:
        step(s)
    assert all_free(s)


def test_abort_is_idempotent_in_every_state_and_frees_blocks() -> None:
    s = make_sched(budget=6, max_seqs=2)
    s.add_request(req("running", 3, max_tokens=50))
    s.add_request(req("prefilling", 12, max_tokens=50, base=30))
    s.add_request(req("waiting", 3, max_tokens=50, base=60))
    step(s)
    assert s.requests["prefilling"].num_computed_tokens == 3  # partial chunk
    s.finish_requests(["running", "prefilling", "waiting", "nope"], RequestStatus.FINISHED_ABORTED)
    s.finish_requests(["running"], RequestStatus.FINISHED_ABORTED)
    out, outs = step(s)
    assert out.is_empty
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [
        ("prefilling", "abort"), ("running", "abort"), ("waiting", "abort")]
    assert not s.has_requests and all_free(s)


def test_abort_during_step_is_not_completed_normally() -> None:
    s = make_sched()
    s.add_request(req("a", 3, max_tokens=50))
    out = s.schedule()
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    outs = s.update_from_output(out, {"a": SampledToken(7)})
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [("a", [], "abort")]
    assert all_free(s)


def test_shared_prefix_is_computed_once() -> None:
    s = make_sched()
    s.add_request(req("a", 9, max_tokens=1))
    step(s)
    s.add_request(req("b", 9, max_tokens=1))
    out, outs = step(s)
    [item] = out.scheduled
    assert (item.start, item.num_tokens, item.block_ids[:2]) == (8, 1, [1, 2])
    assert outs[0].num_cached_tokens == 8
    assert all_free(s)


def test_max_model_len_finishes_with_length() -> None:
    s = make_sched(max_len=6)
    s.add_request(req("a", 4, max_tokens=100))
    step(s)
    _, [o] = step(s)
    assert o.finish_reason == "length" and s.kv.usage == 0.0


def test_random_workload_keeps_block_accounting_exact() -> None:
    """Random arrivals, aborts and stops on a tight pool: ref counts always equal the number of live
    requests holding each block, free + referenced = total, and everything is free at the end."""
    import random

    rng = random.Random(7)
    s = make_sched(num_blocks=24, budget=16, max_seqs=6, max_len=64)
    n = 0
    for _ in range(400):
        r = rng.random()
        if r < 0.25:
            shared = [1, 2, 3, 4, 5, 6, 7, 8] if rng.random() < 0.5 else []
            prompt = shared + [rng.randrange(10, 50) for _ in range(rng.randrange(1, 30))]
            s.add_request(Request(f"q{n}", prompt, SamplingParams(max_tokens=rng.randrange(1, 12),
                                                                  temperature=0.0), eos_token_ids=[EOS]))
            n += 1
        elif r < 0.35 and s.requests:
            s.finish_requests([rng.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED)
        else:
            step(s, token=rng.choice([EOS, 7, 9, 11, 13]))
        holders = [0] * s.kv.pool.num_blocks
        for blocks in s.kv.req_to_blocks.values():
            for b in blocks:
                holders[b] += 1
        assert holders[1:] == s.kv.pool.ref_cnt[1:]
        free = set(s.kv.pool.free_block_ids())
        assert free == {b for b in range(1, s.kv.pool.num_blocks) if holders[b] == 0}
        assert set(s.kv.req_to_blocks) <= set(s.requests)
    while s.has_requests:
        step(s)
    assert all_free(s)
