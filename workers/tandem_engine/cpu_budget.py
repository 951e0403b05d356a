"""How many CPUs this process may really use, and how many intra-op threads each EngineCore gets.

`os.cpu_count()` sees the whole machine (or node), not what the process is allowed: its CPU affinity,
its cgroup's CPU quota (a Kubernetes CPU limit), or a limit the operator passes down because the pod's
cgroup is not visible (downward API `limits.cpu`, env `TANDEM_CPU_LIMIT_MILLICORES`). Running more
OpenMP threads than CPUs makes every parallel region's barrier wait for a descheduled thread; two
engines sharing two cores each with two threads ran 17x slower than one (docs/operations.md, "CPU
threads"). The smallest of these budgets wins, split evenly among data-parallel EngineCores.

Everything reads through a `root` path so tests can feed cgroup v1 and v2 fixture trees.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CPU_LIMIT_ENV = "TANDEM_CPU_LIMIT_MILLICORES"
# libgomp (torch's OpenMP) spins 300,000 iterations at every barrier before it sleeps: a thread whose
# peer was descheduled by another process burns its whole time slice. Two busy engines on two cores took
# 9x one engine's time with that, 2.8x with a 10,000 spin and 1.45x with passive waiting, which costs one
# engine alone ~10% (bench/results/cpu_sharing.md): an engine cannot know who shares its cores, so it
# waits passively unless the user sets OMP_WAIT_POLICY or GOMP_SPINCOUNT.
OMP_WAIT_POLICY = "PASSIVE"
# Where cgroup v1 mounts the cpu controller, by distribution.
_V1_MOUNTS = ("cpu,cpuacct", "cpuacct,cpu", "cpu")


@dataclass(frozen=True)
class CpuLimit:
    cpus: float
    source: str  # "affinity", "cgroup v2 cpu.max", "cgroup v1 cfs quota", TANDEM_CPU_LIMIT_MILLICORES
    detail: str  # e.g. "150000 100000 in /sys/fs/cgroup/kubepods/pod1/cpu.max"


@dataclass(frozen=True)
class ThreadPlan:
    threads: int
    reason: str
    limit: CpuLimit | None  # the binding limit; None when --num-threads decided


def affinity_limit(cpus: set[int] | None = None) -> CpuLimit:
    mask = cpus if cpus is not None else os.sched_getaffinity(0)
    return CpuLimit(float(len(mask)), "affinity", f"CPUs {_ranges(sorted(mask))}")


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5", as the kernel's cpulist files write it."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and runs[-1][-1] == c - 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _cgroup_paths(root: Path) -> dict[str, str]:
    """controller list -> path, from /proc/self/cgroup ("" is the cgroup v2 unified hierarchy)."""
    paths: dict[str, str] = {}
    try:
        text = (root / "proc/self/cgroup").read_text()
    except OSError:
        return paths
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            paths[parts[1]] = parts[2]
    return paths


def _candidate_dirs(mount: Path, path: str) -> list[Path]:
    """The cgroup's own folder and its ancestors up to the mount: a quota on any of them applies.

    Inside a container without a cgroup namespace, /proc/self/cgroup names the host's path, which is
    not mounted there; the container's own cgroup is then the mount's root."""
    rel = Path(path.lstrip("/"))
    own = mount / rel
    if not own.is_dir():
        return [mount]
    dirs = [own]
    while rel != Path("."):
        rel = rel.parent
        dirs.append(mount / rel)
    return dirs


def cgroup_v2_limit(root: Path = Path("/")) -> CpuLimit | None:
    path = _cgroup_paths(root).get("")
    mount = root / "sys/fs/cgroup"
    if path is None or not (mount / "cgroup.controllers").exists():
        return None
    best: CpuLimit | None = None
    for d in _candidate_dirs(mount, path):
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if quota == "max" or int(period) <= 0:
            continue
        cpus = int(quota) / int(period)
        if best is None or cpus < best.cpus:
            best = CpuLimit(cpus, "cgroup v2 cpu.max", f"{quota} {period} in {d / 'cpu.max'}")
    return best


def cgroup_v1_limit(root: Path = Path("/")) -> CpuLimit | None:
    paths = _cgroup_paths(root)
    best: CpuLimit | None = None
    for controllers, path in paths.items():
        if "cpu" not in controllers.split(","):
            continue
        for name in _V1_MOUNTS:
            mount = root / "sys/fs/cgroup" / name
            if not mount.is_dir():
                continue
            for d in _candidate_dirs(mount, path):
                try:
                    quota = int((d / "cpu.cfs_quota_us").read_text())
                    period = int((d / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                if quota <= 0 or period <= 0:  # -1: no quota
                    continue
                cpus = quota / period
                if best is None or cpus < best.cpus:
                    best = CpuLimit(cpus, "cgroup v1 cfs quota", f"{quota}/{period} us in {d}")
            break
    return best


def env_limit(env: Mapping[str, str] | None = None) -> CpuLimit | None:
    value = (os.environ if env is None else env).get(CPU_LIMIT_ENV, "").strip()
    if not value:
        return None
    try:
        millicores = int(value)
    except ValueError:
        return None
    if millicores <= 0:
        return None
    return CpuLimit(millicores / 1000, CPU_LIMIT_ENV, f"{millicores}m")


def cpu_limits(root: Path = Path("/"), env: Mapping[str, str] | None = None,
               affinity: set[int] | None = None) -> list[CpuLimit]:
    """Every limit that applies to this process; the machine's own root unless a test says otherwise."""
    limits = [affinity_limit(affinity)]
    for found in (cgroup_v2_limit(root), cgroup_v1_limit(root), env_limit(env)):
        if found is not None:
            limits.append(found)
    return limits


def openmp_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What to add to an EngineCore's environment before torch loads libgomp; a user's own
    OMP_WAIT_POLICY or GOMP_SPINCOUNT wins."""
    env = os.environ if env is None else env
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return {}
    return {"OMP_WAIT_POLICY": OMP_WAIT_POLICY}


def plan_threads(data_parallel_size: int = 1, override: int | None = None,
                 limits: list[CpuLimit] | None = None) -> ThreadPlan:
    """Intra-op threads per EngineCore: `override` (--num-threads) if given, else the tightest CPU
    limit divided among the DP EngineCores, rounded down (a fractional CPU cannot host a spinning
    thread) and at least 1."""
    if override:
        return ThreadPlan(override, f"--num-threads {override}", None)
    limits = limits if limits is not None else cpu_limits()
    tightest = min(limits, key=lambda lim: lim.cpus)
    dp = max(1, data_parallel_size)
    threads = max(1, math.floor(tightest.cpus / dp + 1e-9))
    share = f" / {dp} EngineCores" if dp > 1 else ""
    return ThreadPlan(threads, f"{tightest.cpus:g} CPUs from {tightest.source} ({tightest.detail}){share}", tightest)
