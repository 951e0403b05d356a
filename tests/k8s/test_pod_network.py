"""The node agent's pod network: its IPs and its teardown.

No cluster is needed: each network here gets a recording `ip` and a temporary /etc/netns of its own. Nothing
in tests/k8s/pod_network.py may be monkeypatched: the session's cluster runs in this process, and a pod it
tore down while such a patch was in place removed the test's directory instead of its own (CI found the real
/etc/netns dir left behind).
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.pod_network import PodNetwork

Hook = Callable[[tuple[str, ...]], None]


def network(tmp_path: Path, hook: Hook = lambda args: None) -> PodNetwork:
    def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        hook(args)
        return subprocess.CompletedProcess(["ip", *args], 0, "", "")

    return PodNetwork(cidr="10.99.0.0/29", run_ip=ip, etc_root=tmp_path)  # host .1, pods .2 to .6


def pause_at(match: Callable[[tuple[str, ...]], bool]) -> tuple[Hook, threading.Event, threading.Event]:
    """A hook that holds the first `ip` command `match` accepts until `release` is set, and `reached`."""
    reached, release = threading.Event(), threading.Event()

    def hook(args: tuple[str, ...]) -> None:
        if match(args):
            reached.set()
            release.wait(5)

    return hook, reached, release


def test_a_released_ip_is_reused_only_after_every_other_free_one(tmp_path: Path) -> None:
    """A pod that replaces another must not get its address back at once: peers' neighbour caches still
    hold the old pod's MAC, and connections to the new pod time out (a scale from zero did)."""
    net = network(tmp_path)
    first = net.create("pod-a").ip
    net.destroy("pod-a")
    order: list[Any] = [net.create(f"pod-{i}").ip for i in range(4)]
    assert first == "10.99.0.2"
    assert order == ["10.99.0.3", "10.99.0.4", "10.99.0.5", "10.99.0.6"]
    assert net.create("pod-last").ip == first  # the range went round


def test_a_sandbox_being_built_when_the_agent_stops_leaves_nothing_behind(tmp_path: Path) -> None:
    """A pod whose sandbox is still being built when the agent tears the network down: the teardown waits
    for it and removes it (its /etc/netns files are not written after the teardown), and a pod that comes
    later is refused a sandbox."""
    hook, at_route, release = pause_at(lambda args: "route" in args)
    net = network(tmp_path, hook)
    building = threading.Thread(target=net.create, args=("late-pod",))
    building.start()
    assert at_route.wait(5)
    stopping = threading.Thread(target=net.teardown)
    stopping.start()
    stopping.join(0.2)
    release.set()
    building.join(5)
    stopping.join(5)
    assert not building.is_alive() and not stopping.is_alive()
    assert list(tmp_path.iterdir()) == [], "a sandbox's /etc/netns files outlived the teardown"
    with pytest.raises(RuntimeError, match="torn down"):
        net.create("later-pod")
    assert list(tmp_path.iterdir()) == []


def test_the_teardown_returns_only_after_a_pods_own_teardown_under_way(tmp_path: Path) -> None:
    """A pod worker still removing its sandbox when the agent's teardown runs: the teardown must not find
    nothing to do and return, or the suite checks for leftovers (and may exit) before the worker has
    removed the pod's /etc/netns dir."""
    hook, at_netns_del, release = pause_at(lambda args: args[:2] == ("netns", "del"))
    net = network(tmp_path, hook)
    net.create("slow-pod")
    assert [p.name for p in tmp_path.iterdir()] == ["tandem0-slowpod"]
    worker = threading.Thread(target=net.destroy, args=("slow-pod",))
    worker.start()
    assert at_netns_del.wait(5)
    stopping = threading.Thread(target=net.teardown)
    stopping.start()
    stopping.join(0.2)
    assert stopping.is_alive(), "the teardown did not wait for the pod's own teardown"
    release.set()
    stopping.join(5)
    assert list(tmp_path.iterdir()) == []
    worker.join(5)
