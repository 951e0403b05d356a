"""The test cluster proves itself: real controllers drive the node agent's pods, which network, probe,
read their downward API and token, and shut down as kubelet's would."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from tests.k8s.cluster import Cluster, eventually

pytestmark = pytest.mark.k8s

NODE = "tandem-node-0"


@pytest.fixture(autouse=True)
def delete_new_namespaces(k8s_cluster: Cluster) -> Iterator[None]:
    """A test's pods stop with it: the crash-looping and probed ones would otherwise run, and take CPU,
    for the rest of the suite (the namespace controller and the agent finish the deletion meanwhile)."""
    def names() -> set[str]:
        return {n["metadata"]["name"] for n in k8s_cluster.kube.get("/api/v1/namespaces")["items"]}

    before = names()
    yield
    for ns in names() - before:
        k8s_cluster.kube.delete(f"/api/v1/namespaces/{ns}")


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in pod.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def is_ready(pod: dict[str, Any]) -> bool:
    return condition(pod, "Ready").get("status") == "True"


def wait_pod(
    cluster: Cluster, namespace: str, name: str, predicate: Callable[[dict[str, Any]], bool], what: str,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Waits until the pod satisfies predicate; on timeout the message carries its status and logs."""
    last: dict[str, Any] = {}

    def check() -> dict[str, Any] | None:
        nonlocal last
        try:
            last = cluster.pod(namespace, name)
        except ApiException as e:
            if e.status != 404:
                raise
            return None
        return last if predicate(last) else None

    try:
        result: dict[str, Any] = eventually(check, timeout_s, f"pod {namespace}/{name}: {what}")
        return result
    except AssertionError as e:
        raise AssertionError(
            f"{e}\nstatus: {json.dumps(last.get('status'), indent=1)}\nlogs:\n{cluster.pod_log(namespace, name)}"
        ) from None


def wait_gone(cluster: Cluster, namespace: str, name: str, timeout_s: float) -> None:
    def gone() -> bool:
        try:
            cluster.pod(namespace, name)
        except ApiException as e:
            return e.status == 404
        return False

    eventually(gone, timeout_s, f"pod {namespace}/{name} still exists", interval_s=0.1)


def python_pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "python:ignored", "command": ["python", "-u", "-c", script]}
    container.update(spec.pop("container", {}))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [container], **spec}}


def events(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.kube.get(f"/api/v1/namespaces/{namespace}/events")["items"]
    return items


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def test_node_is_ready_and_schedulable(k8s_cluster: Cluster) -> None:
    node = k8s_cluster.kube.get(f"/api/v1/nodes/{NODE}")
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    assert not node["spec"].get("taints")
    assert int(node["status"]["allocatable"]["cpu"]) >= 32
    print(f"cluster started in {k8s_cluster.startup_s:.1f} s")


def test_deployment_serves_by_pod_ip_and_service_name(k8s_cluster: Cluster) -> None:
    ns = k8s_cluster.create_namespace("web")
    labels = {"app": "web"}
    server = {
        "name": "server", "image": "ignored",
        "command": ["python", "-m", "http.server", "8080", "--bind", "0.0.0.0"],
        "ports": [{"name": "http", "containerPort": 8080}],
        "startupProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1, "failureThreshold": 30},
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 2},
    }
    k8s_cluster.apply(ns, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {"containers": [server]}}},
    }, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": labels, "ports": [{"name": "http", "port": 8080, "targetPort": "http"}]},
    })
    kube = k8s_cluster.kube
    replica_sets = eventually(lambda: kube.get(f"/apis/apps/v1/namespaces/{ns}/replicasets")["items"], 30,
                              "the deployment controller made no ReplicaSet")
    assert replica_sets[0]["metadata"]["ownerReferences"][0]["name"] == "web"

    pods = eventually(lambda: kube.get(f"/api/v1/namespaces/{ns}/pods", labelSelector="app=web")["items"], 30,
                      "the ReplicaSet controller made no pod")
    name = pods[0]["metadata"]["name"]
    pod = wait_pod(k8s_cluster, ns, name, is_ready, "never Ready")
    pod_ip = pod["status"]["podIP"]
    assert pod["spec"]["nodeName"] == NODE
    assert pod["status"]["containerStatuses"][0]["started"] is True

    def ready_addresses() -> list[str]:
        slices = kube.get(f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
                          labelSelector="kubernetes.io/service-name=web")["items"]
        return [a for s in slices for e in s.get("endpoints") or [] if e["conditions"].get("ready")
                for a in e["addresses"]]

    assert eventually(ready_addresses, 30, "the EndpointSlice never listed the pod as ready") == [pod_ip]
    with urllib.request.urlopen(f"http://{pod_ip}:8080/", timeout=5) as resp:
        assert resp.status == 200

    client = python_pod("client", (
        "import urllib.request\n"
        "for name in ('web', 'web.web', 'web.web.svc.cluster.local'):\n"
        "    print(name, urllib.request.urlopen(f'http://{name}:8080/', timeout=5).status)\n"
    ), restartPolicy="Never")
    k8s_cluster.apply(ns, client)
    wait_pod(k8s_cluster, ns, "client", lambda p: p["status"].get("phase") == "Succeeded", "did not succeed")
    log = k8s_cluster.pod_output(ns, "client")
    for line in ("web 200", "web.web 200", "web.web.svc.cluster.local 200"):
        assert line in log, log

    eventually(lambda: kube.get(f"/apis/apps/v1/namespaces/{ns}/deployments/web")["status"].get("availableReplicas"),
               30, "the deployment never became available")


READ_PODS = r"""
import json, os, socket, sys
from kubernetes import client, config
keys = ["POD_NAME", "POD_NAMESPACE", "POD_IP", "NODE_NAME", "SA_NAME",
        "CPU_LIMIT_M", "MEM_LIMIT_MI", "CPU_REQUEST_M", "CPU_LIMIT_DEFAULT"]
print("ENV", json.dumps({**{k: os.environ.get(k) for k in keys}, "hostname": socket.gethostname()}))
config.load_incluster_config()
try:
    pods = client.CoreV1Api().list_namespaced_pod(os.environ["POD_NAMESPACE"])
except client.ApiException as e:
    print("STATUS", e.status)
    sys.exit(3)
print("LISTED", len(pods.items))
"""


def downward_pod(name: str, service_account: str) -> dict[str, Any]:
    def field(path: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    def resource(resource: str, divisor: str | None = None, container: str | None = None) -> dict[str, Any]:
        ref: dict[str, Any] = {"resource": resource}
        if divisor:
            ref["divisor"] = divisor
        if container:
            ref["containerName"] = container
        return {"resourceFieldRef": ref}

    env = [
        {"name": "POD_NAME", "valueFrom": field("metadata.name")},
        {"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")},
        {"name": "POD_IP", "valueFrom": field("status.podIP")},
        {"name": "NODE_NAME", "valueFrom": field("spec.nodeName")},
        {"name": "SA_NAME", "valueFrom": field("spec.serviceAccountName")},
        {"name": "CPU_LIMIT_M", "valueFrom": resource("limits.cpu", "1m")},
        {"name": "MEM_LIMIT_MI", "valueFrom": resource("limits.memory", "1Mi")},
        {"name": "CPU_REQUEST_M", "valueFrom": resource("requests.cpu", "1m")},
        # The other container sets no limit: kubelet reports the node's allocatable CPU, in whole cores.
        {"name": "CPU_LIMIT_DEFAULT", "valueFrom": resource("limits.cpu", container="idle")},
    ]
    # An emptyDir at /tmp, as our pods have: it must not hide the token volume's source (kept under /tmp).
    pod = python_pod(name, READ_PODS, restartPolicy="Never", serviceAccountName=service_account, container={
        "env": env,
        "resources": {"limits": {"cpu": "500m", "memory": "256Mi"}, "requests": {"cpu": "250m", "memory": "128Mi"}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }, volumes=[{"name": "tmp", "emptyDir": {}}])
    pod["spec"]["containers"].append({"name": "idle", "image": "ignored", "command": ["true"]})
    return pod


def test_downward_api_and_service_account_token(k8s_cluster: Cluster) -> None:
    ns = k8s_cluster.create_namespace("rbac")
    k8s_cluster.apply(
        ns,
        *({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}} for sa in ("reader", "nobody")),
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "pod-reader"},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "reader"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
         "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}]},
    )
    k8s_cluster.apply(ns, downward_pod("allowed", "reader"), downward_pod("denied", "nobody"))

    def finished(p: dict[str, Any]) -> bool:
        return p["status"].get("phase") in ("Succeeded", "Failed")

    allowed = wait_pod(k8s_cluster, ns, "allowed", finished, "never finished")
    denied = wait_pod(k8s_cluster, ns, "denied", finished, "never finished")
    allowed_log, denied_log = k8s_cluster.pod_output(ns, "allowed"), k8s_cluster.pod_output(ns, "denied")
    assert allowed["status"]["phase"] == "Succeeded", allowed_log
    assert "LISTED 2" in allowed_log
    assert denied["status"]["phase"] == "Failed", denied_log
    assert "STATUS 403" in denied_log
    main = next(c for c in denied["status"]["containerStatuses"] if c["name"] == "main")
    assert main["state"]["terminated"]["exitCode"] == 3

    env = json.loads(next(line for line in allowed_log if line.startswith("ENV "))[4:])
    assert env == {
        "POD_NAME": "allowed", "POD_NAMESPACE": ns, "POD_IP": allowed["status"]["podIP"], "NODE_NAME": NODE,
        "SA_NAME": "reader", "CPU_LIMIT_M": "500", "MEM_LIMIT_MI": "256", "CPU_REQUEST_M": "250",
        "CPU_LIMIT_DEFAULT": k8s_cluster.kube.get(f"/api/v1/nodes/{NODE}")["status"]["allocatable"]["cpu"],
        "hostname": "allowed",
    }


GRACEFUL = r"""
import os, signal, sys, time
def on_term(*_):
    print("SIGTERM prestop-ran=%s" % os.path.exists("/data/prestop"), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("up", flush=True)
while True:
    time.sleep(0.1)
"""

STUBBORN = r"""
import signal, time
signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
print("up", flush=True)
while True:
    time.sleep(0.1)
"""


def test_delete_runs_prestop_then_sigterm_then_sigkill(k8s_cluster: Cluster,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tests.k8s")
    ns = k8s_cluster.create_namespace("grace")
    graceful = python_pod("graceful", GRACEFUL, terminationGracePeriodSeconds=20,
                          volumes=[{"name": "data", "emptyDir": {}}], container={
                              "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                              "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", "touch /data/prestop"]}}},
                          })
    stubborn = python_pod("stubborn", STUBBORN, terminationGracePeriodSeconds=3)
    k8s_cluster.apply(ns, graceful, stubborn)

    def up(pod: dict[str, Any]) -> bool:
        return is_ready(pod) and "up" in k8s_cluster.pod_output(ns, pod["metadata"]["name"])

    for name in ("graceful", "stubborn"):
        wait_pod(k8s_cluster, ns, name, up, "never came up")
    assert k8s_cluster.agent is not None
    netns = [k8s_cluster.agent.netns_of(ns, name) for name in ("graceful", "stubborn")]
    assert all(n in netns_names() for n in netns)

    deleted = time.monotonic()
    for name in ("graceful", "stubborn"):
        k8s_cluster.kube.delete(f"/api/v1/namespaces/{ns}/pods/{name}")
    wait_gone(k8s_cluster, ns, "graceful", 20)
    graceful_s = time.monotonic() - deleted
    wait_gone(k8s_cluster, ns, "stubborn", 20)
    stubborn_s = time.monotonic() - deleted

    assert "SIGTERM prestop-ran=True" in k8s_cluster.pod_output(ns, "graceful")
    assert graceful_s < 10, "a pod that exits on SIGTERM must not wait out its grace period"
    assert "ignoring SIGTERM" in k8s_cluster.pod_output(ns, "stubborn")
    # Once (CI, a loaded 2-core machine) the stubborn pod was gone 0.1 s after the delete: the agent's
    # lines and the pod's Events say who ended it, should it happen again.
    timeline = [f"{r.relativeCreated / 1000:.2f} {r.getMessage()}" for r in caplog.records
                if f"{ns}/" in r.getMessage()]
    timeline += [f"event {e['reason']}: {e['message']}" for e in events(k8s_cluster, ns)]
    assert 3 <= stubborn_s < 12, (f"SIGKILL comes when the 3 s grace period is over, not after {stubborn_s:.1f} s",
                                  timeline)
    # The agent tears the sandbox down right after it deleted the pod object.
    eventually(lambda: not set(netns) & set(netns_names()), 10, "a deleted pod's netns remains")


def test_liveness_failure_restarts_container(k8s_cluster: Cluster) -> None:
    ns = k8s_cluster.create_namespace("liveness")
    pod = python_pod("unhealthy", "import time; print('started'); time.sleep(3600)", terminationGracePeriodSeconds=1,
                     container={"livenessProbe": {"exec": {"command": ["sh", "-c", "exit 1"]}, "periodSeconds": 1,
                                                  "failureThreshold": 2}})
    k8s_cluster.apply(ns, pod)

    def restarted_twice(p: dict[str, Any]) -> bool:
        statuses = p["status"].get("containerStatuses") or [{}]
        return int(statuses[0].get("restartCount", 0)) >= 2

    pod = wait_pod(k8s_cluster, ns, "unhealthy", restarted_twice, "was not restarted twice")
    last = pod["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] in (143, 137), last
    # The third start is counted when its process is spawned, a moment before it prints.
    deadline = time.monotonic() + 30
    while k8s_cluster.pod_output(ns, "unhealthy").count("started") < 3:
        assert time.monotonic() < deadline, k8s_cluster.pod_output(ns, "unhealthy")
        time.sleep(0.2)
    assert {"Unhealthy", "Killing"} <= {e["reason"] for e in events(k8s_cluster, ns)}


def test_unsupported_volume_keeps_pod_pending(k8s_cluster: Cluster) -> None:
    ns = k8s_cluster.create_namespace("hostpath")
    pod = python_pod("hostpath", "print('never')", volumes=[{"name": "host", "hostPath": {"path": "/tmp"}}])
    k8s_cluster.apply(ns, pod)
    message = "hostPath volumes are not supported"
    pod = wait_pod(k8s_cluster, ns, "hostpath", lambda p: message in condition(p, "Ready").get("message", ""),
                   "no condition says why it cannot run")
    assert pod["status"]["phase"] == "Pending"
    assert any(e["reason"] == "FailedMount" and message in e["message"] for e in events(k8s_cluster, ns))
    k8s_cluster.kube.delete(f"/api/v1/namespaces/{ns}/pods/hostpath")
    wait_gone(k8s_cluster, ns, "hostpath", 30)


AFFINITY = "import os, time; print('cpus', sorted(os.sched_getaffinity(0)), flush=True); time.sleep(3600)"


def test_a_cpu_limit_pins_the_container_to_that_many_cpus(k8s_cluster: Cluster) -> None:
    """The node's stand-in for the CFS quota: a 1-CPU container sees one CPU, two such containers get
    different ones while both run, a container without a limit sees them all."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    ns = k8s_cluster.create_namespace("cpus")
    one = {"resources": {"limits": {"cpu": "1"}, "requests": {"cpu": "1"}}}
    k8s_cluster.apply(ns, python_pod("a", AFFINITY, terminationGracePeriodSeconds=1, container=one),
                      python_pod("b", AFFINITY, terminationGracePeriodSeconds=1, container=one),
                      python_pod("free", AFFINITY, terminationGracePeriodSeconds=1))

    def seen(name: str) -> list[int]:
        def printed() -> list[str]:
            return [x for x in k8s_cluster.pod_output(ns, name) if x.startswith("cpus ")]

        wait_pod(k8s_cluster, ns, name, lambda _: bool(printed()), "never printed")
        return list(json.loads(printed()[0].split(" ", 1)[1]))

    a, b, free = seen("a"), seen("b"), seen("free")
    assert len(a) == len(b) == 1 and a != b, (a, b)
    assert free == cpus


FLAKY_ONCE = r"""
import os, sys
if not os.path.exists("/scratch/failed-once"):
    open("/scratch/failed-once", "w").close()
    print("failing once")
    sys.exit(1)
print("init wrote:", open("/scratch/from-init").read())
"""


def test_init_container_config_map_volume_and_on_failure_restart(k8s_cluster: Cluster) -> None:
    ns = k8s_cluster.create_namespace("init")
    k8s_cluster.apply(ns, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "greeting"},
                           "data": {"text": "hello from a ConfigMap"}})
    pod = python_pod("staged", FLAKY_ONCE, restartPolicy="OnFailure", container={
        "volumeMounts": [{"name": "work", "mountPath": "/scratch"}],
    }, volumes=[{"name": "work", "emptyDir": {}}, {"name": "config", "configMap": {"name": "greeting"}}],
        initContainers=[{
            "name": "copy", "image": "ignored", "command": ["sh", "-c", "cp /config/text /scratch/from-init"],
            "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True},
                             {"name": "work", "mountPath": "/scratch"}],
        }])
    k8s_cluster.apply(ns, pod)
    pod = wait_pod(k8s_cluster, ns, "staged", lambda p: p["status"].get("phase") == "Succeeded", "did not succeed")
    assert pod["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    main = pod["status"]["containerStatuses"][0]
    assert main["restartCount"] == 1 and main["lastState"]["terminated"]["exitCode"] == 1, main
    assert condition(pod, "Initialized")["status"] == "True"
    log = k8s_cluster.pod_output(ns, "staged")
    assert "failing once" in log and "init wrote: hello from a ConfigMap" in log, log
