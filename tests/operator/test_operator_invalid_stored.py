"""The real operator (kopf run with `tandem operator`'s arguments) against the KMock apiserver, for what a
real API server cannot be made to hold on demand: an InferenceService its schema would refuse (one stored
before the CRD carried its validation, or written with validation bypassed). The operator must report it as
a condition and an Event, not crash, and build everything once it is fixed.

Everything else about reconciling runs on the real control plane: test_operator_cluster.py (objects,
controllers, garbage collector, kwok's fake node) and test_cluster_e2e.py (pods that serve).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kmock as kmock_lib
import pytest
from isvc_utils import OPERATOR_ARGS, Api, condition, eventually, example, expected_children, prepare
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
    "NetworkPolicy": "networking.k8s.io/v1/networkpolicies",
    "Service": "v1/services",
    "Deployment": "apps/v1/deployments",
}


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
