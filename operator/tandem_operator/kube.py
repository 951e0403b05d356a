"""A thin asynchronous Kubernetes client for the kinds the operator writes.

It uses the typed APIs of `kubernetes.aio` so that every body is checked against the Kubernetes
models before it leaves the process, and reads responses as plain dicts (the builders' shape).
Patches are JSON merge patches: the manifests are complete, so a merge patch sets every field the
operator owns and leaves the fields the apiserver and other controllers own alone.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from kubernetes.aio import client as k8s
from kubernetes.aio import config as k8s_config

from tandem_operator import GROUP, PLURAL, VERSION

logger = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"

# kind -> (typed API class, method suffix): what the operator writes, and the EndpointSlices its planner reads
KINDS: dict[str, tuple[type[Any], str]] = {
    "EndpointSlice": (k8s.DiscoveryV1Api, "endpoint_slice"),
    "ConfigMap": (k8s.CoreV1Api, "config_map"),
    "Pod": (k8s.CoreV1Api, "pod"),
    "Service": (k8s.CoreV1Api, "service"),
    "ServiceAccount": (k8s.CoreV1Api, "service_account"),
    "Deployment": (k8s.AppsV1Api, "deployment"),
    "Role": (k8s.RbacAuthorizationV1Api, "role"),
    "RoleBinding": (k8s.RbacAuthorizationV1Api, "role_binding"),
    "NetworkPolicy": (k8s.NetworkingV1Api, "network_policy"),
}


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


async def _result(response: Any) -> dict[str, Any]:
    """Read an aiohttp response: the object as a dict, or KubeError carrying the HTTP status."""
    raw = await response.read()
    status = int(response.status)
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        data = {"message": raw.decode(errors="replace")}
    if status >= 400:
        raise KubeError(status, str(data.get("message", data)) if isinstance(data, dict) else str(data))
    return data if isinstance(data, dict) else {}


class KubeClient:
    """One connection pool for the whole operator process."""

    def __init__(self, api_client: k8s.ApiClient) -> None:
        self.closed = False  # the operator is exiting: loops still running must end, not fail
        self.api_client = api_client
        self._apis: dict[type[Any], Any] = {}
        self.custom = k8s.CustomObjectsApi(api_client)

    @classmethod
    async def connect(cls) -> KubeClient:
        """In-cluster credentials when running in a pod, else $KUBECONFIG (read now, not at import)."""
        configuration = k8s.Configuration()
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            await k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
            )
        configuration.connection_pool_maxsize = 32
        return cls(k8s.ApiClient(configuration))

    async def close(self) -> None:
        self.closed = True
        await self.api_client.close()  # type: ignore[no-untyped-call]

    def _method(self, kind: str, verb: str) -> Any:
        api_cls, suffix = KINDS[kind]
        if api_cls not in self._apis:
            self._apis[api_cls] = api_cls(self.api_client)
        return getattr(self._apis[api_cls], f"{verb}_namespaced_{suffix}_without_preload_content")

    async def read(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await _result(await self._method(kind, "read")(name, namespace))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return await _result(await self._method(obj["kind"], "create")(meta["namespace"], obj))

    async def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        method = self._method(kind, "patch")
        return await _result(await method(name, namespace, patch, _content_type=MERGE_PATCH))

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            await _result(await self._method(kind, "delete")(name, namespace))
        except KubeError as exc:
            if exc.status != 404:
                raise

    async def read_isvc(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await _result(
                await self.custom.get_namespaced_custom_object_without_preload_content(
                    GROUP, VERSION, namespace, PLURAL, name
                )
            )
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def patch_isvc(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A merge patch of the InferenceService itself (the autoscaler's `spec.<role>.replicas`)."""
        method = self.custom.patch_namespaced_custom_object_without_preload_content
        return await _result(await method(GROUP, VERSION, namespace, PLURAL, name, patch, _content_type=MERGE_PATCH))

    async def ready_endpoints(self, namespace: str, service: str) -> dict[str, str]:
        """Pod name (the address when no pod is named) -> IP of each ready endpoint of `service`, from its
        EndpointSlices (`ready` unset counts as ready, as Kubernetes documents)."""
        method = self._method("EndpointSlice", "list")
        data = await _result(await method(namespace, label_selector=f"kubernetes.io/service-name={service}"))
        out: dict[str, str] = {}
        for slice_ in data.get("items") or []:
            for ep in slice_.get("endpoints") or []:
                if (ep.get("conditions") or {}).get("ready") is False or not ep.get("addresses"):
                    continue
                address = ep["addresses"][0]
                out[(ep.get("targetRef") or {}).get("name") or address] = address
        return out

    async def patch_isvc_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        method = self.custom.patch_namespaced_custom_object_status_without_preload_content
        return await _result(
            await method(
                GROUP, VERSION, namespace, PLURAL, name, {"status": status}, _content_type=MERGE_PATCH
            )
        )
