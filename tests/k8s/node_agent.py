"""The test node agent: one Node whose pods run as local processes. Stands in for kubelet and a container
runtime, for tests only.

It registers the Node (capacity generous enough for the example manifests), keeps it Ready by renewing its
Lease, watches the Pods bound to it and runs each with a PodWorker. What differs from a real node:

- images are ignored: a container's command + args run from the host with the repository's virtualenv first
  on PATH (container_config.py); runAsUser, fsGroup and securityContext are ignored (all runs as root);
- each pod gets a network namespace on a bridge (pod_network.py); there is no kube-proxy and no DNS, so
  ClusterIPs route nowhere and service names resolve through a per-pod /etc/hosts kept current from
  EndpointSlices (service_hosts.py); in-cluster clients reach the apiserver through KUBERNETES_SERVICE_HOST
  (the bridge's host address), as they normally do;
- no kubelet API: `kubectl logs/exec/port-forward` do not work; container output goes to one log file per
  container under work_dir/pods/ (NodeAgent.pod_log);
- volumes: emptyDir, configMap, secret, downwardAPI, projected (the service-account token); others keep the
  pod Pending with a FailedMount event (pod_volumes.py);
- CPU limits are kept with affinity, not a cgroup quota: a container with `limits.cpu` runs pinned to
  ceil(limit) CPUs, the least used first (cpu_placement.py); memory limits are not enforced.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from tests.k8s.container_config import SYSTEM_PATH
from tests.k8s.kube import MERGE, Kube
from tests.k8s.pod_network import PodNetwork
from tests.k8s.pod_status import rfc3339
from tests.k8s.pod_worker import NodeContext, PodWorker
from tests.k8s.service_hosts import ServiceHosts

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
LEASE_PATH = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
HEARTBEAT_S = 10.0
LEASE_DURATION_S = 40
NOT_SCHEDULABLE_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


def default_capacity() -> dict[str, str]:
    # Generous on purpose: pods only run as processes, and the example manifests request whole CPUs.
    return {"cpu": str(max(32, os.cpu_count() or 1)), "memory": "128Gi", "ephemeral-storage": "100Gi", "pods": "110"}


class NodeAgent:
    def __init__(
        self, api: kubernetes.client.ApiClient, work_dir: Path, node_name: str = "tandem-node-0",
        network: PodNetwork | None = None, capacity: Mapping[str, str] | None = None,
        entrypoints: Mapping[str, list[str]] | None = None, repo_root: Path = REPO,
    ) -> None:
        self.api = api
        self.kube = Kube(api)
        self.node_name = node_name
        self.work_dir = work_dir
        self.network = network or PodNetwork()
        self.capacity = {**default_capacity(), **(capacity or {})}
        self.hosts = ServiceHosts()
        # Image repository -> ENTRYPOINT, for containers without `command`; callers may add to it while running.
        self.entrypoints: dict[str, list[str]] = dict(entrypoints or {})
        api_port = urllib.parse.urlsplit(api.configuration.host).port or 443
        self.node = NodeContext(
            kube=self.kube, node_name=node_name, network=self.network, hosts=self.hosts, work_dir=work_dir,
            allocatable=self.capacity, api_port=api_port,
            base_env={"PATH": f"{repo_root / '.venv' / 'bin'}:{SYSTEM_PATH}", "HOME": os.environ.get("HOME", "/root")},
            working_dir=str(repo_root), entrypoints=self.entrypoints,
        )
        self._workers: dict[str, PodWorker] = {}
        self._finished: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ready_since = rfc3339()

    def start(self) -> NodeAgent:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.network.setup()
            self._register()
            self._spawn("heartbeat", self._heartbeat)
            self._spawn("slices", lambda: self._informer(
                "/apis/discovery.k8s.io/v1/endpointslices", self._slices_listed, self._slice_event
            ))
            self._spawn("pods", lambda: self._informer(
                "/api/v1/pods", self._pods_listed, self._pod_event, fieldSelector=f"spec.nodeName={self.node_name}"
            ))
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=f"node-agent-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.halt()
        for worker in workers:
            worker.join(15.0)
            if not worker.done:
                # The network's teardown below still waits for a create or destroy it is in the middle of.
                logger.warning("[shutdown] pod %s/%s: worker still running after 15 s", worker.namespace, worker.name)
        for thread in self._threads:
            thread.join(10.0)
        self.network.teardown()
        self.node.mount_points.remove()
        logger.info("[shutdown] node agent stopped (%d pods)", len(workers))

    # -- the Node -----------------------------------------------------------------------------------------

    def _node_status(self) -> dict[str, Any]:
        now = rfc3339()

        def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
            return {"type": kind, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": now, "lastTransitionTime": self._ready_since}

        version = self.kube.get("/version")["gitVersion"]
        return {
            "capacity": self.capacity,
            "allocatable": self.capacity,
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                condition("Ready", "True", "KubeletReady", "test node agent is posting ready status"),
            ],
            "addresses": [{"type": "InternalIP", "address": self.network.host_ip},
                          {"type": "Hostname", "address": self.node_name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": platform.release(),
                "osImage": "tandem test node agent", "containerRuntimeVersion": "tandem://0",
                "kubeletVersion": version, "kubeProxyVersion": "", "operatingSystem": "linux",
                "architecture": ARCH.get(platform.machine(), platform.machine()),
            },
        }

    def _register(self) -> None:
        labels = {"kubernetes.io/hostname": self.node_name, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": ARCH.get(platform.machine(), platform.machine())}
        status = self._node_status()
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node_name, "labels": labels},
                "status": status}
        try:
            self.kube.post("/api/v1/nodes", body)
        except ApiException as e:
            if e.status != 409:
                raise
        self.kube.patch(f"/api/v1/nodes/{self.node_name}/status", {"status": status})
        self._renew_lease()
        logger.info("[startup] node %s registered", self.node_name)

    def _renew_lease(self) -> None:
        renew = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            self.kube.patch(f"{LEASE_PATH}/{self.node_name}", {"spec": {"renewTime": renew}}, MERGE)
            return
        except ApiException as e:
            if e.status != 404:
                raise
        node_uid = self.kube.get(f"/api/v1/nodes/{self.node_name}")["metadata"]["uid"]
        self.kube.post(LEASE_PATH, {
            "metadata": {"name": self.node_name, "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": node_uid}]},
            "spec": {"holderIdentity": self.node_name, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": renew},
        })

    def _heartbeat(self) -> None:
        """The Lease every HEARTBEAT_S and the Ready condition's heartbeat every third time, as kubelet does."""
        beats = 0
        while not self._stop.wait(HEARTBEAT_S):
            beats += 1
            try:
                self._renew_lease()
                if beats % 3 == 0:
                    self.kube.patch(f"/api/v1/nodes/{self.node_name}/status", {"status": self._node_status()})
            except Exception as e:  # the apiserver may be restarting or stopping: try again next beat
                logger.warning("[heartbeat] %s: %s", self.node_name, e)

    def wait_ready(self, timeout_s: float = 120.0) -> float:
        """Waits until the node is Ready and the node-lifecycle controller lifted its not-ready taint."""
        began = time.monotonic()
        while True:
            node = self.kube.get(f"/api/v1/nodes/{self.node_name}")
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))
            taints = [t["key"] for t in node["spec"].get("taints") or [] if t["key"] in NOT_SCHEDULABLE_TAINTS]
            if ready and not taints:
                return time.monotonic() - began
            if time.monotonic() - began > timeout_s:
                raise TimeoutError(f"node {self.node_name} not schedulable after {timeout_s:.0f} s: taints {taints}")
            time.sleep(0.25)

    # -- watches ------------------------------------------------------------------------------------------

    def _informer(
        self, path: str, on_list: Callable[[list[dict[str, Any]]], None],
        on_event: Callable[[str, dict[str, Any]], None], **query: Any,
    ) -> None:
        """List, then watch from the list's resourceVersion; any error (410 Gone included) means list again."""
        while not self._stop.is_set():
            try:
                listed = self.kube.get(path, **query)
                on_list(listed["items"])
                version = listed["metadata"]["resourceVersion"]
                while not self._stop.is_set():
                    # Short watches so stop() is not kept waiting; each resumes where the last ended.
                    for event in self.kube.watch(path, version, timeout_s=3, **query):
                        obj = event["object"]
                        version = obj["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            on_event(event["type"], obj)
                        if self._stop.is_set():
                            break
            except Exception as e:  # watch expired (410), apiserver away, or a handler bug: relist
                if not self._stop.is_set():
                    logger.info("[watch] %s: %s: listing again", threading.current_thread().name, e)
                    self._stop.wait(1.0)

    def _slices_listed(self, items: list[dict[str, Any]]) -> None:
        self.hosts.replace_all(items)
        self._refresh_hosts()

    def _slice_event(self, kind: str, obj: dict[str, Any]) -> None:
        self.hosts.update(kind, obj)
        self._refresh_hosts()

    def _refresh_hosts(self) -> None:
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.refresh_hosts()

    def _pods_listed(self, items: list[dict[str, Any]]) -> None:
        listed = {pod["metadata"]["uid"] for pod in items}
        for pod in items:
            self._pod_event("MODIFIED", pod)
        with self._lock:
            for uid, worker in self._workers.items():
                if uid not in listed:
                    worker.gone()

    def _pod_event(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            if self._stop.is_set():
                return  # stop() has halted the workers it found: one started now would run on unhalted
            for done in [u for u, w in self._workers.items() if w.done]:
                del self._workers[done]
                self._finished.add(done)
            worker = self._workers.get(uid)
            if kind == "DELETED":
                if worker:
                    worker.gone()
            elif worker:
                worker.update(pod)
            elif uid not in self._finished and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
                self._workers[uid] = PodWorker(self.node, pod).start()

    # -- for tests ----------------------------------------------------------------------------------------

    def pod_log(self, namespace: str, name: str) -> str:
        """Every container log of every pod that had this name (newest last), with a header per file."""
        parts = []
        dirs = sorted((self.work_dir / "pods").glob(f"{namespace}_{name}_*"), key=lambda p: p.stat().st_mtime)
        for directory in dirs:
            for log in sorted(directory.glob("*.log")):
                parts.append(f"==> {log} <==\n{log.read_text(errors='replace')}")
        return "\n".join(parts)

    def netns_of(self, namespace: str, name: str) -> str | None:
        with self._lock:
            for worker in self._workers.values():
                if (worker.namespace, worker.name) == (namespace, name) and worker.sandbox:
                    return worker.sandbox.netns
        return None
