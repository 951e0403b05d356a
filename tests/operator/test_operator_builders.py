"""Pure unit tests of the manifest builders; every rendered child is checked against the official
Kubernetes schemas (kubernetes-validate, strict) for the oldest and newest versions we support."""

from __future__ import annotations

import copy
import json
from typing import Any

import kopf
import kubernetes_validate
import pytest
from isvc_utils import example

from tandem_operator.args import config_hash, engine_command, router_command, shared_engine_args
from tandem_operator.naming import LABEL_ISVC, LABEL_ROLE, Component
from tandem_operator.resources import build_children, build_engine_service, build_router_role
from tandem_operator.spec import SpecError, parse_spec
from tandem_operator.workloads import build_engine_deployment, build_router_deployment, merge_overrides

K8S_VERSIONS = ("1.28", "1.37")


def body(name: str = "disaggregated", **spec: Any) -> dict[str, Any]:
    obj = example(name, namespace="team-a")
    obj["metadata"]["uid"] = "0b6b3c8e-0000-4000-8000-000000000001"
    for key, value in spec.items():
        obj["spec"][key] = value
    return obj


def rendered(obj: dict[str, Any]) -> list[dict[str, Any]]:
    children = build_children(parse_spec(obj))
    kopf.adopt(children, owner=obj, strict=True)  # type: ignore[arg-type]
    return children


VARIANTS = {
    "disaggregated": body(),
    "colocated": body("colocated"),
    "hf-static-router": body(
        model={
            "uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct",
            "revision": "12fd25f",
            "authSecretName": "hf-token",
        },
        router={"discovery": "Static", "policy": "SessionAffinity"},
    ),
    "pvc-overrides": body(
        model={"uri": "pvc://models/llama/3.1-8b"},
        decode={
            "replicas": 3,
            "podTemplate": {
                "metadata": {"labels": {"team": "a", LABEL_ROLE: "hijack"}},
                "spec": {
                    "nodeSelector": {"gpu": "h200"},
                    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [{"name": "engine", "env": [{"name": "X", "value": "1"}]}],
                },
            },
            "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "40Gi"}},
        },
    ),
}


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANTS.keys())
def test_every_child_is_valid_kubernetes(variant: str) -> None:
    children = rendered(VARIANTS[variant])
    assert children
    for child in children:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(child, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(
                    f"{child['kind']}/{child['metadata']['name']} invalid for {version}: "
                    f"{'.'.join(map(str, exc.path))}: {exc.message}"
                )


def test_validation_can_fail() -> None:
    """The schema check above is real: a typo'd container field is refused in strict mode."""
    dep = copy.deepcopy(build_router_deployment(parse_spec(body())))
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, "1.37", strict=True)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANTS.keys())
def test_names_labels_and_owner(variant: str) -> None:
    obj = VARIANTS[variant]
    name = obj["metadata"]["name"]
    children = rendered(obj)
    assert rendered(obj) == children  # deterministic
    for child in children:
        meta = child["metadata"]
        assert meta["name"].startswith(f"{name}-") and meta["namespace"] == "team-a"
        assert meta["labels"][LABEL_ISVC] == name
        assert meta["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
        if child["kind"] == "Deployment":
            role = meta["labels"][LABEL_ROLE]
            pod_labels = child["spec"]["template"]["metadata"]["labels"]
            assert pod_labels[LABEL_ISVC] == name and pod_labels[LABEL_ROLE] == role
            assert child["spec"]["selector"]["matchLabels"] == {LABEL_ISVC: name, LABEL_ROLE: role}
    kinds = sorted(c["kind"] for c in children)
    assert kinds.count("Deployment") == (3 if parse_spec(obj).disaggregated else 2)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANTS.keys())
def test_pods_are_hardened(variant: str) -> None:
    for child in rendered(VARIANTS[variant]):
        if child["kind"] != "Deployment":
            continue
        pod = child["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"] + pod.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["readOnlyRootFilesystem"] is True
        main = pod["containers"][0]
        assert main["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert main["startupProbe"]["httpGet"]["path"] == "/health"
        assert main["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        assert pod["terminationGracePeriodSeconds"] > 5
        is_router = child["metadata"]["labels"][LABEL_ROLE] == "router"
        assert pod["automountServiceAccountToken"] is (
            is_router and "--discovery" in main["args"] and "kubernetes" in main["args"]
        )


def test_each_role_drains_for_its_own_drain_seconds_inside_its_grace_period() -> None:
    raw = body()
    raw["spec"]["prefill"]["drainSeconds"] = 90
    raw["spec"]["decode"]["drainSeconds"] = 12
    spec = parse_spec(raw)
    digest = config_hash(spec)
    revisions = set()
    for role, drain in ((Component.PREFILL, 90), (Component.DECODE, 12)):
        pod = build_engine_deployment(spec, role, digest)["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert args[args.index("--drain-seconds") + 1] == str(drain)
        revisions.add(args[args.index("--revision") + 1])
        # preStop's sleep, then the engine's drain, then a margin before SIGKILL
        assert pod["terminationGracePeriodSeconds"] == 5 + drain + 5
    # One revision for both roles (the router pairs by it); a role's own drainSeconds is not part of it.
    assert len(revisions) == 1 and config_hash(parse_spec(body())) == digest


def test_the_revision_changes_with_the_shared_configuration_and_the_image_only() -> None:
    def revision(raw: dict[str, Any]) -> str:
        spec = parse_spec(raw)
        args = build_engine_deployment(spec, Component.DECODE, config_hash(spec))["spec"]["template"]["spec"][
            "containers"][0]["args"]
        return str(args[args.index("--revision") + 1])

    base = revision(body())
    changed = {"blockSize": body(), "image": body(), "resources": body()}
    changed["blockSize"]["spec"]["engine"]["blockSize"] = 32
    changed["image"]["spec"]["engine"]["image"] = "registry.example/tandem-worker:next"
    changed["resources"]["spec"]["decode"]["resources"] = {"requests": {"cpu": "2"}}
    assert revision(changed["blockSize"]) != base and revision(changed["image"]) != base
    assert revision(changed["resources"]) == base  # rolls decode alone; prefill and decode still pair


def test_prefill_and_decode_cannot_disagree() -> None:
    spec = parse_spec(body())
    prefill, decode = engine_command(spec, Component.PREFILL), engine_command(spec, Component.DECODE)
    shared = shared_engine_args(spec)
    assert prefill[:2] == decode[:2] == ["tandem", "serve"]
    assert prefill[2 : 2 + len(shared)] == decode[2 : 2 + len(shared)] == shared
    pod_ip = ["--kv-host", "$(POD_IP)"]
    assert prefill[2 + len(shared) :] == ["--role", "prefill", *pod_ip]
    assert decode[2 + len(shared) :] == ["--role", "decode", *pod_ip]
    assert shared == [
        "--model",
        "smollm2-135m-instruct",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--dtype",
        "auto",
        "--max-model-len",
        "2048",
        "--block-size",
        "16",
        "--scheduling-policy",
        "priority",
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "2048",
        "--kv-connector",
        "NixlConnector",
        "--kv-side-channel-port",
        "5600",
        "--kv-events-port",
        "5557",
        "--kv-events-host",
        "0.0.0.0",
    ]
    digest = config_hash(spec)
    p_dep = build_engine_deployment(spec, Component.PREFILL, digest)
    d_dep = build_engine_deployment(spec, Component.DECODE, digest)
    key = "serving.tandem.dev/config-hash"
    assert p_dep["spec"]["template"]["metadata"]["annotations"][key] == digest
    assert d_dep["spec"]["template"]["metadata"]["annotations"][key] == digest
    changed = parse_spec(body(engine={"blockSize": 32}))
    assert config_hash(changed) != digest


def test_startup_budget_and_colocated_role() -> None:
    spec = parse_spec(body("colocated", decode={"startup": {"maxSeconds": 7200}, "replicas": 2}))
    dep = build_engine_deployment(spec, Component.DECODE, "h")
    probe = dep["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == 7200
    assert dep["spec"]["progressDeadlineSeconds"] > 7200
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--role") + 1] == "both" and "--kv-side-channel-port" not in args
    assert "--kv-host" not in args and "--kv-connector" not in args


@pytest.mark.parametrize("role", [Component.PREFILL, Component.DECODE])
def test_disaggregated_engines_advertise_their_pod_ip_for_kv_transfer(role: Component) -> None:
    (container,) = build_engine_deployment(parse_spec(body()), role, "h")["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--kv-host") + 1] == "$(POD_IP)"
    # $(POD_IP) expands only if the variable is defined in the container's env.
    (pod_ip,) = [e for e in container["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_router_command_lines() -> None:
    spec = parse_spec(body())
    assert router_command(spec) == [
        "tandem",
        "route",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--decode",
        "http://smollm2-pd-decode.team-a.svc:8000",
        "--prefill",
        "http://smollm2-pd-prefill.team-a.svc:8000",
        "--policy",
        "prefix-aware",
        "--discovery",
        "kubernetes",
        "--namespace",
        "team-a",
        "--selector",
        f"{LABEL_ISVC}=smollm2-pd",
    ]
    static = parse_spec(body("colocated", router={"discovery": "Static"}))
    assert router_command(static)[-2:] == ["--discovery", "static"] and "--prefill" not in router_command(static)


def test_router_auth_takes_the_key_from_the_secret_the_spec_names() -> None:
    """`router.auth`: the router container gets TANDEM_API_KEY from the named Secret (key `api-key` by
    default) through the kubelet, the variable `tandem route` reads its --api-key from; without it, no key."""
    from tandem_router.cli import API_KEY_ENV

    def env(spec: dict[str, Any]) -> list[dict[str, Any]]:
        (container,) = build_router_deployment(parse_spec(spec))["spec"]["template"]["spec"]["containers"]
        return [e for e in container["env"] if e["name"] == API_KEY_ENV]

    assert env(body()) == []
    assert env(body(router={"auth": {"secretName": "keys"}})) == [
        {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api-key"}}}]
    assert env(body(router={"auth": {"secretName": "keys", "secretKey": "k"}}))[0]["valueFrom"]["secretKeyRef"] == {
        "name": "keys", "key": "k"}
    with pytest.raises(SpecError, match="auth.secretName"):
        parse_spec(body(router={"auth": {"secretKey": "k"}}))


def test_model_sources() -> None:
    pvc = parse_spec(VARIANTS["pvc-overrides"])
    dep = build_engine_deployment(pvc, Component.DECODE, "h")
    pod = dep["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/llama/3.1-8b"
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    hf = parse_spec(VARIANTS["hf-static-router"])
    pod = build_engine_deployment(hf, Component.PREFILL, "h")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["args"][:2] == ["download", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert init["args"][-2:] == ["--revision", "12fd25f"]
    assert any(e["name"] == "HF_TOKEN" for e in init["env"])


def test_pod_template_overrides_merge_but_keep_selector_labels() -> None:
    dep = build_engine_deployment(parse_spec(VARIANTS["pvc-overrides"]), Component.DECODE, "h")
    tmpl = dep["spec"]["template"]
    assert tmpl["metadata"]["labels"]["team"] == "a"
    assert tmpl["metadata"]["labels"][LABEL_ROLE] == "decode"
    assert tmpl["spec"]["nodeSelector"] == {"gpu": "h200"}
    (container,) = tmpl["spec"]["containers"]
    assert container["name"] == "engine" and container["args"][0] == "serve"
    assert {"name": "X", "value": "1"} in container["env"] and any(e["name"] == "POD_IP" for e in container["env"])
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "1", "memory": "40Gi"}}  # as the server says
    assert merge_overrides({"a": [1, 2]}, {"a": [3]}) == {"a": [3]}


def test_services_and_rbac() -> None:
    spec = parse_spec(body())
    svc = build_engine_service(spec, Component.PREFILL)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
    assert {p["name"] for p in svc["spec"]["ports"]} == {"http", "kv-side", "kv-events", "kv-replay"}
    assert svc["metadata"]["labels"][LABEL_ROLE] == "prefill"  # EndpointSlices inherit these
    role = build_router_role(spec)
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    config = next(c for c in build_children(spec) if c["kind"] == "ConfigMap")
    doc = json.loads(config["data"]["engine-config.json"])
    assert doc["engine"]["blockSize"] == 16 and doc["mode"] == "disaggregated"
    assert doc["args"]["prefill"] == engine_command(spec, Component.PREFILL)


def test_spec_errors_are_collected() -> None:
    bad = body(
        decode={"replicas": -2},
        router={"policy": "Random", "replicas": "x"},
        engine={"extraArgs": ["--block-size", "8"], "blockSize": 12},
    )
    bad["spec"].pop("kvTransfer")
    with pytest.raises(SpecError) as info:
        parse_spec(bad)
    text = str(info.value)
    for needle in (
        "spec.decode.replicas",
        "spec.router.policy",
        "spec.router.replicas",
        "spec.engine.extraArgs",
        "spec.engine.blockSize",
        "spec.kvTransfer",
    ):
        assert needle in text
    with pytest.raises(SpecError):
        parse_spec({"metadata": {"name": "x"}})


@pytest.mark.parametrize("role", [Component.PREFILL, Component.DECODE])
def test_engine_pods_pass_their_cpu_limit_to_the_engine(role: Component) -> None:
    """os.cpu_count() in a pod sees the node: the engine reads its CPU limit from the downward API."""
    from tandem_engine.cpu_budget import CPU_LIMIT_ENV, env_limit

    (container,) = build_engine_deployment(parse_spec(body()), role, "h")["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in container["env"] if e["name"] == CPU_LIMIT_ENV]
    ref = env["valueFrom"]["resourceFieldRef"]
    assert ref == {"containerName": container["name"], "resource": "limits.cpu", "divisor": "1m"}
    # What the kubelet writes for `limits: {cpu: 1500m}` with that divisor, read as the engine reads it.
    limit = env_limit({CPU_LIMIT_ENV: "1500"})
    assert limit is not None and limit.cpus == 1.5


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANTS.keys())
def test_engine_pods_start_from_the_image_cache(variant: str) -> None:
    """No volume shadows the model cache and kernel baked into the image (its TANDEM_CACHE_DIR,
    read-only); whatever the engine or a model download may write goes to the /tmp emptyDir."""
    for child in rendered(VARIANTS[variant]):
        if child["kind"] != "Deployment" or child["metadata"]["labels"][LABEL_ROLE] == "router":
            continue
        pod = child["spec"]["template"]["spec"]
        assert {v["name"] for v in pod["volumes"] if "emptyDir" in v} <= {"tmp", "dshm", "model"}
        for container in pod["containers"] + pod.get("initContainers", []):
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert "TANDEM_CACHE_DIR" not in env
            for name in ("HOME", "HF_HOME", "XDG_CACHE_HOME"):
                assert env.get(name, "/tmp").startswith("/tmp"), (container["name"], name)
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert "/tmp" in mounts and not mounts["/tmp"].get("readOnly")
            assert not [p for p in mounts if p.startswith("/opt/tandem") or p == "/cache"]


def _policy(obj: dict[str, Any], operator_namespace: str | None = "tandem-system") -> dict[str, Any]:
    children = build_children(parse_spec(obj), operator_namespace)
    (policy,) = [c for c in children if c["kind"] == "NetworkPolicy"]
    return policy


def test_the_engines_admit_only_their_own_service_and_the_operators_scrapes() -> None:
    """Every engine port is open to this service's router and engines only (any port: UCX's data connections
    are ephemeral); the HTTP port also to the operator's namespace and the peers metricsFrom names; the
    router is not selected (it serves clients); another InferenceService's pods are not admitted."""
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    policy = _policy(body(networkPolicy={"metricsFrom": [monitoring]}))
    assert policy["metadata"]["name"] == "smollm2-pd-engines"
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]  # egress (DNS, the API server, model downloads) untouched
    selector = spec["podSelector"]
    assert selector["matchLabels"] == {LABEL_ISVC: "smollm2-pd"}
    assert selector["matchExpressions"] == [{"key": LABEL_ROLE, "operator": "In", "values": ["prefill", "decode"]}]
    own, scrapes = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {LABEL_ISVC: "smollm2-pd"}}}]}
    assert scrapes["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert scrapes["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "tandem-system"}}}, monitoring]
    colocated = _policy(body("colocated"), operator_namespace=None)["spec"]
    assert colocated["podSelector"]["matchExpressions"][0]["values"] == ["decode"]
    assert colocated["ingress"] == [{"from": [{"podSelector": {"matchLabels": {LABEL_ISVC: "smollm2"}}}]}]
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(policy, version, strict=True)


def test_network_policy_can_be_turned_off_and_bad_peers_are_refused() -> None:
    kinds = {c["kind"] for c in build_children(parse_spec(body(networkPolicy={"enabled": False})))}
    assert "NetworkPolicy" not in kinds and "Deployment" in kinds
    for peers in ({"podSelector": {}}, [{}], [{"nodeSelector": {}}]):
        with pytest.raises(SpecError, match=r"spec.networkPolicy.metricsFrom"):
            parse_spec(body(networkPolicy={"metricsFrom": peers}))


def test_drain_first_rolls_engines_without_a_surge_pod_and_the_router_holds_meanwhile() -> None:
    """DrainFirst: each engine role's old pod leaves before its replacement starts (no extra pod), while the
    router (always Surge: it is one small pod) holds requests whenever no decode engine is Ready, up to
    rollout.holdSeconds; the default is Surge, and its router holds nothing."""
    def strategies(obj: dict[str, Any]) -> dict[str, Any]:
        return {c["metadata"]["name"]: c["spec"]["strategy"]["rollingUpdate"] for c in rendered(obj)
                if c["kind"] == "Deployment"}

    surge, drain = {"maxSurge": 1, "maxUnavailable": 0}, {"maxSurge": 0, "maxUnavailable": 1}
    assert strategies(body()) == {"smollm2-pd-prefill": surge, "smollm2-pd-decode": surge,
                                  "smollm2-pd-router": surge}
    obj = body(rollout={"strategy": "DrainFirst", "holdSeconds": 90})
    assert strategies(obj) == {"smollm2-pd-prefill": drain, "smollm2-pd-decode": drain,
                               "smollm2-pd-router": surge}
    args = router_command(parse_spec(obj))
    assert args[args.index("--cold-start-timeout") + 1] == "90"
    assert "--cold-start-timeout" not in router_command(parse_spec(body()))
    with pytest.raises(SpecError, match=r"spec.rollout.strategy"):
        parse_spec(body(rollout={"strategy": "Recreate"}))
