"""Builders and API helpers shared by the operator tests (tests/operator only)."""

from __future__ import annotations

import asyncio
import copy
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "serving.tandem.dev_inferenceservices.yaml"
EXAMPLES = REPO / "crds" / "examples"
OPERATOR_ARGS = ["--standalone", "-A"]

ISVC_PATH = "/apis/serving.tandem.dev/v1alpha1/namespaces/{ns}/inferenceservices"
PATHS = {
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "Service": "/api/v1/namespaces/{ns}/services",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "InferenceService": ISVC_PATH,
    "Event": "/api/v1/namespaces/{ns}/events",
    "ReplicaSet": "/apis/apps/v1/namespaces/{ns}/replicasets",
    "Pod": "/api/v1/namespaces/{ns}/pods",
}


def expected_children(name: str, prefill: bool = True) -> set[tuple[str, str]]:
    """(kind, name) of every child the operator makes for an InferenceService."""
    kids = {("ConfigMap", f"{name}-engine-config"), ("ServiceAccount", f"{name}-router"), ("Role", f"{name}-router"),
            ("RoleBinding", f"{name}-router"), ("Service", f"{name}-decode"), ("Service", f"{name}-router"),
            ("Deployment", f"{name}-decode"), ("Deployment", f"{name}-router"), ("NetworkPolicy", f"{name}-engines")}
    if prefill:
        kids |= {("Service", f"{name}-prefill"), ("Deployment", f"{name}-prefill")}
    return kids


def load_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def example(name: str, **overrides: Any) -> dict[str, Any]:
    """A copy of crds/examples/<name>.yaml with metadata overrides (name, namespace)."""
    body = copy.deepcopy(load_yaml(EXAMPLES / f"{name}.yaml"))
    body["metadata"].update(overrides)
    return body


def variant(change: dict[str, Any], name: str = "disaggregated") -> dict[str, Any]:
    """The example with dotted paths set (`{"spec.engine.port": 9000}`), or removed where the value is None."""
    obj = example(name)
    for dotted, value in change.items():
        *parents, leaf = dotted.split(".")
        node = obj
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return obj


def crd_schema() -> dict[str, Any]:
    crd = load_yaml(CRD_PATH)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert isinstance(schema, dict)
    return schema


def prepare(emulator: kmock.KubernetesEmulator) -> None:
    """Declare the builtin resources and our CRD's resource the way discovery would show them."""
    with warnings.catch_warnings():  # kmock 0.8 uses a deprecated importlib.resources call
        warnings.simplefilter("ignore", DeprecationWarning)
        emulator.resources.load_bundled()
    emulator.resources["serving.tandem.dev/v1alpha1/inferenceservices"] = kmock.ResourceInfo(
        kind="InferenceService",
        singular="inferenceservice",
        shortnames={"tisvc"},
        namespaced=True,
        verbs={"list", "watch", "get", "create", "patch", "delete"},
        subresources={"status"},
    )


class Api:
    """Plain HTTP calls against the emulator, independent of the operator's own client."""

    def __init__(self, base: str, session: aiohttp.ClientSession) -> None:
        self.base = base.rstrip("/")
        self.session = session

    def _url(self, kind: str, ns: str, name: str | None = None, sub: str | None = None) -> str:
        url = self.base + PATHS[kind].format(ns=ns)
        if name:
            url += f"/{name}"
        if sub:
            url += f"/{sub}"
        return url

    async def create(self, kind: str, body: dict[str, Any], ns: str = "default") -> dict[str, Any]:
        async with self.session.post(self._url(kind, ns), json=body) as resp:
            data: dict[str, Any] = await resp.json()
            assert resp.status == 201, data
            return data

    async def get(self, kind: str, name: str, ns: str = "default") -> dict[str, Any] | None:
        async with self.session.get(self._url(kind, ns, name)) as resp:
            if resp.status == 404:
                return None
            data: dict[str, Any] = await resp.json()
            assert resp.status == 200, data
            return data

    async def list(self, kind: str, ns: str = "default") -> list[dict[str, Any]]:
        async with self.session.get(self._url(kind, ns)) as resp:
            data = await resp.json()
            assert resp.status == 200, data
            items: list[dict[str, Any]] = data["items"]
            return items

    async def patch(
        self, kind: str, name: str, patch: dict[str, Any], ns: str = "default", sub: str | None = None
    ) -> dict[str, Any]:
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.session.patch(self._url(kind, ns, name, sub), json=patch, headers=headers) as resp:
            data: dict[str, Any] = await resp.json()
            assert resp.status == 200, data
            return data

    async def delete(self, kind: str, name: str, ns: str = "default") -> int:
        async with self.session.delete(self._url(kind, ns, name)) as resp:
            await resp.read()
            return resp.status

    async def kubelet_reports(self, name: str, ready: int, ns: str = "default") -> None:
        """Write a Deployment's status the way the Deployment controller and kubelets would."""
        dep = await self.get("Deployment", name, ns)
        assert dep is not None
        replicas = dep["spec"]["replicas"]
        status = {
            "observedGeneration": dep["metadata"]["generation"],
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
        }
        await self.patch("Deployment", name, {"status": status}, ns, sub="status")


async def eventually(probe: Callable[[], Awaitable[Any]], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Poll `probe` until it returns something truthy; fail with its last value after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s; last value: {last!r}")


def condition(isvc: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for cond in ((isvc or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return dict(cond)
    return None


# Invalid variants of the disaggregated example and a phrase of the refusal: checked offline against the CRD
# (test_operator_crd.py) and by the real apiserver (test_cluster_e2e.py).
AUTOSCALED = {"prefill": {"minReplicas": 1, "maxReplicas": 2}, "decode": {"minReplicas": 1, "maxReplicas": 4}}

INVALID = {
    "negative replicas": ({"spec.decode.replicas": -1}, "decode.replicas"),
    "replicas not a number": ({"spec.router.replicas": "two"}, "router.replicas"),
    "unknown policy": ({"spec.router.policy": "Random"}, "policy"),
    "router auth without a secret": ({"spec.router.auth": {"secretKey": "k"}}, "secretName"),
    "unknown connector": ({"spec.kvTransfer.connector": "Mooncake"}, "connector"),
    "block size": ({"spec.engine.blockSize": 17}, "blockSize"),
    "model uri": ({"spec.model.uri": "s3://bucket/model"}, "uri"),
    "no model": ({"spec.model": None}, "model"),
    "unknown field": ({"spec.engine.blocksize": 16}, "blocksize"),
    "prefill without connector": ({"spec.kvTransfer": None}, "KV connector"),
    "side channel on the http port": ({"spec.kvTransfer.sideChannelPort": 8000}, "sideChannelPort"),
    "managed flag in extraArgs": ({"spec.engine.extraArgs": ["--block-size=32"]}, "extraArgs"),
    "batch below seqs": ({"spec.engine.maxNumBatchedTokens": 8}, "maxNumBatchedTokens"),
    "name too long": ({"metadata.name": "x" * 41}, "40 characters"),
    "autoscaling min above max": ({"spec.autoscaling": {"decode": {"minReplicas": 3, "maxReplicas": 2}}},
                                  "minReplicas must be <= maxReplicas"),
    "autoscaling without max": ({"spec.autoscaling": {"decode": {"minReplicas": 1}}}, "maxReplicas"),
    "autoscaling without decode": ({"spec.autoscaling": {"intervalSeconds": 15}}, "decode"),
    "ratio min above max": ({"spec.autoscaling": {**AUTOSCALED, "prefillDecodeRatio": {"min": 2, "max": 0.5}}},
                            "prefillDecodeRatio.min must be <= max"),
    "ratio without prefill bounds": ({"spec.autoscaling": {"decode": {"maxReplicas": 4},
                                                           "prefillDecodeRatio": {"max": 2}}}, "prefillDecodeRatio"),
    "percentile": ({"spec.autoscaling": {**AUTOSCALED, "targets": {"percentile": 80}}}, "percentile"),
    "kv target above 1": ({"spec.autoscaling": {**AUTOSCALED, "fallback": {"kvCacheUsage": 1.5}}}, "kvCacheUsage"),
    "zero on one role only": ({"spec.autoscaling": {"prefill": {"minReplicas": 0, "maxReplicas": 2},
                                                    "decode": {"minReplicas": 1, "maxReplicas": 4}}}, "both"),
    "decode to zero, prefill fixed": ({"spec.autoscaling": {"decode": {"minReplicas": 0, "maxReplicas": 4}}},
                                      "needs autoscaling.prefill"),
    "idle below 30 s": ({"spec.autoscaling": {**AUTOSCALED, "scaleToZero": {"idleSeconds": 5}}}, "idleSeconds"),
}
