"""The path users take, on the cluster `make cluster` starts (tests/k8s: a real control plane and a real node,
its kubelet running containers from the images of docker/): `kubectl apply -f crds/`, `helm install` with
the chart's defaults, `helm test`, then InferenceServices whose pods serve real answers.

Order matters within this module: the CRD and the operator are installed once, then each test uses them.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from cluster_utils import (
    LABEL_ISVC,
    LABEL_ROLE,
    OPERATOR_NS,
    REPO,
    SUBJECTS,
    Env,
    apply_example,
    blocks_read,
    chat,
    chat_usage,
    condition,
    messages,
    wait_ready,
)
from isvc_utils import INVALID, variant
from kubernetes.utils import parse_quantity
from tests.engine.engine_server import run_server
from tests.k8s.cluster import Cluster, eventually, port_forward

from tandem_operator.handlers import CHILD_RESOURCES
from tandem_router.procs import scrape as metric  # raises for a metric nobody exports: a rename cannot pass

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(1200)]

RELEASE = "tandem"
OPERATOR_SA = "tandem-operator"  # the chart's full name for release "tandem"


@pytest.fixture(scope="module")
def env(k8s_cluster: Cluster) -> Iterator[Env]:
    yield Env(k8s_cluster)


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
    ("create", "networkpolicies.networking.k8s.io", "-n", "team-x"),
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
            if dtype == "auto":  # every variant, for the tests that need each prompt new to a decode engine
                out |= {f"auto/{v}": chat(s.url, variant=v) for v in range(len(SUBJECTS))}
    return out




def ucx_info(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` with UCX printing the protocols it picks (UCX_PROTO_INFO): what carried the KV blocks between
    the pods, in the engines' logs. It changes no choice UCX makes."""
    spec["spec"]["engine"]["env"] = [{"name": "UCX_PROTO_INFO", "value": "y"},
                                     {"name": "UCX_LOG_LEVEL", "value": "info"}]
    return spec


def ucx_transport(env: Env, ns: str, pod: dict[str, Any]) -> list[str]:
    """UCX's own lines on the protocols it chose, from `kubectl logs`."""
    logs = env.ok("kubectl", "logs", "-n", ns, pod["metadata"]["name"])
    return [ln for ln in logs.splitlines() if "UCX" in ln and ("INFO" in ln or "ucp_" in ln)]


def in_pod(env: Env, ns: str, pod: dict[str, Any], url: str, v: int) -> tuple[str, int]:
    """`messages(v)` answered through `url`, asked from inside `pod` (`kubectl exec`): answer, prompt tokens."""
    body = json.dumps({"model": "smollm2-135m-instruct", "messages": messages(v), "max_tokens": 12,
                       "temperature": 0})
    client = (f"import json, urllib.request; r = urllib.request.urlopen(urllib.request.Request("
              f"'{url}/v1/chat/completions', data={body!r}.encode(), "
              "headers={'content-type': 'application/json'}), timeout=300); a = json.load(r); "
              "print(json.dumps([a['choices'][0]['message']['content'], a['usage']['prompt_tokens']]))")
    answer, prompt_tokens = json.loads(env.ok("kubectl", "exec", "-n", ns, pod["metadata"]["name"], "--",
                                              "python", "-c", client))
    return str(answer), int(prompt_tokens)


def received_blocks(env: Env, decodes: list[dict[str, Any]]) -> float:
    return sum(metric(env.url(d), "tandem:kv_transfer_received_blocks_total") for d in decodes)


def router_pairs(env: Env, router: dict[str, Any], prefill: int, decode: int) -> None:
    """Wait until the router has checked the engines' revisions (an endpoint of unknown revision is paired with
    no one: its P/D requests prefill locally meanwhile), e.g. right after the service became Ready."""
    url = env.url(router)
    eventually(lambda: metric(url, "tandem:router_revision_endpoints", role="prefill") >= prefill
               and metric(url, "tandem:router_revision_endpoints", role="decode") >= decode, 60,
               "the router never knew the engines' revisions", interval_s=0.5)


def test_disaggregated_example_serves_through_the_router(env: Env, reference: dict[str, str]) -> None:
    """The disaggregated example, as NOTES.txt tells a user to reach it: the router Service by DNS name and
    ClusterIP from inside a pod (`kubectl exec` into the router), and `kubectl port-forward svc/...` from the
    host. Prefill and decode are containers from the worker image, each with its own PID, IPC and network
    namespace: the example's `tcp,sm` leaves UCX only the network between them. Every answer equals a local
    engine's; decode received exactly each prompt's blocks."""
    ns, name = "pd", "smollm2-pd"
    env.ok("kubectl", "create", "namespace", ns)
    spec = ucx_info(yaml.safe_load((REPO / "crds" / "examples" / "disaggregated.yaml").read_text()))
    env.ok("kubectl", "apply", "-n", ns, "-f", "-", input=json.dumps(spec))
    obj = wait_ready(env, ns, name)
    kinds = {(i["kind"], i["metadata"]["name"]) for i in env.get(
        "deploy,rs,svc,cm,sa,role,rolebinding", "-n", ns, "-l", f"{LABEL_ISVC}={name}")["items"]}
    for role in ("prefill", "decode", "router"):
        assert ("Deployment", f"{name}-{role}") in kinds, kinds
        assert any(k == "ReplicaSet" and n.startswith(f"{name}-{role}-") for k, n in kinds), kinds
    assert obj["status"]["decode"]["ready"].startswith("2"), obj["status"]
    (router,) = env.ready_pods(ns, name, "router")
    decodes = env.ready_pods(ns, name, "decode")
    (prefill,) = env.ready_pods(ns, name, "prefill")
    router_pairs(env, router, 1, len(decodes))

    svc = env.get("svc", f"{name}-router", "-n", ns)
    port = svc["spec"]["ports"][0]["port"]
    assert obj["status"]["endpoint"]["url"].startswith(f"http://{name}-router.{ns}.svc"), obj["status"]["endpoint"]
    # Each a prompt no engine has seen: the decode engine holds none of its blocks.
    urls = (f"http://{name}-router.{ns}.svc:{port}", f"http://{svc['spec']['clusterIP']}:{port}")
    for v, url in enumerate(urls):
        before = received_blocks(env, decodes)
        answer, prompt_tokens = in_pod(env, ns, router, url, v)
        assert answer == reference[f"auto/{v}"], url
        # Every block of the prompt but the one holding its last token (recomputed on decode), exactly.
        assert received_blocks(env, decodes) - before == blocks_read(prompt_tokens), url
    with port_forward(env.env, ns, f"svc/{name}-router", port) as url:
        before = received_blocks(env, decodes)
        answer, prompt_tokens = chat_usage(url, variant=2)
        assert answer == reference["auto/2"]
        assert received_blocks(env, decodes) - before == blocks_read(prompt_tokens)
    for decode in decodes:
        assert metric(env.url(decode), "tandem:kv_transfer_failures_total") == 0

    # What `kubectl logs` shows of an engine: its startup, with every CPU kernel baked into the image.
    logs = env.ok("kubectl", "logs", "-n", ns, prefill["metadata"]["name"])
    assert "[startup] ready in" in logs and "steps fused: one C call per step" in logs, logs[-3000:]
    print("UCX between prefill and decode pods (transports tcp,sm):",
          *[ln for d in decodes for ln in ucx_transport(env, ns, d)][:12], sep="\n  ")


def test_the_router_asks_for_an_api_key_once_router_auth_names_a_secret(env: Env) -> None:
    """`router.auth.secretName`: the kubelet hands the router the Secret's key; a request without it gets
    OpenAI's 401, with it an answer, and the probes' paths stay open. Removing `auth` opens the router again."""
    ns, name = "pd", "smollm2-pd"
    key = "sk-tandem-e2e"
    env.ok("kubectl", "create", "secret", "generic", "router-keys", "-n", ns, f"--from-literal=api-key={key}")

    def router_with_key(wanted: bool) -> dict[str, Any] | None:
        pods = env.ready_pods(ns, name, "router")
        keyed = [any(e["name"] == "TANDEM_API_KEY" for e in p["spec"]["containers"][0].get("env", [])) for p in pods]
        return pods[0] if len(pods) == 1 and keyed == [wanted] else None

    env.ok("kubectl", "patch", "tisvc", name, "-n", ns, "--type=merge", "-p",
           json.dumps({"spec": {"router": {"auth": {"secretName": "router-keys"}}}}))
    router = eventually(lambda: router_with_key(True), 180, "the router never restarted with the key")
    url = env.url(router)
    body = {"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 2}
    refused = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", refused.text
    wrong = httpx.post(url + "/v1/completions", json=body, timeout=60, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    ok = httpx.post(url + "/v1/completions", json=body, timeout=120, headers={"Authorization": f"Bearer {key}"})
    assert ok.status_code == 200, ok.text
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    env.ok("kubectl", "patch", "tisvc", name, "-n", ns, "--type=json", "-p",
           json.dumps([{"op": "remove", "path": "/spec/router/auth"}]))
    router = eventually(lambda: router_with_key(False), 180, "the router never restarted without the key")
    assert httpx.post(env.url(router) + "/v1/completions", json=body, timeout=120).status_code == 200


# Run in a pod by `kubectl exec`, argv: HOST:PORT...; prints {target: "open" | why it did not connect}.
PROBE = """
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
def probe(target):
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        return "open"
    except OSError as exc:
        return type(exc).__name__
with ThreadPoolExecutor(32) as pool:
    print(json.dumps(dict(zip(sys.argv[1:], pool.map(probe, sys.argv[1:])))))
"""
# Run in an engine container: the TCP ports it listens on for other hosts (not loopback only).
LISTENING = """
import json
ports = set()
for path in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(path).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port = local.rsplit(":", 1)
        if state == "0A" and address not in ("0100007F", "00000000000000000000000001000000"):
            ports.add(int(port, 16))
print(json.dumps(sorted(ports)))
"""


def probe_from(env: Env, ns: str, pod: str, targets: list[str]) -> dict[str, str]:
    return dict(json.loads(env.ok("kubectl", "exec", "-n", ns, pod, "--", "python", "-c", PROBE, *targets)))


def test_only_the_services_own_pods_reach_its_engines(env: Env, reference: dict[str, str]) -> None:
    """The operator's NetworkPolicy, enforced by the node's policy plugin: from a pod in another namespace, no
    port an engine listens on (HTTP, KV side channel, KV events, replay, NIXL/UCX's listener) accepts a
    connection, while the router there does; from the router pod every one of them does, and the service
    answers through the router."""
    ns, name = "pd", "smollm2-pd"
    policy = env.get("networkpolicy", f"{name}-engines", "-n", ns)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    engines = env.ready_pods(ns, name, "prefill") + env.ready_pods(ns, name, "decode")
    targets = []
    for pod in engines:
        ports = json.loads(env.ok("kubectl", "exec", "-n", ns, pod["metadata"]["name"], "--", "python", "-c",
                                  LISTENING))
        # HTTP, KV events, replay and (prefill) the side channel are declared; UCX's listener is not, and is
        # there too.
        declared = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        serving = {"http", "kv-events", "kv-replay"} | ({"kv-side"} if "prefill" in pod["metadata"]["name"] else set())
        assert {declared[n] for n in serving} <= set(ports) and set(ports) - set(declared.values()), (ports, declared)
        targets += [f"{pod['status']['podIP']}:{port}" for port in ports]
    (router,) = env.ready_pods(ns, name, "router")
    router_target = f"{router['status']['podIP']}:8000"
    image = env.get("tisvc", name, "-n", ns)["spec"]["engine"]["image"]
    env.ok("kubectl", "create", "namespace", "outsider")
    env.ok("kubectl", "run", "prober", "-n", "outsider", f"--image={image}", "--image-pull-policy=Never",
           "--restart=Never", "--overrides", json.dumps({"spec": {"terminationGracePeriodSeconds": 0}}),
           "--command", "--", "python", "-c", "import time; time.sleep(3600)")
    env.ok("kubectl", "wait", "-n", "outsider", "--for=condition=Ready", "pod/prober", "--timeout=120s")
    outside = probe_from(env, "outsider", "prober", [router_target, *targets])
    assert outside.pop(router_target) == "open"
    assert not [t for t, result in outside.items() if result == "open"], outside
    inside = probe_from(env, ns, router["metadata"]["name"], targets)
    assert all(result == "open" for result in inside.values()), inside
    assert chat(env.url(router)) == reference["auto"]
    print(f"from namespace outsider: {outside}")
    env.ok("kubectl", "delete", "namespace", "outsider", "--wait=false")


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
    # The namespace the test before deleted without waiting: its controller's deletions count as writes too.
    eventually(lambda: "outsider" not in {n["metadata"]["name"] for n in env.get("namespaces")["items"]},
               180, "the namespace of the test before was never removed", interval_s=1)
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


OOM_LIMIT = "3Gi"
# Run in an engine container by `kubectl exec`: children of 64 MiB each (written, so resident) until the
# container's memory cgroup is full. The kernel's OOM killer then takes the largest process in it: the
# engine's (GBs of weights and KV cache), not one of these.
FILL_MEMORY = """
import os, time
for _ in range(96):
    if os.fork() == 0:
        block = b"x" * (64 << 20)
        time.sleep(600)
        os._exit(0)
time.sleep(600)
"""


def test_kv_moves_between_pods_over_tcp_alone(env: Env, reference: dict[str, str]) -> None:
    """The same with UCX_TLS=tcp forced (kvTransfer.ucx.transports): the blocks cross the pods' network
    namespaces over TCP, which UCX's protocol lines show. The decode pods' memory limit is the next
    test's (a pod over it is OOM-killed), the planner holds decode at 2 to 3."""
    ns, name = "pd-tcp", "smollm2-pd"
    env.ok("kubectl", "create", "namespace", ns)
    spec = ucx_info(yaml.safe_load((REPO / "crds" / "examples" / "disaggregated.yaml").read_text()))
    spec["spec"]["kvTransfer"]["ucx"]["transports"] = "tcp"
    spec["spec"]["decode"]["resources"] = {"requests": {"cpu": "250m", "memory": "1Gi"},
                                           "limits": {"memory": OOM_LIMIT}}
    spec["spec"]["autoscaling"] = {"prefill": {"minReplicas": 1, "maxReplicas": 1},
                                   "decode": {"minReplicas": 2, "maxReplicas": 3},
                                   "targets": {"ttftSeconds": 30, "itlSeconds": 5}, "intervalSeconds": 2}
    env.ok("kubectl", "apply", "-n", ns, "-f", "-", input=json.dumps(spec))
    wait_ready(env, ns, name)
    (router,) = env.ready_pods(ns, name, "router")
    decodes = env.ready_pods(ns, name, "decode")
    router_pairs(env, router, 1, len(decodes))
    for v in range(len(SUBJECTS)):  # new prompts, spread over both decode pods
        before = received_blocks(env, decodes)
        answer, prompt_tokens = chat_usage(env.url(router), variant=v)
        assert answer == reference[f"auto/{v}"]
        assert received_blocks(env, decodes) - before == blocks_read(prompt_tokens)
    lines = [ln for d in decodes for ln in ucx_transport(env, ns, d)]
    print("UCX between prefill and decode pods (UCX_TLS=tcp):", *lines[:12], sep="\n  ")
    assert any("tcp" in ln for ln in lines), lines
    assert not [ln for ln in lines if any(sm in ln for sm in ("posix", "sysv", "cma", "xpmem", "knem"))], lines
    pids = env.ok("kubectl", "exec", "-n", ns, decodes[0]["metadata"]["name"], "--", "python", "-c",
                  "import os; print(len([p for p in os.listdir('/proc') if p.isdigit()]))")
    assert int(pids) < 50, "the decode container sees the host's processes: no PID namespace of its own"


def test_an_engine_over_its_memory_limit_is_oom_killed_and_nothing_hangs(env: Env) -> None:
    """A decode container passes its memory limit while it streams: the kernel kills the engine, the
    kubelet restarts the container (lastState OOMKilled), the stream ends (answered by the other decode
    pod, or a clear error: never a hang), no engine keeps KV blocks, the restarted pod gets traffic again,
    and the planner, which holds decode at 2 to 3, sees no reason to scale."""
    ns, name = "pd-tcp", "smollm2-pd"
    (router,) = env.ready_pods(ns, name, "router")
    decodes = env.ready_pods(ns, name, "decode")
    assert len(decodes) == 2
    result: dict[str, Any] = {}

    def stream() -> None:
        text, error = [], None
        try:
            with httpx.stream("POST", env.url(router) + "/v1/completions", timeout=120, json={
                    "model": "smollm2-135m-instruct", "prompt": "Count slowly to a thousand:" * 4,
                    "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]
                    else:
                        text.extend(c["text"] for c in event["choices"])
        except httpx.HTTPError as e:
            error = f"{type(e).__name__}: {e}"
        result.update(tokens=len(text), error=error)

    streamer = threading.Thread(target=stream)
    streamer.start()
    victim = eventually(lambda: next((d for d in decodes if metric(env.url(d), "vllm:num_requests_running") > 0),
                                     None), 60, "the stream never reached a decode pod", interval_s=0.2)
    vname = victim["metadata"]["name"]
    filled = env.run("kubectl", "exec", "-n", ns, vname, "--", "python", "-c", FILL_MEMORY, timeout=300)
    assert filled.returncode != 0, "the memory filler outlived its container"
    streamer.join(timeout=300)
    assert not streamer.is_alive(), "the stream hung after its decode engine was OOM-killed"
    print("stream through the OOM kill:", result)
    # Answered in full by the other decode pod (the router resumes it there), or ended with an error.
    assert result.get("error") or result.get("tokens") == 400, result

    def restarted() -> dict[str, Any] | None:
        (status,) = env.get("pod", vname, "-n", ns)["status"]["containerStatuses"]
        return status if status["restartCount"] >= 1 and status.get("ready") else None

    status = eventually(restarted, 300, f"{vname} was not restarted and Ready again", interval_s=1)
    assert status["lastState"]["terminated"]["reason"] == "OOMKilled", status
    assert len(env.pods(ns, name, "decode")) == 2, "the ReplicaSet replaced a pod the kubelet restarts"
    pod = env.get("pod", vname, "-n", ns)
    new_pod_gets_traffic(env, router, pod)
    for role in ("prefill", "decode"):
        for p in env.ready_pods(ns, name, role):
            eventually(lambda p=p: metric(env.url(p), "vllm:kv_cache_usage_perc") == 0.0, 60,
                       f"{p['metadata']['name']} still holds KV blocks")
    scaled = scaling_events(env, ns, name, "ScaledUp") + scaling_events(env, ns, name, "ScaledDown")
    assert not scaled, scaled
    assert env.get("tisvc", name, "-n", ns)["spec"]["decode"]["replicas"] == 2
    env.ok("kubectl", "delete", "namespace", ns, "--wait=false")


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
    # The pod going away drains first (preStop, then in-flight requests): the status counts it until it is gone.
    eventually(lambda: wait_ready(env, ns, name)["status"]["decode"]["ready"] == "1/1", 120,
               "the status never showed decode at 1/1")
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
    # Stopped here; the next test takes both pools back to one pod each, under load, which a planner still
    # running would undo.
    env.ok("kubectl", "patch", "tisvc", name, "-n", ns, "--type=merge", "-p",
           json.dumps({"spec": {"autoscaling": None}}))


def serving_revisions(env: Env, ns: str, name: str) -> list[str]:
    return [r["revision"] for r in env.get("tisvc", name, "-n", ns).get("status", {}).get("revisions") or []]


def pod_revisions(env: Env, ns: str, name: str) -> list[str]:
    """The engine revisions the prefill and decode pods (not terminating) run, from their `--revision` flag."""
    return sorted({flag(a, "--revision") or "" for a in engine_args(env, ns, name)})


def patch_spec(env: Env, ns: str, name: str, spec: dict[str, Any]) -> None:
    env.ok("kubectl", "patch", "tisvc", name, "-n", ns, "--type=merge", "-p", json.dumps({"spec": spec}))


def engine_args(env: Env, ns: str, name: str) -> list[list[str]]:
    pods = env.pods(ns, name, "prefill") + env.pods(ns, name, "decode")
    return [p["spec"]["containers"][0]["args"] for p in pods]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@contextlib.contextmanager
def steady_load(url: str, workers: int = 4, answers: dict[str, str] | None = None) -> Iterator[list[str]]:
    """Streamed P/D completions (prompts new to every engine, 16 greedy tokens each) through the router at `url`,
    one after the other on each of `workers` threads, until the block ends; yields the outcomes so far ("ok" for
    a whole answer, else what broke). Each whole answer's text goes into `answers` under its prompt."""
    stop, results = threading.Event(), []

    def load(worker: int) -> None:
        for k in range(100_000):
            if stop.is_set():
                return
            prompt = f"Request {worker}.{k}: " + "the quick brown fox jumps over the lazy dog. " * 12
            body = {"model": "smollm2-135m-instruct", "max_tokens": 16, "ignore_eos": True, "temperature": 0,
                    "stream": True, "prompt": prompt}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            events = [json.loads(ln[6:]) for ln in lines if ln != "data: [DONE]"]
            finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
            broken = r.status_code != 200 or any("error" in e for e in events) or finish != ["length"] \
                or lines[-1:] != ["data: [DONE]"]
            results.append(f"broken: {r.status_code} {lines[-3:]}" if broken else "ok")
            if not broken and answers is not None:
                answers[prompt] = "".join(c.get("text", "") for e in events for c in e.get("choices", []))

    with ThreadPoolExecutor(workers) as pool:
        running = [pool.submit(load, w) for w in range(workers)]
        try:
            yield results
        finally:
            stop.set()
            for f in running:
                f.result(timeout=300)


DRAINED = re.compile(r"\[drain\] engine 0 drained in [0-9.]+s: (\d+) leases released, (\d+) expired while it waited "
                     r"\((\d+) released, (\d+) expired since it started\)")


def follow_engine_logs(env: Env, ns: str, name: str, log_dir: Path) -> dict[str, tuple[str, subprocess.Popen[bytes]]]:
    """`kubectl logs -f` of every engine pod of the service into `log_dir`: pod -> (role, follower)."""
    return {p["metadata"]["name"]: (p["metadata"]["labels"][LABEL_ROLE], subprocess.Popen(
                ["kubectl", "logs", "-f", "-n", ns, p["metadata"]["name"]], env=dict(env.env),
                stdout=(log_dir / f"{p['metadata']['name']}.log").open("w"), stderr=subprocess.STDOUT))
            for role in ("prefill", "decode") for p in env.ready_pods(ns, name, role)}


def scale_down_under_load(env: Env, ns: str, name: str, log_dir: Path, scale: Any) -> None:
    """With prefill and decode at 2 pods each, `scale()` while streamed P/D requests run through the router, until
    one pod of each is left: every request answers in full, no stream breaks (no migration, no replay), the
    surviving decode engine read every prompt's KV without a failure, and the pods that left drained first:
    their logs say so, and no lease on the prefill engine's blocks ever ran out."""
    eventually(lambda: len(env.ready_pods(ns, name, "prefill")) == len(env.ready_pods(ns, name, "decode")) == 2,
               300, "prefill and decode never stood at 2 pods each", interval_s=1)
    (router,) = env.ready_pods(ns, name, "router")
    url = env.url(router)
    followers = follow_engine_logs(env, ns, name, log_dir)
    migrations = metric(url, "tandem:router_migrations_total")
    with steady_load(url) as results:
        eventually(lambda: len(results) >= 8, 180, "the load never got going", interval_s=0.5)
        scale()
        left = f"{LABEL_ISVC}={name},{LABEL_ROLE} in (prefill,decode)"
        eventually(lambda: len(env.get("pods", "-n", ns, "-l", left)["items"]) == 2, 180,
                   "the pools did not shrink to one pod each", interval_s=1)
        done = len(results)
        eventually(lambda: len(results) >= done + 4, 120, "the load did not go on on the pods left")
    assert results and all(r == "ok" for r in results), [r for r in results if r != "ok"]
    assert metric(url, "tandem:router_migrations_total") == migrations  # nothing broke, nothing was replayed
    (decode,) = env.ready_pods(ns, name, "decode")
    assert metric(env.url(decode), "tandem:kv_transfer_failures_total") == 0
    assert metric(env.url(decode), "tandem:kv_transfer_received_blocks_total") > 0
    staying = {p["metadata"]["name"] for role in ("prefill", "decode") for p in env.pods(ns, name, role)}
    gone = sorted(set(followers) - staying)
    assert sorted(followers[p][0] for p in gone) == ["decode", "prefill"], (gone, staying)
    for pod in gone:
        role, follower = followers[pod]
        follower.wait(60)
        log = (log_dir / f"{pod}.log").read_text()
        assert "[drain] engine 0 draining for up to 30s" in log, log[-3000:]
        drained = DRAINED.search(log)
        assert drained, log[-3000:]
        assert (drained[2], drained[4]) == ("0", "0"), drained[0]  # no lease ran out, before or during the drain
        if role == "prefill":
            assert int(drained[3]) > 0, drained[0]  # it served decode engines, and each released its lease
        print(f"{role} {pod}:", *[ln for ln in log.splitlines() if "[drain]" in ln], sep="\n  ")
    for _, follower in followers.values():
        follower.terminate()


def test_the_planner_steps_both_pools_down_under_load_and_nothing_is_lost(env: Env, tmp_path: Path) -> None:
    """The planner, its targets far above what a light load costs, steps prefill 2 -> 1 and decode 2 -> 1 in the
    middle of that load (marking the pods' deletion cost first): nothing is lost (scale_down_under_load)."""
    ns, name = "pd", "smollm2-pd"

    def planner_on() -> None:
        autoscale(env, ns, name, {"prefill": {"minReplicas": 1, "maxReplicas": 2},
                                  "decode": {"minReplicas": 1, "maxReplicas": 2},
                                  "targets": {"ttftSeconds": 60, "itlSeconds": 10}, "intervalSeconds": 2,
                                  "scaleDown": {"stabilizationSeconds": 4}})

    scale_down_under_load(env, ns, name, tmp_path, planner_on)
    downs = scaling_events(env, ns, name, "ScaledDown")
    assert sorted(m.split(":")[0] for m in downs) == ["decode 2->1", "prefill 2->1"], downs
    patch_spec(env, ns, name, {"autoscaling": None, "prefill": {"replicas": 1}, "decode": {"replicas": 1}})


def test_kv_transfer_verified_follows_what_the_engines_count(env: Env) -> None:
    """KVTransferVerified comes from the router's and the engines' own counters, judged every 15 s: True while
    long prompts move KV from prefill to decode; False (NoPrefillEngine), with a Warning Event, within two
    intervals once no prefill engine is left to send them to; True again once one is back."""
    ns, name = "pd", "smollm2-pd"
    (router,) = env.ready_pods(ns, name, "router")
    sent = iter(range(100_000))

    def verified() -> tuple[str, str]:
        """A long prompt no engine has seen goes through the router; then the condition as it stands."""
        r = httpx.post(env.url(router) + "/v1/completions", timeout=300, json={
            "model": "smollm2-135m-instruct", "prompt": f"Note {next(sent)}: " + "a long document line. " * 20,
            "max_tokens": 2})
        assert r.status_code == 200, r.text
        c = condition(env.get("tisvc", name, "-n", ns), "KVTransferVerified")
        return c.get("status", ""), c.get("reason", "")

    eventually(lambda: verified() == ("True", "KVReceived"), 90, "KV moved, but the condition never said so",
               interval_s=2)
    env.ok("kubectl", "patch", "tisvc", name, "-n", ns, "--type=merge", "-p",
           json.dumps({"spec": {"prefill": {"replicas": 0}}}))
    eventually(lambda: not env.pods(ns, name, "prefill"), 120, "prefill did not scale to 0", interval_s=1)
    eventually(lambda: verified() == ("False", "NoPrefillEngine"), 45,
               "no prefill engine was up, and the condition did not say so within two intervals", interval_s=2)
    (warning,) = scaling_events(env, ns, name, "NoPrefillEngine")[:1]
    assert "prefilled on decode: no prefill engine" in warning, warning
    env.ok("kubectl", "patch", "tisvc", name, "-n", ns, "--type=merge", "-p",
           json.dumps({"spec": {"prefill": {"replicas": 1}}}))
    eventually(lambda: verified() == ("True", "KVReceived"), 300, "KV moves again, but the condition stayed False",
               interval_s=3)


def test_kv_transfer_verified_says_transfer_failed_while_ucx_cannot_connect(env: Env) -> None:
    """kvTransfer.ucx.netDevices `lo`: UCX may use only each pod's loopback, so no decode engine can reach a
    prefill engine's blocks. Streamed requests still answer (the router replays them with local prefill), but
    KVTransferVerified goes False with reason TransferFailed and a Warning Event, within two intervals of
    the first failure; back to the pods' network, it goes True again."""
    ns, name = "pd", "smollm2-pd"
    patch_spec(env, ns, name, {"kvTransfer": {"ucx": {"netDevices": "lo"}}, "autoscaling": {
        "prefill": {"minReplicas": 1, "maxReplicas": 1}, "decode": {"minReplicas": 1, "maxReplicas": 1},
        "intervalSeconds": 5}})
    sent = iter(range(100_000))

    def devices() -> list[str | None]:
        return [next((e.get("value") for e in p["spec"]["containers"][0].get("env", [])
                      if e["name"] == "UCX_NET_DEVICES"), None)
                for role in ("prefill", "decode") for p in env.pods(ns, name, role)]

    def verified() -> tuple[str, str]:
        """A long streamed prompt (a stream whose KV load fails is replayed with local prefill: it still answers
        whole), then the condition as it stands."""
        (router,) = env.ready_pods(ns, name, "router")
        with httpx.stream("POST", env.url(router) + "/v1/completions", timeout=300, json={
                "model": "smollm2-135m-instruct", "prompt": f"Memo {next(sent)}: " + "a long document line. " * 20,
                "max_tokens": 2, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert r.status_code == 200 and lines[-1:] == ["data: [DONE]"], lines
        assert not [ln for ln in lines if '"error"' in ln], lines
        c = condition(env.get("tisvc", name, "-n", ns), "KVTransferVerified")
        return c.get("status", ""), c.get("reason", "")

    eventually(lambda: devices() == ["lo", "lo"] and len(env.ready_pods(ns, name, "decode")) == 1
               and len(env.ready_pods(ns, name, "prefill")) == 1, 300, "the engines did not roll", interval_s=1)
    eventually(lambda: verified() == ("False", "TransferFailed"), 60,
               "KV could not move, and the condition did not say so", interval_s=2)
    (warning,) = scaling_events(env, ns, name, "TransferFailed")[:1]
    print("KVTransferVerified False:", warning)
    (decode,) = env.ready_pods(ns, name, "decode")
    assert metric(env.url(decode), "tandem:kv_transfer_failures_total") > 0
    # Back to the pods' network, and float32 for the rollouts that follow (one roll for both): in bfloat16 a
    # matmul's rounding depends on the batch's shape, so an answer under load need not be the greedy one.
    patch_spec(env, ns, name, {"kvTransfer": {"ucx": {"netDevices": None}}, "engine": {"dtype": "float32"}})
    eventually(lambda: devices() == [None, None] and len(env.ready_pods(ns, name, "decode")) == 1
               and len(env.ready_pods(ns, name, "prefill")) == 1
               and all(flag(a, "--dtype") == "float32" for a in engine_args(env, ns, name)), 300,
               "the engines did not roll back", interval_s=1)
    eventually(lambda: verified() == ("True", "KVReceived"), 120, "KV moves again, but the condition stayed False",
               interval_s=2)


class Greedy:
    """What a local float32 engine answers to a prompt (16 greedy tokens), per KV block size: one engine per block
    size, started at its first question and kept for the module, and every answer kept (the loads of several
    tests send the same prompts)."""

    def __init__(self, log_dir: Path, stack: contextlib.ExitStack) -> None:
        self.log_dir, self.stack = log_dir, stack
        self.urls: dict[int, str] = {}
        self.known: dict[tuple[int, str], str] = {}

    def url(self, block_size: int) -> str:
        if block_size not in self.urls:
            self.urls[block_size] = self.stack.enter_context(run_server(
                ["--block-size", str(block_size), "--max-model-len", "2048"], self.log_dir)).url
        return self.urls[block_size]

    def answer(self, block_size: int, prompt: str) -> str:
        if (block_size, prompt) not in self.known:
            r = httpx.post(self.url(block_size) + "/v1/completions", timeout=300, json={
                "model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 16, "ignore_eos": True,
                "temperature": 0})
            r.raise_for_status()
            self.known[block_size, prompt] = r.json()["choices"][0]["text"]
        return self.known[block_size, prompt]

    def wrong(self, answers: dict[str, str], block_sizes: tuple[int, ...]) -> list[str]:
        """The answers that equal no local engine's greedy answer to the same prompt (at any of `block_sizes`:
        while two revisions serve, a request may have taken either)."""
        for block_size in block_sizes:  # one engine at a time (started here, not by a thread), four requests at once
            self.url(block_size)
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda p, b=block_size: self.answer(b, p), sorted(answers)))
        return [f"{p!r}: {a!r} vs {[self.answer(b, p) for b in block_sizes]}" for p, a in answers.items()
                if all(self.answer(b, p) != a for b in block_sizes)]


@pytest.fixture(scope="module")
def greedy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Greedy]:
    with contextlib.ExitStack() as stack:
        yield Greedy(tmp_path_factory.mktemp("greedy"), stack)


def roll_under_load(env: Env, ns: str, name: str, change: dict[str, Any], done: Any,
                    answers: dict[str, str]) -> tuple[str, str, str]:
    """`change` to the spec while a steady load of streamed P/D requests runs through the router, until `done`
    (given each engine pod's args) holds for both one-pod roles and status.revisions shows one new revision.
    Asserts that every request answered in full and none was migrated or replayed (no stream broke); returns
    the old revision, the new, and the router's URL."""
    # The pods' revision, once status.revisions shows it alone (a change made just before may still show there).
    (old,) = eventually(lambda: len(pod_revisions(env, ns, name)) == 1
                        and serving_revisions(env, ns, name) == pod_revisions(env, ns, name)
                        and serving_revisions(env, ns, name), 60, "status.revisions never showed the pods' revision")
    (router,) = env.ready_pods(ns, name, "router")
    url, seen = env.url(router), []
    migrations = metric(url, "tandem:router_migrations_total")
    with steady_load(url, answers=answers) as results:
        eventually(lambda: len(results) >= 8, 180, "the load never got going", interval_s=0.5)
        patch_spec(env, ns, name, change)

        def rolled() -> bool:
            seen.append(serving_revisions(env, ns, name))
            args = engine_args(env, ns, name)
            return (len(args) == 2 and all(done(a) for a in args) and seen[-1] != [old]
                    and seen[-1] == pod_revisions(env, ns, name))

        eventually(rolled, 300, "the rollout did not finish", interval_s=1)
        # Requests started once the new revision's prefill engine was admitted move their KV to its decode.
        eventually(lambda: all(metric(env.url(p), "tandem:kv_transfer_received_blocks_total") > 0
                               for p in env.ready_pods(ns, name, "decode")), 120,
                   "no KV moved to the new revision's decode engine under the load", interval_s=1)
    assert results and all(r == "ok" for r in results), [r for r in results if r != "ok"]
    assert metric(url, "tandem:router_migrations_total") == migrations
    (new,) = seen[-1]
    # Both new pods serve: status.revisions says so within a few of its 2 s intervals.
    eventually(lambda: [(r["revision"], r["prefill"], r["decode"]) for r in
                        env.get("tisvc", name, "-n", ns)["status"]["revisions"]] == [(new, 1, 1)], 30,
               "status.revisions never showed the new revision alone, with both its pods")
    for pod in env.ready_pods(ns, name, "decode"):
        assert metric(env.url(pod), "tandem:kv_transfer_failures_total") == 0
    changes = [r for i, r in enumerate(seen) if i == 0 or r != seen[i - 1]]
    print(f"{change}: {len(results)} requests, status.revisions during the rollout: {changes}")
    return old, new, url


def test_a_rollout_of_a_shared_setting_loses_no_request_and_every_answer_is_greedy(
        env: Env, greedy: Greedy) -> None:
    """engine.maxModelLen 2048 -> 1024 (a change KV could cross, but which rolls both roles) under a steady load
    of streamed P/D requests: every request answers in full, no stream breaks, no KV load fails, and every
    answer equals a local engine's greedy answer to the same prompt. The engines run float32 since the test
    before (a change made without load): in bfloat16 a matmul's rounding depends on the batch's shape."""
    ns, name = "pd", "smollm2-pd"
    # Ticks every 2 s (the planner holds both roles at 1: nothing scales), so that the status sees the overlap.
    patch_spec(env, ns, name, {"autoscaling": {
        "prefill": {"minReplicas": 1, "maxReplicas": 1}, "decode": {"minReplicas": 1, "maxReplicas": 1},
        "intervalSeconds": 2}})
    assert all(flag(a, "--dtype") == "float32" for a in engine_args(env, ns, name))
    answers: dict[str, str] = {}
    roll_under_load(env, ns, name, {"engine": {"maxModelLen": 1024}},
                    lambda a: flag(a, "--max-model-len") == "1024", answers)
    wrong = greedy.wrong(answers, (16,))
    assert not wrong, wrong[:5]


def test_a_rollout_kv_cannot_cross_loses_no_request_and_pairs_within_each_revision(
        env: Env, greedy: Greedy) -> None:
    """engine.blockSize 16 -> 32 under a steady load of streamed P/D requests: a change no KV can cross (a decode
    engine refuses blocks of another size), so while old and new pods serve side by side the router must pair
    each request's prefill and decode within one revision. Every request answers in full with the greedy
    answer, no stream breaks, no KV load fails on any decode engine, both revisions took requests, and
    status.revisions ends with the new one alone."""
    ns, name = "pd", "smollm2-pd"
    answers: dict[str, str] = {}
    old, new, url = roll_under_load(env, ns, name, {"engine": {"blockSize": 32}},
                                           lambda a: flag(a, "--block-size") == "32", answers)
    # Both revisions took requests during the change (each pod of one role rolls within a second or two, so
    # status.revisions, written every 2 s, may or may not catch both at once).
    assert metric(url, "tandem:router_revision_requests_total", revision=old) > 0
    assert metric(url, "tandem:router_revision_requests_total", revision=new) > 0
    wrong = greedy.wrong(answers, (16, 32))
    assert not wrong, wrong[:5]


def cpu_millis(quantity: str) -> int:
    return int(parse_quantity(quantity) * 1000)


def free_cpu(env: Env, node: str, leaving: tuple[str, ...] = ()) -> int:
    """Millicores of `node` that no pod requests, counting the pods whose names start with `leaving` as gone."""
    allocatable = cpu_millis(env.get("node", node)["status"]["allocatable"]["cpu"])
    pods = env.get("pods", "-A", "--field-selector",
                   f"spec.nodeName={node},status.phase!=Succeeded,status.phase!=Failed")["items"]
    used = sum(cpu_millis(c.get("resources", {}).get("requests", {}).get("cpu", "0"))
               for p in pods if not (leaving and p["metadata"]["name"].startswith(leaving))
               for c in p["spec"]["containers"])
    return allocatable - used


def test_drain_first_rolls_a_full_node_and_loses_no_request(env: Env, greedy: Greedy) -> None:
    """rollout.strategy DrainFirst, with the engines' CPU requests sized so that the node has room for no third
    engine pod (a Surge rollout would wait for room forever): engine.blockSize 32 -> 16 under the same steady
    load rolls both roles, each old pod draining before its replacement starts. Meanwhile the router pairs
    within a revision, prefills on decode while no prefill engine of the request's revision is up, and holds
    requests while no decode engine is Ready: every request answers in full with the greedy answer, and no
    KV load fails."""
    ns, name = "pd", "smollm2-pd"
    (pod,) = env.ready_pods(ns, name, "decode")
    node = pod["spec"]["nodeName"]
    # Two engine pods fit, a third does not (the requests roll the pods once more, DrainFirst already).
    share = free_cpu(env, node, leaving=(f"{name}-prefill-", f"{name}-decode-")) * 45 // 100
    requests = {"resources": {"requests": {"cpu": f"{share}m"}}}
    patch_spec(env, ns, name, {"rollout": {"strategy": "DrainFirst", "holdSeconds": 120},
                               "prefill": requests, "decode": requests})
    for role in ("prefill", "decode"):
        eventually(lambda r=role: [cpu_millis(p["spec"]["containers"][0]["resources"]["requests"]["cpu"])
                                   for p in env.ready_pods(ns, name, r)] == [share]
                   and len(env.pods(ns, name, r)) == 1, 300, f"{role} did not roll to its new request", interval_s=1)
    eventually(lambda: [flag(p["spec"]["containers"][0]["args"], "--cold-start-timeout")
                        for p in env.pods(ns, name, "router")] == ["120"] and env.ready_pods(ns, name, "router"),
               120, "the router did not roll to hold requests")
    assert free_cpu(env, node) < share, "the node still has room for another engine pod"
    deploy = env.get("deploy", f"{name}-decode", "-n", ns)
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    answers: dict[str, str] = {}
    roll_under_load(env, ns, name, {"engine": {"blockSize": 16}}, lambda a: flag(a, "--block-size") == "16", answers)
    wrong = greedy.wrong(answers, (16, 32))
    assert not wrong, wrong[:5]
    # Room on the node for the tests that follow (no roll back: nothing uses this service again).
    patch_spec(env, ns, name, {"autoscaling": None, "prefill": {"replicas": 0}, "decode": {"replicas": 0}})


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
