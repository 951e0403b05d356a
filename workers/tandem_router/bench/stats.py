"""Summary statistics of a benchmark run: TTFT, TPOT, ITL, e2e (mean, p50, p99) and throughput."""

from __future__ import annotations

import math
from typing import Any

from tandem_router.bench.client import Record


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def describe(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean/p50/p99 (milliseconds by default)."""
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    return {
        "mean": sum(values) / len(values) * scale,
        "p50": percentile(values, 50) * scale,
        "p99": percentile(values, 99) * scale,
    }


def summarize(records: list[Record], duration: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else math.nan,
        "output_throughput": out_tokens / duration if duration else math.nan,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else math.nan,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft_ms": describe([r.ttft for r in ok]),
        "tpot_ms": describe([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": describe([x for r in ok for x in r.itl]),
        "e2e_ms": describe([r.e2e for r in ok]),
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"requests: {s['completed']} completed, {s['failed']} failed in {s['duration_s']:.2f} s",
        f"throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s",
        f"{'':8}{'mean':>10}{'p50':>10}{'p99':>10}   (ms)",
    ]
    for key in ("ttft", "tpot", "itl", "e2e"):
        d = s[f"{key}_ms"]
        lines.append(f"{key.upper():8}{d['mean']:>10.2f}{d['p50']:>10.2f}{d['p99']:>10.2f}")
    if "prefix_cache_hit_rate" in s:
        lines.append(f"prefix cache hit rate: {s['prefix_cache_hit_rate']:.1%}")
    return "\n".join(lines)
