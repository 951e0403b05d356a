"""tandem in containers (a real kubelet running the images of docker/) against the stand-ins they replace:

  1. images: each image's size, and with `--rebuild` its build time (hack/build-images.sh --rebuild: the
     Debian base and both images again, every step, no build cache);
  2. an engine pod, created -> Ready (its condition, as the kubelet reports it) and -> answering /health
     (polled from the host every 0.1 s): from the worker image on the real node, the first pod after the
     node started and then `--runs` more, against the same engine started as a process from .venv (what
     the test node agent, the stand-in the real node replaced, ran for a pod);
  3. KV transfer between a prefill and a decode pod (UCX_TLS=tcp: each in its own network namespace), per
     request from the decode engine's own tandem:kv_transfer_seconds and block count, against raw TCP
     between the same two network namespaces in the same run (a Python socket pair in the two containers,
     started by `kubectl exec`, moving the same bytes);
  4. P/D TTFT and ITL under bench/pd_latency.py's load with prefill and decode in those pods, against the
     same two engines as local processes sharing the host's IPC and network namespaces (what every P/D
     test ran on before). The local engines build their CPU kernels for x86-64-v3, as the image does, so
     the two differ only in where they run;
  5. what the image's kernels cost on this CPU: one engine's single-stream decode rate with the kernels
     the image holds for it (the first of x86-64-v4,x86-64-v3 it has), with x86-64-v3 alone (the image's
     only level before), and with -march=native (what `make run` builds), local processes.

    .venv/bin/python bench/k8s_containers.py [--rebuild] [--runs 3] [--kv-runs 10]      (as root)

Needs the tools, node packages and images of `make cluster`. Writes bench/results/k8s_containers.*.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from harness import MODEL, RESULTS, bench_main, describe, save_plot, text  # noqa: E402
from pd_latency import Target, measure  # noqa: E402
from tests.k8s.cluster import Cluster, build_tools, eventually  # noqa: E402
from tests.k8s.real_node import RealNode, product_images  # noqa: E402

from tandem_router.bench.stats import percentile  # noqa: E402
from tandem_router.procs import Child, free_port, scrape, stop_all, tandem_child  # noqa: E402

WORKER = "ghcr.io/tandem-dev/tandem-worker:0.1.0"
IMAGES = {"base": None, "operator": "ghcr.io/tandem-dev/tandem-operator:0.1.0", "worker": WORKER}
# SmolLM2-135M's KV block in float32: layers x (K, V) x block size x KV heads x head dim x 4 bytes.
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4
SIDE_CHANNEL_PORT = 5600
TCP_PORT = 7001
NS = "bench"
IMAGE_MARCH = "x86-64-v4,x86-64-v3"  # docker/worker.Dockerfile's CPU_KERNEL_MARCH: the first the CPU has
# P/D as pd_latency.py runs it: one torch thread per engine, float32 (BLOCK_BYTES) on every CPU kind.
PD_ARGS = {"prefill": ["--role", "prefill", "--num-threads", "1", "--dtype", "float32"],
           "decode": ["--role", "decode", "--num-threads", "1", "--dtype", "float32"]}

# Raw TCP between the two pods: the decode pod receives `runs` streams of `size` bytes, each timed from its
# first byte to its last, and prints the seconds; the prefill pod sends them.
TCP_RECEIVER = """
import socket, sys, time
port, size, runs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
srv = socket.create_server(("0.0.0.0", port))
print("listening", flush=True)
buf = memoryview(bytearray(4 << 20))
for _ in range(runs):
    conn, _ = srv.accept()
    got = conn.recv_into(buf)
    t0 = time.perf_counter()
    while got < size:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    print(time.perf_counter() - t0, got, flush=True)
    conn.sendall(b"k")
    conn.close()
"""
TCP_SENDER = """
import socket, sys
host, port, size, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
data = memoryview(b"k" * size)
for _ in range(runs):
    s = socket.create_connection((host, port))
    s.sendall(data)
    s.recv(1)
    s.close()
"""


def engine(name: str, args: list[str], logs: Path, march: str = IMAGE_MARCH) -> Child:
    """A local `tandem serve` on the embedded model, its CPU kernels built for `march`, started."""
    return tandem_child(name, "serve", ["--model", MODEL, *args], logs / f"{name}.log",
                        env={"TANDEM_CPU_KERNEL_MARCH": march} if march != "native" else {}).start()


async def decode_rate(url: str) -> float:
    """Tokens per second of one stream of 128 tokens after its first (median inter-token time)."""
    t = Target(url, None)
    async with httpx.AsyncClient(timeout=600) as c:
        await t.stream(c, text(20, 1), 4)  # warm-up
        times = await t.stream(c, text(20, 2), 129)
    gaps = [b - a for a, b in zip(times[1:], times[2:], strict=False)]
    return 1.0 / statistics.median(gaps)


def engine_pod(name: str, args: list[str], env: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine as test_real_node.py's (UID 10001, read-only root)."""
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
            "containers": [{
                "name": "engine", "image": WORKER, "imagePullPolicy": "Never",
                "args": ["serve", "--model", MODEL, "--host", "0.0.0.0", "--port", "8000", *args],
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}, *env],
                "ports": [{"containerPort": 8000, "name": "http"}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
                "resources": {"requests": {"cpu": "250m", "memory": "1Gi"}},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True},
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "shm", "mountPath": "/dev/shm"}],
            }],
            "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "shm", "emptyDir": {"medium": "Memory"}}],
        },
    }


def start_pod(cluster: Cluster, pod: dict[str, Any]) -> dict[str, Any]:
    """Creates `pod`; seconds until it answers /health and until its Ready condition, and its URL."""
    name = pod["metadata"]["name"]
    t0 = time.perf_counter()
    cluster.kube.post(f"/api/v1/namespaces/{NS}/pods", pod)
    serving = ready = None
    url = ""
    while ready is None or serving is None:
        if time.perf_counter() - t0 > 600:
            raise TimeoutError(f"pod {name} not Ready in 600 s")
        obj = cluster.pod(NS, name)
        ip = obj["status"].get("podIP")
        if ip and serving is None:
            url = f"http://{ip}:8000"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    serving = time.perf_counter() - t0
            except httpx.HTTPError:
                pass
        if ready is None and any(c["type"] == "Ready" and c["status"] == "True"
                                 for c in obj["status"].get("conditions", [])):
            ready = time.perf_counter() - t0
        time.sleep(0.1)
    return {"ready_s": ready, "serving_s": serving, "url": url}


def delete_pod(cluster: Cluster, name: str) -> None:
    cluster.kubectl("delete", "pod", name, "-n", NS, "--grace-period=1", "--wait=true", "--timeout=120s")


STARTUP_ARGS = ["--max-model-len", "1024"]


def startup_pods(cluster: Cluster, runs: int) -> list[dict[str, Any]]:
    """The first engine pod on the node, then `runs` more, one at a time."""
    out = []
    for i in range(runs + 1):
        r = start_pod(cluster, engine_pod(f"engine-{i}", STARTUP_ARGS, []))
        print(f"  engine pod {i}: Ready in {r['ready_s']:.1f} s, /health in {r['serving_s']:.1f} s", flush=True)
        out.append({"ready_s": r["ready_s"], "serving_s": r["serving_s"]})
        delete_pod(cluster, f"engine-{i}")
    return out


def startup_processes(runs: int, work: Path) -> list[dict[str, Any]]:
    """The same engine as a local process, started `runs` + 1 times: seconds to answering /health. An
    untimed start first builds its kernels (the image holds them built)."""
    out = []
    warm = engine("startup-warm", STARTUP_ARGS, work)
    try:
        warm.wait_healthy(600)
    finally:
        warm.stop()
    for i in range(runs + 1):
        t0 = time.perf_counter()
        e = engine(f"startup-{i}", STARTUP_ARGS, work)
        try:
            e.wait_healthy(300)
            out.append({"serving_s": time.perf_counter() - t0})
        finally:
            e.stop()
        print(f"  engine process {i}: /health in {out[-1]['serving_s']:.1f} s", flush=True)
    return out


def pd_pods(cluster: Cluster) -> tuple[str, str]:
    """A prefill and a decode pod, UCX over TCP alone; their URLs."""
    tcp = [{"name": "UCX_TLS", "value": "tcp"}]
    prefill = start_pod(cluster, engine_pod("prefill", [*PD_ARGS["prefill"], "--kv-host", "$(POD_IP)",
                                                        "--kv-side-channel-port", str(SIDE_CHANNEL_PORT)], tcp))
    decode = start_pod(cluster, engine_pod("decode", PD_ARGS["decode"], tcp))
    return prefill["url"], decode["url"]


async def kv_transfers(prefill: str, decode: str, runs: int, words: int) -> list[dict[str, float]]:
    """One P/D request at a time, each a new prompt: the decode engine's transfer seconds and blocks."""
    t = Target(decode, prefill)
    out = []
    async with httpx.AsyncClient(timeout=600) as c:
        await t.stream(c, text(50, 999), 2)  # the NIXL handshake
        for i in range(runs):
            before = [scrape(decode, m) for m in ("tandem:kv_transfer_seconds_sum",
                                                  "tandem:kv_transfer_received_blocks_total")]
            await t.stream(c, text(words, 500 + i), 1)
            after = [scrape(decode, m) for m in ("tandem:kv_transfer_seconds_sum",
                                                 "tandem:kv_transfer_received_blocks_total")]
            seconds, blocks = after[0] - before[0], after[1] - before[1]
            out.append({"seconds": seconds, "blocks": blocks, "gb_per_s": blocks * BLOCK_BYTES / seconds / 1e9})
    return out


def raw_tcp(cluster: Cluster, size: int, runs: int) -> list[float]:
    """GB/s of `runs` streams of `size` bytes from the prefill pod to the decode pod."""
    kubectl = [str(cluster.bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", "exec", "-n", NS]
    receiver = subprocess.Popen([*kubectl, "decode", "--", "python", "-c", TCP_RECEIVER, str(TCP_PORT), str(size),
                                 str(runs)],
                                stdout=subprocess.PIPE, text=True)
    assert receiver.stdout is not None
    assert receiver.stdout.readline().strip() == "listening"
    decode_ip = cluster.pod(NS, "decode")["status"]["podIP"]
    subprocess.run([*kubectl, "prefill", "--", "python", "-c", TCP_SENDER, decode_ip, str(TCP_PORT), str(size),
                    str(runs)],
                   check=True, timeout=600)
    out, _ = receiver.communicate(timeout=60)
    rates = []
    for line in out.split("\n"):
        if line.strip():
            seconds, got = line.split()
            assert int(got) == size, line
            rates.append(size / float(seconds) / 1e9)
    return rates


def summary(rates: list[float]) -> dict[str, float]:
    """Median and p99 of transfer rates: the p99 a transfer's time sets, so the rate's 1st percentile."""
    return {"median": statistics.median(rates), "p99": percentile(rates, 1)}


def image_sizes() -> dict[str, int]:
    base = subprocess.run(["bash", str(REPO / "hack" / "build-base-image.sh"), "--print"], capture_output=True,
                          text=True, check=True).stdout.strip()
    sizes = {}
    for name, tag in IMAGES.items():
        listed = json.loads(subprocess.run(["buildah", "images", "--json", tag or base], capture_output=True,
                                           text=True, check=True).stdout)
        value, unit = listed[0]["size"].split()  # buildah's own rounding: "6.53 GB" (decimal units)
        sizes[name] = int(float(value) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit])
    return sizes


def rebuild() -> dict[str, float]:
    """hack/build-images.sh --rebuild; the seconds each image took, from its own report."""
    out = subprocess.run(["bash", str(REPO / "hack" / "build-images.sh"), "--rebuild"], capture_output=True,
                         text=True, timeout=7200)
    assert out.returncode == 0, out.stderr[-3000:]
    took = {}
    for line in out.stderr.splitlines():  # "[images] <image> built in N s"
        if " built in " in line:
            image, seconds = line.split(" built in ")
            name = next((n for n, tag in IMAGES.items() if tag and tag in image), "base")
            took[name] = float(seconds.split()[0])
    return took


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if args.rebuild:
        res["build_s"] = rebuild()
    res["image_bytes"] = image_sizes()
    bin_dir = build_tools()
    words = args.kv_words

    print("P/D as local processes (shared IPC and network namespaces)", flush=True)
    p = engine("prefill", [*PD_ARGS["prefill"], "--kv-side-channel-port", str(free_port())], work)
    d = engine("decode", PD_ARGS["decode"], work)
    try:
        p.wait_healthy(300)
        d.wait_healthy(300)
        res["kv_local"] = await kv_transfers(p.url, d.url, args.kv_runs, words)
        res["pd_local"] = await measure(Target(d.url, p.url), 1500, 3, 4, 5)
    finally:
        stop_all([d, p])

    print("engines as local processes", flush=True)
    res["startup_process"] = startup_processes(args.runs, work)
    res["decode_tok_s"] = {}
    for march in (IMAGE_MARCH, "x86-64-v3", "native") * 2:  # interleaved
        e = engine(f"rate-{march}", ["--num-threads", "2"], work, march)
        try:
            e.wait_healthy(600)  # the first start of a build compiles its kernels
            res["decode_tok_s"].setdefault(march, []).append(await decode_rate(e.url))
        finally:
            e.stop()

    print("engine pods from the worker image on the real node", flush=True)
    node = RealNode(work / "real" / "node", bin_dir, None, name="tandem-node-1", images=product_images())
    with Cluster(work / "real", bin_dir, real_node=node) as real:
        real.create_namespace(NS)
        res["startup_real"] = startup_pods(real, args.runs)
        prefill, decode = pd_pods(real)
        res["kv_pods"] = await kv_transfers(prefill, decode, args.kv_runs, words)
        size = round(statistics.median(r["blocks"] for r in res["kv_pods"])) * BLOCK_BYTES
        res["tcp_bytes"] = size
        res["tcp_pods"] = raw_tcp(real, size, args.kv_runs)
        res["pd_pods"] = await measure(Target(decode, prefill), 1500, 3, 4, 5)
        eventually(lambda: scrape(decode, "vllm:kv_cache_usage_perc") == 0.0, 60, "decode kept KV blocks")
    return res


def table(res: dict[str, Any]) -> str:
    a = res["config"]
    lines = [
        "# tandem in containers against the stand-ins", "",
        f"`{res['command']}`; {res['time']}; {describe(res['machine'])}; 1-minute load {res['load_average'][0]:.2f} "
        f"before, {res['load_average'][1]:.2f} after. Real node: the kubelet, containerd and runc of "
        "tests/k8s/real_node.py.", "",
        "| image | size (MB) | build (s) |", "|---|---|---|"]
    for name, size in res["image_bytes"].items():
        built = res.get("build_s", {}).get(name)
        lines.append(f"| {name} | {size / 1e6:.0f} | {f'{built:.0f}' if built else 'not rebuilt'} |")
    lines += ["", f"An engine created -> Ready (the pod's condition) and -> answering /health; the first after the "
              f"node started, then the median of {a['runs']} more. The stand-in is the engine as a process from "
              ".venv: what the test node agent ran for a pod before the real node replaced it.", "",
              "| engine | first: Ready (s) | first: /health (s) | later: Ready (s) | later: /health (s) |",
              "|---|---|---|---|---|"]
    for key, label in (("startup_process", "process from .venv (the stand-in)"),
                       ("startup_real", "pod on the real node (container from the worker image)")):
        first, later = res[key][0], res[key][1:]

        def ready(r: dict[str, Any]) -> str:
            return f"{r['ready_s']:.1f}" if "ready_s" in r else "-"

        later_ready = f"{statistics.median(r['ready_s'] for r in later):.1f}" if "ready_s" in first else "-"
        lines.append(f"| {label} | {ready(first)} | {first['serving_s']:.1f} | {later_ready} | "
                     f"{statistics.median(r['serving_s'] for r in later):.1f} |")
    tcp = summary(res["tcp_pods"])
    lines += ["", f"KV transfer per request ({a['kv_words']}-word prompts, {res['tcp_bytes'] / 1e6:.1f} MB each, "
              f"{a['kv_runs']} runs, float32), from the decode engine's tandem:kv_transfer_seconds; raw TCP moves "
              "the same bytes between the same two pods' network namespaces.", "",
              "| path | median GB/s | p99 GB/s (the slowest 1%) | median vs raw TCP between the pods |",
              "|---|---|---|---|",
              f"| raw TCP, prefill pod -> decode pod | {tcp['median']:.2f} | {tcp['p99']:.2f} | 100% |"]
    for key, label in (("kv_pods", "NIXL/UCX, UCX_TLS=tcp, between the pods"),
                       ("kv_local", "NIXL/UCX between local processes (shared IPC)")):
        s = summary([r["gb_per_s"] for r in res[key]])
        lines.append(f"| {label} | {s['median']:.2f} | {s['p99']:.2f} | {s['median'] / tcp['median']:.0%} |")
    lines += ["", "P/D under bench/pd_latency.py's load (TTFT: one 500-word prompt at a time; ITL: 3 streams "
              "while 4 prompts of 1500 words arrive), one torch thread per engine, float32, CPU kernels built "
              f"for {IMAGE_MARCH} (the image's) in both.", "",
              "| where | TTFT p50 (s) | ITL p50 (ms) | ITL p99 (ms) | ITL max (ms) |", "|---|---|---|---|---|"]
    for key, label in (("pd_local", "local processes (shared IPC)"), ("pd_pods", "pods on the real node")):
        r = res[key]
        lines.append(f"| {label} | {r['ttft_p50_s']:.2f} | {r['itl_p50_s'] * 1e3:.0f} | "
                     f"{r['itl_p99_s'] * 1e3:.0f} | {r['itl_max_s'] * 1e3:.0f} |")
    rates = res["decode_tok_s"]
    lines += ["", "The image's CPU kernels on this CPU: one engine (2 threads), one stream, decode tokens/s "
              "(median inter-token time of 128 tokens), two interleaved runs each; the image's list picks the first "
              "level this CPU has.", "",
              "| kernels built for | decode tok/s (runs) | vs native |", "|---|---|---|"]
    native = statistics.median(rates["native"])
    for march in (IMAGE_MARCH, "x86-64-v3", "native"):
        runs = ", ".join(f"{r:.1f}" for r in rates[march])
        label = f"{march} (the image)" if march == IMAGE_MARCH else march
        lines.append(f"| {label} | {runs} | {statistics.median(rates[march]) / native:.0%} |")
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    def draw(ax: Any) -> None:
        labels = ["raw TCP\n(pods)", "NIXL\n(pods)", "NIXL\n(local)"]
        values = [res["tcp_pods"], [r["gb_per_s"] for r in res["kv_pods"]],
                  [r["gb_per_s"] for r in res["kv_local"]]]
        ax.boxplot(values, tick_labels=labels)
        ax.plot([], [], " ", label=f"{res['tcp_bytes'] / 1e6:.0f} MB per transfer")

    save_plot(path, (6, 4), "KV transfer between engine pods against raw TCP", "GB/s", draw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rebuild", action="store_true", help="time a rebuild of the base and both images")
    ap.add_argument("--runs", type=int, default=3, help="engine pods started after the first, per node kind")
    ap.add_argument("--kv-runs", type=int, default=10)
    ap.add_argument("--kv-words", type=int, default=1500, help="words per prompt of the KV transfer runs")
    ap.add_argument("--render", action="store_true", help="only rewrite the .md and .png from the .json")
    args = ap.parse_args()
    if args.render:
        res = json.loads((RESULTS / "k8s_containers.json").read_text())
        (RESULTS / "k8s_containers.md").write_text(table(res))
        plot(res, RESULTS / "k8s_containers.png")
        return 0
    return bench_main("k8s_containers", args, run, table, plot)


if __name__ == "__main__":
    raise SystemExit(main())
