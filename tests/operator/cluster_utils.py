"""kubectl and helm against the test cluster (tests/k8s), for test_cluster_e2e.py: the chart-installed operator,
InferenceServices whose pods serve, and what their engines answer."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from tests.k8s.cluster import Cluster, eventually

REPO = Path(__file__).resolve().parents[2]
OPERATOR_NS = "tandem-system"
LABEL_ISVC = "serving.tandem.dev/inferenceservice"
LABEL_ROLE = "serving.tandem.dev/role"
# Long enough (> the router's 32-token remote-prefill threshold) that the router sends it prefill -> decode.
MESSAGES = [{"role": "system", "content": "You are a patient art teacher who answers in short lists. " * 4},
            {"role": "user", "content": "Name three colours."}]
SUBJECTS = ("art", "music", "history", "cooking")


def messages(variant: int = 0) -> list[dict[str, str]]:
    """MESSAGES (variant 0), or the same chat for another subject's teacher: a prompt that shares no block
    with the others, so a decode engine that served one holds none of another's KV blocks."""
    return [{**MESSAGES[0], "content": MESSAGES[0]["content"].replace("art", SUBJECTS[variant])}, MESSAGES[1]]


class Env:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
                    "PATH": f"{cluster.bin_dir}:{os.environ['PATH']}",
                    "HELM_CACHE_HOME": str(cluster.work_dir / "helm-cache"),
                    "HELM_CONFIG_HOME": str(cluster.work_dir / "helm-config"),
                    "HELM_DATA_HOME": str(cluster.work_dir / "helm-data")}

    def run(self, *argv: str, input: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env=self.env, input=input, capture_output=True, text=True, timeout=timeout,
                              cwd=REPO)

    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, input=input)

    def ok(self, *argv: str, input: str | None = None, timeout: float = 300) -> str:
        out = self.run(*argv, input=input, timeout=timeout)
        assert out.returncode == 0, f"{' '.join(argv)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
        return out.stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.ok("kubectl", "get", "-o", "json", *args))

    def pods(self, ns: str, name: str, role: str) -> list[dict[str, Any]]:
        items = self.get("pods", "-n", ns, "-l", f"{LABEL_ISVC}={name},{LABEL_ROLE}={role}")["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def ready_pods(self, ns: str, name: str, role: str) -> list[dict[str, Any]]:
        return [p for p in self.pods(ns, name, role)
                if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]

    def url(self, pod: dict[str, Any]) -> str:
        (container,) = pod["spec"]["containers"]
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
        return f"http://{pod['status']['podIP']}:{port}"

    def logs(self, ns: str) -> str:
        """The last lines each pod of `ns` printed (`kubectl logs`; of the previous run after a restart)."""
        out = []
        for p in self.get("pods", "-n", ns)["items"]:
            name = p["metadata"]["name"]
            text = self.kubectl("logs", name, "-n", ns, "--all-containers", "--tail=60").stdout
            out.append(f"--- {name}\n{text}")
        return "\n".join(out)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), {})




def chat_usage(url: str, max_tokens: int = 12, variant: int = 0) -> tuple[str, int]:
    """The greedy answer to `messages(variant)` and its prompt's token count."""
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "smollm2-135m-instruct", "messages": messages(variant), "max_tokens": max_tokens,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"]), int(r.json()["usage"]["prompt_tokens"])


def chat(url: str, max_tokens: int = 12, variant: int = 0) -> str:
    return chat_usage(url, max_tokens, variant)[0]


def blocks_read(prompt_tokens: int, block_size: int = 16) -> int:
    """KV blocks a decode engine holding none of the prompt reads from prefill: all but the last token's,
    which it recomputes for its logits (the examples' blockSize is 16)."""
    return -(-(prompt_tokens - 1) // block_size)


def wait_ready(env: Env, ns: str, name: str, timeout: float = 600) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        obj = env.get("tisvc", name, "-n", ns)
        c = condition(obj, "Ready")
        ok = c.get("status") == "True" and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
        return obj if ok else None

    try:
        return eventually(ready, timeout, f"{name} never became Ready", interval_s=2)  # type: ignore[no-any-return]
    except AssertionError:
        print(env.ok("kubectl", "get", "tisvc,deploy,rs,pods,endpointslices", "-n", ns, "-o", "wide"))
        print(env.logs(ns))
        print(env.logs(OPERATOR_NS))
        raise


def apply_example(env: Env, example: str, ns: str) -> str:
    env.ok("kubectl", "create", "namespace", ns)
    eventually(lambda: env.kubectl("get", "sa/default", "-n", ns).returncode == 0, 60, "no default SA")
    t0 = time.monotonic()
    env.ok("kubectl", "apply", "-n", ns, "-f", f"crds/examples/{example}.yaml")
    return f"{t0}"
