"""The Helm chart, linted and installed by a real Helm engine (helm-sdkpy) into the KMock apiserver.

Set TANDEM_UPDATE_GOLDEN=1 to rewrite charts/tandem/examples/golden/ after an intended change.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from isvc_utils import CRD_PATH, REPO, load_yaml

from tandem_operator.handlers import CHILD_RESOURCES

CHART = REPO / "charts" / "tandem"
GOLDEN = CHART / "examples" / "golden"
K8S_VERSIONS = ("1.28", "1.37")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("helm_sdkpy") is None,
    reason="helm-sdkpy not installed (pip install --ignore-requires-python helm-sdkpy)",
)


def _render(values: list[Path]) -> dict[str, Any]:
    env = dict(os.environ, HELM_DRIVER="memory", PYTHONPATH=os.pathsep.join(["operator", "workers", "."]))
    out = subprocess.run(
        [sys.executable, str(REPO / "tests" / "operator" / "helm_render.py"), str(CHART), *map(str, values)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    bad = tmp_path_factory.mktemp("values") / "values-bad.yaml"
    bad.write_text("operator:\n  logLevel: loud\nrbac:\n  scope: Everything\n")
    result = _render([CHART / "examples" / "values-namespaced.yaml", bad])
    installs = result["installs"]
    return {"lint": result["lint"], "default": installs[0], "namespaced": installs[1], "bad": installs[2]}


def by_kind(install: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [o for o in install["objects"] if o["kind"] == kind]


def test_lint_is_clean(rendered: dict[str, Any]) -> None:
    lint = rendered["lint"]
    assert lint["TotalChartsLinted"] == 1 and not lint["Errors"]
    assert [m for m in lint["Messages"] if m["Severity"] >= 2] == []  # no warnings or errors


def test_crds_are_copies_of_the_source() -> None:
    spec = importlib.util.spec_from_file_location("sync_crds", REPO / "charts" / "sync_crds.py")
    assert spec is not None and spec.loader is not None
    sync_crds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync_crds)
    assert sync_crds.drift() == [], "run: python charts/sync_crds.py"


def test_values_schema_accepts_the_documented_values() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = load_yaml(CHART / "values.yaml")
    jsonschema.validate(values, schema)
    for example in sorted((CHART / "examples").glob("values-*.yaml")):
        jsonschema.validate(yaml.safe_load(example.read_text()) or {}, schema)
    text = (CHART / "values.yaml").read_text()
    documented = text.count("# --")
    assert documented >= 20, "every key carries a `# --` comment"


def test_invalid_values_are_refused_by_helm(rendered: dict[str, Any]) -> None:
    bad = rendered["bad"]
    assert bad["error"] and "logLevel" in bad["error"]
    assert by_kind(bad, "Deployment") == []


@pytest.mark.parametrize("which", ["default", "namespaced"])
def test_install_creates_valid_objects(rendered: dict[str, Any], which: str) -> None:
    install = rendered[which]
    assert install["error"] is None
    kinds = sorted(o["kind"] for o in install["objects"])
    assert kinds.count("CustomResourceDefinition") == 1 and kinds.count("Deployment") == 1
    hooks = [yaml.safe_load(h) for h in install["hooks"]]
    for obj in install["objects"] + hooks:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    (crd,) = by_kind(install, "CustomResourceDefinition")
    assert crd["spec"] == load_yaml(CRD_PATH)["spec"]


def test_operator_deployment(rendered: dict[str, Any]) -> None:
    (dep,) = by_kind(rendered["default"], "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/tandem-dev/tandem-operator:0.1.0"
    assert container["args"][:3] == [
        "--standalone",
        "--all-namespaces",
        "--liveness=http://0.0.0.0:8080/healthz",
    ]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert pod["serviceAccountName"] == "tandem-operator"

    (ns_dep,) = by_kind(rendered["namespaced"], "Deployment")
    ns_container = ns_dep["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=team-a" in ns_container["args"] and "--namespace=team-b" in ns_container["args"]
    assert "--all-namespaces" not in ns_container["args"] and "--verbose" in ns_container["args"]
    assert {"name": "TANDEM_OPERATOR_NO_SCANNING", "value": "1"} in ns_container["env"]


def _grants(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    grants: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants.setdefault((group, resource), set()).update(rule["verbs"])
    return grants


def test_rbac_is_least_privilege(rendered: dict[str, Any]) -> None:
    (cluster_role,) = by_kind(rendered["default"], "ClusterRole")
    grants = _grants(cluster_role["rules"])
    for group, _, plural, _ in CHILD_RESOURCES:  # exactly what the reconciler writes and watches
        assert grants[(group, plural)] == {"get", "list", "watch", "create", "patch", "delete"}
    assert grants[("serving.tandem.dev", "inferenceservices")] == {"get", "list", "watch", "patch"}
    assert grants[("serving.tandem.dev", "inferenceservices/status")] == {"get", "patch"}
    assert grants[("discovery.k8s.io", "endpointslices")] == {"get", "list", "watch"}
    assert not any("*" in key or "*" in verbs for key, verbs in grants.items())
    # Pods: only the planner's pod-deletion-cost annotation before a scale-down, never read, create or delete.
    assert ("", "secrets") not in grants and grants[("", "pods")] == {"patch"}
    namespaced = rendered["namespaced"]
    assert by_kind(namespaced, "ClusterRole") == [] and by_kind(namespaced, "ClusterRoleBinding") == []
    roles = by_kind(namespaced, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert ("apiextensions.k8s.io", "customresourcedefinitions") not in _grants(role["rules"])
    for binding in by_kind(namespaced, "RoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "tandem-operator", "namespace": "tandem-system"}
        ]


def test_notes_and_test_hook(rendered: dict[str, Any]) -> None:
    assert "NAME-router.<namespace>.svc" in rendered["default"]["notes"]
    assert "http://smollm2-pd-router.tandem-system.svc" in rendered["namespaced"]["notes"]
    (hook,) = [yaml.safe_load(h) for h in rendered["namespaced"]["hooks"]]
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = hook["spec"]["containers"][0]["args"][0]
    assert "tandem-operator.tandem-system.svc:8080/healthz" in script
    assert "http://smollm2-pd-router.tandem-system.svc/health" in script


@pytest.mark.parametrize("which", ["default", "namespaced"])
def test_golden_renders(rendered: dict[str, Any], which: str) -> None:
    text = rendered[which]["manifest"] + "".join(f"\n---\n# hook\n{h}" for h in rendered[which]["hooks"])
    path = GOLDEN / f"values-{which}.yaml"
    if os.environ.get("TANDEM_UPDATE_GOLDEN"):
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), "run with TANDEM_UPDATE_GOLDEN=1"
    assert text == path.read_text()
