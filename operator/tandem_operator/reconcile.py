"""Level-based reconciliation: make the children and the status of one InferenceService match its spec.

`Reconciler.reconcile()` is the single entry point, called for create, update and resume of the
InferenceService and for every event of any of its children. It compares the desired children with
the observed ones (kopf's in-memory indexes, so an event costs no API reads) and writes only what
differs, so a reconcile of a settled service makes no writes at all and cannot feed back into itself.

Three-way merge, as `kubectl apply` does: each child carries the manifest last written in an
annotation; a field the operator wrote before but no longer wants is removed with a `null` in the
merge patch, while fields other controllers and the apiserver set are left alone.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from tandem_operator import GROUP
from tandem_operator.kube import KubeClient, KubeError
from tandem_operator.naming import Component, workload_name
from tandem_operator.resources import build_children, child_key
from tandem_operator.spec import InferenceServiceSpec, SpecError, parse_spec
from tandem_operator.status import compute_status, invalid_status, same_status

logger = logging.getLogger(__name__)

ANNOTATION_LAST_APPLIED = f"{GROUP}/last-applied"
ChildKey = tuple[str, str]  # (kind, name)
# Returns the service's body (None once gone) and its observed children, as the indexes hold them now.
Latest = Callable[[], tuple[Mapping[str, Any] | None, Mapping[ChildKey, Mapping[str, Any]]]]


@dataclass
class Outcome:
    created: list[ChildKey] = field(default_factory=list)
    patched: list[ChildKey] = field(default_factory=list)
    deleted: list[ChildKey] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    status: dict[str, Any] | None = None
    status_written: bool = False


def contains(actual: Any, desired: Any) -> bool:
    """Whether `actual` already has every field of `desired` (extra fields in `actual` are fine)."""
    # Plain dict/list checks: these run for every child on every event, and ABC checks are slow.
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return False
        for key, value in desired.items():
            if value is None:
                if actual.get(key) is not None:
                    return False
            elif key not in actual and _empty(value):
                continue  # the API server omits empty values (Go `omitempty`): not a difference
            elif not contains(actual.get(key), value):
                return False
        return True
    if isinstance(desired, list):
        if not isinstance(actual, list) or len(actual) != len(desired):
            return False
        return all(contains(a, d) for a, d in zip(actual, desired, strict=True))
    return bool(actual == desired)


def _empty(value: Any) -> bool:
    return value is False or value == 0 or value == "" or value == [] or value == {}


def removals(previous: Any, desired: Any) -> dict[str, Any]:
    """Merge-patch `null`s for the map keys written last time that `desired` no longer has."""
    out: dict[str, Any] = {}
    if not isinstance(previous, Mapping) or not isinstance(desired, Mapping):
        return out
    for key, old in previous.items():
        if key not in desired:
            out[key] = None
        elif isinstance(old, Mapping) and isinstance(desired[key], Mapping):
            nested = removals(old, desired[key])
            if nested:
                out[key] = nested
    return out


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    result = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = value
    return result


def last_applied(obj: Mapping[str, Any]) -> dict[str, Any]:
    raw = ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_LAST_APPLIED)
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def desired_children(
    spec: InferenceServiceSpec, body: Mapping[str, Any], operator_namespace: str | None = None
) -> list[dict[str, Any]]:
    """The children of a valid spec, owned by `body` and annotated with what is being written."""
    children = build_children(spec, operator_namespace)
    kopf.adopt(children, owner=body, strict=True)  # type: ignore[arg-type]
    for child in children:
        record = json.dumps(child, sort_keys=True, separators=(",", ":"))
        child["metadata"].setdefault("annotations", {})[ANNOTATION_LAST_APPLIED] = record
    return children


@dataclass
class _ServiceState:
    """What the operator remembers about one service between reconciles (all of it can be lost)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    queued: bool = False
    desired_key: tuple[Any, ...] | None = None
    spec: InferenceServiceSpec | None = None
    children: list[dict[str, Any]] = field(default_factory=list)
    # Children this process wrote that the watch may not have delivered yet.
    written: dict[ChildKey, Mapping[str, Any]] = field(default_factory=dict)
    status: dict[str, Any] | None = None


class Reconciler:
    """Serialises reconciles per InferenceService; different services reconcile concurrently."""

    def __init__(self, client: KubeClient, operator_namespace: str | None = None) -> None:
        self.client = client
        self.operator_namespace = operator_namespace
        self._services: dict[tuple[str, str], _ServiceState] = {}

    def forget(self, namespace: str, name: str) -> None:
        self._services.pop((namespace, name), None)

    def child_gone(self, namespace: str, owner: str, key: ChildKey) -> None:
        """A child was deleted: stop trusting what this process last wrote for it."""
        state = self._services.get((namespace, owner))
        if state is not None:
            state.written.pop(key, None)

    async def reconcile(
        self,
        body: Mapping[str, Any],
        observed: Mapping[ChildKey, Mapping[str, Any]],
        log: logging.Logger | logging.LoggerAdapter[Any] = logger,
    ) -> Outcome:
        """Reconcile one service from its current body and observed children."""
        meta = body.get("metadata") or {}
        state = self._services.setdefault(
            (str(meta.get("namespace")), str(meta.get("name"))), _ServiceState()
        )
        async with state.lock:
            return await self._reconcile(state, body, observed, log, from_child=False)

    async def reconcile_latest(
        self,
        namespace: str,
        name: str,
        latest: Latest,
        log: logging.Logger | logging.LoggerAdapter[Any] = logger,
    ) -> Outcome:
        """Reconcile after a child's event, reading the service and its children from the indexes
        only once the lock is held. Calls coalesce: one already waiting will see the newest state.
        A missing child is recreated only after checking that the service still exists, so a child
        the garbage collector removes right after its owner is not brought back."""
        state = self._services.setdefault((namespace, name), _ServiceState())
        if state.queued:
            return Outcome()
        state.queued = True
        async with state.lock:
            state.queued = False
            body, observed = latest()
            if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                return Outcome()
            return await self._reconcile(state, body, observed, log, from_child=True)

    async def _owner_alive(self, namespace: str, name: str, uid: str) -> bool:
        live = await self.client.read_isvc(namespace, name)
        meta = (live or {}).get("metadata") or {}
        return live is not None and meta.get("uid") == uid and not meta.get("deletionTimestamp")

    def _desired(
        self, state: _ServiceState, body: Mapping[str, Any]
    ) -> tuple[InferenceServiceSpec, list[dict[str, Any]]]:
        """Parse and render, reusing the last result while the spec and labels are unchanged."""
        meta = body.get("metadata") or {}
        labels = tuple(sorted((meta.get("labels") or {}).items()))
        desired_key = (
            meta.get("uid"),
            meta.get("generation"),
            labels,
            json.dumps(body.get("spec"), sort_keys=True),
        )
        if state.desired_key != desired_key or state.spec is None:
            spec = parse_spec(dict(body))
            children = desired_children(spec, body, self.operator_namespace)
            state.spec, state.children, state.desired_key = spec, children, desired_key
        return state.spec, state.children

    async def _reconcile(
        self,
        state: _ServiceState,
        body: Mapping[str, Any],
        observed: Mapping[ChildKey, Mapping[str, Any]],
        log: logging.Logger | logging.LoggerAdapter[Any],
        from_child: bool,
    ) -> Outcome:
        outcome = Outcome()
        meta = body.get("metadata") or {}
        namespace, name, uid = str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid"))
        generation = int(meta.get("generation") or 1)
        current_status = dict(body.get("status") or {})
        try:
            spec, children = self._desired(state, body)
        except SpecError as exc:
            state.desired_key = None
            outcome.problems = exc.problems
            status = invalid_status(exc.problems, generation, current_status)
            await self._write_status(state, namespace, name, current_status, status, outcome, from_child)
            return outcome

        # The index lags behind our own writes: trust what we wrote until the watch catches up.
        for ck in list(state.written):
            if ck in observed:
                del state.written[ck]
        known: dict[ChildKey, Mapping[str, Any]] = {**state.written, **observed}
        if from_child and any(child_key(c) not in known for c in children):
            if not await self._owner_alive(namespace, name, uid):
                return outcome
        fresh: dict[ChildKey, Mapping[str, Any]] = dict(known)

        async def apply(child: dict[str, Any]) -> None:
            ck = child_key(child)
            written = await self._apply(child, known.get(ck), uid, outcome, log)
            if written is not None:
                fresh[ck] = state.written[ck] = written

        # Two waves of concurrent writes: what the workloads refer to (config, RBAC, policy, Services),
        # then the workloads, so no pod is created before its ServiceAccount and ConfigMap exist.
        for wave in (
            [c for c in children if c["kind"] != "Deployment"],
            [c for c in children if c["kind"] == "Deployment"],
        ):
            await asyncio.gather(*(apply(child) for child in wave))
        wanted = {child_key(c) for c in children}
        for ck, actual in observed.items():
            if ck not in wanted and controller_uid(actual) == uid:
                log.info("[reconcile] deleting %s/%s: no longer part of the spec", *ck)
                await self.client.delete(ck[0], namespace, ck[1])
                outcome.deleted.append(ck)
                fresh.pop(ck, None)
                state.written.pop(ck, None)

        deployments = {
            role: _as_dict(fresh.get(("Deployment", workload_name(name, role))))
            for role in (Component.PREFILL, Component.DECODE, Component.ROUTER)
        }
        status = compute_status(spec, generation, deployments, current_status)
        await self._write_status(state, namespace, name, current_status, status, outcome, from_child)
        return outcome

    async def _apply(
        self,
        child: dict[str, Any],
        actual: Mapping[str, Any] | None,
        uid: str,
        outcome: Outcome,
        log: logging.Logger | logging.LoggerAdapter[Any],
    ) -> Mapping[str, Any] | None:
        kind, name = child_key(child)
        namespace = child["metadata"]["namespace"]
        if actual is None:
            try:
                created = await self.client.create(child)
                outcome.created.append((kind, name))
                log.info("[reconcile] created %s/%s", kind, name)
                return created
            except KubeError as exc:
                if exc.status != 409:
                    raise
                # Our index has not seen it yet (or it is someone else's): look at the live object.
                actual = await self.client.read(kind, namespace, name)
                if actual is None:
                    raise kopf.TemporaryError(f"{kind}/{name} conflicts but cannot be read", delay=1) from exc
        owner = controller_uid(actual)
        if owner is not None and owner != uid and (actual.get("metadata") or {}).get("ownerReferences"):
            refs = actual["metadata"]["ownerReferences"]
            if not any(r.get("uid") == owner and r.get("kind") == "InferenceService" for r in refs):
                message = f"{kind}/{name} exists and is controlled by another owner; not taking it over"
                outcome.conflicts.append(message)
                log.warning("[reconcile] %s", message)
                return None
        gone = removals(last_applied(actual), last_applied(child))
        if contains(actual, child) and not gone:
            return None
        patched = await self.client.patch(kind, namespace, name, merge(child, gone))
        outcome.patched.append((kind, name))
        log.info("[reconcile] updated %s/%s", kind, name)
        return patched

    async def _write_status(
        self,
        state: _ServiceState,
        namespace: str,
        name: str,
        current: dict[str, Any],
        status: dict[str, Any],
        outcome: Outcome,
        from_child: bool,
    ) -> None:
        outcome.status = status
        if same_status(current, status):
            state.status = status
            return
        if from_child and state.status is not None and same_status(state.status, status):
            return  # written already; the index has not caught up yet
        try:
            await self.client.patch_isvc_status(namespace, name, status)
            state.status = status
            outcome.status_written = True
        except KubeError as exc:
            if exc.status != 404:  # deleted meanwhile: nothing left to report on
                raise


def _as_dict(obj: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if obj is None else dict(obj)
