"""Operator reconcile latency and throughput against KMock (the in-memory apiserver of the tests).

    .venv/bin/python bench/operator_reconcile.py [--singles 10] [--count 100]

Runs the real operator (kopf, `tandem operator -A --standalone`) in a thread against the realistic
KMock emulator served from this process, and measures:
  1. a new InferenceService -> all its 10 children exist (one at a time, `--singles` times);
  2. `--count` InferenceServices created at once -> all children exist, then every status written;
  3. the kubelet reports every Deployment ready -> every InferenceService Ready=True.
Writes bench/results/operator_reconcile.json and .md. The emulator shares this process (and the
GIL) with kopf, so the numbers are an upper bound on the operator's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "operator"), str(REPO / "operator")]

import aiohttp  # noqa: E402
import kmock  # noqa: E402
from isvc_utils import Api, condition, example, prepare  # noqa: E402
from kube_emulator import RealisticEmulator  # noqa: E402

logger = logging.getLogger(__name__)
RESULTS = REPO / "bench" / "results"
ISVC = "serving.tandem.dev/v1alpha1/inferenceservices"
KIDS = [
    ("v1/configmaps", "{n}-engine-config"),
    ("v1/serviceaccounts", "{n}-router"),
    ("rbac.authorization.k8s.io/v1/roles", "{n}-router"),
    ("rbac.authorization.k8s.io/v1/rolebindings", "{n}-router"),
    ("v1/services", "{n}-prefill"),
    ("v1/services", "{n}-decode"),
    ("v1/services", "{n}-router"),
    ("apps/v1/deployments", "{n}-prefill"),
    ("apps/v1/deployments", "{n}-decode"),
    ("apps/v1/deployments", "{n}-router"),
]


class Progress:
    """Cheap polling: each check looks only at the services not yet done (the emulator shares this loop)."""

    def __init__(
        self, em: RealisticEmulator, names: list[str], done: Callable[[RealisticEmulator, str], bool]
    ) -> None:
        self.em, self.pending, self.done = em, list(names), done

    def __call__(self) -> bool:
        self.pending = [n for n in self.pending if not self.done(self.em, n)]
        return not self.pending


def has_children(em: RealisticEmulator, name: str) -> bool:
    return all(em.exists(res, "default", tmpl.format(n=name)) for res, tmpl in KIDS)


def has_status(em: RealisticEmulator, name: str) -> bool:
    return condition(em.stored(ISVC, "default", name), "Ready") is not None


def is_ready(em: RealisticEmulator, name: str) -> bool:
    return (condition(em.stored(ISVC, "default", name), "Ready") or {}).get("status") == "True"


async def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.005) -> float:
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"not done after {timeout}s")
        await asyncio.sleep(interval)
    return time.perf_counter() - start


def body(name: str) -> dict[str, Any]:
    obj = example("disaggregated")
    obj["metadata"]["name"] = name
    return obj


def use_kubeconfig(path: Path, url: str) -> None:
    """Point kopf and the kubernetes client at `url` through a kubeconfig written to `path`."""
    path.write_text(
        f"apiVersion: v1\nkind: Config\ncurrent-context: k\nclusters:\n- name: k\n  cluster:\n"
        f"    server: {url}\nusers:\n- name: k\n  user:\n    token: t\ncontexts:\n"
        f"- name: k\n  context:\n    cluster: k\n    user: k\n"
    )
    os.environ["KUBECONFIG"] = str(path)
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    import kubernetes.config.kube_config as kube_config

    kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(path)


async def measure_singles(api: Api, em: RealisticEmulator, singles: int) -> list[float]:
    """One InferenceService at a time: seconds from create to all its children."""
    single: list[float] = []
    for i in range(singles):
        name = f"single-{i}"
        t0 = time.perf_counter()
        await api.create("InferenceService", body(name))
        await wait_until(Progress(em, [name], has_children), 30)
        single.append(time.perf_counter() - t0)
        await wait_until(Progress(em, [name], has_status), 30)
    return single


async def measure_bulk(api: Api, em: RealisticEmulator, count: int) -> dict[str, Any]:
    """`count` InferenceServices at once: children, status, API requests, then Ready after the kubelet reports."""
    before = dict(em.served)
    names = [f"bulk-{i:03d}" for i in range(count)]
    t0 = time.perf_counter()
    await asyncio.gather(*(api.create("InferenceService", body(n)) for n in names))
    created = time.perf_counter() - t0
    children = await wait_until(Progress(em, names, has_children), 600, 0.05) + created
    status = await wait_until(Progress(em, names, has_status), 600, 0.05) + children
    await asyncio.sleep(1.0)  # let the child events of the burst settle before counting
    served = {k: em.served[k] - before.get(k, 0) for k in em.served}
    writes = sum(served.get(verb, 0) for verb in ("POST", "PATCH", "DELETE"))
    t1 = time.perf_counter()
    for n in names:
        for role in ("prefill", "decode", "router"):
            await api.kubelet_reports(f"{n}-{role}", ready=2 if role == "decode" else 1)
    reported = time.perf_counter() - t1
    ready = await wait_until(Progress(em, names, is_ready), 600, 0.05)
    return {
        "services": count,
        "create_calls_s": round(created, 3),
        "all_children_s": round(children, 3),
        "all_status_s": round(status, 3),
        "per_service_ms": round(1000 * status / count, 2),
        "api_requests": served,
        "writes_per_service": round(writes / count, 1),
        "kubelet_reports_s": round(reported, 3),
        "all_ready_after_reports_s": round(ready, 3),
    }


async def run(singles: int, count: int) -> dict[str, Any]:
    from kopf.testing import KopfRunner

    from tandem_operator.cli import kopf_args

    async with RealisticEmulator() as em, kmock.Server(em) as server, aiohttp.ClientSession() as session:
        prepare(em)
        api = Api(str(server.url), session)
        with tempfile.TemporaryDirectory() as tmp:
            use_kubeconfig(Path(tmp) / "kubeconfig", str(server.url))
            runner = KopfRunner(kopf_args(["--standalone", "-A", "--quiet"]), timeout=30)
            started = time.perf_counter()
            runner.__enter__()
            try:
                await wait_until(lambda: em.watchers(ISVC) > 0 and em.watchers("apps/v1/deployments") > 0, 60)
                startup = time.perf_counter() - started
                single = await measure_singles(api, em, singles)
                bulk = await measure_bulk(api, em, count)
            finally:
                await asyncio.to_thread(runner.__exit__, None, None, None)

    return {
        "setup": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "apiserver": "KMock 0.8 + tests/operator/kube_emulator.py, same process",
            "children_per_service": len(KIDS),
            "example": "crds/examples/disaggregated.yaml",
        },
        "operator_startup_s": round(startup, 3),
        "single": {
            "runs": singles,
            "p50_s": round(statistics.median(single), 4),
            "max_s": round(max(single), 4),
            "min_s": round(min(single), 4),
        },
        "bulk": bulk,
    }


def markdown(r: dict[str, Any]) -> str:
    s, b = r["single"], r["bulk"]
    return "\n".join(
        [
            "# Operator reconcile against KMock",
            "",
            f"`bench/operator_reconcile.py`; {r['setup']['cpus']} CPUs, Python {r['setup']['python']}; "
            "the emulator runs in the same process as kopf. "
            "Each InferenceService is `crds/examples/disaggregated.yaml` "
            f"({r['setup']['children_per_service']} children).",
            "",
            "| measure | value |",
            "|---|---|",
            f"| operator start to watching | {r['operator_startup_s']:.2f} s |",
            f"| new InferenceService to all children (p50 of {s['runs']}) | {s['p50_s'] * 1000:.0f} ms |",
            f"| new InferenceService to all children (max) | {s['max_s'] * 1000:.0f} ms |",
            f"| {b['services']} InferenceServices: all children exist | {b['all_children_s']:.2f} s |",
            f"| {b['services']} InferenceServices: every status written | {b['all_status_s']:.2f} s "
            f"({b['per_service_ms']:.0f} ms each) |",
            f"| API writes per InferenceService (create + patch + delete) | {b['writes_per_service']} |",
            f"| {b['services']} services Ready after the kubelet reports "
            f"| {b['all_ready_after_reports_s']:.2f} s |",
            "",
            "Target ([docs/benchmarks.md](../../docs/benchmarks.md#targets)): a new InferenceService's children "
            "exist within 2 s.",
            "",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--singles", type=int, default=10)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = asyncio.run(run(args.singles, args.count))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "operator_reconcile.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "operator_reconcile.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
