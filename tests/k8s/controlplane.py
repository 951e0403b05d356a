"""A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.

The binaries come from hack/build-tools.sh (built from source). Everything lives in one work dir: the
certificates (pki/), etcd's data, one kubeconfig, and one log file per component, whose paths are printed
when something fails to start. The flags follow controller-runtime's envtest, plus the controller-manager
and scheduler, so Deployments, ReplicaSets, EndpointSlices, ServiceAccounts and garbage collection behave
as in a real cluster. The kubelet is the real node's (real_node.py).
"""

from __future__ import annotations

import logging
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import kubernetes

from tests.k8s import process
from tests.k8s.pki import Pki, make_pki

logger = logging.getLogger(__name__)

SERVICE_CIDR = "10.96.0.0/16"
# The first address of SERVICE_CIDR: the `kubernetes` Service's ClusterIP, which the serving cert names.
SERVICE_IP = "10.96.0.1"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


class ControlPlane:
    def __init__(
        self, work_dir: Path, bin_dir: Path, advertise_address: str = "10.244.0.1", start_timeout_s: float = 180.0
    ) -> None:
        self.work_dir = work_dir
        self.bin_dir = bin_dir
        # Pods reach the apiserver at this address (the pod bridge's host side); it is also what the apiserver
        # publishes as the `kubernetes` Service's endpoint.
        self.advertise_address = advertise_address
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.url = ""
        self.kubeconfig = work_dir / "kubeconfig"
        self.pki: Pki | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()

    def log_path(self, component: str) -> Path:
        return self.work_dir / f"{component}.log"

    def start(self) -> ControlPlane:
        started = time.monotonic()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        logger.info("[startup] control plane ready at %s in %.1f s", self.url, time.monotonic() - started)
        return self

    def _start(self) -> None:
        missing = [c for c in (*COMPONENTS, "kubectl") if not (self.bin_dir / c).is_file()]
        if missing:
            raise RuntimeError(f"{self.bin_dir} lacks {missing}: run hack/build-tools.sh")
        self.pki = pki = make_pki(self.work_dir / "pki", [self.advertise_address, SERVICE_IP])
        etcd_port, peer_port, self.port = process.free_port(), process.free_port(), process.free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self._write_kubeconfig(pki)

        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self._spawn("etcd", [
            "--name=default", f"--data-dir={self.work_dir / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}", "--unsafe-no-fsync=true", "--log-level=warn",
        ])
        self._wait("etcd", lambda: self._get(f"{etcd_url}/health") is not None)

        self._spawn("kube-apiserver", [
            f"--etcd-servers={etcd_url}",
            f"--secure-port={self.port}", "--bind-address=0.0.0.0", f"--advertise-address={self.advertise_address}",
            f"--cert-dir={self.work_dir / 'pki'}",
            f"--tls-cert-file={pki.serving_cert}", f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--service-account-issuer={SA_ISSUER}", f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # RBAC stays on: it is what proves a chart's Roles suffice.
            "--authorization-mode=Node,RBAC", "--allow-privileged=true",
            # How `kubectl logs/exec/port-forward` reach a real node's kubelet: as the admin, at its InternalIP.
            f"--kubelet-client-certificate={pki.admin_cert}", f"--kubelet-client-key={pki.admin_key}",
            "--kubelet-preferred-address-types=InternalIP",
        ])
        self._wait("kube-apiserver", lambda: self._get(f"{self.url}/readyz") == b"ok")

        kubeconfig = f"--kubeconfig={self.kubeconfig}"
        delegated = [f"--authentication-kubeconfig={self.kubeconfig}", f"--authorization-kubeconfig={self.kubeconfig}"]
        self._spawn("kube-controller-manager", [
            kubeconfig, *delegated, "--leader-elect=false",
            f"--secure-port={process.free_port()}", "--bind-address=127.0.0.1",
            f"--cert-dir={self.work_dir / 'pki' / 'controller-manager'}",
            # Without the private key the token controller is off; without the root CA no kube-root-ca.crt.
            f"--service-account-private-key-file={pki.sa_key}", f"--root-ca-file={pki.ca_cert}",
            "--use-service-account-credentials=true",
            f"--cluster-signing-cert-file={pki.ca_cert}", f"--cluster-signing-key-file={pki.ca_key}",
        ])
        self._spawn("kube-scheduler", [
            kubeconfig, *delegated, "--leader-elect=false",
            f"--secure-port={process.free_port()}", "--bind-address=127.0.0.1",
            f"--cert-dir={self.work_dir / 'pki' / 'scheduler'}",
        ])
        # A pod created before its namespace's `default` ServiceAccount exists is refused by admission, and its
        # projected token volume needs kube-root-ca.crt; both come from the controller-manager.
        self._wait("kube-controller-manager", self._default_namespace_ready)

    def _write_kubeconfig(self, pki: Pki) -> None:
        self.kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: tandem\n"
            f"clusters:\n- name: tandem\n  cluster:\n    server: {self.url}\n"
            f"    certificate-authority: {pki.ca_cert}\n"
            f"users:\n- name: admin\n  user:\n    client-certificate: {pki.admin_cert}\n"
            f"    client-key: {pki.admin_key}\n"
            "contexts:\n- name: tandem\n  context:\n    cluster: tandem\n    user: admin\n"
        )

    def _spawn(self, component: str, args: list[str]) -> None:
        logger.info("[startup] %s", component)
        self._procs[component] = process.spawn([str(self.bin_dir / component), *args], self.log_path(component))

    def _get(self, url: str) -> bytes | None:
        context = None
        if url.startswith("https:") and self.pki:
            context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
            context.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as resp:
                body: bytes = resp.read()
                return body
        except (OSError, urllib.error.URLError):
            return None

    def _default_namespace_ready(self) -> bool:
        out = self.kubectl("get", "serviceaccount/default", "configmap/kube-root-ca.crt", "-n", "default", "-o", "name")
        return out.returncode == 0

    def _wait(self, component: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not ready():
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(self._failure(f"{name} exited with {proc.returncode}"))
            if time.monotonic() > deadline:
                raise RuntimeError(self._failure(f"{component} not ready after {self.start_timeout_s:.0f} s"))
            time.sleep(0.25)
        logger.info("[startup] %s ready", component)

    def _failure(self, what: str) -> str:
        parts = [f"control plane failed: {what}"]
        for name in self._procs:
            parts.append(f"--- {self.log_path(name)} (last lines) ---\n{process.tail(self.log_path(name))}")
        return "\n".join(parts)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = False, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            input=input, capture_output=True, text=True, check=check, timeout=timeout,
        )

    def api_client(self, pool_size: int = 32) -> kubernetes.client.ApiClient:
        """A client with the admin identity; the pool is sized for one thread per pod plus the watches."""
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=configuration)
        configuration.connection_pool_maxsize = pool_size
        return kubernetes.client.ApiClient(configuration)

    def stop(self) -> None:
        # Reverse start order: the apiserver must not outlive etcd's clients long, nor etcd the apiserver.
        for name in reversed(list(self._procs)):
            code = process.stop(self._procs[name], grace_s=10.0)
            logger.info("[shutdown] %s exited with %s", name, code)
        self._procs.clear()
        # etcd's data is the only bulky file; the logs and kubeconfig stay for whoever looks afterwards.
        shutil.rmtree(self.work_dir / "etcd", ignore_errors=True)
