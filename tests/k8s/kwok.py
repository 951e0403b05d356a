"""kwok (sigs.k8s.io/kwok, built by hack/build-tools.sh): a fake Node whose pods it marks Running and Ready
without running anything.

Tests of the operator's reconcile loop need real Deployments, ReplicaSets and pods whose readiness moves,
but not engines: their InferenceServices put every pod on this node (`FAKE_NODE_POD_TEMPLATE`). The node
carries a NoSchedule taint, so a pod that does not ask for it (every pod of the serving tests) never lands
there and always runs on the real node.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.k8s.kube import Kube

KWOK_MODULE = "sigs.k8s.io/kwok@v0.8.0"  # the version hack/build-tools.sh builds
ANNOTATION = "kwok.x-k8s.io/node"
TAINT = {"key": ANNOTATION, "value": "fake", "effect": "NoSchedule"}
LABEL = {"type": "kwok"}
# kwok's own stage files: the node becomes Ready and, with `--node-lease-duration-seconds`, renews its Lease
# as a kubelet does (without it the node controller finds the node silent after 40 s, marks it NotReady
# and every pod on it unready, and the Deployments never become available), pods get an
# IP, become Running and Ready, and go away.
STAGES = ["node/fast/node-initialize.yaml", "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
          "pod/general/pod-create.yaml", "pod/general/pod-ready.yaml",
          "pod/general/pod-complete.yaml", "pod/general/pod-delete.yaml"]

# Merged into an InferenceService role's `podTemplate`: schedule the pods on the fake node only.
FAKE_NODE_POD_TEMPLATE = {"spec": {"nodeSelector": LABEL,
                                   "tolerations": [{**TAINT, "operator": "Equal"}]}}


def node(name: str, taint: bool) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {ANNOTATION: "fake"},
                     "labels": {**LABEL, "kubernetes.io/hostname": name}},
        "spec": {"taints": [TAINT]} if taint else {},
        "status": {"allocatable": {"cpu": "1000", "memory": "4Ti", "pods": "2000"},
                   "capacity": {"cpu": "1000", "memory": "4Ti", "pods": "2000"}},
    }


def stage_dir() -> Path:
    """kwok's stage files, from the module cache the tool build filled."""
    out = subprocess.run(["go", "mod", "download", "-json", KWOK_MODULE], capture_output=True, text=True, check=True,
                         env={**os.environ, "GOTOOLCHAIN": "local"})
    return Path(json.loads(out.stdout)["Dir"]) / "kustomize" / "stage"


class FakeNode:
    """`kwok` managing one fake node (tainted unless `taint=False`) on the cluster at `kubeconfig`."""

    def __init__(self, bin_dir: Path, kubeconfig: Path, kube: Kube, log: Path, name: str = "kwok-node-0",
                 taint: bool = True) -> None:
        self.bin_dir, self.kubeconfig, self.kube, self.log = bin_dir, kubeconfig, kube, log
        self.name, self.taint = name, taint
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> FakeNode:
        stages = stage_dir()
        argv = [str(self.bin_dir / "kwok"), f"--kubeconfig={self.kubeconfig}", "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={ANNOTATION}=fake", "--cidr=10.250.0.1/16",
                "--node-ip=10.250.0.1", "--node-lease-duration-seconds=40", *[f"-c={stages / s}" for s in STAGES]]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        if self.kube.get_or_none(f"/api/v1/nodes/{self.name}") is None:
            self.kube.post("/api/v1/nodes", node(self.name, self.taint))
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.kube.get_or_none(f"/api/v1/nodes/{self.name}") is not None:
            self.kube.delete(f"/api/v1/nodes/{self.name}")

    def __enter__(self) -> FakeNode:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
