"""The user's path, literally: `kubectl apply -f crds/`, `helm install` the chart, `kubectl apply` the
disaggregated example, and get prefill, decode and router Deployments; all against one KMock apiserver.

kubectl and Helm's Go client are the real ones (kubectl from the machine image, Helm from helm-sdkpy,
in a subprocess); the operator runs in-process under KopfRunner since there is no kubelet to run
the operator's Deployment.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from isvc_utils import OPERATOR_ARGS, REPO, eventually
from kopf.testing import KopfRunner
from kube_emulator import RealisticEmulator

from tandem_operator.cli import kopf_args

pytestmark = [
    pytest.mark.kmock(cls=RealisticEmulator),
    pytest.mark.timeout(120),
]
HAS_HELM = importlib.util.find_spec("helm_sdkpy") is not None


async def run(*cmd: str, env: dict[str, str] | None = None) -> str:
    """Run a command without blocking the loop that serves the emulator."""
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=90)
    assert proc.returncode == 0, f"{cmd}: {err.decode()[-2000:]}"
    return out.decode()


@pytest.fixture()
async def cluster(kmock: RealisticEmulator, kubeconfig: Any) -> AsyncIterator[dict[str, Any]]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        kmock.resources.load_bundled()  # the builtins only: our CRD arrives through kubectl
    path: Path = kubeconfig(str(kmock.url))
    yield {"emulator": kmock, "kubeconfig": str(path), "url": str(kmock.url)}


async def kubectl(cluster: dict[str, Any], *args: str) -> str:
    extra = ["--validate=false"] if args[0] == "apply" else []  # KMock serves no /openapi
    return await run("kubectl", f"--kubeconfig={cluster['kubeconfig']}", *args, *extra)


async def test_kubectl_helm_kubectl_gives_the_deployments(cluster: dict[str, Any]) -> None:
    em: RealisticEmulator = cluster["emulator"]
    out = await kubectl(cluster, "apply", "-f", "crds/")
    assert "inferenceservices.serving.tandem.dev created" in out
    assert em.exists("apiextensions.k8s.io/v1/customresourcedefinitions", None, "inferenceservices.serving.tandem.dev")  # type: ignore[arg-type]

    if HAS_HELM:
        env = dict(os.environ, HELM_DRIVER="memory")
        release = json.loads(
            await run(
                sys.executable,
                "tests/operator/helm_render.py",
                "--server",
                cluster["url"],
                "charts/tandem",
                env=env,
            )
        )
        assert "kind: Deployment" in release["manifest"]
        assert em.exists("apps/v1/deployments", "tandem-system", "tandem-operator")
        assert em.exists("rbac.authorization.k8s.io/v1/clusterroles", None, "tandem-operator")  # type: ignore[arg-type]

    runner = KopfRunner(kopf_args(OPERATOR_ARGS), timeout=10)
    runner.__enter__()
    try:
        await eventually(lambda: _now(em.watchers("serving.tandem.dev/v1alpha1/inferenceservices") > 0), 30, 0.05)
        out = await kubectl(cluster, "apply", "-n", "default", "-f", "crds/examples/disaggregated.yaml")
        assert "smollm2-pd created" in out

        names = {role: f"smollm2-pd-{role}" for role in ("prefill", "decode", "router")}
        await eventually(lambda: _now(all(em.exists("apps/v1/deployments", "default", n) for n in names.values())))
        deployments = json.loads(await kubectl(cluster, "get", "deployments", "-n", "default", "-o", "json"))
        by_name = {d["metadata"]["name"]: d for d in deployments["items"]}
        isvc = json.loads(await kubectl(cluster, "get", "tisvc", "smollm2-pd", "-n", "default", "-o", "json"))
        for role, name in names.items():
            dep = by_name[name]
            assert dep["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
            pod = dep["spec"]["template"]
            assert pod["metadata"]["labels"]["serving.tandem.dev/role"] == role
            (container,) = pod["spec"]["containers"]
            assert container["image"] == "ghcr.io/tandem-dev/tandem-worker:0.1.0"
            assert container["ports"][0] == {"name": "http", "containerPort": 8000, "protocol": "TCP"}
            assert container["readinessProbe"]["httpGet"]["path"] == "/health"
            assert container["args"][0] == ("route" if role == "router" else "serve")
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)


async def _now(value: Any) -> Any:
    return value
