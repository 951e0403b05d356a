"""Pure builders of the non-workload children: engine ConfigMap, Services, router RBAC; and the full set."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem_operator.args import config_hash, config_json, engine_ports
from tandem_operator.naming import (
    LABEL_ISVC,
    Component,
    config_name,
    engine_components,
    router_account_name,
    selector_labels,
    workload_name,
)
from tandem_operator.spec import InferenceServiceSpec
from tandem_operator.workloads import build_engine_deployment, build_router_deployment, child_meta


def build_config_map(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The rendered engine config shared by prefill and decode (mounted at /etc/tandem)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_meta(spec, config_name(spec.name), None),
        "data": {"engine-config.json": config_json(spec), "config-hash": config_hash(spec)},
    }


def build_engine_service(spec: InferenceServiceSpec, role: Component) -> dict[str, Any]:
    """A headless Service per engine role; its EndpointSlices inherit the labels the router selects on and
    list every engine port (HTTP, KV side channel, KV events and replay) by name."""
    ports = [
        {"name": name, "port": port, "targetPort": name, "protocol": "TCP"} for name, port in engine_ports(spec).named()
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(spec, workload_name(spec.name, role), role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector_labels(spec.name, role),
            "ports": ports,
        },
    }


def build_router_service(spec: InferenceServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(spec, workload_name(spec.name, Component.ROUTER), Component.ROUTER),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(spec.name, Component.ROUTER),
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def router_url(spec: InferenceServiceSpec) -> str:
    return f"http://{workload_name(spec.name, Component.ROUTER)}.{spec.namespace}.svc"


def build_router_service_account(spec: InferenceServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": child_meta(spec, router_account_name(spec.name), Component.ROUTER),
        "automountServiceAccountToken": False,
    }


def build_router_role(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The router may only read EndpointSlices in its own namespace."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": child_meta(spec, router_account_name(spec.name), Component.ROUTER),
        "rules": [
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["get", "list", "watch"],
            }
        ],
    }


def build_router_role_binding(spec: InferenceServiceSpec) -> dict[str, Any]:
    name = router_account_name(spec.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": child_meta(spec, name, Component.ROUTER),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": spec.namespace}],
    }


def build_children(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """Every child the service should have, in creation order (config and RBAC before workloads)."""
    digest = config_hash(spec)
    roles = engine_components(spec.disaggregated)
    children: list[dict[str, Any]] = [build_config_map(spec)]
    if spec.router.discovery == "Kubernetes":
        children += [
            build_router_service_account(spec),
            build_router_role(spec),
            build_router_role_binding(spec),
        ]
    else:
        # Static discovery needs no API access, but the pod still names its ServiceAccount.
        children.append(build_router_service_account(spec))
    children += [build_engine_service(spec, role) for role in roles]
    children.append(build_router_service(spec))
    children += [build_engine_deployment(spec, role, digest) for role in roles]
    children.append(build_router_deployment(spec))
    return children


def child_key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def owner_of(obj: Mapping[str, Any]) -> str | None:
    """Name of the InferenceService a child belongs to, from its label."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    value = labels.get(LABEL_ISVC)
    return value if isinstance(value, str) else None
