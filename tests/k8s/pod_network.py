"""The test node's pod network: one Linux bridge on the host, one network namespace and veth pair per pod.

The host side of the bridge (10.244.0.1 by default) is the node's address: the host reaches every pod IP,
pods reach each other over the bridge and the apiserver at the bridge's address. There is no NAT and no
kube-proxy, so pods reach nothing outside the bridge and ClusterIPs route nowhere; service names resolve
through a per-pod hosts file instead (see service_hosts.py). `ip netns exec` bind-mounts the files of
/etc/netns/<netns>/ over /etc, which is how each pod gets its own hosts and resolv.conf.

A lock file per bridge marks the bridge as owned by a live process; whoever takes the lock and still finds
a bridge or namespaces with its prefix knows a previous run died without cleaning up, and removes them.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

logger = logging.getLogger(__name__)

NETNS_ETC = Path("/etc/netns")
RESOLV_CONF = (
    "# Written by the tandem test node agent: no DNS server; service names are in /etc/hosts.\n"
    "options timeout:1 attempts:1\n"
)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


class IpCommand(Protocol):
    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]: ...


@dataclass(frozen=True)
class Sandbox:
    """One pod's network: its namespace, its address on the bridge, the host end of its veth, and the
    directory whose files `ip netns exec` puts over the pod's /etc."""

    netns: str
    ip: str
    veth: str
    etc_dir: Path


class PodNetwork:
    def __init__(
        self, bridge: str = "tandem0", cidr: str = "10.244.0.0/24", *,
        run_ip: IpCommand = ip, etc_root: Path = NETNS_ETC,
    ) -> None:
        """run_ip and etc_root are for unit tests, which must never patch this module's globals instead: the
        session's live cluster runs in the same process, and a pod it tore down meanwhile once removed a
        test's temporary directory instead of its own /etc/netns dir, which CI then found left behind."""
        self.bridge = bridge
        self._ip = run_ip
        self._etc_root = etc_root
        self.network = ipaddress.ip_network(cidr)
        hosts = self.network.hosts()
        self.host_ip = str(next(hosts))
        self._free = [str(a) for a in hosts]
        self._sandboxes: dict[str, Sandbox] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._lock_file: IO[str] | None = None

    @property
    def prefix(self) -> str:
        return f"{self.bridge}-"

    def setup(self) -> None:
        lock_path = Path(f"/run/{self.bridge}.lock")
        lock_file = open(lock_path, "a+")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            owner = lock_file.read().strip() or "?"
            lock_file.close()
            raise RuntimeError(
                f"bridge {self.bridge} belongs to a running test cluster (pid {owner}, lock {lock_path}); "
                "stop it first (Ctrl-C on `python -m tests.k8s.cluster`)"
            ) from None
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        self._lock_file = lock_file
        self._closed = False
        self._remove_leftovers()
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.host_ip}/{self.network.prefixlen}", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        logger.info("[startup] bridge %s at %s", self.bridge, self.host_ip)

    def _remove_leftovers(self) -> None:
        listed = self._ip("netns", "list").stdout.splitlines()
        stale = [line.split()[0] for line in listed if line.startswith(self.prefix)]
        for netns in stale:
            self._ip("netns", "del", netns, check=False)
        if self._ip("link", "show", self.bridge, check=False).returncode == 0:
            stale.append(self.bridge)
            self._ip("link", "del", self.bridge, check=False)
        for path in self._etc_root.glob(f"{self.prefix}*"):
            shutil.rmtree(path, ignore_errors=True)
        if stale:
            logger.warning("[startup] removed what a dead run left behind: %s", stale)

    def create(self, key: str) -> Sandbox:
        """A namespace with lo up, eth0 on the bridge and a default route via the host; key is the pod uid.

        Creates, destroys and the teardown hold one lock throughout. A sandbox being built while the agent
        stops is finished before the teardown, which then removes it, or refused after it; and the teardown
        returns only once a pod worker's own destroy under way is done.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"pod network {self.bridge} is torn down")
            if not self._free:
                raise RuntimeError(f"no pod IP left in {self.network}")
            address = self._free.pop(0)
            suffix = key.replace("-", "")[:10]
            netns = f"{self.prefix}{suffix}"
            sandbox = Sandbox(netns=netns, ip=address, veth=f"vt{suffix}", etc_dir=self._etc_root / netns)
            self._sandboxes[key] = sandbox
            try:
                self._ip("netns", "add", sandbox.netns)
                self._ip("link", "add", sandbox.veth, "type", "veth", "peer", "name", "eth0",
                         "netns", sandbox.netns)
                self._ip("link", "set", sandbox.veth, "master", self.bridge, "up")
                self._ip("-n", sandbox.netns, "addr", "add", f"{address}/{self.network.prefixlen}", "dev", "eth0")
                self._ip("-n", sandbox.netns, "link", "set", "eth0", "up")
                self._ip("-n", sandbox.netns, "link", "set", "lo", "up")
                self._ip("-n", sandbox.netns, "route", "add", "default", "via", self.host_ip)
                sandbox.etc_dir.mkdir(parents=True, exist_ok=True)
                (sandbox.etc_dir / "resolv.conf").write_text(RESOLV_CONF)
                (sandbox.etc_dir / "hosts").write_text("127.0.0.1\tlocalhost\n")
            except BaseException:
                self._destroy(key)
                raise
        return sandbox

    def write_hosts(self, sandbox: Sandbox, text: str) -> None:
        # In place, never by rename: running pods see the file through a bind mount of its inode.
        path = sandbox.etc_dir / "hosts"
        try:
            with open(path, "r+") as f:
                if f.read() != text:
                    f.seek(0)
                    f.write(text)
                    f.truncate()
        except FileNotFoundError:
            pass  # torn down meanwhile

    def destroy(self, key: str) -> None:
        with self._lock:
            self._destroy(key)

    def _destroy(self, key: str) -> None:
        sandbox = self._sandboxes.pop(key, None)
        if sandbox is None:
            return
        # Deleting the host end deletes the pair now; a namespace's own devices are freed asynchronously.
        self._ip("link", "del", sandbox.veth, check=False)
        self._ip("netns", "del", sandbox.netns, check=False)
        shutil.rmtree(sandbox.etc_dir, ignore_errors=True)
        # To the back of the queue, as CNI's host-local IPAM goes round the range: an address is reused
        # only after every other one. Reused at once, it met peers whose neighbour cache still held the
        # old pod's MAC, and their connections to the new pod timed out for seconds.
        self._free.append(sandbox.ip)

    def teardown(self) -> None:
        with self._lock:
            self._closed = True
            for key in list(self._sandboxes):
                self._destroy(key)
        if self._lock_file is None:
            return
        self._ip("link", "del", self.bridge, check=False)
        try:
            self._etc_root.rmdir()  # only if empty: other tools keep their namespaces' files there too
        except OSError:
            pass
        Path(self._lock_file.name).unlink(missing_ok=True)
        self._lock_file.close()
        self._lock_file = None
        logger.info("[shutdown] bridge %s removed", self.bridge)

    def leftovers(self) -> list[str]:
        """Namespaces, links and /etc/netns dirs of this network that still exist (a test asserts none)."""
        found = [n.split()[0] for n in self._ip("netns", "list").stdout.splitlines() if n.startswith(self.prefix)]
        if self._ip("link", "show", self.bridge, check=False).returncode == 0:
            found.append(f"link {self.bridge}")
        found += [str(p) for p in self._etc_root.glob(f"{self.prefix}*")]
        return found
