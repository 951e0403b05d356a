"""KV transfer bandwidth between two local engines' connectors against a plain memcpy of the same bytes.

Two processes each own a KV pool with SmolLM2-135M's layout `[30, 2, num_blocks, 16, 3, 64]` fp32 and a
real `NixlConnectorWorker` (prefill with its side channel, decode that handshakes and READs through
NIXL/UCX, polling like the engine loop). Each run reads N blocks (every layer, K and V) and is timed
from `start_load_kv` to the load's report; the baseline copies the same bytes in one process, both as
one contiguous memcpy and as the same per-block gather/scatter. Results go to bench/results/.

    .venv/bin/python bench/kv_transfer_bandwidth.py [--blocks 88] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "workers")]

from tandem_engine.config import EngineConfig  # noqa: E402
from tandem_engine.kv_transfer.interface import KVConnectorMetadata, LoadSpec, RemotePrefill  # noqa: E402
from tandem_engine.kv_transfer.nixl_worker import NixlConnectorWorker  # noqa: E402

LAYERS, BS, HEADS, DIM = 30, 16, 3, 64
POLL_S = 0.0005
RESULTS = Path(__file__).resolve().parent / "results"


def pool(num_blocks: int, fill: bool) -> torch.Tensor:
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    t = torch.empty(LAYERS, 2, num_blocks, BS, HEADS, DIM)
    if fill:
        t.copy_(torch.randn_like(t))
    else:
        t.zero_()
    return t


def prefill_proc(port: int, num_blocks: int, ready: Any, done: Any) -> None:
    torch.set_num_threads(1)
    cfg = EngineConfig(role="prefill", kv_side_channel_port=port, kv_lease_seconds=60)
    w = NixlConnectorWorker(cfg, "bench-prefill", port)
    kv = pool(num_blocks, fill=True)
    w.register_kv_caches(kv)
    ready.put(kv[:, :, :8].sum().item())
    done.get()
    w.shutdown()


def run(blocks: int, runs: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    num_blocks = 2 * blocks + 8
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=prefill_proc, args=(port, num_blocks, ready, done))
    proc.start()
    ready.get(timeout=120)
    d = NixlConnectorWorker(EngineConfig(role="decode", kv_lease_seconds=60), "bench-decode", 0)
    kv = pool(num_blocks, fill=False)
    d.register_kv_caches(kv)
    nbytes = blocks * LAYERS * 2 * d.block_bytes
    layouts = {"contiguous": (list(range(1, blocks + 1)), list(range(blocks + 1, 2 * blocks + 1))),
               "scattered": (list(range(1, 2 * blocks, 2)), list(range(2, 2 * blocks + 1, 2)))}
    out: dict[str, Any] = {"blocks": blocks, "bytes": nbytes, "nixl_gbps": {}, "memcpy_gbps": {}}
    n = 0
    for name, (local, remote) in layouts.items():
        times = []
        for i in range(runs + 1):  # the first run also pays the handshake
            n += 1
            rid = f"r{n}"
            rp = RemotePrefill.parse(rid, {
                "remote_engine_id": "bench-prefill", "remote_host": "127.0.0.1", "remote_port": port,
                "remote_request_id": rid, "remote_block_ids": remote, "block_size": BS})
            t0 = time.perf_counter()
            d.start_load_kv(KVConnectorMetadata(new_remote=[rp], loads=[LoadSpec(rid, local, remote)]))
            while True:
                res = d.get_finished()
                if res.finished_recving or res.failed_recving:
                    break
                time.sleep(POLL_S)  # like the engine loop: poll, do not spin against UCX's progress thread
            dt = time.perf_counter() - t0
            assert res.finished_recving == [rid], res
            if i:
                times.append(dt)
        out["nixl_gbps"][name] = nbytes / statistics.median(times) / 1e9
    done.put(1)
    proc.join(30)
    assert torch.count_nonzero(kv[:, :, 1]) > 0
    # The same bytes in one process: one contiguous memcpy, and the same per-block gather/scatter.
    src = pool(num_blocks, fill=True)
    flat_src = torch.empty(nbytes // 4)
    flat_dst = torch.empty(nbytes // 4)
    flat_src.copy_(torch.randn_like(flat_src))
    for name, fn in {
        "memcpy": lambda: flat_dst.copy_(flat_src),
        "contiguous": lambda: kv[:, :, 1:blocks + 1].copy_(src[:, :, blocks + 1:2 * blocks + 1]),
        "scattered": lambda: kv.index_copy_(2, torch.arange(1, 2 * blocks, 2),
                                            src.index_select(2, torch.arange(2, 2 * blocks + 1, 2))),
    }.items():
        fn()
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out["memcpy_gbps"][name] = nbytes / statistics.median(times) / 1e9
    d.shutdown()
    out["ratio_vs_memcpy"] = {k: v / out["memcpy_gbps"]["memcpy"] for k, v in out["nixl_gbps"].items()}
    return out


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["memcpy", "copy contiguous", "copy scattered", "NIXL contiguous", "NIXL scattered"]
    vals = [res["memcpy_gbps"]["memcpy"], res["memcpy_gbps"]["contiguous"], res["memcpy_gbps"]["scattered"],
            res["nixl_gbps"]["contiguous"], res["nixl_gbps"]["scattered"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(labels, vals, color=["#888", "#aaa", "#ccc", "#2a7", "#5c9"])
    ax.set_ylabel("GB/s")
    ax.set_title(f"KV transfer of {res['blocks']} blocks ({res['bytes'] / 1e6:.0f} MB), 2 local processes")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    plt.xticks(rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=88, help="88 SmolLM2 blocks = 65 MB")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    res = run(args.blocks, args.runs)
    print(json.dumps(res, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_transfer_bandwidth.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, RESULTS / "kv_transfer_bandwidth.png")


if __name__ == "__main__":
    main()
