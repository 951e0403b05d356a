"""The path users take, on a real control plane (tests/k8s): `kubectl apply -f crds/`, `helm install`,
`helm test`, then InferenceServices whose pods (run by the test node agent) serve real answers.

Order matters within this module: the CRD and the operator are installed once, then each test uses them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import yaml
from cluster_utils import (
    LABEL_ISVC,
    LABEL_ROLE,
    MESSAGES,
    OPERATOR_NS,
    REPO,
    Env,
    apply_example,
    blocks_read,
    chat,
    chat_usage,
    condition,
    dockerfile_entrypoints,
    wait_ready,
)
from isvc_utils import INVALID, variant
from tests.engine.engine_server import run_server
from tests.k8s.cluster import Cluster, eventually
from tests.k8s.real_node import REAL_NODE_TAINT, RealNode

from tandem_operator.handlers import CHILD_RESOURCES
from tandem_router.procs import scrape as metric  # raises for a metric nobody exports: a rename cannot pass

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(1200)]

RELEASE = "tandem"
OPERATOR_SA = "tandem-operator"  # the chart's full name for release "tandem"


@pytest.fixture(scope="module")
def env(k8s_cluster: Cluster) -> Iterator[Env]:
    e = Env(k8s_cluster)
    if k8s_cluster.agent is not None:
        k8s_cluster.agent.entrypoints.update(dockerfile_entrypoints())
    yield e


# -- install --------------------------------------------------------------------------------------------

def test_crds_apply_on_the_real_server(env: Env) -> None:
    out = env.ok("kubectl", "apply", "-f", "crds/")
    assert "inferenceservices.serving.tandem.dev" in out
    eventually(lambda: condition(env.get("crd", "inferenceservices.serving.tandem.dev"), "Established")
               .get("status") == "True", 60, "the CRD never became Established")


@pytest.mark.parametrize(("change", "needle"), INVALID.values(), ids=INVALID.keys())
def test_invalid_inference_services_are_refused(env: Env, change: dict[str, Any], needle: str) -> None:
    """Every invalid variant the offline checks refuse (test_operator_crd.py, which also checks the
    operator's own parsing), refused by the real apiserver too: its schema, defaulting and CEL rules,
    through a server-side dry run (nothing is created)."""
    out = env.kubectl("apply", "--dry-run=server", "-n", "default", "-f", "-", input=yaml.safe_dump(variant(change)))
    assert out.returncode != 0, "admitted"
    # "is invalid" (schema, CEL), or a "strict decoding error" for an unknown field
    assert ("is invalid" in out.stderr or "strict decoding error" in out.stderr) and needle in out.stderr, out.stderr


def test_helm_install_runs_the_operator_as_a_pod(env: Env) -> None:
    env.ok("helm", "install", RELEASE, "charts/tandem", "--namespace", OPERATOR_NS, "--create-namespace",
           "--wait", "--timeout", "300s", timeout=400)
    pods = env.get("pods", "-n", OPERATOR_NS)["items"]
    assert len(pods) == 1 and pods[0]["status"]["phase"] == "Running", pods
    assert pods[0]["spec"]["serviceAccountName"] == OPERATOR_SA
    out = env.ok("helm", "test", RELEASE, "--namespace", OPERATOR_NS, "--timeout", "120s", timeout=200)
    assert "Succeeded" in out, out


SA = f"system:serviceaccount:{OPERATOR_NS}:{OPERATOR_SA}"
CAN = [
    ("list", "inferenceservices.serving.tandem.dev", "-A"),
    ("patch", "inferenceservices.serving.tandem.dev/status", "-n", "team-x"),
    ("create", "deployments.apps", "-n", "team-x"),
    ("patch", "deployments.apps", "-n", "team-x"),
    ("create", "services", "-n", "team-x"),
    ("create", "configmaps", "-n", "team-x"),
    ("create", "serviceaccounts", "-n", "team-x"),
    ("create", "roles.rbac.authorization.k8s.io", "-n", "team-x"),
    ("create", "rolebindings.rbac.authorization.k8s.io", "-n", "team-x"),
    ("create", "events", "-n", "team-x"),
    ("watch", "deployments.apps", "-A"),
]
CANNOT = [
    ("get", "secrets", "-n", "team-x"),
    ("list", "secrets", "-A"),
    ("create", "pods", "-n", "team-x"),
    ("delete", "namespaces"),
    ("create", "clusterroles.rbac.authorization.k8s.io"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
    ("delete", "customresourcedefinitions.apiextensions.k8s.io"),
    ("create", "nodes"),
    ("escalate", "roles.rbac.authorization.k8s.io", "-n", "team-x"),
    ("impersonate", "serviceaccounts", "-n", "team-x"),
]


def can_i_mismatches(env: Env, account: str, can: list[tuple[str, ...]], cannot: list[tuple[str, ...]]) -> str:
    """`kubectl auth can-i --as=account` for every check; the answers that differ from the wanted ones."""
    wrong = []
    for allowed, checks in ((True, can), (False, cannot)):
        for verb, resource, *scope in checks:
            out = env.kubectl("auth", "can-i", verb, resource, *scope, f"--as={account}")
            if (out.stdout.strip() == "yes") != allowed:
                wrong.append(f"can-i {verb} {resource} {' '.join(scope)}: {out.stdout.strip()} (want "
                             f"{'yes' if allowed else 'no'})")
    return "\n".join(wrong)


def test_operator_service_account_can_do_what_reconciling_needs_and_nothing_more(env: Env) -> None:
    wrong = can_i_mismatches(env, SA, CAN, CANNOT)
    assert not wrong, wrong


NS_SA = "system:serviceaccount:tandem-ns-system:tandem-ns-operator"  # release "tandem-ns", scope Namespace
NS_CAN = [
    ("list", "inferenceservices.serving.tandem.dev", "-n", "team-a"),
    ("watch", "inferenceservices.serving.tandem.dev", "-n", "team-a"),
    ("patch", "inferenceservices.serving.tandem.dev/status", "-n", "team-a"),
    ("create", "deployments.apps", "-n", "team-a"),
    ("delete", "services", "-n", "team-a"),
    ("create", "rolebindings.rbac.authorization.k8s.io", "-n", "team-a"),
    ("create", "events", "-n", "team-a"),
]
NS_CANNOT = [
    ("list", "inferenceservices.serving.tandem.dev", "-A"),
    ("create", "deployments.apps", "-A"),
    ("create", "deployments.apps", "-n", "team-b"),
    ("list", "inferenceservices.serving.tandem.dev", "-n", "team-b"),
    ("get", "secrets", "-n", "team-a"),
    ("list", "namespaces"),
    ("list", "customresourcedefinitions.apiextensions.k8s.io"),
    ("create", "clusterroles.rbac.authorization.k8s.io"),
    ("create", "pods", "-n", "team-a"),
]


def test_namespace_scoped_rbac_grants_only_the_watched_namespaces(env: Env) -> None:
    """The chart's `rbac.scope=Namespace` as the real authorizer sees it: Roles in the watched namespaces,
    nothing cluster-wide (rendered by helm, applied without running a second operator)."""
    for ns in ("tandem-ns-system", "team-a", "team-b"):
        env.ok("kubectl", "create", "namespace", ns)
    try:
        rendered = env.ok("helm", "template", "tandem-ns", "charts/tandem", "--namespace", "tandem-ns-system",
                          "--set", "rbac.scope=Namespace", "--set", "rbac.watchNamespaces={team-a}",
                          "--show-only", "templates/rbac.yaml", "--show-only", "templates/serviceaccount.yaml")
        assert "ClusterRole" not in rendered, rendered
        env.ok("kubectl", "apply", "-f", "-", input=rendered)
        wrong = can_i_mismatches(env, NS_SA, NS_CAN, NS_CANNOT)
        assert not wrong, wrong
    finally:
        env.kubectl("delete", "namespace", "tandem-ns-system", "team-a", "team-b", "--wait=false")


# -- serving --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Greedy answers of a local colocated engine, per dtype (the examples use auto and float32: auto is
    bfloat16 on this machine's CPU if it has AMX, else float32, for the pods as for this engine)."""
    out = {}
    for dtype in ("auto", "float32"):
        with run_server(["--dtype", dtype, "--max-model-len", "2048"], tmp_path_factory.mktemp("ref")) as s:
            out[dtype] = chat(s.url)
    return out




def test_disaggregated_example_serves_through_the_router(env: Env, reference: dict[str, str]) -> None:
    ns, name = "pd", "smollm2-pd"
    apply_example(env, "disaggregated", ns)
    obj = wait_ready(env, ns, name)
    kinds = {(i["kind"], i["metadata"]["name"]) for i in env.get(
        "deploy,rs,svc,cm,sa,role,rolebinding", "-n", ns, "-l", f"{LABEL_ISVC}={name}")["items"]}
    for role in ("prefill", "decode", "router"):
        assert ("Deployment", f"{name}-{role}") in kinds, kinds
        assert any(k == "ReplicaSet" and n.startswith(f"{name}-{role}-") for k, n in kinds), kinds
    assert obj["status"]["decode"]["ready"].startswith("2"), obj["status"]
    (router,) = env.ready_pods(ns, name, "router")
    decodes = env.ready_pods(ns, name, "decode")
    before = sum(metric(env.url(d), "tandem:kv_transfer_received_blocks_total") for d in decodes)
    answer, prompt_tokens = chat_usage(env.url(router))
    assert answer == reference["auto"]
    after = sum(metric(env.url(d), "tandem:kv_transfer_received_blocks_total") for d in decodes)
    # Every block of the prompt but the one holding its last token (recomputed on decode), exactly.
    assert after - before == blocks_read(prompt_tokens), (before, after, prompt_tokens)


def test_disaggregated_pods_in_containers_move_kv_between_ipc_namespaces(
        env: Env, k8s_real_node: RealNode, reference: dict[str, str]) -> None:
    """The disaggregated example with its pods on the real node: containers from the worker image, each in
    its own PID, IPC and network namespace, so NIXL's UCX has only the network between prefill and decode
    (UCX_TLS=tcp forced here: shared memory and CMA cannot cross the namespaces anyway). A client pod asks
    the router's Service by its DNS name, as NOTES.txt tells a user; the answer equals a local engine's,
    and decode received exactly the prompt's blocks. UCX prints the transport it chose (UCX_PROTO_INFO)."""
    ns, name = "pd-real", "smollm2-pd"
    spec = yaml.safe_load((REPO / "crds" / "examples" / "disaggregated.yaml").read_text())
    place = {"spec": {"nodeSelector": {"kubernetes.io/hostname": k8s_real_node.name},
                      "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}]}}
    for role in ("prefill", "decode", "router"):
        spec["spec"][role]["podTemplate"] = place
    for role in ("prefill", "decode"):  # the node has this machine's 2 CPUs: ask for little, cap at 2
        spec["spec"][role]["resources"] = {"requests": {"cpu": "300m", "memory": "1Gi"},
                                           "limits": {"cpu": "2", "memory": "4Gi"}}
    spec["spec"]["decode"]["replicas"] = 1
    spec["spec"]["kvTransfer"]["ucx"]["transports"] = "tcp"
    spec["spec"]["engine"]["env"] = [{"name": "UCX_PROTO_INFO", "value": "y"},
                                     {"name": "UCX_LOG_LEVEL", "value": "info"}]
    env.ok("kubectl", "create", "namespace", ns)
    env.ok("kubectl", "apply", "-n", ns, "-f", "-", input=json.dumps(spec))
    wait_ready(env, ns, name)
    pods = {role: env.ready_pods(ns, name, role) for role in ("prefill", "decode", "router")}
    assert {p["spec"]["nodeName"] for ps in pods.values() for p in ps} == {k8s_real_node.name}
    (decode,), (router,) = pods["decode"], pods["router"]
    before = metric(env.url(decode), "tandem:kv_transfer_received_blocks_total")
    body = json.dumps({"model": "smollm2-135m-instruct", "messages": MESSAGES, "max_tokens": 12, "temperature": 0})
    client = (f"import json, urllib.request; r = urllib.request.urlopen(urllib.request.Request("
              f"'http://{name}-router.{ns}.svc/v1/chat/completions', data={body!r}.encode(), "
              "headers={'content-type': 'application/json'}), timeout=300); a = json.load(r); "
              "print(json.dumps([a['choices'][0]['message']['content'], a['usage']['prompt_tokens']]))")
    out = env.ok("kubectl", "exec", "-n", ns, router["metadata"]["name"], "--", "python", "-c", client)
    answer, prompt_tokens = json.loads(out)
    assert answer == reference["auto"]
    received = metric(env.url(decode), "tandem:kv_transfer_received_blocks_total") - before
    assert received == blocks_read(prompt_tokens), (received, prompt_tokens)
    assert metric(env.url(decode), "tandem:kv_transfer_failures_total") == 0
    # Which UCX transport carried the READ: printed by UCX in the engines' logs, kept in the test's output.
    logs = env.ok("kubectl", "logs", "-n", ns, decode["metadata"]["name"])
    transport = [ln for ln in logs.splitlines() if "UCX" in ln and ("INFO" in ln or "ucp_" in ln)]
    print("UCX between prefill and decode pods:", *transport[:12], sep="\n  ")
    pids = env.ok("kubectl", "exec", "-n", ns, decode["metadata"]["name"], "--", "python", "-c",
                  "import os; print(len([p for p in os.listdir('/proc') if p.isdigit()]))")
    assert int(pids) < 50, "the decode container sees the host's processes: no PID namespace of its own"
    env.ok("kubectl", "delete", "namespace", ns, "--wait=false")


CHILD_PLURALS = tuple(plural for _, _, plural, _ in CHILD_RESOURCES)


def child_writes(env: Env) -> dict[str, float]:
    """The API server's own count of writes to the objects the operator owns (status subresources aside:
    the controllers write those)."""
    writes = env.cluster.kube.writes()
    return {plural: writes.get(plural, 0.0) for plural in CHILD_PLURALS}


def test_a_settled_inference_service_costs_no_writes(env: Env) -> None:
    """Drift is repaired with one write, and the reconciles it sets off write nothing else: the operator
    compares its children with what the real server returns (defaults filled in, empty values omitted)."""
    ns, name = "pd", "smollm2-pd"
    wait_ready(env, ns, name)
    svc = f"{name}-router"
    selector = env.get("svc", svc, "-n", ns)["spec"]["selector"]
    before = child_writes(env)
    env.ok("kubectl", "patch", "svc", svc, "-n", ns, "--type=merge", "-p",
           json.dumps({"spec": {"selector": {**selector, LABEL_ROLE: "nobody"}}}))
    eventually(lambda: env.get("svc", svc, "-n", ns)["spec"]["selector"] == selector, 30,
               "the operator did not restore the router Service's selector")
    time.sleep(5)  # the repair's own watch event, and any reconcile it sets off
    after = child_writes(env)
    extra = {k: after[k] - before[k] for k in CHILD_PLURALS if after[k] != before[k]}
    # Two writes on services: the test's drift and the operator's repair; nothing else.
    assert extra == {"services": 2.0}, extra


def new_pod_gets_traffic(env: Env, router: dict[str, Any], pod: dict[str, Any]) -> None:
    """Requests through the router until `pod` has served one."""
    sent = iter(range(10_000))

    def served() -> bool:
        # Prompts that share no prefix: the prefix-aware policy would keep sending one prompt to one pod.
        r = httpx.post(env.url(router) + "/v1/completions", timeout=120, json={
            "model": "smollm2-135m-instruct", "prompt": f"{next(sent)} green bottles", "max_tokens": 2})
        assert r.status_code == 200, r.text
        return metric(env.url(pod), "vllm:request_success_total") > 0

    eventually(served, 120, f"the router never sent a request to {pod['metadata']['name']}", interval_s=0.5)


def test_deleting_a_decode_pod_under_load(env: Env) -> None:
    """Requests in flight on a deleted pod end (answer or error, never a hang), the ReplicaSet replaces
    it, the router finds the new pod, and no engine is left holding KV blocks."""
    ns, name = "pd", "smollm2-pd"
    (router,) = env.ready_pods(ns, name, "router")
    url = env.url(router)
    victim = env.ready_pods(ns, name, "decode")[0]["metadata"]["name"]
    results: list[str] = []

    def one(i: int) -> None:
        try:
            r = httpx.post(url + "/v1/completions", timeout=300, json={
                "model": "smollm2-135m-instruct", "prompt": f"Count to twenty, run {i}:", "max_tokens": 48,
                "ignore_eos": True, "temperature": 0})
            results.append("ok" if r.status_code == 200 else f"error {r.status_code}")
        except httpx.HTTPError as e:  # an error is acceptable, a hang is not (the timeout would fail)
            results.append(f"error {type(e).__name__}")

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, i) for i in range(6)]
        time.sleep(3)
        threading.Thread(target=env.ok, args=("kubectl", "delete", "pod", victim, "-n", ns, "--wait=false"),
                         daemon=True).start()
        for f in futures:
            f.result(timeout=400)
    assert len(results) == 6, results
    eventually(lambda: len(env.ready_pods(ns, name, "decode")) == 2 and victim not in
               [p["metadata"]["name"] for p in env.pods(ns, name, "decode")], 400, "the ReplicaSet did not replace it")
    newest = max(env.ready_pods(ns, name, "decode"), key=lambda p: p["metadata"]["creationTimestamp"])
    new_pod_gets_traffic(env, router, newest)
    for role in ("prefill", "decode"):
        for pod in env.ready_pods(ns, name, role):
            eventually(lambda p=pod: metric(env.url(p), "vllm:kv_cache_usage_perc") == 0.0, 60,
                       f"{pod['metadata']['name']} still holds KV blocks")
    print("in-flight results:", results)


def test_kubectl_scale_drives_decode_through_the_scale_subresource(env: Env) -> None:
    # As `kubectl scale`, an HPA or KEDA would. Scaling back up is left to the next test's planner
    # (decode held at 2), so that the new pod starts while that test runs.
    ns, name = "pd", "smollm2-pd"
    scale = env.get("tisvc", name, "-n", ns, "--subresource=scale")
    assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2, scale
    assert scale["status"]["selector"] == f"{LABEL_ISVC}={name},{LABEL_ROLE}=decode", scale
    env.ok("kubectl", "scale", "tisvc", name, "-n", ns, "--replicas=1")
    eventually(lambda: len(env.pods(ns, name, "decode")) == 1, 120, "decode did not scale down to 1")
    obj = wait_ready(env, ns, name)
    assert obj["status"]["decode"]["ready"] == "1/1", obj["status"]
    assert env.get("tisvc", name, "-n", ns, "--subresource=scale")["status"]["replicas"] == 1
    (router,) = env.ready_pods(ns, name, "router")
    for _ in range(2):
        assert chat(env.url(router), max_tokens=4)


def test_the_planner_grows_prefill_when_prompts_grow(env: Env) -> None:
    """Long prompts push the prefill engines' TTFT past its target: prefill goes 1 -> 2; decode, held at
    2 by its bounds, goes back from the 1 the previous test left; removing spec.autoscaling stops the
    planner and hands the replicas back."""
    ns, name = "pd", "smollm2-pd"
    autoscale(env, ns, name, {"prefill": {"minReplicas": 1, "maxReplicas": 2},
                              "decode": {"minReplicas": 2, "maxReplicas": 2}, "targets": {"ttftSeconds": 0.05},
                              "intervalSeconds": 2, "scaleUp": {"stabilizationSeconds": 0}})
    (router,) = env.ready_pods(ns, name, "router")
    url, stop = env.url(router), threading.Event()

    def long_prompts(i: int) -> None:
        while not stop.is_set():
            r = httpx.post(url + "/v1/completions", timeout=300, json={
                "model": "smollm2-135m-instruct", "prompt": f"{i} " + "a long shared document line. " * 150,
                "max_tokens": 2})
            assert r.status_code == 200, r.text

    with ThreadPoolExecutor(2) as pool:
        load = [pool.submit(long_prompts, i) for i in range(2)]
        try:
            eventually(lambda: env.get("tisvc", name, "-n", ns)["spec"]["prefill"]["replicas"] == 2, 120,
                       "the planner never scaled prefill up under long prompts", interval_s=1)
        finally:
            stop.set()
            for f in load:
                f.result(timeout=300)
    ups = scaling_events(env, ns, name, "ScaledUp")
    (up,) = [m for m in ups if m.startswith("prefill")]
    assert up.startswith("prefill 1->2: TTFT p90") and "> target 0.05 s" in up, up
    assert any(m.startswith("decode 1->2") for m in ups), ups  # raised to its minReplicas
    obj = env.get("tisvc", name, "-n", ns)
    assert obj["spec"]["decode"]["replicas"] == 2, obj["spec"]
    assert obj["status"]["autoscaling"]["signals"]["prefill"]["ttftSeconds"] > 0.05, obj["status"]["autoscaling"]
    env.ok("kubectl", "patch", "tisvc", name, "-n", ns, "--type=merge", "-p",
           json.dumps({"spec": {"autoscaling": None, "prefill": {"replicas": 1}}}))
    eventually(lambda: len(env.pods(ns, name, "prefill")) == 1, 120, "prefill did not go back to 1")
    time.sleep(5)  # a planner still running would scale it up again
    assert env.get("tisvc", name, "-n", ns)["spec"]["prefill"]["replicas"] == 1


def test_colocated_example_serves(env: Env, reference: dict[str, str]) -> None:
    ns, name = "colo", "smollm2"
    apply_example(env, "colocated", ns)
    wait_ready(env, ns, name)
    assert not env.pods(ns, name, "prefill")
    (router,) = env.ready_pods(ns, name, "router")
    assert chat(env.url(router)) == reference["float32"]


def autoscale(env: Env, ns: str, name: str, autoscaling: dict[str, Any]) -> None:
    """Replace spec.autoscaling whole: a merge patch would keep what an earlier test set and this one
    left out (a 20 ms ITL target and no scale-up window scaled a woken pool straight to 2)."""
    env.ok("kubectl", "patch", "tisvc", name, "-n", ns, "--type=json", "-p",
           json.dumps([{"op": "add", "path": "/spec/autoscaling", "value": autoscaling}]))


def scaling_events(env: Env, ns: str, name: str, reason: str) -> list[str]:
    items = env.get("events", "-n", ns, "--field-selector", f"involvedObject.name={name},reason={reason}")["items"]
    return [e["message"] for e in items]


def test_the_planner_follows_a_load_ramp_and_says_why(env: Env) -> None:
    """Streams push ITL past its target: decode goes 1 -> 2 and the new pod serves; the load stops and
    decode returns to 1 after the down window. Events and status.autoscaling tell the story."""
    ns, name = "colo", "smollm2"
    autoscale(env, ns, name, {"decode": {"minReplicas": 1, "maxReplicas": 2}, "targets": {"itlSeconds": 0.02},
                              "intervalSeconds": 2, "scaleUp": {"stabilizationSeconds": 0},
                              "scaleDown": {"stabilizationSeconds": 10}})
    (router,) = env.ready_pods(ns, name, "router")
    url, stop = env.url(router), threading.Event()

    def stream(i: int) -> None:
        while not stop.is_set():
            r = httpx.post(url + "/v1/completions", timeout=300, json={
                "model": "smollm2-135m-instruct", "prompt": f"{i} Count to a hundred:", "max_tokens": 24,
                "ignore_eos": True})
            assert r.status_code == 200, r.text

    with ThreadPoolExecutor(3) as pool:
        load = [pool.submit(stream, i) for i in range(3)]
        try:
            eventually(lambda: env.get("tisvc", name, "-n", ns)["spec"]["decode"]["replicas"] == 2, 120,
                       "the planner never scaled decode up under load", interval_s=1)
            (up,) = scaling_events(env, ns, name, "ScaledUp")
            assert up.startswith("decode 1->2: ITL p90") and "> target 0.02 s" in up, up
            eventually(lambda: len(env.ready_pods(ns, name, "decode")) == 2, 400, "the new decode pod never got Ready")
            newest = max(env.ready_pods(ns, name, "decode"), key=lambda p: p["metadata"]["creationTimestamp"])
            eventually(lambda: metric(env.url(newest), "vllm:request_success_total") > 0, 120,
                       "the router never sent a request to the new decode pod", interval_s=1)
        finally:
            stop.set()
            for f in load:
                f.result(timeout=300)
    status = env.get("tisvc", name, "-n", ns)["status"]["autoscaling"]
    assert status["signals"]["decode"]["pods"] >= 1 and status["lastScale"]["steps"][0]["to"] == 2, status
    t_idle = time.monotonic()
    eventually(lambda: env.get("tisvc", name, "-n", ns)["spec"]["decode"]["replicas"] == 1, 120,
               "decode never scaled back down after the load stopped", interval_s=1)
    assert time.monotonic() - t_idle >= 7, "scaled down before the 10 s down window"
    (down,) = scaling_events(env, ns, name, "ScaledDown")
    assert down.startswith("decode 2->1"), down
    eventually(lambda: len(env.pods(ns, name, "decode")) == 1, 120, "the second decode pod never went away")


def decode_column(env: Env, ns: str, name: str) -> str:
    """The DECODE column of `kubectl get tisvc` (ready/desired)."""
    header, row = env.ok("kubectl", "get", "tisvc", name, "-n", ns).splitlines()[:2]
    return row[header.index("DECODE"):].split()[0]  # by position: a colocated service's PREFILL is blank


def test_scale_to_zero_and_the_first_request_waits_for_the_pools(env: Env) -> None:
    ns, name = "colo", "smollm2"
    autoscale(env, ns, name, {"decode": {"minReplicas": 0, "maxReplicas": 2}, "intervalSeconds": 2,
                              "scaleToZero": {"idleSeconds": 30, "holdSeconds": 240}})
    # The router restarts with --cold-start-timeout; then, idle, both pools go to zero.
    eventually(lambda: env.get("tisvc", name, "-n", ns)["spec"]["decode"]["replicas"] == 0, 180,
               "decode never scaled to zero when idle", interval_s=2)
    eventually(lambda: not env.pods(ns, name, "decode"), 120, "the decode pod outlived its scale to zero")
    # The status follows the Deployment's, which its controller updates after the pod is gone.
    eventually(lambda: decode_column(env, ns, name) == "0/0", 30, "kubectl still shows a ready decode replica",
               interval_s=1)
    (router,) = env.ready_pods(ns, name, "router")
    assert "--cold-start-timeout" in router["spec"]["containers"][0]["args"]
    t0 = time.monotonic()
    assert chat(env.url(router), max_tokens=4)  # held by the router until a decode pod is Ready
    waited = time.monotonic() - t0
    obj = env.get("tisvc", name, "-n", ns)
    assert obj["spec"]["decode"]["replicas"] == 1 and obj["status"]["decode"]["readyReplicas"] == 1, obj["status"]
    assert any("held at the router" in m for m in scaling_events(env, ns, name, "ScaledUp")), "no ScaledUp from zero"
    assert decode_column(env, ns, name) == "1/1"
    print(f"first request after scale to zero: answered in {waited:.1f} s")


def test_deleting_the_inference_service_collects_every_child(env: Env) -> None:
    for ns, name in (("pd", "smollm2-pd"), ("colo", "smollm2")):
        env.ok("kubectl", "delete", "tisvc", name, "-n", ns, "--wait=true", "--timeout=120s", timeout=200)

        def gone(ns: str = ns, name: str = name) -> bool:
            left = env.get("deploy,rs,pods,svc,cm,sa,role,rolebinding", "-n", ns, "-l", f"{LABEL_ISVC}={name}")
            return not left["items"]

        eventually(gone, 180, f"children of {name} remain", interval_s=1)


def test_helm_uninstall_leaves_nothing_of_the_operator(env: Env) -> None:
    env.ok("helm", "uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait", "--timeout", "120s", timeout=200)

    def gone() -> bool:
        left = env.get("all,sa,role,rolebinding,cm", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/instance=tandem")
        cluster = env.get("clusterrole,clusterrolebinding", "-l", "app.kubernetes.io/instance=tandem")
        return not left["items"] and not cluster["items"]

    eventually(gone, 120, "the operator's objects remain after helm uninstall", interval_s=1)
