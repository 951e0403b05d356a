"""Pure builders of the engine and router Deployments (no API calls, no kopf)."""

from __future__ import annotations

import copy
import math
from typing import Any

from tandem_operator.args import MODEL_DIR, engine_command, engine_ports, engine_revision, router_command
from tandem_operator.naming import (
    ANNOTATION_CONFIG_HASH,
    Component,
    child_labels,
    config_name,
    router_account_name,
    selector_labels,
    workload_name,
)
from tandem_operator.spec import InferenceServiceSpec, RoleSpec, RouterSpec

PRESTOP_SECONDS = 5  # long enough for endpoint removal to reach the router before SIGTERM
RUN_AS = 10001
ENGINE_CONTAINER = "engine"
# The engine's env var for its CPU limit in millicores (tandem_engine.cpu_budget.CPU_LIMIT_ENV; the operator
# never imports the engine, a test checks the two agree).
CPU_LIMIT_ENV = "TANDEM_CPU_LIMIT_MILLICORES"
ROUTER_CONTAINER = "router"


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }


def http_probe(port_name: str, period: int, failures: int, timeout: int = 3) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": port_name},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
        "successThreshold": 1,
    }


def prestop_drain() -> dict[str, Any]:
    return {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}}


def merge_overrides(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Merge a partial pod template into ours: maps recursively, lists of named items by name."""
    result = copy.deepcopy(base)
    for key, value in override.items():
        current = result.get(key)
        if isinstance(current, dict) and isinstance(value, dict):
            result[key] = merge_overrides(current, value)
        elif isinstance(current, list) and isinstance(value, list) and _named(current) and _named(value):
            merged = {item["name"]: item for item in current}
            for item in value:
                merged[item["name"]] = merge_overrides(merged.get(item["name"], {}), item)
            result[key] = list(merged.values())
        else:
            result[key] = copy.deepcopy(value)
    return result


def _named(items: list[Any]) -> bool:
    return all(isinstance(item, dict) and isinstance(item.get("name"), str) for item in items)


def _engine_volumes(spec: InferenceServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # No cache volume: the image carries the model cache and the CPU attention kernel, read-only; what it
    # lacks (another GGUF model's cache) the engine builds under /tmp (docs/operations.md).
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "engine-config", "configMap": {"name": config_name(spec.name)}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "engine-config", "mountPath": "/etc/tandem", "readOnly": True},
    ]
    uri = spec.model.uri
    if uri.startswith("pvc://"):
        claim = uri.removeprefix("pvc://").partition("/")[0]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    elif uri.startswith("hf://"):
        volumes.append({"name": "model", "emptyDir": {}})
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    return volumes, mounts


def _engine_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/huggingface"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "TANDEM_SERVED_MODEL_NAME", "value": spec.model.served_name},
        # The engine sizes its thread pool from this when the pod's cgroup quota is not visible to it
        # (os.cpu_count() sees the node). Without a CPU limit Kubernetes passes the node's allocatable.
        {"name": CPU_LIMIT_ENV, "valueFrom": {"resourceFieldRef": {
            "containerName": ENGINE_CONTAINER, "resource": "limits.cpu", "divisor": "1m"}}},
    ]
    kv = spec.kv_transfer
    if spec.disaggregated and kv is not None:
        if kv.ucx_transports:
            env.append({"name": "UCX_TLS", "value": kv.ucx_transports})
        if kv.ucx_net_devices:
            env.append({"name": "UCX_NET_DEVICES", "value": kv.ucx_net_devices})
    env.extend(copy.deepcopy(list(spec.engine.env)))
    return env


def _model_download(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """An init container that fetches an hf:// model into the pod before the engine starts."""
    if not spec.model.uri.startswith("hf://"):
        return []
    repo = spec.model.uri.removeprefix("hf://")
    args = ["download", repo, "--local-dir", f"{MODEL_DIR}/{repo}"]
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/huggingface"},
    ]
    if spec.model.auth_secret_name:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": spec.model.auth_secret_name, "key": "token"}},
            }
        )
    return [
        {
            "name": "model-download",
            "image": spec.engine.image,
            "imagePullPolicy": spec.engine.image_pull_policy,
            "command": ["hf"],
            "args": args,
            "env": env,
            "volumeMounts": [
                {"name": "model", "mountPath": MODEL_DIR},
                {"name": "tmp", "mountPath": "/tmp"},
            ],
            "securityContext": container_security_context(),
        }
    ]


def child_meta(spec: InferenceServiceSpec, name: str, role: Component | None) -> dict[str, Any]:
    """The metadata of every child: its name in the service's namespace, and the service's labels."""
    return {"name": name, "namespace": spec.namespace, "labels": child_labels(spec.name, role)}


def _server_container(
    spec: InferenceServiceSpec,
    name: str,
    image: str,
    command: list[str],
    *,
    ports: list[dict[str, Any]],
    env: list[dict[str, Any]],
    mounts: list[dict[str, Any]],
    startup_probe: dict[str, Any],
    liveness_failures: int,
    resources: dict[str, Any],
) -> dict[str, Any]:
    """An HTTP server container: started and ready per /health, alive while its port accepts, drained by
    preStop before SIGTERM."""
    container: dict[str, Any] = {
        "name": name,
        "image": image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": command[:1],
        "args": command[1:],
        "ports": ports,
        "env": env,
        "volumeMounts": mounts,
        "startupProbe": startup_probe,
        "readinessProbe": http_probe("http", period=5, failures=2),
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": 10,
            "failureThreshold": liveness_failures,
            "timeoutSeconds": 3,
        },
        "lifecycle": prestop_drain(),
        "securityContext": container_security_context(),
    }
    if resources:
        container["resources"] = copy.deepcopy(resources)
    return container


def _pod(
    spec: InferenceServiceSpec,
    role: Component,
    container: dict[str, Any],
    volumes: list[dict[str, Any]],
    *,
    grace_s: int,
    account: str | None = None,
    api_token: bool = False,
) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {} if account is None else {"serviceAccountName": account}
    pod_spec |= {
        "automountServiceAccountToken": api_token,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": grace_s,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": volumes,
    }
    return {"metadata": {"labels": child_labels(spec.name, role)}, "spec": pod_spec}


def rolling_update(spec: InferenceServiceSpec, role: Component) -> dict[str, int]:
    """How a role's pods are replaced. Surge (the default, and always the router): a new pod is Ready before an
    old one leaves. DrainFirst: an old engine pod drains and goes first, so the roll needs no room for an extra
    pod; meanwhile the router pairs within a revision and holds requests while no decode engine is Ready."""
    if role is not Component.ROUTER and spec.rollout.strategy == "DrainFirst":
        return {"maxSurge": 0, "maxUnavailable": 1}
    return {"maxSurge": 1, "maxUnavailable": 0}


def _deployment(
    spec: InferenceServiceSpec, role: Component, of: RoleSpec | RouterSpec, pod: dict[str, Any], progress_deadline: int
) -> dict[str, Any]:
    """The Deployment of `of.replicas` pods, with the user's `of.pod_template` merged into `pod`."""
    pod = merge_overrides(pod, of.pod_template)
    # Overrides may add labels but never change the ones the selector and the router rely on.
    pod.setdefault("metadata", {}).setdefault("labels", {}).update(child_labels(spec.name, role))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_meta(spec, workload_name(spec.name, role), role),
        "spec": {
            "replicas": of.replicas,
            "selector": {"matchLabels": selector_labels(spec.name, role)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling_update(spec, role)},
            "revisionHistoryLimit": 5,
            "progressDeadlineSeconds": progress_deadline,
            "template": pod,
        },
    }


def build_engine_deployment(spec: InferenceServiceSpec, role: Component, config_hash: str) -> dict[str, Any]:
    """The Deployment of the prefill or decode engines (decode runs `--role both` when colocated)."""
    role_spec: RoleSpec = spec.prefill if role is Component.PREFILL else spec.decode
    volumes, mounts = _engine_volumes(spec)
    ports = [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in engine_ports(spec).named()]
    # Per pod, outside the shared configuration (a role's drainSeconds rolls only that role): the revision
    # the router pairs by, and how long the engine drains after SIGTERM, inside the grace period below.
    command = engine_command(spec, role, ["--revision", engine_revision(spec, config_hash),
                                          "--drain-seconds", str(role_spec.drain_seconds)])
    container = _server_container(
        spec,
        ENGINE_CONTAINER,
        spec.engine.image,
        command,
        ports=ports,
        env=_engine_env(spec),
        mounts=mounts,
        # Probed every 2 s while it starts: a 10 s period left a Ready engine unused for up to 10 s, which
        # every scale-up and every scale from zero would wait out.
        startup_probe=http_probe("http", period=2, failures=math.ceil(role_spec.startup_seconds / 2), timeout=5),
        liveness_failures=6,
        resources=role_spec.resources,
    )
    pod = _pod(spec, role, container, volumes, grace_s=PRESTOP_SECONDS + role_spec.drain_seconds + 5)
    pod["metadata"]["annotations"] = {ANNOTATION_CONFIG_HASH: config_hash}
    init = _model_download(spec)
    if init:
        pod["spec"]["initContainers"] = init
    return _deployment(spec, role, role_spec, pod, progress_deadline=role_spec.startup_seconds + 600)


API_KEY_ENV = "TANDEM_API_KEY"  # what `tandem route` reads its --api-key from (tandem_router/cli.py)


def _api_key_env(r: RouterSpec) -> list[dict[str, Any]]:
    """`TANDEM_API_KEY` from the Secret `spec.router.auth` names (the kubelet reads it: the operator never
    does, and its RBAC grants no Secret access)."""
    if r.auth_secret is None:
        return []
    name, key = r.auth_secret
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}]


def build_router_deployment(spec: InferenceServiceSpec) -> dict[str, Any]:
    r = spec.router
    container = _server_container(
        spec,
        ROUTER_CONTAINER,
        r.image,
        router_command(spec),
        ports=[{"name": "http", "containerPort": r.port, "protocol": "TCP"}],
        env=[{"name": "HOME", "value": "/tmp"}, *_api_key_env(r)],
        mounts=[{"name": "tmp", "mountPath": "/tmp"}],
        startup_probe=http_probe("http", period=2, failures=60),
        liveness_failures=3,
        resources=r.resources,
    )
    pod = _pod(
        spec,
        Component.ROUTER,
        container,
        [{"name": "tmp", "emptyDir": {}}],
        grace_s=PRESTOP_SECONDS + 30,
        account=router_account_name(spec.name),
        api_token=r.discovery == "Kubernetes",
    )
    return _deployment(spec, Component.ROUTER, r, pod, progress_deadline=600)
