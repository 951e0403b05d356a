"""tandem's child processes: start a `tandem` subcommand with its own log file, wait until its /health
answers, scrape its Prometheus metrics, stop it with SIGTERM and then SIGKILL.

`tandem up` (local_stack.py) supervises its engines and router with `Child`; the tests and benchmarks
that start real `tandem serve` / `tandem route` processes use the same helpers, so a server is started,
waited for and stopped one way everywhere. Standard library only: the router imports no engine code.
"""

from __future__ import annotations

import ctypes
import http.client
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1
# `python -c` runs exactly this interpreter on the `tandem_cli` that its sys.path (PYTHONPATH included)
# resolves, so a test or benchmark run from a checkout starts that checkout's code. The console script
# next to the interpreter (`Path(sys.executable).parent / "tandem"`) exists only where an install wrote
# it, and `-m tandem_cli` needs a __main__ the package does not have.
TANDEM = [sys.executable, "-c", "import sys; from tandem_cli import main; sys.exit(main())"]
# Prometheus sample suffixes whose family is declared under the bare name (histograms, summaries).
_FAMILY_SUFFIXES = ("_bucket", "_count", "_sum")


class ChildExited(RuntimeError):
    """The process exited while we waited for it to become healthy."""


def free_port(host: str = "127.0.0.1") -> int:
    """A free port for a server this process starts, below the ephemeral range (`free_ports`)."""
    return free_ports(host, 1)


def ephemeral_ports(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The range the kernel draws ports from for bind(0) and outgoing connections (Linux's default where
    it cannot be read)."""
    try:
        low, high = (int(x) for x in path.read_text().split()[:2])
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A free port whose successor is free too (KV events: PUB on the port, replay on the next)."""
    return free_ports(host, 2)


# Ports free_ports handed out in this process: two servers started at once must not draw the same one.
_handed: set[int] = set()


def free_ports(host: str, count: int, tries: int = 200) -> int:
    """The first of `count` consecutive free ports, taken at random below the ephemeral range and never
    handed out before by this process. Not from bind(0): the kernel draws those from the ephemeral range,
    where every outgoing connection (a health poll, a ZMQ reconnect) and every ZMQ bind to a wildcard port
    (an engine's frontend sockets) takes its ports too, and one of those took a port between the check
    and the server's bind (a health poll then read a ZMQ greeting from a test's engine port)."""
    low, _ = ephemeral_ports()
    rng = random.Random()
    for _ in range(tries):
        port = rng.randrange(max(1024, low - 12000), max(1025, low - count))
        span = range(port, port + count)
        if not any(p in _handed or port_in_use(host, p) for p in span):
            _handed.update(span)
            return port
    raise OSError(f"no {count} consecutive free ports on {host} below {low} in {tries} tries")


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def healthy(url: str) -> bool:
    """Whether `url`/health answers 200 now (anything that is not HTTP is not healthy)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return False


def child_preexec(cpus: list[int] | None, die_with_parent: bool = True) -> Callable[[], None]:
    """A Popen `preexec_fn`: pin the child to `cpus` and (by default) let it get SIGTERM when its parent
    dies (PR_SET_PDEATHSIG). Tests turn the latter off: the signal follows the parent *thread*, and a
    test may start a server from a thread that ends before the server should."""

    def setup() -> None:
        if die_with_parent:
            try:
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            except OSError:  # not Linux: the parent's own shutdown still stops its children
                pass
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` in Prometheus text whose labels include `labels`.

    0.0 when the family is declared but has no such sample yet (a labelled counter before its first
    increment); LookupError when nothing declares it, so a renamed metric fails the caller instead of
    reading as zero."""
    total, declared = 0.0, False
    families = {name, *(name.removesuffix(s) for s in _FAMILY_SUFFIXES if name.endswith(s))}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            declared = declared or line.split()[2] in families
        elif line.startswith((name + "{", name + " ")):
            declared = True
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    if not declared:
        raise LookupError(f"metric {name} is not exported")
    return total


def scrape(url: str, name: str, **labels: str) -> float:
    """`metric()` of `url`/metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return metric(resp.read().decode(), name, **labels)


def engine_pids(server_pid: int) -> list[int]:
    """The EngineCore processes of a `tandem serve` (its `multiprocessing` spawn children)."""
    out = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True).stdout
    pids = []
    for child in map(int, out.split()):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(child)
    return pids


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time the processes used so far (Linux /proc)."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class Child:
    """One server process with its log file. `start()` may be called again after it died (same port)."""

    name: str
    url: str
    argv: list[str]
    log_path: Path
    cpus: list[int] | None = None  # CPU affinity; None: inherit
    env: dict[str, str] | None = None  # added to this process's environment
    cwd: Path | None = None
    die_with_parent: bool = True
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    ready: bool = False
    restarts: int = 0

    def start(self) -> Child:
        """Start it in its own session (Ctrl-C in a terminal reaches only the supervisor, and `kill()` can
        take the whole process group); output is appended to `log_path`."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=child_preexec(self.cpus, self.die_with_parent),
                env={**os.environ, **self.env} if self.env else None,
                cwd=self.cwd,
            )
        self.started = time.monotonic()
        self.ready = False
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout: float, interval: float = 0.1) -> float:
        """Block until /health answers 200; the seconds since `start()`. ChildExited if the process
        exits first, TimeoutError after `timeout` seconds; both carry the end of its log."""
        deadline = time.monotonic() + timeout
        while not healthy(self.url):
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                raise ChildExited(f"{self.name} exited with code {code}:\n{self.tail(40)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not healthy at {self.url} after {timeout:.0f}s:\n{self.tail(40)}")
            time.sleep(interval)
        self.ready = True
        return time.monotonic() - self.started

    def metric(self, name: str, **labels: str) -> float:
        return scrape(self.url, name, **labels)

    def terminate(self) -> None:
        """SIGTERM to the process alone, as Kubernetes does: a server drains and stops its own children."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to its whole process group (its EngineCores too), then reap it."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def reap(self, deadline: float) -> bool:
        """Wait for a terminated child until `deadline` (monotonic), then kill it; True if it was killed."""
        assert self.proc is not None
        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
            return False
        except subprocess.TimeoutExpired:
            self.kill()
            return True

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` seconds; the exit code (None: never started)."""
        if self.alive():
            self.terminate()
            self.reap(time.monotonic() + timeout)
        return self.proc.returncode if self.proc else None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


def stop_all(children: list[Child], timeout: float = 30.0) -> list[Child]:
    """SIGTERM to every live child at once, then wait for them together and kill what is left after
    `timeout` seconds; the children that had to be killed."""
    live = [c for c in children if c.alive()]
    for c in live:
        c.terminate()
    deadline = time.monotonic() + timeout
    return [c for c in live if c.reap(deadline)]


def tandem_child(name: str, command: str, args: list[str], log_path: Path, *, host: str = "127.0.0.1",
                 port: int | None = None, cpus: list[int] | None = None, env: dict[str, str] | None = None,
                 die_with_parent: bool = True) -> Child:
    """`tandem <command> --host H --port P *args` (serve, route or up) as a Child, not started yet; a free
    port unless `port` is given."""
    port = port or free_port(host)
    argv = [*TANDEM, command, "--host", host, "--port", str(port), *args]
    return Child(name, f"http://{host}:{port}", argv, log_path, cpus=cpus, env=env, die_with_parent=die_with_parent)
