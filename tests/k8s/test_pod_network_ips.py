"""The node agent's pod IPs (no cluster needed: the `ip` commands are recorded, not run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.k8s import pod_network
from tests.k8s.pod_network import PodNetwork


@pytest.fixture
def network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> PodNetwork:
    monkeypatch.setattr(pod_network, "ip", lambda *args, **kw: None)
    monkeypatch.setattr(pod_network, "NETNS_ETC", tmp_path)
    monkeypatch.setattr(pod_network.Sandbox, "etc_dir", property(lambda self: tmp_path / self.netns))
    return PodNetwork(cidr="10.99.0.0/29")  # host .1, pods .2 to .6


def test_a_released_ip_is_reused_only_after_every_other_free_one(network: PodNetwork) -> None:
    """A pod that replaces another must not get its address back at once: peers' neighbour caches still
    hold the old pod's MAC, and connections to the new pod time out (a scale from zero did)."""
    first = network.create("pod-a").ip
    network.destroy("pod-a")
    order: list[Any] = [network.create(f"pod-{i}").ip for i in range(4)]
    assert first == "10.99.0.2"
    assert order == ["10.99.0.3", "10.99.0.4", "10.99.0.5", "10.99.0.6"]
    assert network.create("pod-last").ip == first  # the range went round
