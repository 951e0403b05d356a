"""Pure builders of the non-workload children: engine ConfigMap, Services, router RBAC; and the full set."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem_operator.args import config_hash, config_json, engine_ports
from tandem_operator.naming import (
    LABEL_ISVC,
    LABEL_ROLE,
    Component,
    config_name,
    engine_components,
    network_policy_name,
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


def build_engine_network_policy(spec: InferenceServiceSpec, operator_namespace: str | None) -> dict[str, Any]:
    """Who may connect to the engine pods. Every port (HTTP, KV side channel, NIXL/UCX, KV events, replay):
    only this service's own router and engines; UCX opens its data connections on ephemeral ports, so no
    port list can name them. The HTTP port, also: the operator's namespace (the planner and the KV check
    scrape the engines' /metrics) and `networkPolicy.metricsFrom`. The kubelet's probes come from the node,
    which policies do not govern. Ingress only: DNS, the API server and model downloads stay reachable."""
    roles = [role.value for role in engine_components(spec.disaggregated)]
    scrapers: list[dict[str, Any]] = []
    if operator_namespace:
        scrapers.append({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}}})
    scrapers += [dict(peer) for peer in spec.network_policy.metrics_from]
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": {LABEL_ISVC: spec.name}}}]}]
    if scrapers:
        ingress.append({"from": scrapers, "ports": [{"protocol": "TCP", "port": spec.engine.port}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_meta(spec, network_policy_name(spec.name), None),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_ISVC: spec.name},
                            "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": roles}]},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def build_children(spec: InferenceServiceSpec, operator_namespace: str | None = None) -> list[dict[str, Any]]:
    """Every child the service should have, in creation order (config, RBAC and policy before workloads).
    `operator_namespace`: where the operator runs (its scrapes pass the engines' NetworkPolicy)."""
    digest = config_hash(spec)
    roles = engine_components(spec.disaggregated)
    children: list[dict[str, Any]] = [build_config_map(spec)]
    if spec.network_policy.enabled:
        children.append(build_engine_network_policy(spec, operator_namespace))
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
