"""Operator reconcile latency and throughput against a real API server (compare: operator_reconcile.py, KMock).

    .venv/bin/python bench/operator_reconcile_cluster.py [--singles 10] [--count 100]

Starts the test control plane (tests/k8s: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
built by hack/build-tools.sh) and kwok (built by hack/build-tools.sh too) with one fake node whose pods kwok marks
Ready at once, so Deployments become available without running engines. Runs the operator in this process
(kopf, `tandem operator -A --standalone`, admin credentials, as the KMock benchmark does) and measures:
  1. a new InferenceService -> all its 10 children exist, and -> Ready=True (one at a time, `--singles`);
  2. `--count` InferenceServices created at once -> all children exist -> every one Ready=True;
  3. API writes per InferenceService on the objects the operator writes, from the apiserver's own
     `apiserver_request_total` (events excluded: the controllers write those too).
Writes bench/results/operator_reconcile_cluster.json and .md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(REPO / "operator")]

from operator_reconcile import KIDS, body  # noqa: E402
from tests.k8s.cluster import build_tools  # noqa: E402
from tests.k8s.controlplane import ControlPlane  # noqa: E402
from tests.k8s.kube import Kube  # noqa: E402
from tests.k8s.kwok import FakeNode  # noqa: E402

logger = logging.getLogger(__name__)
RESULTS = REPO / "bench" / "results"
NS = "bench"
ISVC = f"/apis/serving.tandem.dev/v1alpha1/namespaces/{NS}/inferenceservices"
# What the operator writes (kopf's own patches of the InferenceService included).
OPERATOR_RESOURCES = {"inferenceservices", "configmaps", "serviceaccounts", "roles", "rolebindings", "services",
                      "deployments"}
CONTROLLER_WRITES = {"deployments/status"}  # the Deployment controller's, not the operator's


def kid_path(resource: str, name: str) -> str:
    group_version, plural = resource.rsplit("/", 1)
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return f"{prefix}/namespaces/{NS}/{plural}/{name}"


def has_children(kube: Kube, name: str) -> bool:
    return all(kube.get_or_none(kid_path(res, tmpl.format(n=name))) is not None for res, tmpl in KIDS)


def is_ready(kube: Kube, name: str) -> bool:
    obj = kube.get_or_none(f"{ISVC}/{name}") or {}
    return any(c["type"] == "Ready" and c["status"] == "True" for c in obj.get("status", {}).get("conditions", []))


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.02) -> float:
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"not done after {timeout}s")
        time.sleep(interval)
    return time.perf_counter() - start


def writes(kube: Kube) -> dict[str, float]:
    """Write requests on the operator's resources, by resource (the Deployment controller's status aside)."""
    return {k: v for k, v in kube.writes().items()
            if k.split("/")[0] in OPERATOR_RESOURCES and k not in CONTROLLER_WRITES}


def measure_singles(kube: Kube, singles: int) -> dict[str, Any]:
    """One InferenceService at a time: seconds from create to all its children, and to Ready=True."""
    single_children, single_ready = [], []
    for i in range(singles):
        name = f"single-{i}"
        t0 = time.perf_counter()
        kube.post(ISVC, body(name))
        wait_until(lambda n=name: has_children(kube, n), 60)
        single_children.append(time.perf_counter() - t0)
        wait_until(lambda n=name: is_ready(kube, n), 120)
        single_ready.append(time.perf_counter() - t0)
    return {"runs": singles, "children_p50_s": round(statistics.median(single_children), 4),
            "children_max_s": round(max(single_children), 4),
            "ready_p50_s": round(statistics.median(single_ready), 4),
            "ready_max_s": round(max(single_ready), 4)}


def measure_bulk(kube: Kube, count: int) -> dict[str, Any]:
    """`count` InferenceServices at once: all children, all Ready=True, and the operator's API writes."""
    time.sleep(2.0)
    before = writes(kube)
    names = [f"bulk-{i:03d}" for i in range(count)]
    t0 = time.perf_counter()
    for n in names:
        kube.post(ISVC, body(n))
    created = time.perf_counter() - t0
    pending = list(names)

    def all_done(done: Callable[[Kube, str], bool]) -> Callable[[], bool]:
        def check() -> bool:
            pending[:] = [n for n in pending if not done(kube, n)]
            return not pending
        return check

    children = wait_until(all_done(has_children), 900, 0.2) + created
    pending[:] = names
    ready = wait_until(all_done(is_ready), 1800, 0.5) + children
    time.sleep(5.0)  # let the bursts' follow-up events settle before counting
    after = writes(kube)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if after.get(k, 0.0) != before.get(k, 0.0)}
    return {"services": count, "create_calls_s": round(created, 3), "all_children_s": round(children, 3),
            "all_ready_s": round(ready, 3), "writes_by_resource": delta,
            "writes_per_service": round(sum(delta.values()) / count, 1)}


def run(singles: int, count: int, work: Path) -> dict[str, Any]:
    from kopf.testing import KopfRunner

    from tandem_operator.cli import kopf_args

    bin_dir = build_tools()
    # The apiserver refuses a loopback advertise address; no pod needs to reach it here (kwok runs none).
    host_ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=True).stdout.split()[0]
    cp = ControlPlane(work / "control-plane", bin_dir, advertise_address=host_ip).start()
    kwok = None
    try:
        api = cp.api_client()
        kube = Kube(api)
        cp.kubectl("apply", "-f", str(REPO / "crds"), check=True)
        # Untainted: no other node here, so every pod belongs on the fake node.
        kwok = FakeNode(bin_dir, cp.kubeconfig, kube, work / "kwok.log", taint=False).start()
        kube.post("/api/v1/namespaces", {"metadata": {"name": NS}})
        wait_until(lambda: kube.get_or_none(f"/api/v1/namespaces/{NS}/serviceaccounts/default") is not None, 60)
        os.environ["KUBECONFIG"] = str(cp.kubeconfig)
        import kubernetes.config.kube_config as kube_config

        kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(cp.kubeconfig)
        runner = KopfRunner(kopf_args(["--standalone", "-A", "--quiet"]), timeout=60)
        started = time.perf_counter()
        runner.__enter__()
        try:
            kube.post(ISVC, body("warm-up"))
            wait_until(lambda: is_ready(kube, "warm-up"), 300)
            startup = time.perf_counter() - started
            single = measure_singles(kube, singles)
            bulk = measure_bulk(kube, count)
        finally:
            runner.__exit__(None, None, None)
        api.close()
    finally:
        if kwok is not None:
            kwok.stop()
        cp.stop()
    return {
        "setup": {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
                  "load_before": LOAD_BEFORE, "apiserver": "kube-apiserver v1.37.2 + etcd v3.7.3 (tests/k8s), "
                  "controller-manager and scheduler; kwok v0.8.0 fake node",
                  "children_per_service": len(KIDS), "example": "crds/examples/disaggregated.yaml"},
        "operator_startup_to_first_ready_s": round(startup, 3),
        "single": single,
        "bulk": bulk,
    }


def markdown(r: dict[str, Any]) -> str:
    s, b = r["single"], r["bulk"]
    return "\n".join([
        "# Operator reconcile against a real API server",
        "",
        f"`bench/operator_reconcile_cluster.py`; {r['setup']['cpus']} CPUs shared by the operator, etcd, the "
        f"apiserver, controller-manager, scheduler and kwok; load average {r['setup']['load_before']:.2f} at the "
        f"start. {r['setup']['apiserver']}. Each InferenceService is `crds/examples/disaggregated.yaml` "
        f"({r['setup']['children_per_service']} children, 4 pods that kwok marks Ready).",
        "",
        "| measure | real API server | KMock (bench/results/operator_reconcile.md) |",
        "|---|---|---|",
        f"| new InferenceService to all children (p50 of {s['runs']}) | {s['children_p50_s'] * 1000:.0f} ms | "
        f"{KMOCK['single']['p50_s'] * 1000:.0f} ms |",
        f"| new InferenceService to all children (max) | {s['children_max_s'] * 1000:.0f} ms | "
        f"{KMOCK['single']['max_s'] * 1000:.0f} ms |",
        f"| new InferenceService to Ready=True (p50 / max) | {s['ready_p50_s']:.2f} / {s['ready_max_s']:.2f} s | "
        "(no controllers) |",
        f"| {b['services']} InferenceServices: all children exist | {b['all_children_s']:.1f} s | "
        f"{KMOCK['bulk']['all_children_s']:.1f} s |",
        f"| {b['services']} InferenceServices: all Ready=True | {b['all_ready_s']:.1f} s | (no controllers) |",
        f"| operator API writes per InferenceService | {b['writes_per_service']} | "
        f"{KMOCK['bulk']['writes_per_service']} |",
        "",
        "Writes by resource (the bulk phase): " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                             sorted(b["writes_by_resource"].items())) + ".",
        "",
        "Target: a new InferenceService's children exist within 2 s.",
        "",
    ])


KMOCK: dict[str, Any] = json.loads((RESULTS / "operator_reconcile.json").read_text())
LOAD_BEFORE = os.getloadavg()[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--singles", type=int, default=10)
    parser.add_argument("--count", type=int, default=100)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="reconcile-cluster-"))
    print("logs in", work, flush=True)  # kept: the control plane's and kwok's logs
    result = run(args.singles, args.count, work)
    (RESULTS / "operator_reconcile_cluster.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "operator_reconcile_cluster.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
