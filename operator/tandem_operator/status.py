"""Status of an `InferenceService`, derived from its children (pure functions).

Conditions follow the Kubernetes API conventions: `type`, `status`, a CamelCase `reason`, `message`,
`lastTransitionTime` (kept while the status does not change) and `observedGeneration`; `Ready`
summarises the per-role conditions. There is no `phase`.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem_operator.naming import Component, selector_labels
from tandem_operator.resources import router_url
from tandem_operator.spec import InferenceServiceSpec

CONDITION_TYPES = ("PrefillReady", "DecodeReady", "RouterReady", "Ready")
# Written by its own loop from the engines' counters (kv_verification.py); reconciles keep it as it is.
KV_CONDITION = "KVTransferVerified"
ROLE_CONDITION = {Component.PREFILL: "PrefillReady", Component.DECODE: "DecodeReady", Component.ROUTER: "RouterReady"}


@dataclass(frozen=True)
class RoleState:
    desired: int
    ready: int
    updated: int
    ok: bool
    reason: str
    message: str

    def as_status(self) -> dict[str, Any]:
        return {
            "replicas": self.desired,
            "readyReplicas": self.ready,
            "updatedReplicas": self.updated,
            "ready": f"{self.ready}/{self.desired}",
        }


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def role_state(deployment: dict[str, Any] | None, desired: int) -> RoleState:
    """Judge one role's Deployment the way `kubectl rollout status` does."""
    if deployment is None:
        return RoleState(desired, 0, 0, False, "DeploymentMissing", "the Deployment does not exist yet")
    meta = deployment.get("metadata") or {}
    st = deployment.get("status") or {}
    ready = int(st.get("readyReplicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    total = int(st.get("replicas") or 0)
    spec_replicas = int((deployment.get("spec") or {}).get("replicas", desired))
    for cond in st.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return RoleState(
                desired,
                ready,
                updated,
                False,
                "ProgressDeadlineExceeded",
                str(cond.get("message") or "the rollout exceeded its progress deadline"),
            )
    if int(st.get("observedGeneration") or 0) < int(meta.get("generation") or 1) or spec_replicas != desired:
        return RoleState(
            desired,
            ready,
            updated,
            False,
            "RolloutPending",
            "the Deployment controller has not observed the latest spec",
        )
    if desired == 0:
        return RoleState(desired, ready, updated, False, "ScaledToZero", "the role has 0 replicas")
    if updated < desired or total > updated:
        return RoleState(
            desired,
            ready,
            updated,
            False,
            "RolloutInProgress",
            f"{updated}/{desired} replicas updated, {total} in total",
        )
    if ready < desired:
        return RoleState(desired, ready, updated, False, "PodsNotReady", f"{ready}/{desired} replicas ready")
    return RoleState(desired, ready, updated, True, "ReplicasReady", f"{ready}/{desired} replicas ready")


def _condition(
    ctype: str,
    ok: bool | None,
    reason: str,
    message: str,
    generation: int,
    previous: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    old = previous.get(ctype)
    changed = old is None or old.get("status") != status
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now() if changed else old.get("lastTransitionTime", now()),  # type: ignore[union-attr]
        "observedGeneration": generation,
    }


def kv_condition(ok: bool | None, reason: str, message: str, generation: int,
                 old: Mapping[str, Any] | None) -> dict[str, Any]:
    """The KVTransferVerified condition, its transition time kept while its status does not change."""
    return _condition(KV_CONDITION, ok, reason, message, generation, {KV_CONDITION: dict(old)} if old else {})


def _previous(current_status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        c["type"]: c for c in current_status.get("conditions") or [] if isinstance(c, dict) and "type" in c
    }


def compute_status(
    spec: InferenceServiceSpec,
    generation: int,
    deployments: dict[Component, dict[str, Any] | None],
    current_status: dict[str, Any],
) -> dict[str, Any]:
    """The full status for a valid spec, given the observed role Deployments."""
    previous = _previous(current_status)
    desired = {
        Component.PREFILL: spec.prefill.replicas,
        Component.DECODE: spec.decode.replicas,
        Component.ROUTER: spec.router.replicas,
    }
    states: dict[Component, RoleState] = {}
    for role in (Component.PREFILL, Component.DECODE, Component.ROUTER):
        if role is Component.PREFILL and not spec.disaggregated:
            continue
        states[role] = role_state(deployments.get(role), desired[role])
    conditions = []
    for role, ctype in ROLE_CONDITION.items():
        if role in states:
            s = states[role]
            conditions.append(_condition(ctype, s.ok, s.reason, s.message, generation, previous))
        else:
            conditions.append(
                _condition(
                    ctype,
                    True,
                    "Disabled",
                    "prefill is disabled: engines serve colocated",
                    generation,
                    previous,
                )
            )
    not_ready = [f"{role.value}: {s.reason}" for role, s in states.items() if not s.ok]
    if not_ready:
        conditions.append(
            _condition("Ready", False, "RolesNotReady", "; ".join(not_ready), generation, previous)
        )
    else:
        conditions.append(
            _condition(
                "Ready",
                True,
                "AllRolesReady",
                "prefill, decode and router are ready"
                if spec.disaggregated
                else "decode and router are ready",
                generation,
                previous,
            )
        )
    if spec.disaggregated:
        conditions.append(previous.get(KV_CONDITION) or _condition(
            KV_CONDITION, None, "AwaitingTransfers", "no long prompt has gone through a prefill engine yet",
            generation, previous))
    roles = {role: {**s.as_status(), "selector": _selector(spec.name, role)} for role, s in states.items()}
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": conditions,
        "prefill": roles.get(Component.PREFILL),
        "decode": roles[Component.DECODE],
        "router": roles[Component.ROUTER],
        "endpoint": {"url": router_url(spec), "model": spec.model.served_name},
    }
    return status


def _selector(isvc: str, role: Component) -> str:
    """The role's pods as a label selector string (what the scale subresource hands to HPA and KEDA)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(isvc, role).items()))


def invalid_status(problems: list[str], generation: int, current_status: dict[str, Any]) -> dict[str, Any]:
    """Status for a spec the operator refuses: `Ready` is False with reason InvalidSpec; children are kept."""
    previous = _previous(current_status)
    message = "; ".join(problems)
    conditions = [c for t, c in previous.items() if t in (*ROLE_CONDITION.values(), KV_CONDITION)]
    conditions.append(_condition("Ready", False, "InvalidSpec", message, generation, previous))
    return {"observedGeneration": generation, "conditions": conditions}


def same_status(current: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Whether writing `desired` would change anything (timestamps of unchanged conditions are kept)."""
    for key, value in desired.items():
        if value is None:
            if current.get(key) is not None:
                return False
        elif current.get(key) != value:
            return False
    return True
