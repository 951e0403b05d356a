"""The NIXL connector's worker side against an in-memory stand-in for the NIXL wrapper: a real ZMQ side
channel, real byte copies between two pools in this process, real heartbeat and release threads."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from tandem_engine.config import EngineConfig
from tandem_engine.kv_transfer import side_channel
from tandem_engine.kv_transfer.interface import KVConnectorMetadata, KVConnectorOutput, LoadSpec, RemotePrefill
from tandem_engine.kv_transfer.messages import (
    Debug,
    DebugView,
    ErrorReply,
    HandshakeReply,
    HeartbeatReply,
    LeaseView,
    RemotePrefillParams,
    reply_decoder,
)
from tandem_engine.kv_transfer.nixl_worker import NixlConnectorWorker
from tandem_router.procs import free_port

BS = 4


def remote(block_ids: list[int], port: int, engine_id: str = "P-1") -> RemotePrefill:
    """Request "r" on decode, reading prefill's request "p-1" from the side channel at `port`."""
    return RemotePrefill.of("r", RemotePrefillParams(
        remote_engine_id=engine_id, remote_request_id="p-1", remote_block_ids=block_ids, remote_host="127.0.0.1",
        remote_port=port, block_size=BS))


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
def pair(request: pytest.FixtureRequest) -> Any:
    """Prefill "P-1" and decode "D-1"; `request.param`, when parametrized indirectly: their KV dtypes."""
    p_dtype, d_dtype = getattr(request, "param", (torch.float32, torch.float32))
    global HELD
    HELD = None
    port = free_port()
    pcfg = EngineConfig(role="prefill", block_size=BS, kv_lease_seconds=1.2)
    dcfg = EngineConfig(role="decode", block_size=BS, kv_lease_seconds=1.2)
    p = NixlConnectorWorker(pcfg, "P-1", port, nixl_factory=FakeNixl,  # type: ignore[arg-type]
                            held=lambda: {"p-1"} if HELD is None else HELD)
    d = NixlConnectorWorker(dcfg, "D-1", 0, nixl_factory=FakeNixl)  # type: ignore[arg-type]
    # [num_layers=2, 2, num_blocks, block_size, num_kv_heads=1, head_dim=3]
    p_pool = torch.arange(2 * 2 * 8 * BS * 3, dtype=torch.float32).reshape(2, 2, 8, BS, 1, 3).to(p_dtype)
    d_pool = torch.zeros(2, 2, 6, BS, 1, 3, dtype=d_dtype)
    p.register_kv_caches(p_pool)
    d.register_kv_caches(d_pool)
    yield p, d, p_pool, d_pool, port
    p.shutdown()
    d.shutdown()


def test_worker_reads_blocks_then_releases_and_heartbeats(pair: Any) -> None:
    p, d, p_pool, d_pool, port = pair
    rp = remote([3, 4, 7], port)
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
    rp = remote([3], port)
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
    rp = remote([3, 4], port)
    d.start_load_kv(KVConnectorMetadata(new_remote=[rp], loads=[LoadSpec("r", [2, 3], [3, 4])]))
    out = _poll(d, lambda o: o.failed_recving, tick=p)
    assert "lease ran out before the read" in out.failed_recving["r"]
    assert FakeNixl.agents["D-1"].posted == [] and torch.count_nonzero(d_pool) == 0
    assert _poll(p, lambda o: o.released).released == [("p-1", 0)]


def test_lease_lost_during_the_read_fails_the_load_instead_of_using_the_bytes(pair: Any) -> None:
    global HELD
    p, d, _, _, port = pair
    FakeNixl.agents["D-1"].in_flight = True
    rp = remote([3], port)
    d.start_load_kv(KVConnectorMetadata(new_remote=[rp], loads=[LoadSpec("r", [2], [3])]))
    _poll(d, lambda o: FakeNixl.agents["D-1"].posted, tick=p)
    HELD = set()  # the prefill engine frees the blocks while the read is in flight
    # Until a heartbeat round (every 0.2 s here) has reported it to the engine thread, however long it takes.
    _poll(d, lambda o: d._pending["r"].lease_lost, tick=p)
    FakeNixl.agents["D-1"].in_flight = False
    out = _poll(d, lambda o: o.failed_recving or o.finished_recving, tick=p)
    assert "lease ran out during the read" in out.failed_recving["r"] and out.finished_recving == []


def test_handshake_with_a_restarted_engine_fails_the_load(pair: Any) -> None:
    p, d, _, _, port = pair
    rp = remote([3], port, "P-0")
    d.start_load_kv(KVConnectorMetadata(new_remote=[rp], loads=[LoadSpec("r", [2], [3])]))
    out = _poll(d, lambda o: o.failed_recving)
    assert "restarted" in out.failed_recving["r"]


def test_handshake_with_nobody_times_out_cleanly() -> None:
    cfg = EngineConfig(role="decode", block_size=BS, kv_lease_seconds=1.0)
    d = NixlConnectorWorker(cfg, "D-2", 0, nixl_factory=FakeNixl)  # type: ignore[arg-type]
    d.register_kv_caches(torch.zeros(2, 2, 6, BS, 1, 3))
    rp = remote([3], free_port(), "P-nonce")
    t0 = time.monotonic()
    d.start_load_kv(KVConnectorMetadata(new_remote=[rp], loads=[LoadSpec("r", [2], [3])]))
    out = _poll(d, lambda o: o.failed_recving, timeout_s=12)
    assert "failed" in out.failed_recving["r"] or "timed out" in out.failed_recving["r"]
    assert time.monotonic() - t0 < 8
    d.shutdown()


def test_side_channel_answers_debug_and_refuses_what_it_cannot_read() -> None:
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    view = DebugView("P-9", 2, {"p-1": LeaseView(2, 1.5)}, [])
    server = side_channel.SideChannelServer("127.0.0.1", port, HandshakeReply("P-9", b"", 0, 1, 1, 1, "x", "h"),
                                            lambda: view, lambda: None)
    try:
        assert side_channel.call(address, Debug(), DebugView) == view
        with pytest.raises(side_channel.SideChannelError, match="refused Debug"):
            side_channel.call(address, Debug(), HeartbeatReply)
        # A peer that speaks another message set (an older tandem's {"op": ...} maps) gets an ErrorReply.
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(address)
        sock.send(msgspec.msgpack.encode({"op": "debug"}))
        assert isinstance(reply_decoder.decode(sock.recv()), ErrorReply)
        sock.close()
        # A stray DEALER without the empty delimiter (e.g. a dead engine's socket reconnecting to a
        # reused port) is dropped, and the side channel keeps answering.
        stray = zmq.Context.instance().socket(zmq.DEALER)
        stray.setsockopt(zmq.LINGER, 0)
        stray.connect(address)
        stray.send(b"not a call")
        stray.send_multipart([b"x", b"y", b"z"])
        assert not stray.poll(300)
        stray.close()
        assert side_channel.call(address, Debug(), DebugView) == view
        # The debugging command in the module's docstring.
        workers = Path(__file__).resolve().parents[3] / "workers"
        cli = subprocess.run([sys.executable, "-m", "tandem_engine.kv_transfer.side_channel", address],
                             env={**os.environ, "PYTHONPATH": str(workers)}, capture_output=True, text=True,
                             timeout=60, check=True)
        assert json.loads(cli.stdout)["leases"] == {"p-1": {"blocks": 2, "expires_in_s": 1.5}}
    finally:
        server.close()


@pytest.mark.parametrize("pair", [(torch.bfloat16, torch.bfloat16)], indirect=True)
def test_16_bit_blocks_move_whole_at_half_the_bytes(pair: Any) -> None:
    p, d, p_pool, d_pool, port = pair
    assert d.block_bytes == p.block_bytes == BS * 1 * 3 * 2
    d.start_load_kv(KVConnectorMetadata(new_remote=[remote([3, 6], port)], loads=[LoadSpec("r", [1, 4], [3, 6])]))
    out = _poll(d, lambda o: o.finished_recving)
    assert out.finished_recving == ["r"] and out.received_blocks == 2
    assert torch.equal(d_pool[:, :, [1, 4]], p_pool[:, :, [3, 6]])
    assert torch.count_nonzero(d_pool[:, :, [0, 2, 3, 5]]) == 0


@pytest.mark.parametrize("pair", [(torch.float32, torch.bfloat16)], indirect=True)
def test_engines_with_different_kv_cache_dtypes_refuse_to_pair(pair: Any) -> None:
    """A bfloat16 decode engine must not read a float32 prefill engine's blocks as bfloat16: the load fails
    with both dtypes and the flag named, and no read is posted."""
    _, d, _, d_pool, port = pair
    d.start_load_kv(KVConnectorMetadata(new_remote=[remote([3], port)], loads=[LoadSpec("r", [2], [3])]))
    out = _poll(d, lambda o: o.failed_recving)
    error = out.failed_recving["r"]
    assert "float32" in error and "bfloat16" in error and "--kv-cache-dtype" in error, error
    assert FakeNixl.agents["D-1"].posted == [] and torch.count_nonzero(d_pool) == 0


def test_ucx_tcp_segments_default_to_1m_unless_the_user_set_one() -> None:
    """Both of UCX's TCP segment sizes at 1 MiB (KV between pods over TCP at twice the rate of UCX's 8 KiB
    default); a user's value of either is kept and the other not forced (UCX refuses a receive segment
    below the send segment, so setting one alone could break a user's own pair)."""
    from tandem_engine.kv_transfer.nixl_wrapper import ucx_defaults

    env: dict[str, str] = {"UCX_TLS": "tcp"}
    ucx_defaults(env)
    assert env == {"UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}
    mine = {"UCX_TCP_RX_SEG_SIZE": "4m"}
    ucx_defaults(mine)
    assert mine == {"UCX_TCP_RX_SEG_SIZE": "4m"}
