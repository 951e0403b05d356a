"""A whole test cluster: the real control plane plus one node, real (a kubelet with containerd: real_node.py)
or run by the test node agent.

    python -m tests.k8s.cluster [--work-dir DIR] [--bridge NAME --pod-cidr CIDR]     (make cluster)

runs it in the foreground (as root) and, once ready, prints the two lines to paste into another shell
(KUBECONFIG and PATH with kubectl and helm); Ctrl-C stops everything and leaves no process, network
namespace or mount behind. Tests use the session fixture `k8s_cluster` (fixtures.py) instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import kubernetes

from tests.k8s.controlplane import ControlPlane
from tests.k8s.kube import Kube
from tests.k8s.node_agent import REPO, NodeAgent
from tests.k8s.pod_network import PodNetwork
from tests.k8s.real_node import RealNode, product_images

logger = logging.getLogger(__name__)


def preflight() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "the test cluster needs root (network namespaces, bridges, mounts): run as root"
    if shutil.which("ip") is None or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "the test cluster needs `ip netns` (iproute2) working on this machine"
    return None


def build_tools() -> Path:
    """hack/build-tools.sh: a no-op once built, tens of minutes the first time; prints the bin dir last."""
    argv = ["bash", str(REPO / "hack" / "build-tools.sh")]
    out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


class Cluster:
    def __init__(self, work_dir: Path, bin_dir: Path, network: PodNetwork | None = None,
                 entrypoints: dict[str, list[str]] | None = None, real_node: RealNode | None = None) -> None:
        """With `real_node` (whose control plane this cluster's becomes), that node alone, untainted: no
        node agent and no `network`. Without, the node agent's node (the suite's session cluster, which
        adds a real node beside it: fixtures.py)."""
        self.work_dir = work_dir
        self.bin_dir = bin_dir
        self.real_node = real_node
        self.network = network or PodNetwork()
        advertise = real_node.gateway if real_node else self.network.host_ip
        self.control_plane = ControlPlane(work_dir / "control-plane", bin_dir, advertise_address=advertise)
        if real_node:
            real_node.control_plane = self.control_plane
        self.entrypoints = entrypoints
        self.agent: NodeAgent | None = None
        self.api: kubernetes.client.ApiClient | None = None
        self.startup_s = 0.0

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()

    @property
    def kubeconfig(self) -> Path:
        return self.control_plane.kubeconfig

    @property
    def kube(self) -> Kube:
        assert self.api is not None, "cluster not started"
        return Kube(self.api)

    def start(self) -> Cluster:
        began = time.monotonic()
        try:
            if self.real_node:
                self.real_node.prepare_network()
            self.control_plane.start()
            self.api = self.control_plane.api_client()
            if self.real_node:
                self.real_node.start()
            else:
                self.agent = NodeAgent(self.api, self.work_dir / "node", network=self.network,
                                       entrypoints=self.entrypoints).start()
                self.agent.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - began
        logger.info("[startup] cluster ready in %.1f s; work dir %s", self.startup_s, self.work_dir)
        return self

    def stop(self) -> None:
        if self.agent is not None:
            self.agent.stop()
            self.agent = None
        if self.real_node:
            self.real_node.stop()
        self.control_plane.stop()
        if self.api is not None:
            self.api.close()
            self.api = None

    def leftovers(self) -> list[str]:
        return self.real_node.leftovers() if self.real_node else self.network.leftovers()

    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.control_plane.kubectl(*args, input=input)

    def apply(self, namespace: str, *objects: dict[str, Any]) -> None:
        """`kubectl apply` of manifests given as dicts."""
        manifest = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
        out = self.kubectl("apply", "-n", namespace, "-f", "-", input=manifest)
        if out.returncode != 0:
            raise RuntimeError(f"kubectl apply failed: {out.stderr}")

    def create_namespace(self, name: str, timeout_s: float = 60.0) -> str:
        """Creates a namespace and waits for what pods in it need: its default ServiceAccount and root CA."""
        self.kube.post("/api/v1/namespaces", {"metadata": {"name": name}})
        eventually(lambda: self.kubectl("get", "sa/default", "cm/kube-root-ca.crt", "-n", name).returncode == 0,
                   timeout_s, f"namespace {name} has no default ServiceAccount or kube-root-ca.crt")
        return name

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self.kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}")

    def pod_log(self, namespace: str, name: str) -> str:
        assert self.agent is not None
        return self.agent.pod_log(namespace, name)

    def pod_output(self, namespace: str, name: str) -> list[str]:
        """The lines the pod's containers printed, without the agent's headers: those quote each
        container's command, so a test looking for what a script prints must not search them."""
        return [line for line in self.pod_log(namespace, name).splitlines() if not line.startswith(("==> ", "--- "))]


def eventually(predicate: Any, timeout_s: float, message: str, interval_s: float = 0.25) -> Any:
    """Polls predicate until it returns something truthy (returned), or fails with message."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} (after {timeout_s:.0f} s)")
        time.sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.k8s.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, help="where certs, kubeconfig and logs go (default: a new temp dir)")
    parser.add_argument("--bridge", default="tandem0",
                        help="the pod network's bridge (default tandem0, the test suite's: one cluster per bridge)")
    parser.add_argument("--pod-cidr", default="10.244.0.0/24", help="pod addresses (default 10.244.0.0/24)")
    parser.add_argument("--node", choices=("real", "agent"), default="real",
                        help="real: a kubelet with containerd running the images of docker/ (default); "
                             "agent: the test node agent, which runs pod commands from .venv")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = preflight()
    if problem:
        parser.error(problem)
    bin_dir = build_tools()
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="tandem-cluster-"))
    done = threading.Event()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    def finish(signum: int, frame: FrameType | None) -> None:
        done.set()

    # During startup a signal interrupts it and Cluster.start cleans up; once up, it only ends the wait.
    # Both are set explicitly: a shell starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        if args.node == "real":
            node = RealNode(work_dir / "node", bin_dir, None, name="tandem-node-0", bridge=args.bridge,
                            pod_cidr=args.pod_cidr, images=product_images(), tainted=False)
            cluster = Cluster(work_dir, bin_dir, real_node=node).start()
        else:
            cluster = Cluster(work_dir, bin_dir, PodNetwork(args.bridge, args.pod_cidr)).start()
    except KeyboardInterrupt:
        logger.info("[shutdown] interrupted during startup; logs in %s", work_dir)
        return 130
    # Started above: `with cluster:` would start it a second time (its __enter__ starts), in the same
    # work dir, with new certificates the first node agent does not trust.
    try:
        signal.signal(signal.SIGINT, finish)
        signal.signal(signal.SIGTERM, finish)
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        print(f"export PATH={bin_dir}:$PATH")
        if cluster.real_node:
            sock = cluster.real_node.socket
            print(f"# images rebuilt by `make images` load at the next start, or now with:\n"
                  f"#   buildah push IMAGE docker-archive:/tmp/i.tar:IMAGE && "
                  f"ctr --address {sock} -n k8s.io images import /tmp/i.tar")
        print(end="", flush=True)
        while not done.wait(1.0):
            pass
        logger.info("[shutdown] stopping; logs stay in %s", work_dir)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
