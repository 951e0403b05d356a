"""The operator's reconcile loop against the real control plane (tests/k8s), with kwok's fake node.

The operator runs in this process (kopf, `tandem operator -A --standalone`, admin credentials); the real
API server validates and defaults, the real Deployment and ReplicaSet controllers make pods, the scheduler
puts them on kwok's node (every role's `podTemplate` asks for it), kwok marks them Running and Ready, and
the real garbage collector follows ownerReferences. No engine runs: these tests are about the objects.
test_cluster_e2e.py covers pods that serve, with the operator installed by the chart.

Still on KMock (test_operator_invalid_stored.py): an InferenceService the real server would refuse reaching the
operator (stored before the CRD had its validation, or with validation bypassed), which a real server
cannot be made to hold on demand.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import kubernetes.config.kube_config as kube_config
import pytest
from isvc_utils import PATHS, REPO, example, expected_children
from kopf.testing import KopfRunner
from tests.k8s.cluster import Cluster, eventually
from tests.k8s.kwok import FAKE_NODE_POD_TEMPLATE, FakeNode

from tandem_operator.cli import kopf_args

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(300)]

NAME = "smollm2-pd"
MERGE = "application/merge-patch+json"
LABEL_ISVC = "serving.tandem.dev/inferenceservice"
LABEL_ROLE = "serving.tandem.dev/role"


def on_fake_node(body: dict[str, Any]) -> dict[str, Any]:
    """Every role's pods go to kwok's node: the objects are real, no engine runs."""
    body = copy.deepcopy(body)
    for role in ("prefill", "decode", "router"):
        if role in body["spec"] or role != "prefill":
            body["spec"].setdefault(role, {})["podTemplate"] = copy.deepcopy(FAKE_NODE_POD_TEMPLATE)
    return body


class Api:
    def __init__(self, cluster: Cluster, ns: str) -> None:
        self.kube, self.ns, self.cluster = cluster.kube, ns, cluster

    def path(self, kind: str, name: str = "") -> str:
        return PATHS[kind].format(ns=self.ns) + (f"/{name}" if name else "")

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return self.kube.get_or_none(self.path(kind, name))

    def list(self, kind: str, **query: Any) -> list[dict[str, Any]]:
        return list(self.kube.get(self.path(kind), **query)["items"])

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.kube.post(self.path(body["kind"]), body)

    def patch(self, kind: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.kube.patch(self.path(kind, name), body, content_type=MERGE)

    def delete(self, kind: str, name: str) -> None:
        self.kube.delete(self.path(kind, name), {"propagationPolicy": "Background"})

    def present(self, name: str = NAME, prefill: bool = True) -> set[tuple[str, str]]:
        return {(k, n) for k, n in expected_children(name, prefill) if self.get(k, n) is not None}

    def deployment(self, name: str) -> dict[str, Any]:
        dep = self.get("Deployment", name)
        assert dep is not None, name
        return dep

    def condition(self, kind: str, name: str = NAME) -> dict[str, Any]:
        obj = self.get("InferenceService", name) or {}
        return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def engine(dep: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = dep["spec"]["template"]["spec"]["containers"][0]
    return container


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.fixture(scope="module")
def cluster(k8s_cluster: Cluster, k8s_fake_node: FakeNode) -> Iterator[Cluster]:
    out = k8s_cluster.kubectl("apply", "-f", str(REPO / "crds"))
    assert out.returncode == 0, out.stderr
    eventually(lambda: k8s_cluster.kubectl("wait", "--for=condition=Established", "--timeout=5s",
                                           "crd/inferenceservices.serving.tandem.dev").returncode == 0,
               60, "the CRD never became Established")
    # One operator at a time: a chart-installed one (test_cluster_e2e.py) would reconcile these too.
    installed = k8s_cluster.kube.get("/apis/apps/v1/deployments", labelSelector="app.kubernetes.io/name=tandem")
    assert not installed["items"], "a chart-installed operator is still running on the test cluster"
    with pytest.MonkeyPatch.context() as mp:
        # kopf's login and the operator's client read the admin kubeconfig; the client library reads its
        # default location once, at import.
        mp.setenv("KUBECONFIG", str(k8s_cluster.kubeconfig))
        mp.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(k8s_cluster.kubeconfig))
        yield k8s_cluster


@pytest.fixture()
def api(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Api]:
    ns = cluster.create_namespace("rec-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].strip("-"))
    try:
        yield Api(cluster, ns)
    finally:
        cluster.kube.delete(f"/api/v1/namespaces/{ns}")


def start_operator(*args: str) -> KopfRunner:
    runner = KopfRunner(kopf_args(list(args or ("--standalone", "-A"))), timeout=30)
    runner.__enter__()
    return runner


def stop_operator(runner: KopfRunner) -> None:
    runner.__exit__(None, None, None)
    assert runner.exception is None, runner.exception


@pytest.fixture()
def operator(api: Api) -> Iterator[KopfRunner]:
    runner = start_operator()
    try:
        yield runner
    finally:
        stop_operator(runner)


def test_create_builds_every_child_owned_and_labelled(api: Api, operator: KopfRunner) -> None:
    isvc = api.create(on_fake_node(example("disaggregated")))
    eventually(lambda: api.present() == expected_children(NAME), 30, "children missing")
    for kind, name in expected_children(NAME):
        child = api.get(kind, name)
        assert child is not None
        assert child["metadata"]["ownerReferences"] == [{
            "apiVersion": "serving.tandem.dev/v1alpha1", "kind": "InferenceService", "name": NAME,
            "uid": isvc["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        assert child["metadata"]["labels"][LABEL_ISVC] == NAME
    prefill, decode = api.deployment(f"{NAME}-prefill"), api.deployment(f"{NAME}-decode")
    assert decode["spec"]["replicas"] == 2 and prefill["spec"]["replicas"] == 1
    p_args, d_args = engine(prefill)["args"], engine(decode)["args"]
    assert flag(p_args, "--role") == "prefill" and flag(d_args, "--role") == "decode"
    for shared in ("--model", "--dtype", "--block-size", "--max-model-len", "--kv-side-channel-port"):
        assert flag(p_args, shared) == flag(d_args, shared)
    router = engine(api.deployment(f"{NAME}-router"))
    assert router["args"][0] == "route" and flag(router["args"], "--selector") == f"{LABEL_ISVC}={NAME}"
    ready = eventually(lambda: api.condition("Ready").get("status") == "True" and api.get("InferenceService", NAME),
                       120, "never Ready")
    # The podTemplate was merged in: the real scheduler put every pod on the fake node, and the real
    # controllers made them from the operator's Deployments.
    pods = api.list("Pod")
    assert len(pods) == 4 and {p["spec"].get("nodeName") for p in pods} == {"kwok-node-0"}, pods
    assert all(p["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet" for p in pods)
    assert ready["status"]["observedGeneration"] == 1
    assert ready["status"]["endpoint"]["url"] == f"http://{NAME}-router.{api.ns}.svc"
    assert ready["status"]["decode"] == {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "ready": "2/2",
                                             "selector": f"{LABEL_ISVC}={NAME},{LABEL_ROLE}=decode"}


def test_colocated_has_no_prefill(api: Api, operator: KopfRunner) -> None:
    api.create(on_fake_node(example("colocated")))
    eventually(lambda: api.present("smollm2", prefill=False) == expected_children("smollm2", prefill=False), 30,
               "children missing")
    assert api.get("Deployment", "smollm2-prefill") is None
    args = engine(api.deployment("smollm2-decode"))["args"]
    assert flag(args, "--role") == "both" and "--kv-side-channel-port" not in args
    eventually(lambda: api.condition("PrefillReady", "smollm2").get("reason") == "Disabled", 30, "no PrefillReady")


def test_scale_and_spec_update_roll_out(api: Api, operator: KopfRunner) -> None:
    api.create(on_fake_node(example("disaggregated")))
    eventually(lambda: api.condition("Ready").get("status") == "True", 120, "never Ready")
    old_hash = api.deployment(f"{NAME}-decode")["spec"]["template"]["metadata"]["annotations"]

    api.patch("InferenceService", NAME, {"spec": {"decode": {"replicas": 4}}})
    eventually(lambda: len(api.list("Pod", labelSelector=f"{LABEL_ISVC}={NAME},serving.tandem.dev/role=decode"))
               == 4, 60, "decode pods did not scale to 4")
    assert api.deployment(f"{NAME}-prefill")["spec"]["replicas"] == 1

    api.patch("InferenceService", NAME, {"spec": {"engine": {"blockSize": 32, "maxModelLen": 4096}}})
    for role in ("prefill", "decode"):
        eventually(lambda r=role: flag(engine(api.deployment(f"{NAME}-{r}"))["args"], "--block-size") == "32", 30,
                   f"{role} not updated")
        assert flag(engine(api.deployment(f"{NAME}-{role}"))["args"], "--max-model-len") == "4096"
    hashes = {api.deployment(f"{NAME}-{r}")["spec"]["template"]["metadata"]["annotations"]
              ["serving.tandem.dev/config-hash"] for r in ("prefill", "decode")}
    assert len(hashes) == 1 and hashes != {old_hash["serving.tandem.dev/config-hash"]}
    config = api.get("ConfigMap", f"{NAME}-engine-config")
    assert config is not None and '"blockSize": 32' in config["data"]["engine-config.json"]
    # The real Deployment controller rolls the pods to the new template, and the status follows.
    def rolled_out() -> bool:
        obj = api.get("InferenceService", NAME) or {}
        return bool(obj.get("status", {}).get("observedGeneration") == 3
                    and api.condition("Ready").get("status") == "True")
    eventually(rolled_out, 120, "the update never rolled out to Ready")
    assert len({rs["metadata"]["name"] for rs in api.list("ReplicaSet", labelSelector=f"{LABEL_ISVC}={NAME},"
                                                                             "serving.tandem.dev/role=decode")}) >= 2

    # Disaggregated -> colocated: the prefill workload and its Service go away (and the GC takes its pods).
    api.patch("InferenceService", NAME, {"spec": {"prefill": {"enabled": False}}})
    eventually(lambda: api.get("Deployment", f"{NAME}-prefill") is None and api.get("Service", f"{NAME}-prefill")
               is None, 30, "prefill children remain")
    assert flag(engine(api.deployment(f"{NAME}-decode"))["args"], "--role") == "both"
    eventually(lambda: not api.list("Pod", labelSelector="serving.tandem.dev/role=prefill"), 60,
               "prefill pods remain")


def test_deleted_or_edited_child_is_restored(api: Api, operator: KopfRunner) -> None:
    api.create(on_fake_node(example("disaggregated")))
    eventually(lambda: api.present() == expected_children(NAME), 30, "children missing")
    first_uid = api.deployment(f"{NAME}-decode")["metadata"]["uid"]

    api.delete("Deployment", f"{NAME}-decode")
    api.delete("ConfigMap", f"{NAME}-engine-config")
    eventually(lambda: api.present() == expected_children(NAME)
               and api.deployment(f"{NAME}-decode")["metadata"]["uid"] != first_uid, 30, "not restored")

    edited = api.deployment(f"{NAME}-router")["spec"]["template"]["spec"]["containers"]
    edited[0]["args"] = ["route", "--policy", "round-robin"]
    api.kube.patch(api.path("Deployment", f"{NAME}-router"),
                   {"spec": {"replicas": 7, "template": {"spec": {"containers": edited}}}})
    eventually(lambda: api.deployment(f"{NAME}-router")["spec"]["replicas"] == 1
               and flag(engine(api.deployment(f"{NAME}-router"))["args"], "--policy") == "prefix-aware", 30,
               "the router Deployment was not restored")

    api.patch("Role", f"{NAME}-router", {"rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]})
    eventually(lambda: (api.get("Role", f"{NAME}-router") or {}).get("rules", [{}])[0].get("resources")
               == ["endpointslices"], 30, "the router Role was not restored")


def test_status_follows_pods(api: Api, operator: KopfRunner, k8s_fake_node: FakeNode) -> None:
    api.create(on_fake_node(example("disaggregated")))
    eventually(lambda: api.condition("Ready").get("status") == "True", 120, "never Ready")
    ready = api.condition("Ready")
    assert ready["reason"] == "AllRolesReady" and ready["observedGeneration"] == 1
    # The node goes into maintenance and the router's pod is deleted: its replacement cannot be scheduled.
    node = f"/api/v1/nodes/{k8s_fake_node.name}"
    api.kube.patch(node, {"spec": {"unschedulable": True}})
    try:
        (router,) = api.list("Pod", labelSelector="serving.tandem.dev/role=router")
        api.kube.delete(api.path("Pod", router["metadata"]["name"]))
        eventually(lambda: api.condition("RouterReady").get("reason") == "PodsNotReady"
                   and api.condition("Ready").get("status") == "False", 60, "Ready did not follow the router pod")
        assert (api.get("InferenceService", NAME) or {})["status"]["router"]["ready"] == "0/1"
    finally:
        api.kube.patch(node, {"spec": {"unschedulable": False}})
    eventually(lambda: api.condition("Ready").get("status") == "True", 120, "not Ready again after the node returned")


def test_deletion_and_resume(api: Api) -> None:
    runner = start_operator()
    try:
        api.create(on_fake_node(example("disaggregated")))
        eventually(lambda: api.present() == expected_children(NAME), 30, "children missing")
    finally:
        stop_operator(runner)

    # Drift while the operator is down is repaired when it resumes.
    api.delete("Service", f"{NAME}-router")
    eventually(lambda: api.get("Service", f"{NAME}-router") is None, 30, "the Service was not deleted")
    runner = start_operator()
    try:
        eventually(lambda: api.present() == expected_children(NAME), 30, "not repaired on resume")
        # No finalizer holds the InferenceService; the real garbage collector removes every child and pod,
        # and the operator does not resurrect them.
        api.delete("InferenceService", NAME)
        eventually(lambda: api.get("InferenceService", NAME) is None, 10, "the InferenceService is held")
        eventually(lambda: not api.present() and not api.list("Pod") and not api.list("ReplicaSet"), 60,
                   "the garbage collector left children")
    finally:
        stop_operator(runner)


def test_namespace_scoped_mode(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--namespace` plus the chart's namespace-scope setting: only the watched namespace is served."""
    team_a, team_b = (cluster.create_namespace(n) for n in ("rec-team-a", "rec-team-b"))
    monkeypatch.setenv("TANDEM_OPERATOR_NO_SCANNING", "1")  # what the chart sets with rbac.scope=Namespace
    runner = start_operator("--standalone", f"--namespace={team_a}")
    try:
        a, b = Api(cluster, team_a), Api(cluster, team_b)
        b.create(on_fake_node(example("colocated")))
        a.create(on_fake_node(example("colocated")))
        eventually(lambda: a.get("Deployment", "smollm2-router") is not None, 30, "team-a not served")
        eventually(lambda: a.condition("Ready", "smollm2").get("status") == "True", 120, "team-a never Ready")
        assert b.get("Deployment", "smollm2-router") is None
        assert not (b.get("InferenceService", "smollm2") or {}).get("status")
    finally:
        stop_operator(runner)
        for ns in (team_a, team_b):
            cluster.kube.delete(f"/api/v1/namespaces/{ns}")

