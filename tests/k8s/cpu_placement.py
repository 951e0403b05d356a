"""CPU limits, as far as processes on one machine can honour them: a container with `limits.cpu` runs
pinned to ceil(limit) of the machine's CPUs, the least used first.

A kubelet enforces a CPU limit with the CFS quota of the container's cgroup: a container never uses more
than its limit, however busy its neighbours are. The node agent has no cgroups of its own; CPU affinity
is the closest it comes. Without it, an engine pod that starts (imports, model load: a few seconds of
every core) takes CPU from the pods already serving on the same two cores, which a real node would not
let it do, and autoscaling measured here would pay for that. Containers without a CPU limit are not
pinned (BestEffort and Burstable pods may use every core on a real node too). The engine sizes its
threads from the same affinity (tandem_engine.cpu_budget), as it would from the quota on a real node.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity


def cpu_limit(container: Mapping[str, Any]) -> Decimal | None:
    """The container's `resources.limits.cpu` in cores, or None when it has none."""
    limit = ((container.get("resources") or {}).get("limits") or {}).get("cpu")
    return None if limit is None else Decimal(parse_quantity(limit))


class CpuPlacer:
    """Which containers are pinned to which CPUs, shared by every pod worker of a node."""

    def __init__(self, cpus: set[int] | None = None) -> None:
        self.cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
        self._users: dict[int, int] = dict.fromkeys(self.cpus, 0)
        self._lock = threading.Lock()

    def place(self, container: Mapping[str, Any]) -> list[int] | None:
        """CPUs for a container about to start (None: unpinned); hand them back with `release`."""
        limit = cpu_limit(container)
        if limit is None or limit <= 0:
            return None
        count = min(len(self.cpus), max(1, math.ceil(limit)))
        with self._lock:
            chosen = sorted(sorted(self.cpus, key=lambda c: (self._users[c], c))[:count])
            for cpu in chosen:
                self._users[cpu] += 1
        return chosen

    def release(self, cpus: list[int] | None) -> None:
        if not cpus:
            return
        with self._lock:
            for cpu in cpus:
                self._users[cpu] -= 1

    def users(self) -> dict[int, int]:
        with self._lock:
            return dict(self._users)
