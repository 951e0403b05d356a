"""Unit tests of status derivation, the three-way merge helpers, the CLI wiring and the import boundary."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from isvc_utils import REPO, example

from tandem_operator.cli import kopf_args
from tandem_operator.naming import Component
from tandem_operator.reconcile import contains, merge, removals
from tandem_operator.spec import parse_spec
from tandem_operator.status import compute_status, invalid_status, role_state, same_status


def dep(
    replicas: int,
    ready: int,
    updated: int | None = None,
    total: int | None = None,
    generation: int = 2,
    observed: int = 2,
    deadline: bool = False,
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "observedGeneration": observed,
        "readyReplicas": ready,
        "updatedReplicas": replicas if updated is None else updated,
        "replicas": replicas if total is None else total,
    }
    if deadline:
        status["conditions"] = [
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "too slow",
            }
        ]
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas}, "status": status}


def test_role_state_reasons() -> None:
    assert role_state(None, 2).reason == "DeploymentMissing"
    assert role_state(dep(2, 2, observed=1), 2).reason == "RolloutPending"
    assert role_state(dep(3, 3), 2).reason == "RolloutPending"  # spec.replicas not yet what we want
    assert role_state(dep(2, 2, updated=1), 2).reason == "RolloutInProgress"
    assert role_state(dep(2, 2, total=3), 2).reason == "RolloutInProgress"  # old pods still around
    assert role_state(dep(2, 1), 2).reason == "PodsNotReady"
    assert role_state(dep(0, 0), 0).reason == "ScaledToZero"
    assert role_state(dep(2, 0, deadline=True), 2).reason == "ProgressDeadlineExceeded"
    ok = role_state(dep(2, 2), 2)
    assert ok.ok and ok.reason == "ReplicasReady" and ok.as_status()["ready"] == "2/2"


def test_compute_status_and_stable_transition_times() -> None:
    spec = parse_spec(example("disaggregated", namespace="ns"))
    deps = {Component.PREFILL: dep(1, 1), Component.DECODE: dep(2, 1), Component.ROUTER: dep(1, 1)}
    first = compute_status(spec, 5, deps, {})
    conds = {c["type"]: c for c in first["conditions"]}
    assert [c["type"] for c in first["conditions"]] == ["PrefillReady", "DecodeReady", "RouterReady", "Ready",
                                                       "KVTransferVerified"]
    assert conds["PrefillReady"]["status"] == "True" and conds["DecodeReady"]["reason"] == "PodsNotReady"
    assert conds["Ready"]["status"] == "False" and "decode: PodsNotReady" in conds["Ready"]["message"]
    assert all(c["observedGeneration"] == 5 for c in first["conditions"])
    assert first["endpoint"] == {"url": "http://smollm2-pd-router.ns.svc", "model": "smollm2-135m-instruct"}

    # Nothing changed: identical status, so no write is needed.
    again = compute_status(spec, 5, deps, first)
    assert again == first and same_status(first, again)

    old = dict(first, conditions=[dict(c, lastTransitionTime="2020-01-01T00:00:00Z") for c in first["conditions"]])
    deps[Component.DECODE] = dep(2, 2)
    ready = compute_status(spec, 5, deps, old)
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times["PrefillReady"] == "2020-01-01T00:00:00Z"  # unchanged condition keeps its time
    assert times["Ready"] != "2020-01-01T00:00:00Z"  # changed condition gets a new one
    assert {c["type"]: c["status"] for c in ready["conditions"]}["Ready"] == "True"


def test_colocated_status_drops_prefill() -> None:
    spec = parse_spec(example("colocated", namespace="ns"))
    status = compute_status(spec, 1, {Component.DECODE: dep(1, 1), Component.ROUTER: dep(1, 1)}, {})
    assert status["prefill"] is None
    assert {c["type"]: c["reason"] for c in status["conditions"]}["PrefillReady"] == "Disabled"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
    assert not same_status({"prefill": {"ready": "1/1"}}, {"prefill": None})


def test_invalid_status_keeps_role_conditions() -> None:
    spec = parse_spec(example("colocated", namespace="ns"))
    good = compute_status(spec, 1, {Component.DECODE: dep(1, 1), Component.ROUTER: dep(1, 1)}, {})
    bad = invalid_status(["spec.router.policy: unsupported"], 2, good)
    conds = {c["type"]: c for c in bad["conditions"]}
    assert conds["Ready"]["reason"] == "InvalidSpec" and conds["Ready"]["observedGeneration"] == 2
    assert conds["DecodeReady"]["status"] == "True" and bad["observedGeneration"] == 2


def test_three_way_merge_helpers() -> None:
    actual = {
        "spec": {
            "replicas": 2,
            "strategy": {"type": "RollingUpdate"},
            "ports": [{"port": 1, "protocol": "TCP"}],
        }
    }
    assert contains(actual, {"spec": {"replicas": 2, "ports": [{"port": 1}]}})
    assert not contains(actual, {"spec": {"replicas": 3}})
    assert not contains(actual, {"spec": {"ports": [{"port": 1}, {"port": 2}]}})
    # The API server omits empty values (Go `omitempty`): a child written with them reads back without.
    as_served = {"spec": {"clusterIP": "None", "ports": [{"port": 1}]}}
    assert contains(as_served, {"spec": {"publishNotReadyAddresses": False, "ports": [{"port": 1, "name": ""}]}})
    assert contains({"spec": {}}, {"spec": {"args": [], "labels": {}, "n": 0}})
    assert not contains({"spec": {"publishNotReadyAddresses": True}}, {"spec": {"publishNotReadyAddresses": False}})
    assert not contains({"spec": {"replicas": 1}}, {"spec": {"replicas": 0}})
    previous = {"spec": {"template": {"spec": {"nodeSelector": {"a": "b"}, "containers": []}}}}
    desired = {"spec": {"template": {"spec": {"containers": []}}}}
    gone = removals(previous, desired)
    assert gone == {"spec": {"template": {"spec": {"nodeSelector": None}}}}
    assert merge(desired, gone)["spec"]["template"]["spec"] == {"containers": [], "nodeSelector": None}


def test_cli_passes_options_through_to_kopf_run() -> None:
    assert kopf_args(["-A", "--standalone"]) == [
        "run",
        "--module",
        "tandem_operator.handlers",
        "-A",
        "--standalone",
    ]
    assert kopf_args(["-n", "a", "-n", "b"])[-4:] == ["-n", "a", "-n", "b"]
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tandem_cli import main; sys.exit(main(['operator', '--help']))",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": "operator:workers"},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "--all-namespaces" in out.stdout and "--standalone" in out.stdout


def test_operator_never_imports_torch_or_the_engine() -> None:
    code = (
        "import sys, tandem_operator.handlers, tandem_operator.cli, tandem_operator.__main__; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'tandem_engine', 'tandem_router')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": "operator"},
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
