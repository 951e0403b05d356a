"""The KMock realism subclass behaves like an apiserver where kopf depends on it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from isvc_utils import CRD_PATH, Api, load_yaml, prepare
from kube_emulator import RealisticEmulator

pytestmark = [pytest.mark.kmock(cls=RealisticEmulator), pytest.mark.timeout(30)]

CM = "/api/v1/namespaces/default/configmaps"


@pytest.fixture()
async def http(kmock: RealisticEmulator) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    prepare(kmock)
    async with aiohttp.ClientSession() as session:
        yield str(kmock.url).rstrip("/"), session


async def _json(resp: aiohttp.ClientResponse) -> Any:
    return json.loads(await resp.read())


async def test_create_sets_server_fields(http: tuple[str, aiohttp.ClientSession]) -> None:
    base, s = http
    async with s.post(base + CM, json={"metadata": {"name": "a"}, "data": {"k": "v"}}) as resp:
        assert resp.status == 201
        obj = await _json(resp)
    meta = obj["metadata"]
    assert meta["namespace"] == "default" and meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"]
    async with s.post(base + CM, json={"metadata": {"generateName": "ev-"}}) as resp:
        assert resp.status == 201 and (await _json(resp))["metadata"]["name"].startswith("ev-")
    async with s.post(base + CM, json={"metadata": {"name": "a"}}) as resp:
        assert resp.status == 409


async def test_versions_generation_and_status_isolation(
    kmock: RealisticEmulator, http: tuple[str, aiohttp.ClientSession]
) -> None:
    base, s = http
    api = Api(base, s)
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"a": "b"}}},
    }
    created = await api.create("Deployment", dep)
    rv0 = int(created["metadata"]["resourceVersion"])
    same = await api.patch("Deployment", "d", {"spec": {"replicas": 1}, "metadata": {"labels": {"x": "y"}}})
    assert int(same["metadata"]["resourceVersion"]) > rv0 and same["metadata"]["generation"] == 1
    changed = await api.patch("Deployment", "d", {"spec": {"replicas": 3}})
    assert changed["metadata"]["generation"] == 2
    # status through the main resource is ignored; spec through /status is ignored.
    await api.patch("Deployment", "d", {"status": {"readyReplicas": 9}})
    await api.patch("Deployment", "d", {"spec": {"replicas": 7}, "status": {"readyReplicas": 3}}, sub="status")
    stored = kmock.stored("apps/v1/deployments", "default", "d")
    assert stored is not None and stored["spec"]["replicas"] == 3 and stored["status"] == {"readyReplicas": 3}
    assert stored["metadata"]["generation"] == 2


async def test_failed_json_patch_test_is_422(http: tuple[str, aiohttp.ClientSession]) -> None:
    base, s = http
    async with s.post(base + CM, json={"metadata": {"name": "a"}}) as resp:
        rv = (await _json(resp))["metadata"]["resourceVersion"]
    headers = {"Content-Type": "application/json-patch+json"}
    stale = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "999"},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x"]},
    ]
    async with s.patch(base + CM + "/a", data=json.dumps(stale), headers=headers) as resp:
        assert resp.status == 422
    fresh = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x"]},
    ]
    async with s.patch(base + CM + "/a", data=json.dumps(fresh), headers=headers) as resp:
        assert resp.status == 200
        obj = await _json(resp)
        assert obj["metadata"]["finalizers"] == ["x"] and int(obj["metadata"]["resourceVersion"]) > int(rv)
    # Deleting with a finalizer marks it; removing the finalizer deletes it.
    async with s.delete(base + CM + "/a") as resp:
        assert resp.status == 200
    async with s.get(base + CM + "/a") as resp:
        assert (await _json(resp))["metadata"]["deletionTimestamp"]
    async with s.patch(
        base + CM + "/a",
        json={"metadata": {"finalizers": None}},
        headers={"Content-Type": "application/merge-patch+json"},
    ) as resp:
        assert resp.status == 200
    async with s.get(base + CM + "/a") as resp:
        assert resp.status == 404


async def test_list_then_watch_from_its_version(http: tuple[str, aiohttp.ClientSession]) -> None:
    base, s = http
    for name in ("a", "b"):
        async with s.post(base + CM, json={"metadata": {"name": name}}):
            pass
    async with s.get(base + "/api/v1/configmaps") as resp:
        listing = await _json(resp)
    assert listing["kind"] == "ConfigMapList" and len(listing["items"]) == 2
    rv = listing["metadata"]["resourceVersion"]
    async with s.patch(
        base + CM + "/b", json={"data": {"k": "v"}}, headers={"Content-Type": "application/merge-patch+json"}
    ):
        pass

    events: list[dict[str, Any]] = []

    async def watch() -> None:
        async with s.get(base + "/api/v1/configmaps", params={"watch": "True", "resourceVersion": rv}) as resp:
            async for line in resp.content:
                if line.strip():
                    events.append(json.loads(line))

    task = asyncio.create_task(watch())
    try:
        async with s.post(base + CM, json={"metadata": {"name": "c"}}):
            pass
        for _ in range(200):
            if len(events) >= 2:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    # Only what changed after the listed version: "b" (modified before the watch) and "c"; not "a".
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b"), ("ADDED", "c")]


async def test_crd_creation_makes_the_resource_discoverable(
    kmock: RealisticEmulator, http: tuple[str, aiohttp.ClientSession]
) -> None:
    base, s = http
    crd = load_yaml(CRD_PATH)
    async with s.post(base + "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd) as resp:
        assert resp.status == 201
    async with s.get(base + "/apis/serving.tandem.dev/v1alpha1") as resp:
        listing = await _json(resp)
    names = {r["name"]: r for r in listing["resources"]}
    assert names["inferenceservices"]["kind"] == "InferenceService" and "inferenceservices/status" in names
    assert names["inferenceservices"]["shortNames"] == ["tisvc"] and names["inferenceservices"]["namespaced"]
    async with s.get(base + "/api/v1") as resp:
        assert (await _json(resp))["groupVersion"] == "v1"
    async with s.get(base + CM + "/missing") as resp:
        assert resp.status == 404 and (await _json(resp))["reason"] == "NotFound"
    async with s.post(
        base + CM, data=b"k8s\x00\x0a", headers={"Content-Type": "application/vnd.kubernetes.protobuf"}
    ) as resp:
        assert resp.status == 415
