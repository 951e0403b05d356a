"""NetworkPolicy is enforced on the real node (kube-router's firewall, real_node.py): a policy that admits
ingress to a server only from its own namespace shuts out a client in another namespace, by the server's
pod IP and by its Service's name, while a client beside the server still gets through; deleting the policy
lets the outsider back in."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests.k8s.cluster import Cluster, eventually
from tests.k8s.test_real_node import wait_ready

pytestmark = pytest.mark.k8s

# Small, already in containerd (the chart runs it), and its Python has http.server and urllib.
IMAGE = "ghcr.io/tandem-dev/tandem-operator:0.1.0"
PORT = 8080


def pod(name: str, role: str, command: list[str], probe: bool = False) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": role, "image": IMAGE, "imagePullPolicy": "Never", "command": command,
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    if probe:  # the kubelet probes from the host: a policy must not cut the node off its pods
        container["ports"] = [{"containerPort": PORT, "name": "http"}]
        container["readinessProbe"] = {"tcpSocket": {"port": PORT}, "periodSeconds": 1}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"role": role}},
            "spec": {"terminationGracePeriodSeconds": 0, "containers": [container],
                     "securityContext": {"runAsNonRoot": True}}}


SERVER = ["python", "-m", "http.server", str(PORT), "--bind", "0.0.0.0", "--directory", "/app"]
CLIENT = ["python", "-c", "import time; time.sleep(10**9)"]


def test_a_network_policy_admits_only_its_namespace_and_its_deletion_reopens(k8s_cluster: Cluster) -> None:
    inside = k8s_cluster.create_namespace("netpol-a")
    outside = k8s_cluster.create_namespace("netpol-b")
    try:
        k8s_cluster.apply(inside, pod("server", "server", SERVER, probe=True), pod("neighbour", "client", CLIENT),
                          {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "server"},
                           "spec": {"selector": {"role": "server"}, "ports": [{"port": 80, "targetPort": PORT}]}})
        k8s_cluster.apply(outside, pod("outsider", "client", CLIENT))
        for ns, name in ((inside, "server"), (inside, "neighbour"), (outside, "outsider")):
            wait_ready(k8s_cluster, ns, name, timeout_s=120)
        server_ip = k8s_cluster.pod(inside, "server")["status"]["podIP"]
        targets = (f"http://{server_ip}:{PORT}/", f"http://server.{inside}.svc.cluster.local/")

        def get(ns: str, client: str, url: str) -> str:
            """The HTTP status `client` gets from url, or why it got none; a 3 s connect timeout inside, 20 s
            for the whole `kubectl exec`, so that nothing here can hang."""
            code = ("import urllib.request, sys\n"
                    f"try: print(urllib.request.urlopen({url!r}, timeout=3).status)\n"
                    "except Exception as e: print(type(e).__name__, e)")
            try:
                out = k8s_cluster.control_plane.kubectl("exec", client, "-n", ns, "--", "python", "-c", code,
                                                        timeout=20)
            except subprocess.TimeoutExpired:
                return "kubectl exec timed out"
            return out.stdout.strip() or f"kubectl exec failed: {out.stderr.strip()}"

        def statuses() -> dict[tuple[str, str], str]:
            return {(client, url): get(ns, client, url)
                    for ns, client in ((inside, "neighbour"), (outside, "outsider")) for url in targets}

        everyone = {key: "200" for key in statuses()}
        eventually(lambda: statuses() == everyone, 30, "without a policy, not every client reaches the server")

        k8s_cluster.apply(inside, {
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "same-namespace"},
            "spec": {"podSelector": {"matchLabels": {"role": "server"}}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {}}]}]}})
        last: dict[tuple[str, str], str] = {}

        def enforced() -> bool:
            last.update(statuses())
            return all((status == "200") == (client == "neighbour") for (client, _), status in last.items())

        try:
            eventually(enforced, 30, "the policy is not enforced")
        except AssertionError as e:
            rules = subprocess.run(["iptables-save", "-t", "filter"], capture_output=True, text=True).stdout
            raise AssertionError(f"{e}: {last}\n{k8s_cluster.real_node.log_path('kube-router')}\n"
                                 + "\n".join(r for r in rules.splitlines() if "KUBE-" in r)) from None
        # Shut out, not let through slowly: REJECTed at once, or dropped (a timeout), never an answer.
        shut_out = [s for (client, _), s in last.items() if client == "outsider"]
        assert all("Connection refused" in s or "timed out" in s for s in shut_out), last
        # Enforced by the rules kube-router wrote into the same iptables (nf_tables) that kube-proxy uses.
        saved = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
        assert "-j KUBE-ROUTER-FORWARD" in saved and ":KUBE-NWPLCY-" in saved and "KUBE-SERVICES" in saved

        assert k8s_cluster.kubectl("delete", "networkpolicy", "same-namespace", "-n", inside).returncode == 0
        eventually(lambda: statuses() == everyone, 30, "deleting the policy did not let the outsider back in")
    finally:
        for ns in (inside, outside):
            k8s_cluster.kubectl("delete", "namespace", ns, "--wait=false")
