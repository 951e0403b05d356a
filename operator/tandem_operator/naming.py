"""Deterministic child names and the labels every child and pod carries (docs/crd-reference.md, "Children")."""

from __future__ import annotations

from enum import StrEnum

from tandem_operator import GROUP

LABEL_ISVC = f"{GROUP}/inferenceservice"
LABEL_ROLE = f"{GROUP}/role"
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
MANAGED_BY = "tandem-operator"

# A name this long keeps every child name (longest suffix: "-engine-config") within 63 characters.
MAX_NAME_LENGTH = 40


class Component(StrEnum):
    """One of an InferenceService's workloads (a Deployment and its Service); the value is the name suffix
    and the `role` / `app.kubernetes.io/component` label of its children."""

    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


def engine_components(disaggregated: bool) -> tuple[Component, ...]:
    """The engine workloads a service runs: decode alone (colocated, `--role both`) or prefill and decode."""
    return (Component.PREFILL, Component.DECODE) if disaggregated else (Component.DECODE,)


def workload_name(isvc: str, role: Component) -> str:
    """Name of a component's Deployment; its Service has the same name."""
    return f"{isvc}-{role.value}"


def config_name(isvc: str) -> str:
    return f"{isvc}-engine-config"


def router_account_name(isvc: str) -> str:
    """ServiceAccount, Role and RoleBinding of the router share this name."""
    return f"{isvc}-router"


def network_policy_name(isvc: str) -> str:
    """The NetworkPolicy that admits only the service's own pods (and its scrapers) to its engines."""
    return f"{isvc}-engines"


def selector_labels(isvc: str, role: Component) -> dict[str, str]:
    """The labels a component's Deployment and Service select pods by (immutable once created)."""
    return {LABEL_ISVC: isvc, LABEL_ROLE: role.value}


def child_labels(isvc: str, role: Component | None) -> dict[str, str]:
    labels = {
        LABEL_ISVC: isvc,
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": isvc,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }
    if role is not None:
        labels[LABEL_ROLE] = role.value
        labels["app.kubernetes.io/component"] = role.value
    return labels


def service_host(isvc: str, namespace: str, role: Component) -> str:
    return f"{workload_name(isvc, role)}.{namespace}.svc"
