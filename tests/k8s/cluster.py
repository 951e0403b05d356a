"""A whole test cluster: the real control plane plus one real node (a kubelet with containerd running the
images of docker/: real_node.py).

    python -m tests.k8s.cluster [--work-dir DIR] [--bridge NAME --pod-cidr CIDR]     (make cluster)

runs it in the foreground (as root) and, once ready, prints the two lines to paste into another shell
(KUBECONFIG and PATH with kubectl and helm); Ctrl-C stops everything and leaves no process, network
namespace or mount behind. Tests use the session fixture `k8s_cluster` (fixtures.py) instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import kubernetes

from tests.k8s import process
from tests.k8s.controlplane import ControlPlane
from tests.k8s.kube import Kube
from tests.k8s.real_node import REPO, RealNode, product_images

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
    def __init__(self, work_dir: Path, bin_dir: Path, real_node: RealNode) -> None:
        """The control plane and `real_node` (whose control plane this cluster's becomes), its only node."""
        self.work_dir = work_dir
        self.bin_dir = bin_dir
        self.real_node = real_node
        self.control_plane = ControlPlane(work_dir / "control-plane", bin_dir, advertise_address=real_node.gateway)
        real_node.control_plane = self.control_plane
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
            self.real_node.prepare_network()
            self.control_plane.start()
            self.api = self.control_plane.api_client()
            self.real_node.start()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - began
        logger.info("[startup] cluster ready in %.1f s; work dir %s", self.startup_s, self.work_dir)
        return self

    def stop(self) -> None:
        self.real_node.stop()
        self.control_plane.stop()
        if self.api is not None:
            self.api.close()
            self.api = None

    def leftovers(self) -> list[str]:
        return self.real_node.leftovers()

    @property
    def host_ip(self) -> str:
        """The host's address on the pod network: pods reach the host there."""
        return self.real_node.gateway

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



@contextlib.contextmanager
def port_forward(env: Mapping[str, str], namespace: str, target: str, port: int) -> Iterator[str]:
    """`kubectl port-forward -n namespace target LOCAL:port` (env: KUBECONFIG and PATH), as a user runs it
    from the host; yields http://127.0.0.1:LOCAL once kubectl says it is forwarding."""
    local = process.free_port()
    proc = subprocess.Popen(["kubectl", "port-forward", "-n", namespace, target, f"{local}:{port}"], env=dict(env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # "Forwarding from 127.0.0.1:LOCAL -> port", or why not
        assert first.startswith("Forwarding from"), f"kubectl port-forward {target}: {first}{proc.stdout.read()}"
        yield f"http://127.0.0.1:{local}"
    finally:
        proc.terminate()
        proc.wait(10)


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
        node = RealNode(work_dir / "node", bin_dir, None, name="tandem-node-0", bridge=args.bridge,
                        pod_cidr=args.pod_cidr, images=product_images())
        cluster = Cluster(work_dir, bin_dir, node).start()
    except KeyboardInterrupt:
        logger.info("[shutdown] interrupted during startup; logs in %s", work_dir)
        return 130
    # Started above: `with cluster:` would start it a second time (its __enter__ starts), in the same
    # work dir, with new certificates the running kubelet does not trust.
    try:
        signal.signal(signal.SIGINT, finish)
        signal.signal(signal.SIGTERM, finish)
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        print(f"export PATH={bin_dir}:$PATH")
        print(f"# images rebuilt by `make images` load at the next start, or now with:\n"
              f"#   buildah push IMAGE docker-archive:/tmp/i.tar:IMAGE && "
              f"ctr --address {cluster.real_node.socket} -n k8s.io images import /tmp/i.tar")
        print(end="", flush=True)
        while not done.wait(1.0):
            pass
        logger.info("[shutdown] stopping; logs stay in %s", work_dir)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
