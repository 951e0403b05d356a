"""End to end: the real operator (kopf run with `tandem operator`'s arguments) against the KMock apiserver.

Tests talk to the emulator over HTTP for writes (so kopf sees watch events) and read its store
directly for assertions. KMock has no garbage collector, no kubelet and no Deployment controller:
tests write Deployment status themselves, as those would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kmock as kmock_lib
import pytest
from isvc_utils import OPERATOR_ARGS, Api, condition, eventually, example, prepare
from kopf.testing import KopfRunner
from kube_emulator import RealisticEmulator

from tandem_operator.cli import kopf_args

pytestmark = [pytest.mark.kmock(cls=RealisticEmulator), pytest.mark.timeout(90)]

NAME = "smollm2-pd"
ISVC = "serving.tandem.dev/v1alpha1/inferenceservices"
RESOURCES = {
    "ConfigMap": "v1/configmaps",
    "ServiceAccount": "v1/serviceaccounts",
    "Role": "rbac.authorization.k8s.io/v1/roles",
    "RoleBinding": "rbac.authorization.k8s.io/v1/rolebindings",
    "Service": "v1/services",
    "Deployment": "apps/v1/deployments",
}


def expected_children(name: str, prefill: bool = True) -> set[tuple[str, str]]:
    kids = {
        ("ConfigMap", f"{name}-engine-config"),
        ("ServiceAccount", f"{name}-router"),
        ("Role", f"{name}-router"),
        ("RoleBinding", f"{name}-router"),
        ("Service", f"{name}-decode"),
        ("Service", f"{name}-router"),
        ("Deployment", f"{name}-decode"),
        ("Deployment", f"{name}-router"),
    }
    if prefill:
        kids |= {("Service", f"{name}-prefill"), ("Deployment", f"{name}-prefill")}
    return kids


@pytest.fixture()
async def api(kmock: RealisticEmulator, kubeconfig: Any) -> AsyncIterator[Api]:
    prepare(kmock)
    kubeconfig(str(kmock.url))
    async with aiohttp.ClientSession() as session:
        yield Api(str(kmock.url), session)


async def start_operator(kmock: RealisticEmulator) -> KopfRunner:
    runner = KopfRunner(kopf_args(OPERATOR_ARGS), timeout=10)
    runner.__enter__()
    # kopf handles nothing until every index is filled; wait for its watches rather than guess.
    await eventually(
        lambda: _async(kmock.watchers(ISVC) > 0 and kmock.watchers("apps/v1/deployments") > 0),
        timeout=30,
        interval=0.05,
    )
    return runner


async def stop_operator(runner: KopfRunner) -> None:
    # Exit off the loop: the emulator serves from this loop while kopf shuts down.
    await asyncio.to_thread(runner.__exit__, None, None, None)


@pytest.fixture()
async def operator(api: Api, kmock: RealisticEmulator) -> AsyncIterator[KopfRunner]:
    runner = await start_operator(kmock)
    try:
        yield runner
    finally:
        await stop_operator(runner)
    server_errors = [e for e in kmock.errors if not isinstance(e, kmock_lib.KubernetesError)]
    assert not server_errors, server_errors


async def _async(value: Any) -> Any:
    return value


def present(kmock: RealisticEmulator, name: str = NAME, ns: str = "default") -> set[tuple[str, str]]:
    return {
        (kind, child) for kind, child in expected_children(name) if kmock.stored(RESOURCES[kind], ns, child) is not None
    }


def deployment(kmock: RealisticEmulator, name: str, ns: str = "default") -> dict[str, Any]:
    dep = kmock.stored("apps/v1/deployments", ns, name)
    assert dep is not None, name
    return dep


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def engine(dep: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = dep["spec"]["template"]["spec"]["containers"][0]
    return container


async def isvc_state(kmock: RealisticEmulator, name: str = NAME) -> dict[str, Any]:
    """The InferenceService once the operator has written a status for it."""

    def with_status() -> dict[str, Any] | None:
        obj = kmock.stored(ISVC, "default", name)
        return obj if obj is not None and (obj.get("status") or {}).get("conditions") else None

    state: dict[str, Any] = await eventually(lambda: _async(with_status()))
    return state


async def test_create_builds_every_child_within_two_seconds(
    api: Api, operator: KopfRunner, kmock: RealisticEmulator
) -> None:
    started = time.monotonic()
    isvc = await api.create("InferenceService", example("disaggregated"))
    await eventually(lambda: _async(present(kmock) == expected_children(NAME)), interval=0.01)
    elapsed = time.monotonic() - started
    assert elapsed < 2.0, f"children took {elapsed:.2f}s"

    for kind, name in expected_children(NAME):
        child = kmock.stored(RESOURCES[kind], "default", name)
        assert child is not None
        assert child["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "serving.tandem.dev/v1alpha1",
                "kind": "InferenceService",
                "name": NAME,
                "uid": isvc["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert child["metadata"]["labels"]["serving.tandem.dev/inferenceservice"] == NAME
    for role in ("prefill", "decode", "router"):
        dep = deployment(kmock, f"{NAME}-{role}")
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert pod_labels["serving.tandem.dev/role"] == role
        assert dep["spec"]["selector"]["matchLabels"] == {
            "serving.tandem.dev/inferenceservice": NAME,
            "serving.tandem.dev/role": role,
        }
        assert engine(dep)["image"] == "ghcr.io/tandem-dev/tandem-worker:0.1.0"
        assert engine(dep)["readinessProbe"]["httpGet"]["path"] == "/health"
        assert engine(dep)["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"

    prefill, decode = deployment(kmock, f"{NAME}-prefill"), deployment(kmock, f"{NAME}-decode")
    assert decode["spec"]["replicas"] == 2 and prefill["spec"]["replicas"] == 1
    p_args, d_args = engine(prefill)["args"], engine(decode)["args"]
    assert flag(p_args, "--role") == "prefill" and flag(d_args, "--role") == "decode"
    for shared in ("--model", "--dtype", "--block-size", "--max-model-len", "--kv-side-channel-port"):
        assert flag(p_args, shared) == flag(d_args, shared)
    assert (
        engine(prefill)["startupProbe"]["failureThreshold"] * engine(prefill)["startupProbe"]["periodSeconds"] >= 1800
    )
    assert {p["name"]: p["containerPort"] for p in engine(prefill)["ports"]} == {
        "http": 8000,
        "kv-side": 5600,
    }
    router = engine(deployment(kmock, f"{NAME}-router"))
    assert router["args"][0] == "route"
    assert flag(router["args"], "--policy") == "prefix-aware"
    assert flag(router["args"], "--discovery") == "kubernetes"
    assert flag(router["args"], "--selector") == f"serving.tandem.dev/inferenceservice={NAME}"

    state = await isvc_state(kmock)
    assert state["status"]["observedGeneration"] == 1
    assert state["status"]["endpoint"]["url"] == f"http://{NAME}-router.default.svc"
    assert condition(state, "Ready")["status"] == "False"  # type: ignore[index]


async def test_colocated_has_no_prefill(api: Api, operator: KopfRunner, kmock: RealisticEmulator) -> None:
    await api.create("InferenceService", example("colocated"))
    expected = expected_children("smollm2", prefill=False)
    await eventually(lambda: _async(present(kmock, "smollm2") == expected))
    assert kmock.stored("apps/v1/deployments", "default", "smollm2-prefill") is None
    args = engine(deployment(kmock, "smollm2-decode"))["args"]
    assert flag(args, "--role") == "both" and "--kv-side-channel-port" not in args
    router_args = engine(deployment(kmock, "smollm2-router"))["args"]
    assert "--prefill" not in router_args and flag(router_args, "--policy") == "least-load"
    state = await isvc_state(kmock, "smollm2")
    assert condition(state, "PrefillReady")["reason"] == "Disabled"  # type: ignore[index]


async def test_scale_and_spec_update_roll_out(api: Api, operator: KopfRunner, kmock: RealisticEmulator) -> None:
    await api.create("InferenceService", example("disaggregated"))
    await eventually(lambda: _async(present(kmock) == expected_children(NAME)))
    old_hash = deployment(kmock, f"{NAME}-decode")["spec"]["template"]["metadata"]["annotations"]

    await api.patch("InferenceService", NAME, {"spec": {"decode": {"replicas": 4}}})
    await eventually(lambda: _async(deployment(kmock, f"{NAME}-decode")["spec"]["replicas"] == 4))
    assert deployment(kmock, f"{NAME}-prefill")["spec"]["replicas"] == 1

    await api.patch("InferenceService", NAME, {"spec": {"engine": {"blockSize": 32, "maxModelLen": 4096}}})
    for role in ("prefill", "decode"):
        await eventually(
            lambda r=role: _async(flag(engine(deployment(kmock, f"{NAME}-{r}"))["args"], "--block-size") == "32")
        )
        assert flag(engine(deployment(kmock, f"{NAME}-{role}"))["args"], "--max-model-len") == "4096"
    hashes = {
        deployment(kmock, f"{NAME}-{r}")["spec"]["template"]["metadata"]["annotations"][
            "serving.tandem.dev/config-hash"
        ]
        for r in ("prefill", "decode")
    }
    assert len(hashes) == 1 and hashes != {old_hash["serving.tandem.dev/config-hash"]}
    config = kmock.stored("v1/configmaps", "default", f"{NAME}-engine-config")
    assert config is not None and '"blockSize": 32' in config["data"]["engine-config.json"]
    await eventually(
        lambda: _async((kmock.stored(ISVC, "default", NAME) or {}).get("status", {}).get("observedGeneration") == 3)
    )

    # Disaggregated -> colocated: the prefill workload and its Service go away.
    await api.patch("InferenceService", NAME, {"spec": {"prefill": {"enabled": False}}})
    await eventually(
        lambda: _async(
            kmock.stored("apps/v1/deployments", "default", f"{NAME}-prefill") is None
            and kmock.stored("v1/services", "default", f"{NAME}-prefill") is None
        )
    )
    assert flag(engine(deployment(kmock, f"{NAME}-decode"))["args"], "--role") == "both"


async def test_deleted_or_edited_child_is_restored(api: Api, operator: KopfRunner, kmock: RealisticEmulator) -> None:
    await api.create("InferenceService", example("disaggregated"))
    await eventually(lambda: _async(present(kmock) == expected_children(NAME)))
    first_uid = deployment(kmock, f"{NAME}-decode")["metadata"]["uid"]

    assert await api.delete("Deployment", f"{NAME}-decode") == 200
    assert await api.delete("ConfigMap", f"{NAME}-engine-config") == 200
    await eventually(lambda: _async(present(kmock) == expected_children(NAME)))
    assert deployment(kmock, f"{NAME}-decode")["metadata"]["uid"] != first_uid

    router = deployment(kmock, f"{NAME}-router")
    edited = router["spec"]["template"]["spec"]["containers"]
    edited[0]["args"] = ["route", "--policy", "round-robin"]
    await api.patch(
        "Deployment",
        f"{NAME}-router",
        {"spec": {"replicas": 7, "template": {"spec": {"containers": edited}}}},
    )
    await eventually(lambda: _async(deployment(kmock, f"{NAME}-router")["spec"]["replicas"] == 1))
    assert flag(engine(deployment(kmock, f"{NAME}-router"))["args"], "--policy") == "prefix-aware"

    await api.patch(
        "Role", f"{NAME}-router", {"rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]}
    )
    await eventually(
        lambda: _async(
            (kmock.stored(RESOURCES["Role"], "default", f"{NAME}-router") or {}).get("rules", [{}])[0].get("resources")
            == ["endpointslices"]
        )
    )


async def test_status_follows_children(api: Api, operator: KopfRunner, kmock: RealisticEmulator) -> None:
    await api.create("InferenceService", example("disaggregated"))
    await eventually(lambda: _async(present(kmock) == expected_children(NAME)))
    await eventually(
        lambda: _async(
            (condition(kmock.stored(ISVC, "default", NAME), "DecodeReady") or {}).get("reason") == "RolloutPending"
        )
    )

    await api.kubelet_reports(f"{NAME}-prefill", ready=1)
    await api.kubelet_reports(f"{NAME}-decode", ready=1)
    await api.kubelet_reports(f"{NAME}-router", ready=1)

    async def decode_partly_ready() -> bool:
        s = await isvc_state(kmock)
        return bool(
            condition(s, "PrefillReady")["status"] == "True"  # type: ignore[index]
            and condition(s, "DecodeReady")["reason"] == "PodsNotReady"
        )  # type: ignore[index]

    await eventually(decode_partly_ready)
    state = await isvc_state(kmock)
    assert condition(state, "Ready")["status"] == "False"  # type: ignore[index]
    assert state["status"]["decode"] == {
        "replicas": 2,
        "readyReplicas": 1,
        "updatedReplicas": 2,
        "ready": "1/2",
    }

    await api.kubelet_reports(f"{NAME}-decode", ready=2)
    await eventually(lambda: _async(condition(kmock.stored(ISVC, "default", NAME), "Ready")["status"] == "True"))  # type: ignore[index]
    state = await isvc_state(kmock)
    ready = condition(state, "Ready")
    assert ready is not None and ready["reason"] == "AllRolesReady" and ready["observedGeneration"] == 1
    assert state["status"]["router"]["ready"] == "1/1"

    # A router pod goes unready: Ready follows.
    await api.kubelet_reports(f"{NAME}-router", ready=0)
    await eventually(lambda: _async(condition(kmock.stored(ISVC, "default", NAME), "Ready")["status"] == "False"))  # type: ignore[index]
    assert condition(await isvc_state(kmock), "RouterReady")["reason"] == "PodsNotReady"  # type: ignore[index]


@pytest.mark.parametrize(
    "spec_patch, problem",
    [
        ({"decode": {"replicas": -1}}, "spec.decode.replicas"),
        ({"router": {"policy": "Random"}}, "spec.router.policy"),
        ({"kvTransfer": None}, "spec.kvTransfer"),
    ],
)
async def test_invalid_spec_is_reported_not_crashed(
    api: Api, operator: KopfRunner, kmock: RealisticEmulator, spec_patch: dict[str, Any], problem: str
) -> None:
    body = example("disaggregated")
    for key, value in spec_patch.items():
        if value is None:
            body["spec"].pop(key)
        else:
            body["spec"][key].update(value)
    await api.create("InferenceService", body)

    async def reported() -> dict[str, Any] | None:
        return condition(kmock.stored(ISVC, "default", NAME), "Ready")

    ready = await eventually(reported)
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec" and problem in ready["message"]
    events = await eventually(lambda: _invalid_spec_events(api))
    assert problem in events[0]["message"]
    assert present(kmock) == set()

    # Fixing the spec is an ordinary update: the operator is still alive and builds everything.
    await api.patch("InferenceService", NAME, {"spec": example("disaggregated")["spec"]})
    await eventually(lambda: _async(present(kmock) == expected_children(NAME)))
    await eventually(
        lambda: _async((condition(kmock.stored(ISVC, "default", NAME), "Ready") or {}).get("reason") == "RolesNotReady")
    )


async def _invalid_spec_events(api: Api) -> list[dict[str, Any]]:
    return [e for e in await api.list("Event") if e.get("reason") == "InvalidSpec"]


async def test_deletion_and_resume(api: Api, kmock: RealisticEmulator) -> None:
    runner = await start_operator(kmock)
    try:
        await api.create("InferenceService", example("disaggregated"))
        await eventually(lambda: _async(present(kmock) == expected_children(NAME)))
    finally:
        await stop_operator(runner)

    # Drift while the operator is down is repaired when it resumes.
    assert await api.delete("Service", f"{NAME}-router") == 200
    runner = await start_operator(kmock)
    try:
        await eventually(lambda: _async(present(kmock) == expected_children(NAME)))
        # Deleting the service: no finalizer holds it, and its children are not resurrected after.
        assert await api.delete("InferenceService", NAME) == 200
        assert kmock.stored(ISVC, "default", NAME) is None
        assert await api.delete("Deployment", f"{NAME}-decode") == 200
        await asyncio.sleep(0.5)
        assert kmock.stored("apps/v1/deployments", "default", f"{NAME}-decode") is None
    finally:
        await stop_operator(runner)
    assert not [e for e in kmock.errors if not isinstance(e, kmock_lib.KubernetesError)]


async def test_namespace_scoped_mode(api: Api, kmock: RealisticEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--namespace` plus the chart's namespace-scope setting: only the watched namespace is served."""
    monkeypatch.setenv("TANDEM_OPERATOR_NO_SCANNING", "1")  # what the chart sets with rbac.scope=Namespace
    runner = KopfRunner(kopf_args(["--standalone", "--namespace=team-a"]), timeout=10)
    runner.__enter__()
    try:
        await eventually(lambda: _async(kmock.watchers(ISVC) > 0), timeout=30, interval=0.05)
        await api.create("InferenceService", example("colocated"), ns="team-b")
        await api.create("InferenceService", example("colocated"), ns="team-a")
        await eventually(lambda: _async(kmock.stored("apps/v1/deployments", "team-a", "smollm2-router") is not None))
        await asyncio.sleep(0.5)
        assert kmock.stored("apps/v1/deployments", "team-b", "smollm2-router") is None
    finally:
        await stop_operator(runner)
