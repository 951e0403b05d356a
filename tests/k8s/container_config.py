"""What the test node agent runs for one container: its argv, its environment and its mounts, as kubelet
would compute them (downward API, resource fields, $(VAR) expansion), minus the image.

Images are ignored: a container's `command` + `args` run from the host's filesystem with the repository's
virtualenv first on PATH. A container without `command` runs the image's ENTRYPOINT only if the agent was
told it (NodeAgent(entrypoints=...)); otherwise it fails with CreateContainerConfigError.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

from tests.k8s.kube import Kube

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Resources whose limit kubelet fills from node allocatable when a container sets none.
ALLOCATABLE_DEFAULTS = ("cpu", "memory", "ephemeral-storage")


class ConfigError(Exception):
    """The container cannot be created yet (missing ConfigMap key, no command); kubelet's
    CreateContainerConfigError: it retries, and so do we."""


@dataclass(frozen=True)
class PodContext:
    """Where a pod runs: what the downward API and the service variables refer to."""

    pod: dict[str, Any]
    pod_ip: str
    host_ip: str
    allocatable: Mapping[str, str]
    api_host: str
    api_port: int


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    read_only: bool


def field_value(ctx: PodContext, path: str) -> str:
    """A downward API fieldRef (metadata.*, spec.nodeName, spec.serviceAccountName, status.*IP*)."""
    meta, spec = ctx.pod["metadata"], ctx.pod["spec"]
    for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        values = meta.get(source) or {}
        if path == prefix:
            return "\n".join(f"{k}={json.dumps(v)}" for k, v in sorted(values.items()))
        if path.startswith(f"{prefix}['") and path.endswith("']"):
            return str(values.get(path[len(prefix) + 2:-2], ""))
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": ctx.pod_ip,
        "status.podIPs": ctx.pod_ip,
        "status.hostIP": ctx.host_ip,
        "status.hostIPs": ctx.host_ip,
    }
    if path not in simple:
        raise ConfigError(f"unsupported fieldRef {path!r}")
    return str(simple[path])


def resource_value(ctx: PodContext, container_name: str, resource: str, divisor: str | None) -> str:
    """A resourceFieldRef, rounded up in units of divisor as kubelet does (pkg/api/v1/resource)."""
    containers = ctx.pod["spec"].get("containers", []) + ctx.pod["spec"].get("initContainers", [])
    container = next((c for c in containers if c["name"] == container_name), None)
    if container is None:
        raise ConfigError(f"resourceFieldRef names unknown container {container_name!r}")
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or not name:
        raise ConfigError(f"unsupported resourceFieldRef {resource!r}")
    values = dict((container.get("resources") or {}).get(kind) or {})
    if kind == "limits":
        for default in ALLOCATABLE_DEFAULTS:
            values.setdefault(default, ctx.allocatable.get(default, "0"))
    quantity = parse_quantity(values.get(name, "0"))
    unit = parse_quantity(divisor or "1") or Decimal(1)
    if name == "cpu":
        # Quantity.MilliValue() rounds up before the division rounds up again.
        return str(math.ceil(math.ceil(quantity * 1000) / math.ceil(unit * 1000)))
    return str(math.ceil(math.ceil(quantity) / math.ceil(unit)))


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) syntax: defined names are replaced, undefined ones kept verbatim, $$ is a $."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        if text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2:end]
            out.append(env.get(name, text[i:end + 1]))
            i = end + 1
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def read_object(kube: Kube, kind: str, namespace: str, name: str, optional: bool) -> dict[str, bytes] | None:
    """A ConfigMap's or Secret's data as bytes (Secret values decoded); None if optional and absent."""
    resource = "configmaps" if kind == "configMap" else "secrets"
    try:
        obj = kube.get(f"/api/v1/namespaces/{namespace}/{resource}/{name}")
    except ApiException as e:
        if e.status == 404 and optional:
            return None
        raise ConfigError(f"{kind} {namespace}/{name}: {e.reason}") from None
    if kind == "secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data


def container_env(
    kube: Kube, ctx: PodContext, container: dict[str, Any], base: Mapping[str, str]
) -> dict[str, str]:
    """base (what the image would set), then the service variables, envFrom and env, in kubelet's order."""
    namespace = ctx.pod["metadata"]["namespace"]
    # Only the master service's variables: the others would name ClusterIPs, which route nowhere here.
    env = dict(base)
    env.update({
        "KUBERNETES_SERVICE_HOST": ctx.api_host,
        "KUBERNETES_SERVICE_PORT": str(ctx.api_port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(ctx.api_port),
        "KUBERNETES_PORT": f"tcp://{ctx.api_host}:{ctx.api_port}",
    })
    for source in container.get("envFrom") or []:
        kind = "configMap" if "configMapRef" in source else "secret"
        ref = source.get("configMapRef") or source.get("secretRef") or {}
        data = read_object(kube, kind, namespace, ref["name"], bool(ref.get("optional")))
        env.update({source.get("prefix", "") + k: v.decode(errors="replace") for k, v in (data or {}).items()})
    for var in container.get("env") or []:
        name, value_from = var["name"], var.get("valueFrom")
        if value_from is None:
            env[name] = expand(var.get("value", ""), env)
        elif "fieldRef" in value_from:
            env[name] = field_value(ctx, value_from["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in value_from:
            ref = value_from["resourceFieldRef"]
            env[name] = resource_value(ctx, ref.get("containerName") or container["name"], ref["resource"],
                                       ref.get("divisor"))
        else:
            kind = "configMap" if "configMapKeyRef" in value_from else "secret"
            ref = value_from.get("configMapKeyRef") or value_from.get("secretKeyRef") or {}
            data = read_object(kube, kind, namespace, ref["name"], bool(ref.get("optional")))
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise ConfigError(f"{kind} {namespace}/{ref['name']} has no key {ref['key']!r}")
            env[name] = data[ref["key"]].decode(errors="replace")
    return env


def image_repository(image: str) -> str:
    image = image.split("@", 1)[0]
    slash = image.rfind("/")
    colon = image.rfind(":")
    return image[:colon] if colon > slash else image


def container_argv(
    container: dict[str, Any], env: Mapping[str, str], entrypoints: Mapping[str, list[str]]
) -> list[str]:
    command = container.get("command")
    if not command:
        command = entrypoints.get(image_repository(container.get("image", "")))
        if not command:
            raise ConfigError(
                f"container {container['name']!r} has no command and the test node agent runs no images "
                f"(no entrypoint known for {container.get('image')!r})"
            )
    return [expand(a, env) for a in [*command, *(container.get("args") or [])]]


def container_mounts(container: dict[str, Any], volume_dirs: Mapping[str, Path], env: Mapping[str, str]) -> list[Mount]:
    mounts = []
    for mount in container.get("volumeMounts") or []:
        if mount["name"] not in volume_dirs:
            raise ConfigError(f"volumeMount {mount['name']!r} names no volume of the pod")
        source = volume_dirs[mount["name"]]
        sub_path = mount.get("subPath") or expand(mount.get("subPathExpr", ""), env)
        if sub_path:
            source = source / sub_path
            if not source.exists():
                source.mkdir(parents=True)  # as kubelet does for a missing subPath
        mounts.append(Mount(source, mount["mountPath"], bool(mount.get("readOnly"))))
    return mounts
