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
    # One real node at a time (containerd's store is shared and locked): `make cluster`'s test runs before
    # the session's cluster starts, whatever order the files were collected in.
    real = next((n for n, i in enumerate(items) if "k8s_cluster" in getattr(i, "fixturenames", ())), None)
    if real is not None:
        made = [i for i in items[real:] if i.path.name == "test_make_cluster.py"]
        for item in made:
            items.remove(item)
        items[real:real] = made
    first = next((i for i in items if "k8s_cluster" in getattr(i, "fixturenames", ())), None)
    if first is None:
        return
    # The session fixture builds the tools and images during the setup of the first test that needs it, if
    # missing, and copies an image version containerd lacks into it (minutes for the worker's 6.5 GB).
    first.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S))


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The suite's cluster, as `make cluster` starts it: the real control plane and one real node (kubelet,
    containerd, CNI, kube-proxy, CoreDNS) holding the images of docker/ (built first if missing). Every pod
    on it is a container. Its own bridge and pod addresses, not `make cluster`'s defaults."""
    from tests.k8s.cluster import Cluster, build_tools, preflight
    from tests.k8s.real_node import RealNode, product_images
    from tests.k8s.real_node import preflight as node_preflight

    problem = preflight() or node_preflight()
    if problem:
        pytest.fail(problem, pytrace=False)
    work = tmp_path_factory.mktemp("k8s-real")
    bin_dir = build_tools()
    node = RealNode(work / "node", bin_dir, None, name="tandem-node-1", images=product_images())
    cluster = Cluster(work, bin_dir, node).start()
    try:
        yield cluster
    finally:
        cluster.stop()
    leftovers = cluster.leftovers()
    assert not leftovers, f"the real node left behind: {leftovers}"


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
