"""KV connector block accounting: the scheduler with the NIXL connector's scheduler side (exact block
ids, reference counts, leases), and the worker side against an in-memory stand-in for the NIXL wrapper
(real ZMQ side channel, real byte copies between two pools in this process)."""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np
import pytest
import torch

from tandem_engine.config import EngineConfig
from tandem_engine.core.kv_cache_manager import KVCacheManager
from tandem_engine.core.scheduler import SampledToken, Scheduler, SchedulerOutput
from tandem_engine.kv_transfer.interface import KVConnectorMetadata, KVConnectorOutput, LoadSpec, RemotePrefill
from tandem_engine.kv_transfer.nixl_connector import NixlConnectorScheduler
from tandem_engine.kv_transfer.nixl_worker import NixlConnectorWorker
from tandem_engine.request import Request, RequestStatus
from tandem_engine.sampling_params import SamplingParams
from tandem_router.procs import free_port as _free_port

BS = 4
EOS = 0
LEASE = 10.0


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
    return {"do_remote_prefill": True, "remote_engine_id": "P-nonce", "remote_request_id": "p-1",
            "remote_block_ids": block_ids, "remote_host": "127.0.0.1", "remote_port": 5600, "block_size": BS}


# -- prefill: leases --------------------------------------------------------------------------------
def test_prefill_holds_blocks_under_a_lease_until_released() -> None:
    s, conn, clock = make("prefill")
    s.add_request(req("a", 10, params={"do_remote_decode": True}))
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
    s.add_request(req("a", 5, params={"do_remote_decode": True}))
    s.add_request(req("b", 5, params={"do_remote_decode": True}, base=50))
    step(s)
    assert conn.num_held_blocks == 4  # 2 + 2
    clock.t += LEASE - 1
    # "a" is heartbeaten: its expiry moves past "b"'s, breaking the insertion order.
    s.update_from_kv_output(KVConnectorOutput(heartbeats=["a"]), clock())
    clock.t += 1.5
    s.update_from_kv_output(KVConnectorOutput(), clock())
    assert conn.num_held_blocks == 2 and list(conn.debug_view()["leases"]) == ["a"]
    clock.t += LEASE
    s.update_from_kv_output(KVConnectorOutput(), clock())
    assert all_free(s) and conn.next_deadline() is None


def test_prefill_frees_at_once_on_any_other_ending() -> None:
    s, conn, clock = make("prefill")
    s.add_request(req("stop", 5, params={"do_remote_decode": True}))
    s.add_request(req("plain", 5, base=40))
    s.add_request(req("aborted", 5, params={"do_remote_decode": True}, base=80))
    s.finish_requests(["aborted"], RequestStatus.FINISHED_ABORTED)
    _, outs = step(s, token=EOS)
    assert {o.request_id: (o.finish_reason, o.kv_transfer_params) for o in outs} == {
        "aborted": ("abort", None), "stop": ("stop", None), "plain": ("stop", None)}
    assert all_free(s) and conn.num_held_blocks == 0


def test_abort_after_finish_is_ignored_and_the_lease_cleans_up() -> None:
    s, conn, clock = make("prefill")
    s.add_request(req("a", 6, params={"do_remote_decode": True}))
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


# -- worker side with an in-memory NIXL stand-in ----------------------------------------------------
class FakeNixl:
    """In-memory stand-in for NixlWrapper: agents in one process, reads are memmoves."""

    agents: dict[str, FakeNixl] = {}

    def __init__(self, name: str, num_threads: int = 0) -> None:
        self.name = name
        self.fail_reads = False
        self.in_flight = False  # reads report "PROC" while set
        self.posted: list[tuple[np.ndarray, np.ndarray]] = []
        FakeNixl.agents[name] = self

    def register(self, addr: int, nbytes: int, mem_type: str) -> None:
        self.region = (addr, nbytes)

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_remote(self, metadata: bytes) -> str:
        return metadata.decode()

    def remove_remote(self, name: str) -> None:
        pass

    def prep_descs(self, agent_name: str, descs: np.ndarray, mem_type: str) -> np.ndarray:
        return descs

    def read(self, local: np.ndarray, local_idx: np.ndarray, remote: np.ndarray,
             remote_idx: np.ndarray) -> tuple[Any, str]:
        self.posted.append((local_idx, remote_idx))
        if self.fail_reads:
            return object(), "PROC"
        for li, ri in zip(local_idx, remote_idx, strict=True):
            ctypes.memmove(int(local[li, 0]), int(remote[ri, 0]), int(local[li, 1]))
        return object(), "PROC"

    def check(self, handle: Any) -> str:
        return "ERR" if self.fail_reads else "PROC" if self.in_flight else "DONE"

    def release(self, handle: Any) -> bool:
        return True

    def close(self) -> None:
        pass


def _poll(worker: NixlConnectorWorker, until: Any, timeout_s: float = 10.0,
          tick: NixlConnectorWorker | None = None) -> KVConnectorOutput:
    """Poll `worker` like the engine loop does (and `tick`, the other engine) until `until(merged)`."""
    merged = KVConnectorOutput()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if tick is not None:
            tick.get_finished()
        out = worker.get_finished()
        merged.finished_recving += out.finished_recving
        merged.failed_recving.update(out.failed_recving)
        merged.released += out.released
        merged.heartbeats += out.heartbeats
        merged.received_blocks += out.received_blocks
        if until(merged):
            return merged
        time.sleep(0.01)
    pytest.fail(f"connector did not report in {timeout_s}s: {merged}")


HELD: set[str] | None = None  # what the prefill side reports as held; None: everything asked about


@pytest.fixture
def pair() -> Any:
    global HELD
    HELD = None
    port = _free_port()
    pcfg = EngineConfig(role="prefill", block_size=BS, kv_lease_seconds=1.2)
    dcfg = EngineConfig(role="decode", block_size=BS, kv_lease_seconds=1.2)
    p = NixlConnectorWorker(pcfg, "P-1", port, nixl_factory=FakeNixl,  # type: ignore[arg-type]
                            held=lambda: {"p-1"} if HELD is None else HELD)
    d = NixlConnectorWorker(dcfg, "D-1", 0, nixl_factory=FakeNixl)  # type: ignore[arg-type]
    # [num_layers=2, 2, num_blocks, block_size, num_kv_heads=1, head_dim=3]
    p_pool = torch.arange(2 * 2 * 8 * BS * 3, dtype=torch.float32).reshape(2, 2, 8, BS, 1, 3)
    d_pool = torch.zeros(2, 2, 6, BS, 1, 3)
    p.register_kv_caches(p_pool)
    d.register_kv_caches(d_pool)
    yield p, d, p_pool, d_pool, port
    p.shutdown()
    d.shutdown()


def test_worker_reads_blocks_then_releases_and_heartbeats(pair: Any) -> None:
    p, d, p_pool, d_pool, port = pair
    rp = RemotePrefill.parse("r", {**remote([3, 4, 7]), "remote_port": port, "remote_engine_id": "P-1"})
    d.start_load_kv(KVConnectorMetadata(new_remote=[rp]))
    assert d.has_pending and not d.transfers_in_flight
    # Heartbeats go out from arrival, before any block is allocated.
    hb = _poll(p, lambda o: o.heartbeats, tick=d)
    assert hb.heartbeats[0] == "p-1"
    d.start_load_kv(KVConnectorMetadata(loads=[LoadSpec("r", [2, 3, 5], [3, 4, 7])]))
    out = _poll(d, lambda o: o.finished_recving)
    assert out.finished_recving == ["r"] and out.received_blocks == 3 and not d.has_pending
    [(local_idx, remote_idx)] = FakeNixl.agents["D-1"].posted
    assert local_idx.tolist()[:3] == [2, 3, 5] and remote_idx.tolist()[:3] == [3, 4, 7]  # layer 0 K first
    assert torch.equal(d_pool[:, :, [2, 3, 5]], p_pool[:, :, [3, 4, 7]])
    assert torch.count_nonzero(d_pool[:, :, [0, 1, 4]]) == 0
    released = _poll(p, lambda o: o.released)
    assert released.released == [("p-1", 3)]


def test_worker_reports_a_failed_read_once_and_still_releases(pair: Any) -> None:
    p, d, _, _, port = pair
    FakeNixl.agents["D-1"].fail_reads = True
    rp = RemotePrefill.parse("r", {**remote([3]), "remote_port": port, "remote_engine_id": "P-1"})
    d.start_load_kv(KVConnectorMetadata(new_remote=[rp], loads=[LoadSpec("r", [2], [3])]))
    out = _poll(d, lambda o: o.failed_recving)
    assert list(out.failed_recving) == ["r"] and out.finished_recving == []
    assert _poll(p, lambda o: o.released).released == [("p-1", 0)]
    assert not d.get_finished().failed_recving


def test_no_read_is_posted_before_a_heartbeat_confirms_the_lease(pair: Any) -> None:
    """Arrival and load in one step (a fast scheduler): the prefill engine has already let the lease run
    out, so its blocks may be reused; the read must never start."""
    global HELD
    HELD = set()
    p, d, _, d_pool, port = pair
    rp = RemotePrefill.parse("r", {**remote([3, 4]), "remote_port": port, "remote_engine_id": "P-1"})
    d.start_load_kv(KVConnectorMetadata(new_remote=[rp], loads=[LoadSpec("r", [2, 3], [3, 4])]))
    out = _poll(d, lambda o: o.failed_recving, tick=p)
    assert "lease ran out before the read" in out.failed_recving["r"]
    assert FakeNixl.agents["D-1"].posted == [] and torch.count_nonzero(d_pool) == 0
    assert _poll(p, lambda o: o.released).released == [("p-1", 0)]


def test_lease_lost_during_the_read_fails_the_load_instead_of_using_the_bytes(pair: Any) -> None:
    global HELD
    p, d, _, _, port = pair
    FakeNixl.agents["D-1"].in_flight = True
    rp = RemotePrefill.parse("r", {**remote([3]), "remote_port": port, "remote_engine_id": "P-1"})
    d.start_load_kv(KVConnectorMetadata(new_remote=[rp], loads=[LoadSpec("r", [2], [3])]))
    _poll(d, lambda o: FakeNixl.agents["D-1"].posted, tick=p)
    HELD = set()  # the prefill engine frees the blocks while the read is in flight
    time.sleep(0.6)  # a heartbeat round (every 0.2 s here) reports it
    FakeNixl.agents["D-1"].in_flight = False
    out = _poll(d, lambda o: o.failed_recving or o.finished_recving, tick=p)
    assert "lease ran out during the read" in out.failed_recving["r"] and out.finished_recving == []


def test_handshake_with_a_restarted_engine_fails_the_load(pair: Any) -> None:
    p, d, _, _, port = pair
    rp = RemotePrefill.parse("r", {**remote([3]), "remote_port": port, "remote_engine_id": "P-0"})
    d.start_load_kv(KVConnectorMetadata(new_remote=[rp], loads=[LoadSpec("r", [2], [3])]))
    out = _poll(d, lambda o: o.failed_recving)
    assert "restarted" in out.failed_recving["r"]


def test_handshake_with_nobody_times_out_cleanly() -> None:
    cfg = EngineConfig(role="decode", block_size=BS, kv_lease_seconds=1.0)
    d = NixlConnectorWorker(cfg, "D-2", 0, nixl_factory=FakeNixl)  # type: ignore[arg-type]
    d.register_kv_caches(torch.zeros(2, 2, 6, BS, 1, 3))
    rp = RemotePrefill.parse("r", {**remote([3]), "remote_port": _free_port()})
    t0 = time.monotonic()
    d.start_load_kv(KVConnectorMetadata(new_remote=[rp], loads=[LoadSpec("r", [2], [3])]))
    out = _poll(d, lambda o: o.failed_recving, timeout_s=12)
    assert "failed" in out.failed_recving["r"] or "timed out" in out.failed_recving["r"]
    assert time.monotonic() - t0 < 8
    d.shutdown()
