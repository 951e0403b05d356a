"""A pod's volumes as host directories, written once before its containers start.

Supported: emptyDir (a fresh dir; medium Memory is ignored), configMap, secret, downwardAPI and projected
(serviceAccountToken from the TokenRequest API bound to the pod, configMap, secret, downwardAPI): the last
is how the ServiceAccount admission plugin injects /var/run/secrets/kubernetes.io/serviceaccount. Contents
are not refreshed afterwards (kubelet would follow ConfigMap edits and rotate the token; tokens here are
valid for the apiserver's extended lifetime, far longer than a test). Anything else (persistentVolumeClaim,
hostPath, ...) is refused up front and the pod stays Pending with a FailedMount event.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from tests.k8s.container_config import ConfigError, PodContext, field_value, read_object, resource_value
from tests.k8s.kube import Kube

logger = logging.getLogger(__name__)

SUPPORTED = ("emptyDir", "configMap", "secret", "downwardAPI", "projected")
PROJECTED_SOURCES = ("serviceAccountToken", "configMap", "secret", "downwardAPI")


def unsupported(pod: dict[str, Any]) -> str | None:
    """Why the agent cannot run this pod at all, or None."""
    spec = pod["spec"]
    for volume in spec.get("volumes") or []:
        kind = next((k for k in volume if k != "name"), "?")
        if kind not in SUPPORTED:
            return f"volume {volume['name']!r}: {kind} volumes are not supported by the test node agent"
        for source in (volume.get("projected") or {}).get("sources") or []:
            for source_kind in source:
                if source_kind not in PROJECTED_SOURCES:
                    return f"volume {volume['name']!r}: projected {source_kind} is not supported by the test node agent"
    for container in spec.get("initContainers") or []:
        if container.get("restartPolicy") == "Always":
            return f"init container {container['name']!r}: sidecars are not supported by the test node agent"
    return None


def _write(directory: Path, files: Mapping[str, bytes], mode: int | None) -> None:
    for relative, content in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode if mode is not None else 0o644)


def _select(data: dict[str, bytes] | None, source: dict[str, Any], what: str) -> dict[str, bytes]:
    """A configMap/secret source's files: every key, or only `items` (key -> path)."""
    if data is None:
        return {}
    items = source.get("items")
    if not items:
        return data
    missing = [i["key"] for i in items if i["key"] not in data]
    if missing and not source.get("optional"):
        raise ConfigError(f"{what} has no key {missing}")
    return {i["path"]: data[i["key"]] for i in items if i["key"] in data}


class PodVolumes:
    def __init__(self, kube: Kube, ctx: PodContext, root: Path) -> None:
        self.kube = kube
        self.ctx = ctx
        self.root = root

    @property
    def namespace(self) -> str:
        return str(self.ctx.pod["metadata"]["namespace"])

    def prepare(self) -> dict[str, Path]:
        """Writes every volume; ConfigError (and nothing half-written kept) if one cannot be built yet."""
        shutil.rmtree(self.root, ignore_errors=True)
        dirs: dict[str, Path] = {}
        try:
            for volume in self.ctx.pod["spec"].get("volumes") or []:
                directory = self.root / volume["name"]
                directory.mkdir(parents=True)
                mode = None
                if "configMap" in volume or "secret" in volume:
                    kind = "configMap" if "configMap" in volume else "secret"
                    source = volume[kind]
                    name = source.get("name") or source.get("secretName")
                    what = f"{kind} {self.namespace}/{name}"
                    data = read_object(self.kube, kind, self.namespace, name, bool(source.get("optional")))
                    _write(directory, _select(data, source, what), source.get("defaultMode"))
                elif "downwardAPI" in volume:
                    _write(directory, self._downward(volume["downwardAPI"]), volume["downwardAPI"].get("defaultMode"))
                elif "projected" in volume:
                    mode = volume["projected"].get("defaultMode")
                    for source in volume["projected"].get("sources") or []:
                        _write(directory, self._projected(source), mode)
                dirs[volume["name"]] = directory
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        return dirs

    def _projected(self, source: dict[str, Any]) -> dict[str, bytes]:
        if "serviceAccountToken" in source:
            token = source["serviceAccountToken"]
            return {token["path"]: self._token(token.get("audience"), token.get("expirationSeconds", 3600))}
        if "downwardAPI" in source:
            return self._downward(source["downwardAPI"])
        kind = "configMap" if "configMap" in source else "secret"
        ref = source[kind]
        data = read_object(self.kube, kind, self.namespace, ref["name"], bool(ref.get("optional")))
        return _select(data, ref, f"{kind} {self.namespace}/{ref['name']}")

    def _downward(self, source: dict[str, Any]) -> dict[str, bytes]:
        files = {}
        for item in source.get("items") or []:
            if "fieldRef" in item:
                value = field_value(self.ctx, item["fieldRef"]["fieldPath"])
            else:
                ref = item["resourceFieldRef"]
                value = resource_value(self.ctx, ref["containerName"], ref["resource"], ref.get("divisor"))
            files[item["path"]] = value.encode()
        return files

    def _token(self, audience: str | None, expiration_s: int) -> bytes:
        meta = self.ctx.pod["metadata"]
        service_account = self.ctx.pod["spec"].get("serviceAccountName") or "default"
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            # No audience means the apiserver's own (--api-audiences, defaulting to the issuer), as kubelet asks.
            "spec": {
                "audiences": [audience] if audience else [],
                "expirationSeconds": expiration_s,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
            },
        }
        try:
            resp = self.kube.post(f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{service_account}/token", body)
        except ApiException as e:
            raise ConfigError(f"token for serviceaccount {self.namespace}/{service_account}: {e.reason}") from None
        token: str = resp["status"]["token"]
        return token.encode()
