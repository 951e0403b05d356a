"""The node agent's stand-in for CPU limits (no cluster needed): which CPUs a container is pinned to."""

from __future__ import annotations

from tests.k8s.cpu_placement import CpuPlacer


def limits(cpu: str | None) -> dict[str, object]:
    return {"name": "main", "resources": {"limits": {"cpu": cpu}} if cpu else {}}


def test_containers_without_a_cpu_limit_are_not_pinned() -> None:
    placer = CpuPlacer({0, 1, 2, 3})
    assert placer.place(limits(None)) is None
    assert placer.place({"name": "main", "resources": {"requests": {"cpu": "2"}}}) is None
    assert placer.users() == {0: 0, 1: 0, 2: 0, 3: 0}


def test_a_limit_takes_its_ceiling_in_cpus_the_least_used_first() -> None:
    placer = CpuPlacer({0, 1, 2, 3})
    first = placer.place(limits("1"))
    second = placer.place(limits("500m"))  # rounds up to one CPU, not the one already taken
    pair = placer.place(limits("1500m"))
    assert first == [0] and second == [1] and pair == [2, 3]
    placer.release(second)
    assert placer.place(limits("1")) == [1]
    assert placer.users() == {0: 1, 1: 1, 2: 1, 3: 1}


def test_a_limit_above_the_machine_gets_every_cpu_and_released_cpus_are_reused() -> None:
    placer = CpuPlacer({0, 1})
    everything = placer.place(limits("8"))
    assert everything == [0, 1]
    one = placer.place(limits("1"))
    assert one == [0]  # both are shared now: the lowest of the least used
    placer.release(everything)
    placer.release(one)
    assert placer.users() == {0: 0, 1: 0}
