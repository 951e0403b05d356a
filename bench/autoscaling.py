"""SLO-driven autoscaling on a real control plane: the share of requests that meet the TTFT and ITL
targets across a load ramp, with the planner against fixed minimum and fixed maximum replicas (cost in
replica-seconds), and the time from a first request to its first token when the pools are at zero.

    sudo .venv/bin/python bench/autoscaling.py [--low 0.4 --high 2.0 --ramp 30,90,60]

Starts the test cluster (tests/k8s: etcd, kube-apiserver, controller-manager, scheduler, and a real node
running the pods as containers from the images of docker/, their 1-CPU limits as CFS quotas) and the
operator (`tandem operator -A --standalone`, a child process with the cluster's kubeconfig). Per arm, a
colocated InferenceService (one core per engine pod, `--max-num-seqs 8`): `fixed-min` 1 decode replica,
`fixed-max` 2, `planner` min 1 max 2 with the targets below. Requests (~60-word prompts, 32 streamed tokens)
arrive at Poisson times through the router pod: `--low` req/s, then `--high`, then `--low` again, for the
`--ramp` seconds. A request meets the SLO when its TTFT is within `--ttft` and its mean inter-token time
within `--itl`. Replica-seconds integrate the ready decode pods over the ramp. Then the planner's service
gets `minReplicas: 0`; once idle at zero, one request is sent and timed to its first token (`--zero-trials`
times). Writes bench/results/autoscaling.json, .md and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "operator")]

import aiohttp  # noqa: E402
from cluster_utils import LABEL_ISVC, LABEL_ROLE  # noqa: E402
from harness import MODEL, bench_main, text  # noqa: E402
from tests.k8s.cluster import Cluster, build_tools, eventually  # noqa: E402
from tests.k8s.real_node import RealNode, product_images  # noqa: E402

from tandem_router.bench.client import Record, Target, one_request  # noqa: E402
from tandem_router.procs import TANDEM  # noqa: E402

NS = "bench"
ARMS = ("fixed-min", "fixed-max", "planner")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--low", type=float, default=0.4, help="requests/s before and after the peak")
    p.add_argument("--high", type=float, default=2.0, help="requests/s at the peak (above one engine's capacity)")
    p.add_argument("--ramp", default="30,90,60", help="seconds of low, high, low load")
    p.add_argument("--ttft", type=float, default=2.0, help="TTFT target, seconds (also the planner's)")
    p.add_argument("--itl", type=float, default=0.25, help="mean inter-token target, seconds (also the planner's)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--zero-trials", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def service(name: str, replicas: int, autoscaling: dict[str, Any] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"uri": MODEL},
        "engine": {"dtype": "float32", "maxModelLen": 1024, "maxNumSeqs": 8},
        "prefill": {"enabled": False},
        "decode": {"replicas": replicas, "resources": {"requests": {"cpu": "500m"}, "limits": {"cpu": "1"}}},
        "router": {"policy": "LeastLoad"},
    }
    if autoscaling is not None:
        spec["autoscaling"] = autoscaling
    return {"apiVersion": "serving.tandem.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


def planner_settings(a: argparse.Namespace, minimum: int = 1, idle: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"decode": {"minReplicas": minimum, "maxReplicas": 2}, "intervalSeconds": 5,
                           "targets": {"ttftSeconds": a.ttft, "itlSeconds": a.itl},
                           "scaleUp": {"stabilizationSeconds": 10}, "scaleDown": {"stabilizationSeconds": 30}}
    if idle is not None:
        out["scaleToZero"] = {"idleSeconds": idle, "holdSeconds": 300}
    return out


class Bench:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def kubectl(self, *args: str, input: str | None = None) -> str:
        out = self.cluster.kubectl(*args, input=input)
        if out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {out.stderr}")
        return out.stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", "-o", "json", *args))

    def ready_pods(self, name: str, role: str) -> list[dict[str, Any]]:
        items = self.get("pods", "-n", NS, "-l", f"{LABEL_ISVC}={name},{LABEL_ROLE}={role}")["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp") and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]

    def router_url(self, name: str) -> str:
        (pod,) = self.ready_pods(name, "router")
        return f"http://{pod['status']['podIP']}:8000"

    def wait_ready(self, name: str, decode: int) -> None:
        eventually(lambda: len(self.ready_pods(name, "decode")) == decode and len(self.ready_pods(name, "router")) == 1,
                   600, f"{name} never got {decode} ready decode pods", interval_s=2)

    def delete(self, name: str) -> None:
        self.kubectl("delete", "tisvc", name, "-n", NS, "--wait=true", "--timeout=180s")
        eventually(lambda: not self.get("pods", "-n", NS, "-l", f"{LABEL_ISVC}={name}")["items"], 180,
                   f"pods of {name} remain", interval_s=2)


Timeline = list[tuple[float, int]]


async def ramp(url: str, a: argparse.Namespace, bench: Bench, name: str) -> tuple[list[Record], Timeline]:
    """Poisson arrivals low -> high -> low; returns every request and (time, ready decode pods) each second."""
    phases = [int(x) for x in a.ramp.split(",")]
    rates = [a.low, a.high, a.low]
    rng = random.Random(a.seed)
    replicas: Timeline = []
    stop = threading.Event()
    t0 = time.perf_counter()

    def sample() -> None:
        while not stop.is_set():
            replicas.append((time.perf_counter() - t0, len(bench.ready_pods(name, "decode"))))
            stop.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    records: list[Record] = []
    target = Target(url, MODEL, "completions", a.max_tokens, timeout=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = []
        end = 0.0
        for seconds, rate in zip(phases, rates, strict=True):
            end += seconds
            while time.perf_counter() - t0 < end:
                rec = Record(start=0.0, group=len(records), turn=0)
                records.append(rec)
                prompt = text(a.prompt_words, seed=a.seed * 100_000 + len(records))
                tasks.append(asyncio.create_task(one_request(http, target, [], prompt, rec, t0)))
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    stop.set()
    sampler.join()
    return records, replicas


def outcome(records: list[Record], replicas: Timeline, a: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    met = [r for r in ok if r.ttft <= a.ttft and (r.tpot is None or r.tpot <= a.itl)]
    met_ids = {id(r) for r in met}
    seconds = sum((t1 - t0) * n for (t0, n), (t1, _) in zip(replicas, replicas[1:], strict=False))
    return {"requests": len(records), "completed": len(ok), "met_slo": len(met),
            "slo_attainment": len(met) / len(records) if records else 0.0, "replica_seconds": round(seconds, 1),
            "timeline": [{"t": round(t, 1), "ready": n} for t, n in replicas],
            "requests_timeline": [{"t": round(r.start, 2), "met": id(r) in met_ids} for r in records]}


async def first_token_from_zero(bench: Bench, name: str, a: argparse.Namespace) -> float:
    """Once the planner's service is idle at zero: seconds from one request to its first token."""
    eventually(lambda: bench.get("tisvc", name, "-n", NS)["spec"]["decode"]["replicas"] == 0, 300,
               "the pools never went to zero", interval_s=2)
    eventually(lambda: not bench.get("pods", "-n", NS, "-l", f"{LABEL_ISVC}={name},{LABEL_ROLE}=decode")["items"],
               180, "decode pods remain at zero", interval_s=2)
    url = bench.router_url(name)
    rec = Record(start=0.0, group=0, turn=0)
    async with aiohttp.ClientSession() as http:
        await one_request(http, Target(url, MODEL, "completions", 8, timeout=600), [], text(20, seed=7), rec,
                          time.perf_counter())
    if not rec.ok:
        raise RuntimeError(f"the request after scale to zero failed: {rec.error}")
    return rec.ttft


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    bin_dir = build_tools()
    node = RealNode(work / "node", bin_dir, None, images=product_images())
    cluster = Cluster(work, bin_dir, real_node=node).start()
    operator = None
    try:
        bench = Bench(cluster)
        bench.kubectl("apply", "-f", str(REPO / "crds"))
        cluster.create_namespace(NS)
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        log = (work / "operator.log").open("w")
        operator = subprocess.Popen([*TANDEM, "operator", "-A", "--standalone"], env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
        arms: dict[str, Any] = {}
        for arm in ARMS:
            replicas = 2 if arm == "fixed-max" else 1
            body = service(arm, replicas, planner_settings(a) if arm == "planner" else None)
            bench.kubectl("apply", "-f", "-", input=json.dumps(body))
            bench.wait_ready(arm, replicas)
            url = bench.router_url(arm)
            warm = Record(start=0.0, group=0, turn=0)
            async with aiohttp.ClientSession() as http:
                await one_request(http, Target(url, MODEL, "completions", 4), [], "warm up", warm, time.perf_counter())
            records, timeline = await ramp(url, a, bench, arm)
            arms[arm] = outcome(records, timeline, a)
            print(arm, {k: v for k, v in arms[arm].items() if "timeline" not in k}, flush=True)
            if arm == "planner":
                events = bench.get("events", "-n", NS, "--field-selector", f"involvedObject.name={arm}")["items"]
                arms[arm]["events"] = [f"{e['reason']}: {e['message']}" for e in events
                                       if e["reason"] in ("ScaledUp", "ScaledDown")]
            else:
                bench.delete(arm)
        body = service("planner", 1, planner_settings(a, minimum=0, idle=30))
        bench.kubectl("apply", "-f", "-", input=json.dumps(body))
        zero = []
        for _ in range(a.zero_trials):
            zero.append(await first_token_from_zero(bench, "planner", a))
            print("first token from zero", zero[-1], flush=True)
        return {"arms": arms, "from_zero_ttft_s": zero}
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(30)
        cluster.stop()


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7))
    colors = {"fixed-min": "tab:gray", "fixed-max": "tab:blue", "planner": "tab:green"}
    for arm, r in res["arms"].items():
        top.step([p["t"] for p in r["timeline"]], [p["ready"] for p in r["timeline"]], where="post",
                 color=colors[arm], label=f"{arm}: ready decode pods")
    edges = [0.0]
    for seconds in res["config"]["ramp"].split(","):
        edges.append(edges[-1] + float(seconds))
    for x in edges[1:-1]:
        top.axvline(x, color="black", ls=":")
    top.set(xlabel="seconds", ylabel="ready decode pods", title="offered load low -> high -> low (dotted: changes)")
    top.legend(fontsize=8)
    names = list(res["arms"])
    bottom.bar([n + "\nSLO met" for n in names], [res["arms"][n]["slo_attainment"] * 100 for n in names],
               color=[colors[n] for n in names])
    bottom.set(ylabel="% of requests within TTFT and ITL targets")
    twin = bottom.twinx()
    twin.plot([n + "\nSLO met" for n in names], [res["arms"][n]["replica_seconds"] for n in names], "kD",
              label="replica-seconds")
    twin.set(ylabel="replica-seconds (diamonds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(res: dict[str, Any]) -> str:
    c = res["config"]
    zero = res["from_zero_ttft_s"]
    lines = [
        "# Autoscaling on a real control plane: SLO attainment and cost across a load ramp",
        "",
        f"`{res['command']}` at {res['time']}, 1-minute load average {res['load_average'][0]:.2f} before, "
        f"{res['load_average'][1]:.2f} after, {os.cpu_count()} cores. Test cluster (real control plane, a real "
        "node running the images as containers) and the operator; a colocated InferenceService per arm (one core per "
        f"engine pod). Poisson arrivals at {c['low']}, {c['high']}, {c['low']} requests/s for {c['ramp']} s "
        f"(~{c['prompt_words']}-word prompts, {c['max_tokens']} streamed tokens). SLO: TTFT <= {c['ttft']} s and "
        f"mean inter-token time <= {c['itl']} s. Planner: decode 1-2, the same targets, 5 s ticks, up window "
        "10 s, down window 30 s.",
        "",
        "| arm | requests | SLO met | replica-seconds |",
        "|---|---|---|---|",
    ]
    for arm, r in res["arms"].items():
        lines.append(f"| {arm} | {r['requests']} | {r['slo_attainment']:.1%} | {r['replica_seconds']:.0f} |")
    lines += ["", "Planner events:", ""] + [f"- {e}" for e in res["arms"]["planner"].get("events", [])]
    lines += ["", f"Scale from zero (idle 30 s, then one request): time to first token "
              f"{', '.join(f'{z:.1f} s' for z in zero)}.", "", "![autoscaling](autoscaling.png)", ""]
    return "\n".join(lines)


def main() -> int:
    return bench_main("autoscaling", parse_args(), run, table, plot)


if __name__ == "__main__":
    sys.exit(main())
