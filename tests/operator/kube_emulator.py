"""KMock 0.8's Kubernetes emulator made realistic enough for kopf, kubectl and Helm (see
docs/kubernetes-testbed.md, "What still runs against KMock").

Stock kmock stores objects exactly as sent. kopf relies on apiserver behaviour it lacks:
server-set ``uid``/``resourceVersion``/``generation``, watches that resume from a
``resourceVersion`` without losing events, 201 on create and 422 on a failed JSON-patch test.
This subclass adds those, and also:

- status-subresource isolation (``status`` cannot be written through the main resource, nor
  ``spec`` through ``/status``), and ``generation`` bumps only when ``spec`` really changes;
- ``generateName``; CRDs that make their resource discoverable when created; the apiserver's
  error reasons (``NotFound``, ``AlreadyExists``); list ``kind``; a configurable server version;
- 415 for protobuf bodies (kmock would 500 on them) and a core group discovery document that
  client-go accepts, so Helm can install into it (with ``HELM_DRIVER=memory``);
- O(1) object lookups and a bounded request history (kmock scans both on every request).

It uses kmock private members (``_lock``, ``_buses``, ``_objects``, ``_requests``, name-mangled
helpers): re-verify on every kmock upgrade (pinned to 0.8).
"""

from __future__ import annotations

import collections
import copy
import datetime
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import rendering

logger = logging.getLogger(__name__)

_WATCH_TRUE = {"true", "True", "1"}
_REASONS = {404: "NotFound", 409: "AlreadyExists"}
CRDS = kmock.resource("apiextensions.k8s.io/v1/customresourcedefinitions")


@attrs.define(kw_only=True)
class RealisticEmulator(kmock.KubernetesEmulator):
    """An in-memory apiserver with monotonic resourceVersions and resumable watches."""

    _revision: int = 0
    # kmock matches every request against its whole request history (quadratic over a run); the
    # tests assert on objects, not on requests, so only the newest few are kept.
    keep_requests: int = 1
    # kmock reports a K3s 1.26 server; the chart needs >= 1.28 (what kubernetes-validate checks too).
    kube_version: str = "1.31.0"
    # Requests served, by HTTP method (for benchmarks: writes per reconcile).
    served: collections.Counter[str] = attrs.field(factory=collections.Counter)

    def _next_revision(self) -> str:
        self._revision += 1
        return str(self._revision)

    def watchers(self, resource: str) -> int:
        """How many watch streams are open on a resource (e.g. to know that kopf is listening)."""
        return self._buses[kmock.resource(resource)].consumer_count

    def exists(self, resource: str, namespace: str, name: str) -> bool:
        key = (kmock.resource(resource), namespace, name)
        return key in self.objects and not self.objects[key].deleted

    def stored(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The live object as stored (a copy), or None; read without going through HTTP."""
        key = (kmock.resource(resource), namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(dict(self.objects[key].raw))

    def _has_status_subresource(self, resource: kmock.resource) -> bool:
        for known in self.resources:
            if known == resource:
                return "status" in self.resources[known].subresources
        return False

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if "protobuf" in raw_request.headers.get("Content-Type", ""):
            # Only JSON is spoken here (kmock would fail to decode the body with a 500).
            await raw_request.read()
            return await self._render_error(
                kmock.KubernetesError(
                    status=415,
                    reason="UnsupportedMediaType",
                    message="only application/json bodies are supported",
                )
            )
        return await super().__call__(raw_request)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self.served[str(request.method.value if request.method is not None else "?")] += 1
        if len(self._requests) > self.keep_requests:
            del self._requests[: -self.keep_requests]
        action = request.action
        if request.resource is not None:
            if action == kmock.action.LIST and request.params.get("watch") in _WATCH_TRUE:
                # The Python clients send watch=True; kmock only recognises watch=true.
                object.__setattr__(request, "action", kmock.action.WATCH)
            elif action == kmock.action.CREATE and isinstance(request.data, dict):
                self._prepare_create(request)
            elif action == kmock.action.UPDATE and request.name is not None:
                self._prepare_update(request)
            elif action == kmock.action.DELETE and request.name is not None:
                self._prepare_delete(request)
        return await super()._handle(request)

    def _prepare_create(self, request: rendering.Request) -> None:
        meta = request.data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        meta["resourceVersion"] = self._next_revision()
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        if request.resource is not None and self._has_status_subresource(request.resource):
            request.data.pop("status", None)  # the apiserver ignores status on create
        if request.resource == CRDS:
            self._serve_crd(request.data)

    def _serve_crd(self, crd: dict[str, Any]) -> None:
        """A created CRD makes its resource discoverable, as the apiserver does."""
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        for version in spec.get("versions") or []:
            if not version.get("served"):
                continue
            self.resources[f"{spec.get('group')}/{version.get('name')}/{names.get('plural')}"] = kmock.ResourceInfo(
                kind=names.get("kind"),
                singular=names.get("singular"),
                shortnames=set(names.get("shortNames") or []),
                categories=set(names.get("categories") or []),
                namespaced=spec.get("scope") == "Namespaced",
                verbs={"create", "delete", "get", "list", "patch", "watch"},
                subresources=set(version.get("subresources") or {}),
            )

    def _prepare_update(self, request: rendering.Request) -> None:
        body = request.data
        if isinstance(body, list):  # JSON patch: keep kopf's `test` op first, then bump the version
            body.append({"op": "add", "path": "/metadata/resourceVersion", "value": self._next_revision()})
            return
        if not isinstance(body, dict):
            return
        assert request.resource is not None
        if self._has_status_subresource(request.resource):
            if request.subresource == "status":
                for key in [k for k in body if k not in ("status", "metadata")]:
                    del body[key]
                body["metadata"] = {}
            else:
                body.pop("status", None)
        meta = body.setdefault("metadata", {})
        if not isinstance(meta, dict):
            return
        meta.pop("uid", None)
        meta.pop("generation", None)
        meta["resourceVersion"] = self._next_revision()
        if "spec" in body and request.subresource is None:
            current = self._current(request)
            raw = current.raw if current is not None else None
            if raw is not None and _spec_changes(raw.get("spec") or {}, body["spec"]):
                meta["generation"] = int(raw.get("metadata", {}).get("generation", 1)) + 1

    def _prepare_delete(self, request: rendering.Request) -> None:
        current = self._current(request)
        if current is not None and not current.get("metadata", {}).get("deletionTimestamp"):
            current.patch({"metadata": {"resourceVersion": self._next_revision()}})

    def _current(self, request: rendering.Request) -> kmock.Object | None:
        assert request.resource is not None
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            obj: kmock.Object = self.objects[key]
            return obj
        return None

    async def _serve_server_version(self, request: rendering.Request) -> rendering.Payload:
        payload = dict(await super()._serve_server_version(request))  # type: ignore[arg-type]
        major, minor, _ = self.kube_version.split(".")
        payload.update(major=major, minor=minor, gitVersion=f"v{self.kube_version}")
        return payload

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        payload = dict(await super()._serve_version(request))  # type: ignore[arg-type]
        # kmock renders the core group as "/v1"; clients (client-go, hence Helm) need "v1".
        payload["groupVersion"] = str(payload.get("groupVersion", "")).lstrip("/")
        return payload

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, jsonpatch.JsonPatchTestFailed | jsonpatch.JsonPatchConflict):
            exc = kmock.KubernetesError(status=422, reason="Invalid", message=str(exc))
        elif isinstance(exc, kmock.KubernetesError) and exc.status in _REASONS:
            # Clients branch on the apiserver's machine-readable reasons (Helm skips AlreadyExists CRDs).
            exc = kmock.KubernetesError(
                status=exc.status, reason=_REASONS[exc.status], message=exc.message, details=exc.details
            )
        return await super()._render_error(exc)

    # kmock finds an object by scanning every stored object; a dict lookup is O(1).
    def _lookup(self, request: rendering.Request, namespace: str | None, name: str | None) -> kmock.Object | None:
        key = (request.resource, namespace, name)
        return self._objects[key] if key in self._objects else None

    async def _serve_create(self, request: rendering.Request) -> rendering.Payload:
        meta = request.data.get("metadata", {}) if isinstance(request.data, dict) else {}
        async with self._lock:
            obj = self._lookup(request, request.namespace or meta.get("namespace"), request.name or meta.get("name"))
            assert obj is not None  # created in _handle()
            payload = obj.raw
        return kmock.Response(status=201, payload=payload)

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        async with self._lock:
            obj = self._lookup(request, request.namespace, request.name)
            if obj is None or obj.deleted:
                raise kmock.KubernetesObjectNotFoundError()
            return obj.raw

    async def _serve_update(self, request: rendering.Request) -> rendering.Payload:
        async with self._lock:
            obj = self._lookup(request, request.namespace, request.name)
            assert obj is not None  # updated in _handle()
            return obj.last.raw

    async def _serve_delete(self, request: rendering.Request) -> rendering.Payload:
        async with self._lock:
            obj = self._lookup(request, request.namespace, request.name)
            assert obj is not None  # deleted in _handle()
            return obj.last.raw

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        for resource in self._get_resources():
            if resource == request.resource:
                break
        else:
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            objs = self._KubernetesEmulator__get_objs(request, strict=False)  # type: ignore[attr-defined]
            items = [obj.raw for obj in objs if not obj.deleted]
            revision = str(self._revision)
        assert request.resource is not None
        kind = self.resources[request.resource].kind or request.resource.plural.capitalize()
        group, version = request.resource.group, request.resource.version
        return {
            "apiVersion": f"{group}/{version}" if group else version,
            "kind": f"{kind}List",
            "metadata": {"resourceVersion": revision},
            "items": items,
        }

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""  # flush the headers so the client sees a started stream
        assert request.resource is not None
        try:
            since = int(request.params.get("resourceVersion", ""))
        except ValueError:
            since = -1
        bus = self._buses[request.resource]
        # Snapshot and subscribe atomically: nothing written in between can be lost.
        async with self._lock:
            objs = self._KubernetesEmulator__get_objs(request, strict=False)  # type: ignore[attr-defined]
            snapshot = [obj.raw for obj in objs if not obj.deleted and _revision_of(obj.raw) > since]
            marker = await bus.mark()
        try:
            for raw in snapshot:
                yield {"type": "ADDED", "object": raw}
            async for event in bus.stream(since=marker):
                meta = event.get("object", {}).get("metadata", {})
                if _revision_of(event.get("object", {})) <= since:
                    continue
                check = self._KubernetesEmulator__check  # type: ignore[attr-defined]
                if check(request, request.resource, meta.get("namespace"), meta.get("name"), strict=False):
                    yield event
        finally:
            await bus.unmark(marker)


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _revision_of(obj: dict[str, Any]) -> int:
    try:
        return int(obj.get("metadata", {}).get("resourceVersion", 0))
    except (TypeError, ValueError):
        return 0


def _spec_changes(current: Any, patch: Any) -> bool:
    """Whether a JSON merge patch would change `current` (a real apiserver bumps generation only then)."""
    if isinstance(patch, dict):
        if not isinstance(current, dict):
            return True
        for key, value in patch.items():
            if value is None:
                if key in current:
                    return True
            elif key not in current or _spec_changes(current[key], value):
                return True
        return False
    return bool(current != patch)
