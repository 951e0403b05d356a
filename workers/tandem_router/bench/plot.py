"""A PNG of one benchmark run: TTFT and ITL distributions, e2e latency CDF, TTFT over time."""

from __future__ import annotations

from typing import Any

from tandem_router.bench.client import Record


def plot_run(records: list[Record], summary: dict[str, Any], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ttft = [r.ttft * 1000 for r in ok]
    itl = [x * 1000 for r in ok for x in r.itl]
    e2e = sorted(r.e2e for r in ok)
    axes[0][0].hist(ttft, bins=40, color="tab:blue")
    axes[0][0].set(title="TTFT", xlabel="ms", ylabel="requests")
    axes[0][1].hist(itl, bins=60, color="tab:orange")
    axes[0][1].set(title="Inter-token latency", xlabel="ms", ylabel="tokens")
    axes[1][0].plot(e2e, [(i + 1) / len(e2e) for i in range(len(e2e))] if e2e else [], color="tab:green")
    axes[1][0].set(title="End-to-end latency CDF", xlabel="s", ylabel="fraction")
    axes[1][1].scatter([r.start for r in ok], ttft, s=6, c=[r.turn for r in ok], cmap="viridis")
    axes[1][1].set(title="TTFT over time (colour: turn)", xlabel="s since start", ylabel="ms")
    fig.suptitle(f"{title}: {summary['completed']} requests, {summary['output_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
