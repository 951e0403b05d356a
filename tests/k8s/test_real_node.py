"""The real node (real_node.py): pods from the worker image run as containers under the kubelet, and what a
user types against them works (`kubectl logs`, `exec`, `port-forward`, a Service's ClusterIP and name)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any

import httpx
import pytest

from tests.k8s.cluster import Cluster, port_forward

pytestmark = pytest.mark.k8s

WORKER = "ghcr.io/tandem-dev/tandem-worker:0.1.0"


def engine_pod(name: str) -> dict[str, Any]:
    """An engine as the operator's pods run it: the worker image's own entrypoint, as UID 10001 on a
    read-only root with /tmp and /dev/shm as emptyDirs."""
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "engine", "image": WORKER, "imagePullPolicy": "Never",
                "args": ["serve", "--model", "smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8000",
                         "--max-model-len", "1024", "--num-kv-blocks", "128"],
                "ports": [{"containerPort": 8000, "name": "http"}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
                # The node has this machine's 2 CPUs: request part of one, and let the quota allow both.
                "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "shm", "mountPath": "/dev/shm"}],
            }],
            "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "shm", "emptyDir": {"medium": "Memory"}}],
        },
    }


def wait_ready(cluster: Cluster, ns: str, pod: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = cluster.kubectl("get", "pod", pod, "-n", ns, "-o",
                              "jsonpath={.status.conditions[?(@.type=='Ready')].status}")
        if out.stdout.strip() == "True":
            return
        time.sleep(1)
    logs = cluster.kubectl("logs", pod, "-n", ns, "--tail=40").stdout
    described = cluster.kubectl("describe", "pod", pod, "-n", ns).stdout
    raise AssertionError(f"pod {pod} not Ready in {timeout_s:.0f} s\n{described}\n{logs}")


def test_an_engine_from_the_worker_image_runs_as_10001_on_a_read_only_root(k8s_cluster: Cluster) -> None:
    ns = k8s_cluster.create_namespace("real-node-engine")
    k8s_cluster.apply(ns, engine_pod("engine"))
    k8s_cluster.apply(ns, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "engine"},
                           "spec": {"selector": {"app": "engine"}, "ports": [{"port": 80, "targetPort": 8000}]}})
    wait_ready(k8s_cluster, ns, "engine")

    def exec_(*argv: str) -> subprocess.CompletedProcess[str]:
        return k8s_cluster.kubectl("exec", "engine", "-n", ns, "--", *argv)

    ident = exec_("id")
    assert ident.returncode == 0 and "uid=10001" in ident.stdout, ident
    refused = exec_("touch", "/written")
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr, refused
    compilers = exec_("python", "-c", "import shutil; print([c for c in ('cc', 'gcc', 'clang') if shutil.which(c)])")
    assert compilers.stdout.strip() == "[]", compilers
    # Its own PID namespace: the engine's processes are all there is.
    ps = exec_("python", "-c", "import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    assert json.loads(ps.stdout)[0] == 1, ps

    logs = k8s_cluster.kubectl("logs", "engine", "-n", ns).stdout
    # Every kernel came baked into the image (none failed to build: there is no compiler), the fused steps on.
    assert "steps fused: one C call per step" in logs and "C kernel" not in logs, logs[-3000:]

    # The Service's ClusterIP and DNS name from a pod (kube-proxy, CoreDNS), and port-forward from the host.
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0}
    via_dns = exec_("python", "-c", "import json, urllib.request; r = urllib.request.urlopen(urllib.request.Request("
                    f"'http://engine.{ns}.svc.cluster.local/v1/chat/completions', data=json.dumps({chat!r}).encode(), "
                    "headers={'content-type': 'application/json'}), timeout=60); "
                    "print(json.load(r)['choices'][0]['message']['content'])")
    assert via_dns.returncode == 0 and via_dns.stdout.strip(), via_dns
    kube_env = {**os.environ, "KUBECONFIG": str(k8s_cluster.kubeconfig),
                "PATH": f"{k8s_cluster.bin_dir}:{os.environ['PATH']}"}
    with port_forward(kube_env, ns, "svc/engine", 80) as url:
        resp = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"] == via_dns.stdout.strip()
    k8s_cluster.kubectl("delete", "namespace", ns, "--wait=false")
