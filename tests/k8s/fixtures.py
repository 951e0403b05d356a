"""The session-scoped `k8s_cluster` fixture, registered for the whole suite by tests/conftest.py.

Imports of the cluster code happen inside the fixture, so a suite run that asks for no cluster needs
neither the Kubernetes binaries nor root.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.k8s.cluster import Cluster
    from tests.k8s.kwok import FakeNode
    from tests.k8s.real_node import RealNode

REPO = Path(__file__).resolve().parents[2]
# A cold build of the Kubernetes binaries takes tens of minutes on 2 cores: more than one test's timeout.
BUILD_TIMEOUT_S = 3600


TOOLS_BUILT = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    """Every test's `kubectl` and `helm` are the pinned builds from hack/build-tools.sh, not the machine's."""
    built = subprocess.run(["bash", str(REPO / "hack" / "build-tools.sh"), "--print"], capture_output=True, text=True)
    config.stash[TOOLS_BUILT] = built.returncode == 0
    if built.returncode == 0:
        os.environ["PATH"] = built.stdout.strip() + os.pathsep + os.environ.get("PATH", "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = next((i for i in items if "k8s_cluster" in getattr(i, "fixturenames", ())), None)
    if first is None:
        return
    if not config.stash[TOOLS_BUILT]:
        # The session fixture builds them during the setup of the first test that needs it.
        first.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S))


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from tests.k8s.cluster import Cluster, build_tools, preflight

    problem = preflight()
    if problem:
        pytest.fail(problem, pytrace=False)
    cluster = Cluster(tmp_path_factory.mktemp("k8s"), build_tools()).start()
    try:
        yield cluster
    finally:
        cluster.stop()
    leftovers = cluster.leftovers()
    assert not leftovers, f"the test cluster left behind: {leftovers}"


@pytest.fixture(scope="session")
def k8s_fake_node(k8s_cluster: Cluster) -> Iterator[FakeNode]:
    """A kwok node on the session cluster (tainted: only pods that ask for it land there)."""
    from tests.k8s.kwok import FakeNode

    node = FakeNode(k8s_cluster.bin_dir, k8s_cluster.kubeconfig, k8s_cluster.kube,
                    k8s_cluster.work_dir / "kwok.log").start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def k8s_real_node(k8s_cluster: Cluster) -> Iterator[RealNode]:
    """A real node (kubelet, containerd, CNI, kube-proxy, CoreDNS) on the session cluster, holding the images
    of docker/ (built first if missing), tainted: only pods that tolerate it land there."""
    from tests.k8s.real_node import RealNode, preflight, product_images

    problem = preflight()
    if problem:
        pytest.fail(problem, pytrace=False)
    node = RealNode(k8s_cluster.work_dir / "real-node", k8s_cluster.bin_dir, k8s_cluster.control_plane,
                    images=product_images()).start()
    try:
        yield node
    finally:
        node.stop()
    leftovers = node.leftovers()
    assert not leftovers, f"the real node left behind: {leftovers}"
