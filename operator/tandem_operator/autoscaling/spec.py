"""`spec.autoscaling`: the planner's settings, their defaults and the checks the CRD's schema also makes.

Parsed by `tandem_operator.spec.parse_spec`; docs/crd-reference.md lists the fields and docs/architecture.md
("P/D autoscaling") the model the planner applies them with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem_operator.spec import SpecReader

PERCENTILES = (50, 75, 90, 95, 99)
# Seconds between ticks when spec.autoscaling does not say (and for the loops that run without it).
DEFAULT_INTERVAL_SECONDS = 15


@dataclass(frozen=True)
class RoleBounds:
    min_replicas: int  # 0: the role may scale to zero, only through `ScaleToZero`
    max_replicas: int


@dataclass(frozen=True)
class Targets:
    percentile: int
    ttft_seconds: float
    itl_seconds: float


@dataclass(frozen=True)
class Fallback:
    """Targets of the load signals, which also stand in for latency when no request finished."""

    queue_depth_per_replica: float
    kv_cache_usage: float


@dataclass(frozen=True)
class RatioBounds:
    """Bounds on prefill replicas / decode replicas; None: unbounded on that side."""

    min: float | None
    max: float | None


@dataclass(frozen=True)
class AutoscalingSpec:
    prefill: RoleBounds | None  # None: prefill is not autoscaled (colocated, or left at prefill.replicas)
    decode: RoleBounds
    targets: Targets
    fallback: Fallback
    scale_up_seconds: int
    scale_down_seconds: int
    ratio: RatioBounds
    idle_seconds: int
    hold_seconds: int  # how long the router holds a request while no engine is up (scale to zero only)
    interval_seconds: int

    @property
    def scale_to_zero(self) -> bool:
        """Both pools may go to zero when idle: every autoscaled role allows `minReplicas: 0`."""
        return self.decode.min_replicas == 0 and (self.prefill is None or self.prefill.min_replicas == 0)


def _number(
    r: SpecReader, obj: dict[str, Any], key: str, path: str, default: float, minimum: float, maximum: float
) -> float:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        r.problems.append(f"{path}.{key}: must be a number, got {value!r}")
        return default
    if not minimum <= value <= maximum:
        r.problems.append(f"{path}.{key}: must be between {minimum:g} and {maximum:g}, got {value:g}")
    return float(value)


def _bounds(r: SpecReader, raw: dict[str, Any], path: str) -> RoleBounds:
    if "maxReplicas" not in raw:
        r.problems.append(f"{path}.maxReplicas: is required")
    low = r.required_int(raw, "minReplicas", path, 1, minimum=0, maximum=1000)
    high = r.required_int(raw, "maxReplicas", path, max(low, 1), minimum=1, maximum=1000)
    if low > high:
        r.problems.append(f"{path}.minReplicas: must be <= maxReplicas ({low} > {high})")
    return RoleBounds(low, high)


def _ratio(r: SpecReader, raw: dict[str, Any]) -> RatioBounds:
    p = "spec.autoscaling.prefillDecodeRatio"
    low = _number(r, raw, "min", p, 0.0, 0.0, 100.0) if "min" in raw else None
    high = _number(r, raw, "max", p, 0.0, 0.01, 100.0) if "max" in raw else None
    if low is not None and high is not None and low > high:
        r.problems.append(f"{p}.min: must be <= max ({low:g} > {high:g})")
    return RatioBounds(low, high)


def parse_autoscaling(r: SpecReader, spec: dict[str, Any], disaggregated: bool) -> AutoscalingSpec | None:
    """`spec.autoscaling` typed, or None when it is absent (fixed replicas)."""
    if spec.get("autoscaling") is None:
        return None
    p = "spec.autoscaling"
    raw = r.section(spec, "autoscaling", "spec")
    if "decode" not in raw:
        r.problems.append(f"{p}.decode: is required")
    decode = _bounds(r, r.section(raw, "decode", p), f"{p}.decode")
    prefill = None
    if raw.get("prefill") is not None:
        if not disaggregated:
            r.problems.append(f"{p}.prefill: only a disaggregated service (prefill enabled) has a prefill pool")
        prefill = _bounds(r, r.section(raw, "prefill", p), f"{p}.prefill")
    ratio = _ratio(r, r.section(raw, "prefillDecodeRatio", p))
    if prefill is None and raw.get("prefillDecodeRatio") is not None:
        r.problems.append(f"{p}.prefillDecodeRatio: needs {p}.prefill (both pools autoscaled)")
    if prefill is not None and (prefill.min_replicas == 0) != (decode.min_replicas == 0):
        r.problems.append(f"{p}: minReplicas 0 (scale to zero) must be set on both prefill and decode")
    elif disaggregated and prefill is None and decode.min_replicas == 0:
        r.problems.append(f"{p}.prefill: decode minReplicas 0 needs prefill autoscaled with minReplicas 0")
    targets = r.section(raw, "targets", p)
    fallback = r.section(raw, "fallback", p)
    return AutoscalingSpec(
        prefill=prefill,
        decode=decode,
        targets=Targets(
            percentile=r.required_int(targets, "percentile", f"{p}.targets", 90, choices=PERCENTILES),
            ttft_seconds=_number(r, targets, "ttftSeconds", f"{p}.targets", 2.0, 0.001, 3600.0),
            itl_seconds=_number(r, targets, "itlSeconds", f"{p}.targets", 0.25, 0.001, 60.0),
        ),
        fallback=Fallback(
            queue_depth_per_replica=_number(r, fallback, "queueDepthPerReplica", f"{p}.fallback", 4.0, 0.1, 10000.0),
            kv_cache_usage=_number(r, fallback, "kvCacheUsage", f"{p}.fallback", 0.8, 0.05, 1.0),
        ),
        scale_up_seconds=r.required_int(
            r.section(raw, "scaleUp", p), "stabilizationSeconds", f"{p}.scaleUp", 30, minimum=0, maximum=3600
        ),
        scale_down_seconds=r.required_int(
            r.section(raw, "scaleDown", p), "stabilizationSeconds", f"{p}.scaleDown", 300, minimum=0, maximum=3600
        ),
        ratio=ratio,
        idle_seconds=r.required_int(
            r.section(raw, "scaleToZero", p), "idleSeconds", f"{p}.scaleToZero", 600, minimum=30, maximum=86400
        ),
        hold_seconds=r.required_int(
            r.section(raw, "scaleToZero", p), "holdSeconds", f"{p}.scaleToZero", 300, minimum=1, maximum=3600
        ),
        interval_seconds=r.required_int(raw, "intervalSeconds", p, DEFAULT_INTERVAL_SECONDS, minimum=1, maximum=600),
    )
