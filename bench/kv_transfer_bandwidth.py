"""KV transfer bandwidth between two local engines' connectors against a plain memcpy of the same bytes.

Two processes each own a KV pool with SmolLM2-135M's layout `[30, 2, num_blocks, 16, 3, 64]` fp32 and a
real `NixlConnectorWorker` (prefill with its side channel, decode that handshakes and READs through
NIXL/UCX, polling like the engine loop). Each run reads N blocks (every layer, K and V) and is timed
from `start_load_kv` to the load's report; the baseline copies the same bytes in one process, both as
one contiguous memcpy and as the same per-block gather/scatter. Results go to bench/results/.

    .venv/bin/python bench/kv_transfer_bandwidth.py [--blocks 88] [--runs 20] [--threads 0,2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "workers")]

from harness import write_results  # noqa: E402

from tandem_engine.config import EngineConfig  # noqa: E402
from tandem_engine.kv_transfer.interface import KVConnectorMetadata, LoadSpec, RemotePrefill  # noqa: E402
from tandem_engine.kv_transfer.messages import RemotePrefillParams  # noqa: E402
from tandem_engine.kv_transfer.nixl_worker import NixlConnectorWorker  # noqa: E402
from tandem_router.bench.stats import percentile  # noqa: E402
from tandem_router.procs import free_port  # noqa: E402

LAYERS, BS, HEADS, DIM = 30, 16, 3, 64
POLL_S = 0.0005


def pool(num_blocks: int, fill: bool) -> torch.Tensor:
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    t = torch.empty(LAYERS, 2, num_blocks, BS, HEADS, DIM)
    if fill:  # seeded, so the reader can check what it received
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1234)))
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


def copies(blocks: int, num_blocks: int, nbytes: int) -> tuple[torch.Tensor, dict[str, Callable[[], Any]]]:
    """The baseline: the same bytes copied in one process, as one contiguous memcpy and as the same
    per-block gather/scatter. Also the source pool, which holds what the prefill process serves."""
    src = pool(num_blocks, fill=True)
    dst = pool(num_blocks, fill=False)
    flat_src = torch.randn(nbytes // 4)
    flat_dst = torch.zeros(nbytes // 4)
    return src, {
        "memcpy": lambda: flat_dst.copy_(flat_src),
        "contiguous": lambda: dst[:, :, 1:blocks + 1].copy_(src[:, :, blocks + 1:2 * blocks + 1]),
        "scattered": lambda: dst.index_copy_(2, torch.arange(1, 2 * blocks, 2),
                                             src.index_select(2, torch.arange(2, 2 * blocks + 1, 2))),
    }


def summary(blocks: int, nbytes: int, runs: int, threads: list[int], nixl_t: dict[str, list[float]],
            copy_t: dict[str, list[float]]) -> dict[str, Any]:
    def gbps(ts: list[float]) -> dict[str, float]:  # p99 of the time is the slow tail: the low bandwidth
        return {"median": nbytes / statistics.median(ts) / 1e9, "p99": nbytes / percentile(ts, 99) / 1e9}

    out: dict[str, Any] = {"blocks": blocks, "bytes": nbytes, "runs": runs, "threads": threads,
                           "nixl_gbps": {k: gbps(v) for k, v in nixl_t.items()},
                           "memcpy_gbps": {k: gbps(v) for k, v in copy_t.items()}}
    base = out["memcpy_gbps"]["memcpy"]["median"]
    out["ratio_vs_memcpy"] = {k: v["median"] / base for k, v in out["nixl_gbps"].items()}
    return out


def run(blocks: int, runs: int, threads: list[int]) -> dict[str, Any]:
    torch.set_num_threads(1)
    num_blocks = 2 * blocks + 8
    port = free_port()
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=prefill_proc, args=(port, num_blocks, ready, done))
    proc.start()
    ready.get(timeout=120)
    # One decode connector per --kv-transfer-threads setting, all reading the same prefill pool.
    decoders = {}
    for t in threads:
        cfg = EngineConfig(role="decode", kv_lease_seconds=60, kv_transfer_threads=t)
        d = NixlConnectorWorker(cfg, f"bench-decode-t{t}", 0)
        kv = pool(num_blocks, fill=False)
        d.register_kv_caches(kv)
        decoders[t] = (d, kv)
    block_bytes = next(iter(decoders.values()))[0].block_bytes
    nbytes = blocks * LAYERS * 2 * block_bytes
    layouts = {"contiguous": (list(range(1, blocks + 1)), list(range(blocks + 1, 2 * blocks + 1))),
               "scattered": (list(range(1, 2 * blocks, 2)), list(range(2, 2 * blocks + 1, 2)))}
    n = 0

    def read(d: NixlConnectorWorker, local: list[int], remote: list[int]) -> float:
        nonlocal n
        n += 1
        rid = f"r{n}"
        rp = RemotePrefill.of(rid, RemotePrefillParams(
            remote_engine_id="bench-prefill", remote_host="127.0.0.1", remote_port=port,
            remote_request_id=rid, remote_block_ids=remote, block_size=BS))
        t0 = time.perf_counter()
        d.start_load_kv(KVConnectorMetadata(new_remote=[rp], loads=[LoadSpec(rid, local, remote)]))
        while True:
            res = d.get_finished()
            if res.finished_recving or res.failed_recving:
                break
            time.sleep(POLL_S)  # like the engine loop: poll, do not spin against UCX's threads
        dt = time.perf_counter() - t0
        assert res.finished_recving == [rid], res
        return dt

    src, baselines = copies(blocks, num_blocks, nbytes)
    nixl_t: dict[str, list[float]] = {f"{name}/t{t}": [] for name in layouts for t in threads}
    copy_t: dict[str, list[float]] = {name: [] for name in baselines}
    for i in range(runs + 1):  # round 0 warms up (handshakes, first touch) and is not counted
        # Interleaved, so that whatever else the machine does falls on every variant alike.
        for name, (local, remote) in layouts.items():
            for t, (d, _) in decoders.items():
                dt = read(d, local, remote)
                if i:
                    nixl_t[f"{name}/t{t}"].append(dt)
        for name, fn in baselines.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i:
                copy_t[name].append(dt)
    done.put(1)
    proc.join(30)
    for d, kv in decoders.values():  # the last round's scattered read: odd local blocks <- even remote ones
        assert torch.equal(kv[:, :, 1:2 * blocks:2], src[:, :, 2:2 * blocks + 1:2]), "NIXL read wrong bytes"
        d.shutdown()
    return summary(blocks, nbytes, runs, threads, nixl_t, copy_t)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mc = res["memcpy_gbps"]
    bars = [("memcpy", mc["memcpy"], "#888"), ("copy contiguous", mc["contiguous"], "#aaa"),
            ("copy scattered", mc["scattered"], "#ccc")]
    for t in res["threads"]:
        bars += [(f"NIXL contiguous\n{t} threads", res["nixl_gbps"][f"contiguous/t{t}"], "#2a7"),
                 (f"NIXL scattered\n{t} threads", res["nixl_gbps"][f"scattered/t{t}"], "#5c9")]
    fig, ax = plt.subplots(figsize=(2 + 1.1 * len(bars), 4))
    xs = range(len(bars))
    med = [b[1]["median"] for b in bars]
    p99 = [b[1]["p99"] for b in bars]
    ax.bar(xs, med, color=[b[2] for b in bars], label="median")
    ax.scatter(xs, p99, color="k", marker="_", s=200, label="p99 (slowest runs)")
    ax.set_xticks(list(xs), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title(f"KV transfer of {res['blocks']} blocks ({res['bytes'] / 1e6:.0f} MB) between 2 local processes, "
                 f"{res['runs']} runs", fontsize=10)
    for i, v in enumerate(med):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(res: dict[str, Any]) -> str:
    base = res["memcpy_gbps"]["memcpy"]["median"]
    rows = [f"KV transfer of {res['blocks']} SmolLM2 blocks ({res['bytes'] / 1e6:.1f} MB), {res['runs']} interleaved "
            "runs; NIXL/UCX READ between two processes against a single-threaded copy in one process.", "",
            "| path | median GB/s | p99 GB/s | median vs memcpy |", "|---|---|---|---|"]
    for name, v in res["memcpy_gbps"].items():
        rows.append(f"| copy: {name} | {v['median']:.2f} | {v['p99']:.2f} | {v['median'] / base:.0%} |")
    for name, v in res["nixl_gbps"].items():
        layout, t = name.split("/t")
        rows.append(f"| NIXL {layout}, --kv-transfer-threads {t} | {v['median']:.2f} | {v['p99']:.2f} | "
                    f"{v['median'] / base:.0%} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=88, help="88 SmolLM2 blocks = 65 MB")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", default="0,2", help="--kv-transfer-threads settings to compare")
    args = ap.parse_args()
    res = run(args.blocks, args.runs, [int(t) for t in args.threads.split(",")])
    write_results("kv_transfer_bandwidth", res, table(res), plot)
    print(table(res))


if __name__ == "__main__":
    main()
