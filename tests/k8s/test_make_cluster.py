"""`make cluster` as the README tells a user to run it: in the foreground, the two `export` lines once it is
up (a real node running our images), kubectl working with them, the README's next steps (the CRDs, `helm
install` with the chart's defaults, the disaggregated example, a chat through the router's Service), and
Ctrl-C leaving nothing behind."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.k8s.cluster import build_tools, port_forward, preflight
from tests.k8s.fixtures import BUILD_TIMEOUT_S, REPO
from tests.k8s.real_node import product_images

# Its own bridge and addresses: the session's cluster (tandem0, 10.244.0.0/24) may be up in this process.
BRIDGE, CIDR = "tandem7", "10.244.7.0/24"
UP_WITHIN_S = 60  # the acceptance bound, once the tools and images are built
IMAGE_LOAD_ALLOWANCE_S = 900
STOP_WITHIN_S = 120  # pods are deleted through the kubelet first (sandboxes, CNI), then the processes stop


def _processes_naming(text: str) -> list[str]:
    """Command lines of live processes that mention `text`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{d.name}: {cmd[:200]}")
    return found


class Output:
    """Every line a process prints, read by a thread (a line already in the pipe's buffer wakes no
    select()), waited for by content."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._new: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        for line in proc.stdout or ():
            self._new.put(line.rstrip("\n"))

    def exports(self, deadline: float) -> dict[str, str]:
        """The `export NAME=value` lines, read until both came or the deadline passed."""
        found: dict[str, str] = {}
        while len(found) < 2 and (left := deadline - time.monotonic()) > 0:
            try:
                line = self._new.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            self.lines.append(line)
            if m := re.match(r"export (KUBECONFIG|PATH)=(.*)$", line.strip()):
                found[m[1]] = m[2]
        return found

    def rest(self) -> str:
        """All the output, once the process has exited."""
        self._thread.join(timeout=10)
        while not self._new.empty():
            self.lines.append(self._new.get())
        return "\n".join(self.lines)


@pytest.mark.k8s
@pytest.mark.timeout(BUILD_TIMEOUT_S + IMAGE_LOAD_ALLOWANCE_S + 1200)
def test_make_cluster_then_helm_install_and_a_chat_and_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    if problem := preflight():
        pytest.fail(problem, pytrace=False)
    build_tools()  # a no-op once built; the bound below is for the cluster, not for a cold build
    product_images()  # the same for the images (make test builds them first)
    mounts_before = Path("/proc/self/mounts").read_text()
    work = tmp_path / "cluster"
    # A new session, as a terminal's foreground job: Ctrl-C signals make and the cluster together.
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "cluster",
         f"CLUSTER_ARGS=--work-dir {work} --bridge {BRIDGE} --pod-cidr {CIDR}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = Output(proc)
    try:
        began = time.monotonic()
        # The first start after an image is rebuilt copies it into containerd's store (minutes for the
        # worker's 6.5 GB): the bound is for the rest.
        exports = output.exports(began + UP_WITHIN_S + IMAGE_LOAD_ALLOWANCE_S)
        tail = "\n".join(output.lines[-40:])
        assert set(exports) == {"KUBECONFIG", "PATH"}, f"no exports:\n{tail}"
        loaded = (re.search(r"loaded into containerd in ([\d.]+) s", ln) for ln in output.lines)
        loading = sum(float(m[1]) for m in loaded if m)
        assert time.monotonic() - began - loading < UP_WITHIN_S, tail
        # The shell would expand $PATH in the export line; do the same.
        env = {**os.environ, "KUBECONFIG": exports["KUBECONFIG"],
               "PATH": exports["PATH"].replace("$PATH", os.environ["PATH"])}
        assert Path(exports["KUBECONFIG"]).is_file()

        def kubectl(*args: str) -> str:
            out = subprocess.run(["kubectl", *args], env=env, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
            return out.stdout

        assert "Server Version: v1." in kubectl("version")
        # The node registers and turns Ready within moments of the exports (the first kubectl may race it).
        deadline = time.monotonic() + 30
        while " Ready " not in (nodes := kubectl("get", "nodes")) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert re.search(r"\n\S+\s+Ready\s", nodes), nodes
        assert _processes_naming(str(work)), "the control plane's processes were not found while it ran"
        # The README's next steps, with the chart's defaults and the example as it is: a chat through the
        # router, port-forwarded as NOTES.txt says.
        env |= {f"HELM_{kind}_HOME": str(tmp_path / f"helm-{kind.lower()}") for kind in ("CACHE", "CONFIG", "DATA")}
        kubectl("apply", "-f", str(REPO / "crds"))
        helm = subprocess.run(["helm", "install", "tandem", str(REPO / "charts" / "tandem"), "--namespace",
                               "tandem-system", "--create-namespace", "--wait", "--timeout", "300s"],
                              env=env, capture_output=True, text=True, timeout=400)
        assert helm.returncode == 0, f"{helm.stdout}\n{helm.stderr}\n{kubectl('describe', 'pods', '-A')[-4000:]}"
        kubectl("apply", "-n", "tandem-system", "-f", str(REPO / "crds" / "examples" / "disaggregated.yaml"))
        ready = subprocess.run(["kubectl", "wait", "-n", "tandem-system", "tisvc/smollm2-pd", "--for=condition=Ready",
                                "--timeout=400s"], env=env, capture_output=True, text=True, timeout=450)
        assert ready.returncode == 0, f"{ready.stderr}\n{kubectl('get', 'tisvc,pods', '-A', '-o', 'wide')}"
        with port_forward(env, "tandem-system", "svc/smollm2-pd-router", 80) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
            answer = client.chat.completions.create(
                model="smollm2-135m-instruct", max_tokens=8, temperature=0,
                messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert answer.choices[0].message.content, answer
        print("chat through the router of make cluster:", answer.choices[0].message.content)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"make cluster did not stop within {STOP_WITHIN_S} s of Ctrl-C:\n{output.rest()[-3000:]}")
    rest = output.rest()
    # make itself dies of the SIGINT (as in a terminal), or reports its child's end
    assert proc.returncode in (0, 2, 130, -signal.SIGINT), rest[-3000:]
    assert "[shutdown]" in rest
    assert not _processes_naming(str(work)), "processes outlived make cluster"
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [n for n in netns.splitlines() if n.startswith(f"{BRIDGE}-")], netns
    assert subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0, "bridge left"
    assert not list(Path("/etc/netns").glob(f"{BRIDGE}-*"))
    # The cluster's mounts: pods' volumes and containers' roots under its work dir, network namespaces.
    # (Not any mount at all: an image build elsewhere on the machine mounts its layers meanwhile.)
    new_mounts = set(Path("/proc/self/mounts").read_text().splitlines()) - set(mounts_before.splitlines())
    ours = [m for m in new_mounts if m.split()[1].startswith((str(work), "/run/netns/", "/etc/netns/",
                                                              f"/var/lib/tandem-node-{BRIDGE}"))]
    assert not ours, f"mounts left behind: {ours}"
