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
from typing import IO

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


@dataclass(frozen=True)
class Sandbox:
    """One pod's network: its namespace, its address on the bridge and the host end of its veth."""

    netns: str
    ip: str
    veth: str

    @property
    def etc_dir(self) -> Path:
        return NETNS_ETC / self.netns


class PodNetwork:
    def __init__(self, bridge: str = "tandem0", cidr: str = "10.244.0.0/24") -> None:
        self.bridge = bridge
        self.network = ipaddress.ip_network(cidr)
        hosts = self.network.hosts()
        self.host_ip = str(next(hosts))
        self._free = [str(a) for a in hosts]
        self._sandboxes: dict[str, Sandbox] = {}
        self._lock = threading.Lock()
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
        self._remove_leftovers()
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.host_ip}/{self.network.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        logger.info("[startup] bridge %s at %s", self.bridge, self.host_ip)

    def _remove_leftovers(self) -> None:
        stale = [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.startswith(self.prefix)]
        for netns in stale:
            ip("netns", "del", netns, check=False)
        if ip("link", "show", self.bridge, check=False).returncode == 0:
            stale.append(self.bridge)
            ip("link", "del", self.bridge, check=False)
        for path in NETNS_ETC.glob(f"{self.prefix}*"):
            shutil.rmtree(path, ignore_errors=True)
        if stale:
            logger.warning("[startup] removed what a dead run left behind: %s", stale)

    def create(self, key: str) -> Sandbox:
        """A namespace with lo up, eth0 on the bridge and a default route via the host; key is the pod uid."""
        with self._lock:
            if not self._free:
                raise RuntimeError(f"no pod IP left in {self.network}")
            address = self._free.pop(0)
        suffix = key.replace("-", "")[:10]
        sandbox = Sandbox(netns=f"{self.prefix}{suffix}", ip=address, veth=f"vt{suffix}")
        with self._lock:
            self._sandboxes[key] = sandbox
        try:
            ip("netns", "add", sandbox.netns)
            ip("link", "add", sandbox.veth, "type", "veth", "peer", "name", "eth0", "netns", sandbox.netns)
            ip("link", "set", sandbox.veth, "master", self.bridge, "up")
            ip("-n", sandbox.netns, "addr", "add", f"{address}/{self.network.prefixlen}", "dev", "eth0")
            ip("-n", sandbox.netns, "link", "set", "eth0", "up")
            ip("-n", sandbox.netns, "link", "set", "lo", "up")
            ip("-n", sandbox.netns, "route", "add", "default", "via", self.host_ip)
            sandbox.etc_dir.mkdir(parents=True, exist_ok=True)
            (sandbox.etc_dir / "resolv.conf").write_text(RESOLV_CONF)
            (sandbox.etc_dir / "hosts").write_text("127.0.0.1\tlocalhost\n")
        except BaseException:
            self.destroy(key)
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
            sandbox = self._sandboxes.pop(key, None)
        if sandbox is None:
            return
        # Deleting the host end deletes the pair now; a namespace's own devices are freed asynchronously.
        ip("link", "del", sandbox.veth, check=False)
        ip("netns", "del", sandbox.netns, check=False)
        shutil.rmtree(sandbox.etc_dir, ignore_errors=True)
        with self._lock:
            # To the back of the queue, as CNI's host-local IPAM goes round the range: an address is reused
            # only after every other one. Reused at once, it met peers whose neighbour cache still held the
            # old pod's MAC, and their connections to the new pod timed out for seconds.
            self._free.append(sandbox.ip)

    def teardown(self) -> None:
        for key in list(self._sandboxes):
            self.destroy(key)
        if self._lock_file is None:
            return
        ip("link", "del", self.bridge, check=False)
        try:
            NETNS_ETC.rmdir()  # only if empty: other tools keep their namespaces' files there too
        except OSError:
            pass
        Path(self._lock_file.name).unlink(missing_ok=True)
        self._lock_file.close()
        self._lock_file = None
        logger.info("[shutdown] bridge %s removed", self.bridge)

    def leftovers(self) -> list[str]:
        """Namespaces, links and /etc/netns dirs of this network that still exist (a test asserts none)."""
        found = [n.split()[0] for n in ip("netns", "list").stdout.splitlines() if n.startswith(self.prefix)]
        if ip("link", "show", self.bridge, check=False).returncode == 0:
            found.append(f"link {self.bridge}")
        found += [str(p) for p in NETNS_ETC.glob(f"{self.prefix}*")]
        return found
