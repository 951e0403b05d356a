"""The thread-count decision: affinity masks, cgroup v1 and v2 quotas (fixture trees), DP sizes, override."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem_engine.cpu_budget import (
    CpuLimit,
    affinity_limit,
    cgroup_v1_limit,
    cgroup_v2_limit,
    cpu_limits,
    env_limit,
    openmp_env,
    plan_threads,
)


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_tree(root: Path, own: str = "max 100000", parent: str = "max 100000",
            path: str = "/kubepods/pod1/ctr") -> Path:
    write(root, "proc/self/cgroup", f"0::{path}\n")
    write(root, "sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n")
    write(root, f"sys/fs/cgroup{path}/cpu.max", own + "\n")
    write(root, f"sys/fs/cgroup{str(Path(path).parent)}/cpu.max", parent + "\n")
    return root


def v1_tree(root: Path, quota: int, period: int = 100000, mount: str = "cpu,cpuacct",
            path: str = "/kubepods/pod1/ctr") -> Path:
    write(root, "proc/self/cgroup", f"4:memory:{path}\n3:cpu,cpuacct:{path}\n2:cpuset:/\n")
    write(root, f"sys/fs/cgroup/{mount}{path}/cpu.cfs_quota_us", f"{quota}\n")
    write(root, f"sys/fs/cgroup/{mount}{path}/cpu.cfs_period_us", f"{period}\n")
    write(root, f"sys/fs/cgroup/{mount}/cpu.cfs_quota_us", "-1\n")
    write(root, f"sys/fs/cgroup/{mount}/cpu.cfs_period_us", "100000\n")
    return root


def test_affinity_mask_counts_cpus_and_names_them() -> None:
    lim = affinity_limit({0, 1, 2, 5})
    assert lim.cpus == 4 and lim.source == "affinity" and lim.detail == "CPUs 0-2,5"


def test_v2_quota_of_the_pod_binds(tmp_path: Path) -> None:
    lim = cgroup_v2_limit(v2_tree(tmp_path, own="max 100000", parent="150000 100000"))
    assert lim is not None and lim.cpus == 1.5 and lim.source == "cgroup v2 cpu.max"
    assert "kubepods/pod1/cpu.max" in lim.detail


def test_v2_tightest_ancestor_wins(tmp_path: Path) -> None:
    lim = cgroup_v2_limit(v2_tree(tmp_path, own="50000 100000", parent="300000 100000"))
    assert lim is not None and lim.cpus == 0.5


def test_v2_without_a_quota_is_no_limit(tmp_path: Path) -> None:
    assert cgroup_v2_limit(v2_tree(tmp_path)) is None


def test_v2_container_without_cgroup_namespace_reads_the_mount_root(tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path, which the container does not have mounted.
    write(tmp_path, "proc/self/cgroup", "0::/kubepods.slice/kubepods-pod1.slice/cri-abc.scope\n")
    write(tmp_path, "sys/fs/cgroup/cgroup.controllers", "cpu\n")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "200000 100000\n")
    lim = cgroup_v2_limit(tmp_path)
    assert lim is not None and lim.cpus == 2


@pytest.mark.parametrize("mount", ["cpu,cpuacct", "cpu"])
def test_v1_cfs_quota(tmp_path: Path, mount: str) -> None:
    lim = cgroup_v1_limit(v1_tree(tmp_path, quota=250000, mount=mount))
    assert lim is not None and lim.cpus == 2.5 and lim.source == "cgroup v1 cfs quota"


def test_v1_unlimited_quota_is_no_limit(tmp_path: Path) -> None:
    assert cgroup_v1_limit(v1_tree(tmp_path, quota=-1)) is None


def test_v1_tree_is_not_mistaken_for_v2(tmp_path: Path) -> None:
    assert cgroup_v2_limit(v1_tree(tmp_path, quota=100000)) is None


@pytest.mark.parametrize(("value", "cpus"), [("1500", 1.5), ("4000", 4.0), ("", None), ("0", None), ("2", 0.002),
                                             ("two", None)])
def test_downward_api_env(value: str, cpus: float | None) -> None:
    lim = env_limit({"TANDEM_CPU_LIMIT_MILLICORES": value})
    assert (lim.cpus if lim else None) == cpus


def test_tightest_limit_decides(tmp_path: Path) -> None:
    limits = cpu_limits(v1_tree(tmp_path, quota=300000), env={"TANDEM_CPU_LIMIT_MILLICORES": "2000"},
                        affinity=set(range(8)))
    plan = plan_threads(1, None, limits)
    assert plan.threads == 2
    assert plan.limit is not None and plan.limit.source == "TANDEM_CPU_LIMIT_MILLICORES"
    assert "2 CPUs from TANDEM_CPU_LIMIT_MILLICORES" in plan.reason


def test_machine_without_limits_uses_affinity(tmp_path: Path) -> None:
    plan = plan_threads(1, None, cpu_limits(tmp_path, env={}, affinity={0, 1}))
    assert plan.threads == 2 and plan.limit is not None and plan.limit.source == "affinity"


@pytest.mark.parametrize(("cpus", "dp", "threads"), [(8, 1, 8), (8, 2, 4), (8, 3, 2), (2, 4, 1), (1.5, 1, 1),
                                                      (0.5, 1, 1), (3.999, 1, 3), (6, 2, 3)])
def test_share_per_engine_core(cpus: float, dp: int, threads: int) -> None:
    plan = plan_threads(dp, None, [CpuLimit(cpus, "affinity", "")])
    assert plan.threads == threads
    if dp > 1:
        assert f"/ {dp} EngineCores" in plan.reason


def test_num_threads_overrides_every_limit() -> None:
    plan = plan_threads(2, 6, [CpuLimit(1, "cgroup v2 cpu.max", "")])
    assert plan.threads == 6 and plan.limit is None and plan.reason == "--num-threads 6"


def test_this_machine(tmp_path: Path) -> None:
    """The real machine's files parse: whatever they say, at least one thread and a reason."""
    plan = plan_threads()
    assert plan.threads >= 1 and "CPUs from" in plan.reason


def test_openmp_waits_passively_unless_the_user_chose() -> None:
    assert openmp_env({}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert openmp_env({"GOMP_SPINCOUNT": "0"}) == {}
