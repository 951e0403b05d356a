"""A real Kubernetes node on this machine: the kubelet (built from the pinned k8s.io/kubernetes), containerd
with runc as its CRI runtime (Debian's; crun refuses this machine's hybrid cgroups), CNI bridge networking
(Debian's plugins: bridge, host-local, portmap), kube-proxy in iptables mode, kube-router's NetworkPolicy
controller as the firewall (NetworkPolicies are enforced), and CoreDNS as a pod.

Pods on it are containers from images: their own PID, IPC, mount and network namespaces, their user, a
read-only root when they ask for one, cgroup CPU and memory limits, `kubectl logs/exec/port-forward`. No
registry is reachable, so images reach containerd from buildah's local storage (hack/build-images.sh,
hack/build-node-images.sh) by an archive import, once per image version: containerd's image store lives
in a cache directory that outlives the cluster (docs/kubernetes-testbed.md, "The real node").

Two settings this machine needs: the kubelet's `failCgroupV1: false` (cgroup v1 here; refused by default
since v1.35) and containerd's `restrict_oom_score_adj` (root here lacks CAP_SYS_RESOURCE: without it runc
cannot lower a sandbox's oom_score_adj and every sandbox fails to start).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.k8s import process
from tests.k8s.controlplane import SERVICE_CIDR, ControlPlane
from tests.k8s.pki import issue_client_cert

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
CNI_BIN = Path("/usr/lib/cni")
CLUSTER_DNS = str(ipaddress.ip_network(SERVICE_CIDR)[10])  # 10.96.0.10, as kubeadm picks it
NAMESPACE = "k8s.io"  # containerd's namespace for CRI
IMAGE_ID_LABEL = "dev.tandem.image-id"  # on an image's name in containerd: the buildah image it was copied from
# What kube-router's NetworkPolicy controller makes (pkg/controllers/netpol): filter-table chains, jumped to
# from INPUT, FORWARD and OUTPUT, and the ipsets its rules match on. Nothing else on this machine uses these
# names (kube-proxy's chains are KUBE-SERVICES, KUBE-FORWARD, ...; it makes no ipsets).
NETPOL_CHAIN_PREFIXES = ("KUBE-ROUTER-", "KUBE-NWPLCY-", "KUBE-POD-FW-")
NETPOL_IPSET_PREFIXES = ("KUBE-SRC-", "KUBE-DST-", "inet6:KUBE-SRC-", "inet6:KUBE-DST-")


def preflight() -> str | None:
    """Why this machine cannot run a real node, or None."""
    tools = ("containerd", "containerd-shim-runc-v2", "runc", "buildah", "iptables", "iptables-save",
             "iptables-restore", "ipset")
    missing = [t for t in tools if not shutil.which(t)]
    missing += [str(CNI_BIN / p) for p in ("bridge", "host-local", "loopback") if not (CNI_BIN / p).exists()]
    if missing:
        return f"a real node needs {', '.join(missing)}: hack/install-node-deps.sh installs them"
    return None


def build_node_images(bin_dir: Path) -> dict[str, str]:
    """hack/build-node-images.sh: {"pause": image, "coredns": image}, built once."""
    out = subprocess.run(["bash", str(REPO / "hack" / "build-node-images.sh"), str(bin_dir)],
                         stdout=subprocess.PIPE, text=True, check=True, timeout=600).stdout
    return dict(line.split("=", 1) for line in out.split())


def product_images() -> list[str]:
    """The images of docker/ (hack/build-images.sh), built if missing or out of date."""
    out = subprocess.run(["bash", str(REPO / "hack" / "build-images.sh")], stdout=subprocess.PIPE, text=True,
                         check=True, timeout=3600).stdout
    return out.split()


class RealNode:
    def __init__(self, work_dir: Path, bin_dir: Path, control_plane: ControlPlane | None, name: str = "tandem-node-1",
                 bridge: str = "tandemk0", pod_cidr: str = "10.244.64.0/24", images: Sequence[str] = (),
                 cache_dir: Path | None = None) -> None:
        """`images`: besides the node's own (pause, CoreDNS), what containerd must hold before pods start."""
        self.work_dir = work_dir
        self.bin_dir = bin_dir
        self.control_plane: ControlPlane = control_plane  # type: ignore[assignment]  # set by its Cluster
        self.name = name
        self.bridge = bridge
        self.pod_cidr = pod_cidr
        self.images = list(images)
        # containerd's content and snapshots outlive the cluster: an image is imported once per version. One
        # store for every real node (the suite's, make cluster's): two cannot run at once (containerd locks it).
        self.store = (cache_dir or Path.home() / ".cache" / "tandem" / "node") / "containerd"
        # Sockets (containerd's, and the kubelet's under its root dir) need paths of at most 104 characters:
        # not under a test's temporary directory. Pods' volumes live under the kubelet's root too: on disk.
        self.run_dir = Path("/var/lib") / f"tandem-node-{bridge}"
        self.socket = self.run_dir / "containerd.sock"
        self.node_images: dict[str, str] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def log_path(self, component: str) -> Path:
        return self.work_dir / f"{component}.log"

    @property
    def gateway(self) -> str:
        """The host's address on the pod bridge: pods reach the host (and the apiserver) there."""
        return str(next(ipaddress.ip_network(self.pod_cidr).hosts()))

    def prepare_network(self) -> None:
        """The pod bridge with the host's address, before anything starts: an address for the apiserver to
        advertise when no other node exists (the CNI bridge plugin adopts the bridge as it finds it)."""
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        prefix = ipaddress.ip_network(self.pod_cidr).prefixlen
        for args in (["link", "add", self.bridge, "type", "bridge"],
                     ["addr", "add", f"{self.gateway}/{prefix}", "dev", self.bridge],
                     ["link", "set", self.bridge, "up"]):
            subprocess.run(["ip", *args], capture_output=True, text=True, check=True)

    # -- start ----------------------------------------------------------------------------------------------

    def start(self) -> RealNode:
        problem = preflight()
        if problem:
            raise RuntimeError(problem)
        began = time.monotonic()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.node_images = build_node_images(self.bin_dir)
            self._start_containerd()
            if [self.load_image(image) for image in [*self.node_images.values(), *self.images]].count(True):
                self._collect_garbage()
            self._start_kubelet()
            self._start_kube_proxy()
            self._start_kube_router()
            self._start_coredns()
        except BaseException:
            self.stop()
            raise
        logger.info("[startup] real node %s ready in %.1f s", self.name, time.monotonic() - began)
        return self

    def _spawn(self, component: str, argv: list[str]) -> None:
        logger.info("[startup] %s", component)
        self._procs[component] = process.spawn(argv, self.log_path(component))

    def _wait(self, what: str, ready: Callable[[], bool], timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} waiting for {what}:\n"
                                       f"{process.tail(self.log_path(name))}")
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n} ---\n{process.tail(self.log_path(n))}" for n in self._procs)
                raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s\n{logs}")
            time.sleep(0.25)

    def _start_containerd(self) -> None:
        state, cni = self.work_dir / "containerd", self.work_dir / "cni"
        for d in (state, cni, self.store, self.run_dir):
            d.mkdir(parents=True, exist_ok=True)
        disabled = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.internal.v1.tracing"]
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config = "\n".join([
            "version = 2",
            f'root = "{self.store}"',
            f'state = "{state / "state"}"',
            f"disabled_plugins = {json.dumps(disabled)}",
            "[grpc]",
            f'  address = "{self.socket}"',
            f"[{cri}]",
            f'  sandbox_image = "{self.node_images["pause"]}"',
            "  restrict_oom_score_adj = true",
            "  enable_unprivileged_ports = true",
            f"[{cri}.containerd]",
            '  snapshotter = "overlayfs"',
            '  default_runtime_name = "runc"',
            f"[{cri}.containerd.runtimes.runc]",
            '  runtime_type = "io.containerd.runc.v2"',
            f"[{cri}.containerd.runtimes.runc.options]",
            f'  BinaryName = "{shutil.which("runc")}"',
            "  SystemdCgroup = false",
            f"[{cri}.cni]",
            f'  bin_dir = "{CNI_BIN}"',
            f'  conf_dir = "{cni}"',
        ]) + "\n"
        (state / "config.toml").write_text(config)
        (cni / "10-tandem.conflist").write_text(json.dumps({
            # No masquerade and no host ports: nothing outside this machine is reachable anyway, and neither
            # leaves iptables rules behind a pod the kubelet did not tear down.
            "cniVersion": "1.0.0", "name": "tandem", "plugins": [
                {"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": self.pod_cidr}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(self.work_dir / "cni-ipam")}},
            ]}, indent=1))
        self._spawn("containerd", ["containerd", "--config", str(state / "config.toml")])
        self._wait("containerd", lambda: self.ctr("version", check=False).returncode == 0, 60.0)

    def ctr(self, *args: str, check: bool = True, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ctr", "--address", str(self.socket), "-n", NAMESPACE, *args], capture_output=True,
                              text=True, check=check, timeout=timeout)

    def load_image(self, image: str) -> bool:
        """Copy `image` from buildah's storage into containerd's, unless it is there in this version: the
        image id (the digest of its config) is kept as a label of the name. Returns whether it copied."""
        image_id = subprocess.run(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", image],
                                  capture_output=True, text=True, check=True).stdout.strip()
        label = f"{IMAGE_ID_LABEL}={image_id}"
        if any(line.split()[:1] == [image] and label in line for line in self.ctr("images", "ls").stdout.splitlines()):
            return False
        began = time.monotonic()
        # Streamed from buildah's storage into containerd's through a pipe: a worker image is gigabytes, and an
        # archive on disk in between doubled the disk a copy needs (CI's push failed, exit 125, with 6 GB
        # free). Either side failing ends the other: EOF for the import, a broken pipe for the push.
        push = subprocess.Popen(["buildah", "push", "--quiet", image, f"docker-archive:/dev/stdout:{image}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert push.stdout is not None and push.stderr is not None
        try:
            imported = subprocess.run(["ctr", "--address", str(self.socket), "-n", NAMESPACE, "images", "import",
                                       "-"], stdin=push.stdout, capture_output=True, text=True, timeout=1200)
            push.stdout.close()
            push_err = push.stderr.read().decode(errors="replace")
            push.wait(timeout=60)
        finally:
            if push.poll() is None:
                push.kill()
                push.wait()
        if push.returncode != 0 or imported.returncode != 0:
            raise RuntimeError(f"copying {image} into containerd failed: buildah push exited {push.returncode}"
                               f" ({push_err.strip()[-2000:]}), ctr images import exited {imported.returncode}"
                               f" ({imported.stderr.strip()[-2000:]}); free disk: {_free_gib(self.store):.1f} GiB"
                               f" under {self.store}")
        self.ctr("images", "label", image, label)
        logger.info("[startup] image %s loaded into containerd in %.1f s", image, time.monotonic() - began)
        return True

    def _collect_garbage(self) -> None:
        """Free what earlier versions of the images held (gigabytes for each rebuilt worker image): names an
        import left under an image id, then a synchronous collection of every blob and snapshot no name
        and no container uses (a deletion is what starts one)."""
        names = self.ctr("images", "ls", "-q").stdout.split()
        stale = [n for n in names if n.startswith("sha256:")]
        trigger = "localhost/tandem-gc:trigger"
        if names:
            self.ctr("images", "tag", "--force", names[0], trigger, check=False)
        self.ctr("images", "rm", "--sync", *stale, trigger, check=False)
        logger.info("[startup] containerd's store collected (%d earlier image names dropped)", len(stale))

    def _start_kubelet(self) -> None:
        pki = self.control_plane.pki
        assert pki is not None
        kdir = self.work_dir / "kubelet"
        kdir.mkdir(exist_ok=True)
        cert, key = issue_client_cert(pki, kdir / "node", f"system:node:{self.name}", "system:nodes")
        kubeconfig = kdir / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: node\n"
            f"clusters:\n- name: tandem\n  cluster:\n    server: {self.control_plane.url}\n"
            f"    certificate-authority: {pki.ca_cert}\n"
            f"users:\n- name: node\n  user:\n    client-certificate: {cert}\n    client-key: {key}\n"
            "contexts:\n- name: node\n  context:\n    cluster: tandem\n    user: node\n")
        self.kubelet_port = process.free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{self.bridge}",
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "port": self.kubelet_port, "readOnlyPort": 0, "healthzPort": 0,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(pki.ca_cert)}},
            "authorization": {"mode": "Webhook"},
            "clusterDomain": "cluster.local", "clusterDNS": [CLUSTER_DNS],
            "failSwapOn": False, "resolvConf": "/etc/resolv.conf",
            # The disk is shared with everything else on this machine: evict for memory only.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100, "serializeImagePulls": False,
            "shutdownGracePeriod": "0s",
        }
        (kdir / "config.yaml").write_text(json.dumps(config))
        for hierarchy in CGROUP_FS.iterdir():  # the kubelet requires its cgroupRoot in every hierarchy
            if hierarchy.is_dir() and not hierarchy.is_symlink():
                (hierarchy / self.bridge).mkdir(exist_ok=True)
        self._spawn("kubelet", [
            str(self.bin_dir / "kubelet"), f"--config={kdir / 'config.yaml'}", f"--kubeconfig={kubeconfig}",
            f"--hostname-override={self.name}", f"--node-ip={self.control_plane.advertise_address}",
            f"--root-dir={self.run_dir / 'kubelet'}", f"--cert-dir={kdir / 'pki'}", "--v=1",
        ])
        self._wait(f"node {self.name} Ready", self._node_ready, 120.0)

    def _node_ready(self) -> bool:
        out = self.control_plane.kubectl("get", "node", self.name, "-o",
                                         "jsonpath={.status.conditions[?(@.type=='Ready')].status}")
        return out.returncode == 0 and out.stdout.strip() == "True"

    def _start_kube_proxy(self) -> None:
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "mode": "iptables", "clusterCIDR": self.pod_cidr, "hostnameOverride": self.name,
            "clientConnection": {"kubeconfig": str(self.control_plane.kubeconfig)},
            "metricsBindAddress": f"127.0.0.1:{process.free_port()}",
            "healthzBindAddress": f"127.0.0.1:{process.free_port()}",
            "conntrack": {"maxPerCore": 0},  # leave the host's conntrack table size alone
        }
        path = self.work_dir / "kube-proxy.yaml"
        path.write_text(json.dumps(config))
        self._spawn("kube-proxy", [str(self.bin_dir / "kube-proxy"), f"--config={path}", "--v=1"])

    def _start_kube_router(self) -> None:
        """kube-router with its NetworkPolicy controller only (no routing, no service proxy: the bridge and
        kube-proxy do those), beside kube-proxy and with the same iptables (the `iptables` on PATH, nf_tables
        here). It filters pods' traffic in FORWARD (bridged, through br_netfilter), OUTPUT (from the host)
        and INPUT, and REJECTs what a policy does not allow. Its identity is its own, `system:kube-router`,
        with read access to what it watches (kube-router's own RBAC, less what routing and the proxy need)."""
        _remove_netpol_rules()  # what a killed earlier node left: it starts from nothing
        pki = self.control_plane.pki
        assert pki is not None
        rdir = self.work_dir / "kube-router"
        rdir.mkdir(exist_ok=True)
        cert, key = issue_client_cert(pki, rdir / "client", "system:kube-router", "tandem:kube-router")
        kubeconfig = rdir / "kubeconfig"  # under work_dir: its command line names it, so _pids() finds it
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: kube-router\n"
            f"clusters:\n- name: tandem\n  cluster:\n    server: {self.control_plane.url}\n"
            f"    certificate-authority: {pki.ca_cert}\n"
            f"users:\n- name: kube-router\n  user:\n    client-certificate: {cert}\n    client-key: {key}\n"
            "contexts:\n- name: kube-router\n  context:\n    cluster: tandem\n    user: kube-router\n")
        out = self.control_plane.kubectl("apply", "-f", "-", input=json.dumps(kube_router_rbac("system:kube-router")))
        if out.returncode != 0:
            raise RuntimeError(f"kube-router's RBAC: {out.stderr}")
        self._spawn("kube-router", [
            str(self.bin_dir / "kube-router"), f"--kubeconfig={kubeconfig}", f"--hostname-override={self.name}",
            "--run-firewall=true", "--run-router=false", "--run-service-proxy=false", "--enable-cni=false",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # No listener at all: its health port (20244 on every address by default) and metrics are off.
            "--health-port=0", "--metrics-port=0",
            "--v=1",
        ])
        # Its top-level chains are hooked in once its informers have synced and its first full sync ran.
        self._wait("kube-router's firewall", lambda: "-j KUBE-ROUTER-FORWARD" in subprocess.run(
            ["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout, 60.0)

    def _start_coredns(self) -> None:
        manifest = coredns_manifest(self.node_images["coredns"], self.name)
        out = self.control_plane.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        if out.returncode != 0:
            raise RuntimeError(f"CoreDNS: {out.stderr}")
        self._wait("CoreDNS", lambda: self.control_plane.kubectl(
            "get", "deploy/coredns", "-n", "kube-system", "-o", "jsonpath={.status.readyReplicas}").stdout == "1")

    # -- stop -----------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Pods go first, through the kubelet (sandboxes torn down, CNI released), then the processes, then
        whatever a crash left: containers, network namespaces, mounts, the bridge, kube-proxy's rules."""
        if "kubelet" in self._procs and self._procs["kubelet"].poll() is None:
            self._drain()
        for name in reversed(list(self._procs)):
            code = process.stop(self._procs[name], grace_s=10.0)
            logger.info("[shutdown] %s exited with %s", name, code)
        self._procs.clear()
        self._remove_leftovers()

    def _drain(self) -> None:
        kubectl = self.control_plane.kubectl
        kubectl("cordon", self.name)  # no replacement lands here (CoreDNS's Deployment would make one at once)
        kubectl("delete", "pods", "--all-namespaces", f"--field-selector=spec.nodeName={self.name}",
                "--grace-period=0", "--force", "--wait=false", timeout=60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.ctr("tasks", "ls", "-q", check=False).stdout.strip():
            time.sleep(0.5)

    def _remove_leftovers(self) -> None:
        """What a drain that did not finish leaves: containers' processes (in the node's cgroups), their
        shims (whose command lines name the node's socket), sandbox network namespaces, mounts, cgroups."""
        for pid in self._pids():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        for netns in self._own_netns():
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        _unmount_under(self.work_dir)
        _unmount_under(self.run_dir)
        _remove_cgroups(self.bridge)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        subprocess.run([str(self.bin_dir / "kube-proxy"), "--cleanup"], capture_output=True, timeout=60)
        _remove_netpol_rules()

    def _pids(self) -> set[int]:
        """The node's processes: what runs in its pods' cgroups, and containerd and its shims (their
        command lines name its work dir or its socket's)."""
        return {*_pids_naming(str(self.work_dir)), *_pids_naming(str(self.run_dir)), *_cgroup_pids(self.bridge)}

    def _own_netns(self) -> list[str]:
        """Sandbox network namespaces containerd made for this node's pods: those whose eth0 has an address
        of its pod CIDR."""
        found = []
        net = ipaddress.ip_network(self.pod_cidr)
        for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            if not name.startswith("cni-"):
                continue
            addrs = subprocess.run(["ip", "-n", name, "-j", "addr", "show"], capture_output=True, text=True).stdout
            ips = [a["local"] for i in json.loads(addrs or "[]") for a in i.get("addr_info", [])]
            if not ips or any(ipaddress.ip_address(ip) in net for ip in ips if ":" not in ip):
                found.append(name)
        return found

    def leftovers(self) -> list[str]:
        """Processes, network namespaces, mounts, cgroups and links of this node that still exist (a test
        asserts none)."""
        found = [f"process {pid}" for pid in self._pids()]
        found += [f"netns {n}" for n in self._own_netns()]
        found += [f"mount {m}" for m in (*_mounts_under(self.work_dir), *_mounts_under(self.run_dir))]
        found += [f"cgroup {d}" for d in _cgroup_dirs(self.bridge)]
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode == 0:
            found.append(f"link {self.bridge}")
        chains, _ = _netpol_rules()
        found += [f"iptables chain {c}" for c in chains]
        found += [f"ipset {s}" for s in _netpol_ipsets()]
        return found


def _pids_naming(text: str) -> list[int]:
    """Processes whose command line mentions `text`: containerd and its shims name the node's socket."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


CGROUP_FS = Path("/sys/fs/cgroup")


def _cgroup_dirs(root: str) -> list[Path]:
    """The node's cgroups (the kubelet's cgroupRoot, /ROOT, in every v1 hierarchy), deepest first."""
    found = [d for top in CGROUP_FS.glob(f"*/{root}") for d in top.rglob("*") if d.is_dir()]
    found += list(CGROUP_FS.glob(f"*/{root}"))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _cgroup_pids(root: str) -> set[int]:
    pids: set[int] = set()
    for d in _cgroup_dirs(root):
        try:
            pids.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        except OSError:
            pass
    return pids


def _remove_cgroups(root: str) -> None:
    for d in _cgroup_dirs(root):
        try:
            d.rmdir()
        except OSError:
            pass


def _free_gib(path: Path) -> float:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free / 2**30


def _mounts_under(path: Path) -> list[str]:
    return [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[1].startswith(str(path))]


def _unmount_under(path: Path) -> None:
    for mount in sorted(_mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True)


def _netpol_rules() -> tuple[list[str], list[str]]:
    """kube-router's chains in the filter table, and the rules of other chains that jump to them (as
    iptables-save writes them)."""
    saved = subprocess.run(["iptables-save", "-t", "filter"], capture_output=True, text=True).stdout.splitlines()
    chains = [line[1:].split()[0] for line in saved if line.startswith(":") and
              line[1:].startswith(NETPOL_CHAIN_PREFIXES)]
    jumps = [line for line in saved if line.startswith("-A ") and not line.split()[1].startswith(NETPOL_CHAIN_PREFIXES)
             and any(f" -j {c}" in f"{line} " or f" -g {c}" in f"{line} " for c in chains)]
    return chains, jumps


def _netpol_ipsets() -> list[str]:
    names = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True).stdout.split()
    return [n for n in names if n.startswith(NETPOL_IPSET_PREFIXES)]


def _remove_netpol_rules() -> None:
    """Removes what kube-router's NetworkPolicy controller leaves when it stops (it keeps its rules, so that
    a restart does not open the firewall): its chains, the jumps to them, then its ipsets. One
    iptables-restore --noflush (other chains untouched), as kube-proxy --cleanup does for its own.
    `kube-router --cleanup-config` is no help: in v2.1.0 its firewall part runs without iptables or ipset
    handlers (it logs success and removes nothing), then its service-proxy part flushes every IPVS service
    on the machine and panics on a nil pointer."""
    chains, jumps = _netpol_rules()
    if chains:
        script = ["*filter", *(f":{c} - [0:0]" for c in chains), *("-D" + j[2:] for j in jumps),
                  *(f"-X {c}" for c in chains), "COMMIT", ""]
        out = subprocess.run(["iptables-restore", "--noflush"], input="\n".join(script), capture_output=True,
                             text=True, timeout=60)
        if out.returncode != 0:
            logger.warning("[shutdown] removing kube-router's chains failed: %s", out.stderr.strip())
    for name in _netpol_ipsets():
        subprocess.run(["ipset", "destroy", name], capture_output=True, timeout=60)


def kube_router_rbac(user: str) -> dict[str, object]:
    """Read access to what kube-router's informers watch (they must all sync before its firewall starts)."""
    name = {"name": "tandem:kube-router"}
    return {"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": name, "rules": [
            {"apiGroups": [""], "resources": ["namespaces", "pods", "services", "nodes", "endpoints"],
             "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["get", "list", "watch"]},
        ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": name,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name["name"]},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]},
    ]}


def coredns_manifest(image: str, node: str) -> dict[str, object]:
    """CoreDNS as kubeadm deploys it, in brief: the kubernetes plugin for cluster.local, the host's
    resolvers for the rest, on an unprivileged port behind the kube-dns Service at CLUSTER_DNS."""
    labels = {"k8s-app": "kube-dns"}
    meta = {"name": "coredns", "namespace": "kube-system"}
    corefile = (".:5353 {\n    errors\n    health :8080\n    ready :8181\n"
                "    kubernetes cluster.local in-addr.arpa ip6.arpa {\n        pods insecure\n"
                "        fallthrough in-addr.arpa ip6.arpa\n    }\n    forward . /etc/resolv.conf\n"
                "    cache 30\n    loop\n    reload\n}\n")
    items: list[dict[str, object]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "system:coredns"},
         "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
         "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": "kube-system"}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"Corefile": corefile}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {**meta, "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
             "metadata": {"labels": labels},
             "spec": {
                 "serviceAccountName": "coredns", "dnsPolicy": "Default", "nodeSelector": {
                     "kubernetes.io/hostname": node},
                 "containers": [{
                     "name": "coredns", "image": image, "imagePullPolicy": "Never",
                     "args": ["-conf", "/etc/coredns/Corefile"],
                     "ports": [{"containerPort": 5353, "protocol": "UDP", "name": "dns"},
                               {"containerPort": 5353, "protocol": "TCP", "name": "dns-tcp"}],
                     "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181}, "periodSeconds": 2},
                     "resources": {"limits": {"memory": "128Mi"}, "requests": {"cpu": "50m", "memory": "32Mi"}},
                     "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                         "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
                     "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns", "readOnly": True}],
                 }],
                 "volumes": [{"name": "config", "configMap": {"name": "coredns"}}],
             }}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
         "spec": {"selector": labels, "clusterIP": CLUSTER_DNS, "ports": [
             {"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"},
             {"name": "dns-tcp", "port": 53, "targetPort": 5353, "protocol": "TCP"}]}},
    ]
    return {"apiVersion": "v1", "kind": "List", "items": items}
