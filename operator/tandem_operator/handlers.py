"""kopf handlers: every InferenceService event and every event of one of its children runs one reconcile.

The children are kept in kopf indexes (in memory, filled by watches), so noticing a deleted or
hand-edited child, or a Deployment whose pods became ready, costs no API reads. A reconcile writes
only what differs from the spec, so events caused by its own writes settle after one pass.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from tandem_operator import GROUP, KIND, PLURAL, VERSION
from tandem_operator.autoscaling.loop import Autoscaler
from tandem_operator.kube import KubeClient
from tandem_operator.kv_verification import Verifier
from tandem_operator.naming import LABEL_ISVC
from tandem_operator.reconcile import ChildKey, Reconciler
from tandem_operator.resources import owner_of

logger = logging.getLogger(__name__)

# (group, version, plural, kind) of every kind of child.
CHILD_RESOURCES = (
    ("", "v1", "configmaps", "ConfigMap"),
    ("", "v1", "services", "Service"),
    ("", "v1", "serviceaccounts", "ServiceAccount"),
    ("apps", "v1", "deployments", "Deployment"),
    ("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    ("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
)
ISVC_INDEX = "tandem_isvcs"
OPERATOR_NAMESPACE_ENV = "TANDEM_OPERATOR_NAMESPACE"
OwnerKey = tuple[str | None, str]


def _index_id(plural: str) -> str:
    return f"tandem_children_{plural}"


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    if os.environ.get("TANDEM_OPERATOR_NO_SCANNING") == "1":
        # Namespace-scoped RBAC cannot list CRDs or namespaces cluster-wide.
        settings.scanning.disabled = True
    client = await KubeClient.connect()
    memo["client"] = client
    # The chart sets it from the downward API; an operator outside the cluster has none, and its scrapes of
    # the engines then need `networkPolicy.metricsFrom` (docs/operations.md, "Network policy").
    memo["reconciler"] = Reconciler(client, operator_namespace=os.environ.get(OPERATOR_NAMESPACE_ENV) or None)
    logger.info("[startup] tandem operator ready")


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    client = memo.get("client")
    if isinstance(client, KubeClient):
        await client.close()


@kopf.index(GROUP, VERSION, PLURAL, id=ISVC_INDEX)
def index_isvc(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[OwnerKey, dict[str, Any]]:
    return {(namespace, name): dict(body)}


def _index_child(kind: str) -> Any:
    def index(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[OwnerKey, Any] | None:
        owner = owner_of(body)
        if owner is None:
            return None
        # kopf builds a new body for every event and never changes it: a shallow copy is enough.
        return {(namespace, owner): ((kind, name), dict(body))}

    return index


for _group, _version, _plural, _kind in CHILD_RESOURCES:
    kopf.index(_group, _version, _plural, id=_index_id(_plural), labels={LABEL_ISVC: kopf.PRESENT})(
        _index_child(_kind)
    )


def observed_children(indexes: Mapping[str, Any], namespace: str | None, name: str) -> dict[ChildKey, Any]:
    found: dict[ChildKey, Any] = {}
    for _, _, plural, _ in CHILD_RESOURCES:
        index = indexes.get(_index_id(plural))
        if index is None:
            continue
        for key, child in index.get((namespace, name), []):
            found[key] = child
    return found


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
async def reconcile_isvc(
    body: kopf.Body, namespace: str | None, name: str, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    """Create, update or resume: reconcile now; an invalid spec becomes a condition and an Event."""
    reconciler: Reconciler = memo["reconciler"]
    outcome = await reconciler.reconcile(body, observed_children(kwargs, namespace, name), logger)
    if outcome.problems:
        message = "; ".join(outcome.problems)
        kopf.event(body, type="Warning", reason="InvalidSpec", message=message[:1000])
        raise kopf.PermanentError(f"invalid spec: {message}")
    if outcome.conflicts:
        for conflict in outcome.conflicts:
            kopf.event(body, type="Warning", reason="ChildConflict", message=conflict)
        raise kopf.TemporaryError("; ".join(outcome.conflicts), delay=30)
    if outcome.created or outcome.patched or outcome.deleted:
        logger.info(
            "[reconcile] %s %s: %d created, %d updated, %d deleted",
            KIND,
            name,
            len(outcome.created),
            len(outcome.patched),
            len(outcome.deleted),
        )


def _autoscaled(spec: kopf.Spec, **_: Any) -> bool:
    return spec.get("autoscaling") is not None


@kopf.daemon(GROUP, VERSION, PLURAL, id="autoscaler", when=_autoscaled, cancellation_timeout=10)
async def autoscale(
    body: kopf.Body, namespace: str | None, name: str, stopped: kopf.DaemonStopped, memo: kopf.Memo, **_: Any
) -> None:
    """While `spec.autoscaling` is set: the planner's loop (autoscaling/loop.py); kopf stops it when the field
    goes or the service is deleted, and starts it again after an operator restart."""
    await Autoscaler(memo["client"], str(namespace), name).run(body, stopped)


@kopf.daemon(GROUP, VERSION, PLURAL, id="kv-verifier", cancellation_timeout=10)
async def verify_kv(
    body: kopf.Body, namespace: str | None, name: str, stopped: kopf.DaemonStopped, memo: kopf.Memo, **_: Any
) -> None:
    """status.revisions, and on a P/D service the KVTransferVerified condition, from the router's and the
    engines' counters (kv_verification.py)."""
    await Verifier(memo["client"], str(namespace), name).run(body, stopped)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def forget_deleted(
    type: str | None, namespace: str | None, name: str, memo: kopf.Memo, **_: Any
) -> None:
    if type == "DELETED" and "reconciler" in memo:
        memo["reconciler"].forget(str(namespace), name)


async def on_child_event(
    type: str | None, body: kopf.Body, namespace: str | None, memo: kopf.Memo, **kwargs: Any
) -> None:
    """A child appeared, changed, or went away: reconcile its InferenceService (drift repair, status)."""
    owner = owner_of(body)
    if owner is None or "reconciler" not in memo:
        return
    reconciler: Reconciler = memo["reconciler"]
    if type == "DELETED":
        reconciler.child_gone(str(namespace), owner, (str(body.get("kind")), body.metadata.name or ""))

    def latest() -> tuple[Mapping[str, Any] | None, dict[ChildKey, Any]]:
        # kopf's indexes are live: read them when the reconcile starts, not when the event came.
        parents = list(kwargs.get(ISVC_INDEX, {}).get((namespace, owner), []))
        return (parents[0] if parents else None), observed_children(kwargs, namespace, owner)

    outcome = await reconciler.reconcile_latest(str(namespace), owner, latest, logger)
    if outcome.created or outcome.patched:
        logger.info(
            "[drift] %s/%s after %s of %s/%s: restored %s",
            namespace,
            owner,
            type or "LIST",
            body.get("kind"),
            body.metadata.name,
            outcome.created + outcome.patched,
        )


for _group, _version, _plural, _kind in CHILD_RESOURCES:
    kopf.on.event(_group, _version, _plural, id=f"tandem_child_{_plural}", labels={LABEL_ISVC: kopf.PRESENT})(
        on_child_event
    )
