"""KV connector block accounting: the scheduler with the NIXL connector's scheduler side (exact block
ids, reference counts, leases). The worker side is in test_nixl_worker.py."""

from __future__ import annotations

from typing import Any

import msgspec

from tandem_engine.config import EngineConfig
from tandem_engine.core.kv_cache_manager import KVCacheManager
from tandem_engine.core.scheduler import Scheduler
from tandem_engine.kv_transfer.interface import KVConnectorMetadata, KVConnectorOutput, LeaseCounts, LoadSpec
from tandem_engine.kv_transfer.messages import RemoteDecodeParams, RemotePrefillParams
from tandem_engine.kv_transfer.nixl_connector import NixlConnectorScheduler
from tandem_engine.request import Request, RequestStatus
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.scheduler_output import SampledToken, SchedulerOutput

BS = 4
EOS = 0
LEASE = 10.0
DECODE_REMOTELY: dict[str, Any] = msgspec.to_builtins(RemoteDecodeParams())


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(role: str, num_blocks: int = 32, policy: str = "fail") -> tuple[Scheduler, NixlConnectorScheduler, Clock]:
    cfg = EngineConfig(role=role, block_size=BS, kv_lease_seconds=LEASE)  # type: ignore[arg-type]
    clock = Clock()
    conn = NixlConnectorScheduler(cfg, "P-nonce", 5600, clock=clock)
    return Scheduler(KVCacheManager(num_blocks, BS), 8, 64, 128, conn, policy), conn, clock


def req(rid: str, n_prompt: int, max_tokens: int = 1, params: dict[str, Any] | None = None,
        base: int = 1) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, [base + i for i in range(n_prompt)], sp, eos_token_ids=[EOS], kv_transfer_params=params)


def step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Any]]:
    out = s.schedule()
    sampled = {x.request.request_id: SampledToken(token) for x in out.scheduled if x.sample}
    return out, s.update_from_output(out, sampled)


def ref(s: Scheduler, blocks: list[int]) -> list[int]:
    return [s.kv.pool.ref_cnt[b] for b in blocks]


def all_free(s: Scheduler) -> bool:
    pool = s.kv.pool
    return pool.num_free_blocks == pool.num_blocks - 1 and pool.ref_cnt[1:] == [0] * (pool.num_blocks - 1)


def remote(block_ids: list[int]) -> dict[str, Any]:
    """A decode request's `kv_transfer_params`, as a prefill engine named "P-nonce" returns them."""
    params = RemotePrefillParams(remote_engine_id="P-nonce", remote_request_id="p-1", remote_block_ids=block_ids,
                                 remote_host="127.0.0.1", remote_port=5600, block_size=BS)
    built: dict[str, Any] = msgspec.to_builtins(params)
    return built


# -- prefill: leases --------------------------------------------------------------------------------
def test_prefill_holds_blocks_under_a_lease_until_released() -> None:
    s, conn, clock = make("prefill")
    s.add_request(req("a", 10, params=DECODE_REMOTELY))
    _, [out] = step(s)
    assert out.finish_reason == "length"
    params = out.kv_transfer_params
    assert params["remote_block_ids"] == [1, 2, 3] and params["remote_request_id"] == "a"
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "P-nonce"
    assert not s.has_requests and ref(s, [1, 2, 3]) == [1, 1, 1] and conn.num_held_blocks == 3
    assert s.stats().kv_blocks_held_for_transfer == 3
    s.update_from_kv_output(KVConnectorOutput(released=[("a", 3)]), clock())
    assert all_free(s) and conn.num_held_blocks == 0
    stats = s.stats()
    assert (stats.kv_blocks_held_for_transfer, stats.kv_transfer_sent_blocks) == (0, 3)
    # A second release (or one for an unknown id) is dropped: blocks are freed exactly once.
    s.update_from_kv_output(KVConnectorOutput(released=[("a", 3), ("zz", 1)]), clock())
    assert all_free(s)


def test_lease_expires_and_heartbeats_extend_it_out_of_order() -> None:
    s, conn, clock = make("prefill")
    s.add_request(req("a", 5, params=DECODE_REMOTELY))
    s.add_request(req("b", 5, params=DECODE_REMOTELY, base=50))
    step(s)
    assert conn.num_held_blocks == 4  # 2 + 2
    clock.t += LEASE - 1
    # "a" is heartbeaten: its expiry moves past "b"'s, breaking the insertion order.
    s.update_from_kv_output(KVConnectorOutput(heartbeats=["a"]), clock())
    clock.t += 1.5
    s.update_from_kv_output(KVConnectorOutput(), clock())
    assert conn.num_held_blocks == 2 and list(conn.debug_view().leases) == ["a"]
    clock.t += LEASE
    s.update_from_kv_output(KVConnectorOutput(), clock())
    assert all_free(s) and conn.next_deadline() is None
    # Both ran out (what a draining engine reports, and tandem:kv_leases_expired counts); none was released.
    assert conn.leases == LeaseCounts(held=0, held_blocks=0, released=0, expired=2)
    assert s.stats().kv_leases_expired == 2 and s.stats().kv_leases_expired == 0


def test_lease_counts_tell_released_from_expired() -> None:
    s, conn, clock = make("prefill")
    for rid, base in (("a", 1), ("b", 50), ("c", 90)):
        s.add_request(req(rid, 5, params=DECODE_REMOTELY, base=base))
    step(s)
    assert conn.leases == LeaseCounts(held=3, held_blocks=6, released=0, expired=0)
    s.update_from_kv_output(KVConnectorOutput(released=[("a", 2), ("b", 2)]), clock())
    clock.t += LEASE + 1
    s.update_from_kv_output(KVConnectorOutput(released=[("a", 2)]), clock())  # a repeat changes nothing
    assert conn.leases == LeaseCounts(held=0, held_blocks=0, released=2, expired=1)
    assert all_free(s)


def test_prefill_frees_at_once_on_any_other_ending() -> None:
    s, conn, clock = make("prefill")
    s.add_request(req("stop", 5, params=DECODE_REMOTELY))
    s.add_request(req("plain", 5, base=40))
    s.add_request(req("aborted", 5, params=DECODE_REMOTELY, base=80))
    s.finish_requests(["aborted"], RequestStatus.FINISHED_ABORTED)
    _, outs = step(s, token=EOS)
    assert {o.request_id: (o.finish_reason, o.kv_transfer_params) for o in outs} == {
        "aborted": ("abort", None), "stop": ("stop", None), "plain": ("stop", None)}
    assert all_free(s) and conn.num_held_blocks == 0


def test_abort_after_finish_is_ignored_and_the_lease_cleans_up() -> None:
    s, conn, clock = make("prefill")
    s.add_request(req("a", 6, params=DECODE_REMOTELY))
    step(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # the client disconnect raced the finish
    assert conn.num_held_blocks == 2 and ref(s, [1, 2]) == [1, 1]
    clock.t += LEASE + 0.01
    s.update_from_kv_output(KVConnectorOutput(), clock())
    assert all_free(s)


# -- decode: loads ----------------------------------------------------------------------------------
def test_decode_reads_only_uncached_blocks_then_computes_the_last_token() -> None:
    s, conn, clock = make("decode")
    # Cache the first 2 blocks (8 tokens) locally with a plain request sharing the prefix.
    s.add_request(req("local", 9))
    step(s)
    assert all_free(s)
    s.add_request(req("r", 14, max_tokens=2, params=remote([11, 12, 13, 14])))
    out, outs = step(s)
    assert out.is_empty and outs == [] and s.waiting_for_kv["r"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = s.kv.get_block_ids("r")
    # 13 tokens before the last: 4 blocks; 2 are prefix hits, 2 new (taken from the free-queue head).
    assert blocks[:2] == [1, 2] and len(blocks) == 4
    meta = conn.build_connector_meta()
    assert [rp.request_id for rp in meta.new_remote] == ["r"]
    assert meta.loads == [LoadSpec("r", blocks[2:], [13, 14])]
    # Loaded blocks are not prefix-cache hits until their KV has arrived.
    assert [s.kv.pool.block_hash[b] for b in blocks[2:]] == [None, None]
    s.update_from_kv_output(KVConnectorOutput(finished_recving=["r"], received_blocks=2), clock())
    out, outs = step(s)
    [item] = out.scheduled
    assert (item.start, item.num_tokens, item.sample) == (13, 1, True)
    assert outs[0].new_token_ids == [7]
    assert s.kv.pool.block_hash[blocks[2]] is not None  # cached once computed
    assert s.stats().kv_transfer_received_blocks == 2
    step(s)
    assert all_free(s) and not s.has_requests


def test_full_local_hit_reads_nothing_and_releases_prefill() -> None:
    s, conn, clock = make("decode")
    s.add_request(req("local", 9))
    step(s)
    s.add_request(req("r", 9, params=remote([5, 6, 7])))  # 8 tokens before the last: both cached
    out, _ = step(s)
    assert [(x.start, x.num_tokens) for x in out.scheduled] == [(8, 1)]
    meta = conn.build_connector_meta()
    assert meta.loads == [] and meta.cancels == ["r"]
    assert all_free(s)


def test_abort_while_reading_keeps_blocks_until_the_load_reports() -> None:
    s, conn, clock = make("decode")
    s.add_request(req("r", 9, params=remote([5, 6, 7])))
    step(s)
    blocks = s.kv.get_block_ids("r")
    assert blocks == [1, 2] and ref(s, blocks) == [1, 1]
    conn.build_connector_meta()
    s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    _, outs = step(s)
    assert [o.finish_reason for o in outs] == ["abort"]
    assert conn.build_connector_meta().cancels == ["r"]
    assert ref(s, blocks) == [1, 1]  # a read may still write them
    s.update_from_kv_output(KVConnectorOutput(finished_recving=["r"]), clock())
    assert all_free(s) and not s.has_requests


def test_abort_before_admission_releases_prefill_at_once() -> None:
    s, conn, clock = make("decode")
    s.add_request(req("r", 9, params=remote([5, 6, 7])))
    s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    meta = conn.build_connector_meta()
    assert [rp.request_id for rp in meta.new_remote] == ["r"] and meta.cancels == ["r"]
    assert all_free(s)


def test_failed_load_fails_the_request_cleanly() -> None:
    s, conn, clock = make("decode")
    s.add_request(req("r", 9, params=remote([5, 6, 7])))
    step(s)
    s.update_from_kv_output(KVConnectorOutput(failed_recving={"r": "peer gone"}), clock())
    _, outs = step(s)
    assert [(o.finish_reason, o.error) for o in outs] == [("error", "KV transfer failed: peer gone")]
    assert all_free(s) and not s.has_requests
    assert s.stats().kv_transfer_failures == 1


def test_failed_load_recomputes_under_the_recompute_policy() -> None:
    s, conn, clock = make("decode", policy="recompute")
    s.add_request(req("r", 9, params=remote([5, 6, 7])))
    step(s)
    s.update_from_kv_output(KVConnectorOutput(failed_recving={"r": "peer gone"}), clock())
    out, outs = step(s)
    assert [(x.start, x.num_tokens) for x in out.scheduled] == [(0, 9)]
    assert outs[0].finish_reason == "length"
    assert all_free(s)


def test_requests_waiting_for_kv_count_toward_max_num_seqs() -> None:
    s, conn, clock = make("decode")
    s.max_num_seqs = 2
    s.add_request(req("r1", 9, params=remote([5, 6, 7])))
    s.add_request(req("r2", 9, params=remote([5, 6, 7]), base=30))
    s.add_request(req("plain", 5, base=60))
    out, _ = step(s)
    assert out.is_empty and set(s.waiting_for_kv) == {"r1", "r2"} and [r.request_id for r in s.waiting] == ["plain"]


def test_malformed_remote_params_prefill_locally() -> None:
    s, conn, clock = make("decode")
    s.add_request(req("r", 9, params={**remote([5, 6, 7]), "remote_port": "not a port"}))
    out, outs = step(s)
    assert [(x.start, x.num_tokens) for x in out.scheduled] == [(0, 9)] and outs[0].finish_reason == "length"
    assert conn.build_connector_meta() == KVConnectorMetadata()
    assert all_free(s)
