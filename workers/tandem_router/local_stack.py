"""`tandem up`: router + prefill + decode engines as local processes, one log per process.

Children run in their own session so that Ctrl-C reaches only this supervisor, which then stops them in
order (router first, so no new requests reach a stopping engine). They also get SIGTERM if the
supervisor dies (PR_SET_PDEATHSIG), so no engine outlives a killed `tandem up`. Each engine is pinned to
its own share of the CPUs (as pods with their own cores would be), so engines never fight over a core
and each sizes its thread pool to its share; the router may run anywhere. A child that dies
after start-up is restarted on the same port, as Kubernetes restarts a pod; the router ejects the
engine meanwhile and re-admits it when its /health answers again.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
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
from types import FrameType

from tandem_router.policies import POLICIES

PR_SET_PDEATHSIG = 1
MAX_RESTARTS = 5
# `python -c` rather than `-m tandem_cli` (a package without __main__) or the `tandem` script (maybe not
# on PATH): the children run with exactly this interpreter.
TANDEM = [sys.executable, "-c", "import sys; from tandem_cli import main; sys.exit(main())"]


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: Ctrl-C handling still stops the children
        pass


def split_cpus(n: int, available: set[int] | None = None) -> list[list[int]]:
    """Disjoint CPU shares for n engines, sizes differing by at most one. With more engines than CPUs
    the shares wrap around (overlap cannot be avoided then, but it stays even)."""
    cpus = sorted(available if available is not None else os.sched_getaffinity(0))
    if n <= 0:
        return []
    if n >= len(cpus):
        return [[cpus[i % len(cpus)]] for i in range(n)]
    base, extra = divmod(len(cpus), n)
    shares, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        shares.append(cpus[start:start + size])
        start += size
    return shares


def child_preexec(cpus: list[int] | None, die_with_parent: bool = True) -> Callable[[], None]:
    """A Popen `preexec_fn`: pin the child to `cpus` and (by default) let it die with its parent."""
    def setup() -> None:
        if die_with_parent:
            _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Child:
    name: str
    url: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    cpus: list[int] | None = None  # CPU affinity; None: inherit
    env: dict[str, str] | None = None  # added to this process's environment
    started: float = 0.0
    ready: bool = False
    restarts: int = 0

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=child_preexec(self.cpus),
                env={**os.environ, **self.env} if self.env else None,
            )
        self.started = time.monotonic()
        self.ready = False

    def stop(self, timeout: float = 15.0) -> None:
        if self.alive():
            self.terminate()
            self.reap(time.monotonic() + timeout, timeout)

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def reap(self, deadline: float, timeout: float) -> None:
        """Wait for a terminated child until `deadline`, then kill it."""
        assert self.proc is not None
        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            say(f"{self.name} did not stop in {timeout:.0f}s; killing it")
            self.proc.kill()
            self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def supports_roles(engine_cmd: list[str]) -> bool:
    """Whether this engine build has `--role prefill|decode` (P/D) or only colocated serving."""
    try:
        out = subprocess.run(engine_cmd + ["--help"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--role" in out.stdout and "prefill" in out.stdout


def _names(children: list[Child]) -> str:
    return ", ".join(c.name for c in children)


def say(msg: str) -> None:
    print(f"[up] {msg}", flush=True)


class Stack:
    def __init__(self, children: list[Child], router: Child, startup_timeout: float) -> None:
        self.engines = children
        self.router = router
        self.startup_timeout = startup_timeout
        self.stopping = False

    def all(self) -> list[Child]:
        return [*self.engines, self.router]

    def wait_ready(self, children: list[Child]) -> bool:
        pending = list(children)
        last_report = time.monotonic()
        deadline = time.monotonic() + self.startup_timeout
        while pending and not self.stopping:
            for c in list(pending):
                if not c.alive():
                    code = c.proc.returncode if c.proc else None
                    say(f"{c.name} exited with code {code} before it was ready; last lines of {c.log}:")
                    print(c.tail(), flush=True)
                    return False
                if healthy(c.url):
                    say(f"{c.name} ready at {c.url} ({time.monotonic() - c.started:.1f}s)")
                    c.ready = True
                    pending.remove(c)
            if time.monotonic() > deadline:
                say(f"gave up after {self.startup_timeout:.0f}s waiting for {_names(pending)}")
                return False
            if pending and time.monotonic() - last_report > 10:
                waited = time.monotonic() - pending[0].started
                say(f"still waiting for {_names(pending)} ({waited:.0f}s; loading the model)")
                last_report = time.monotonic()
            time.sleep(0.25)
        return not self.stopping

    def supervise(self) -> bool:
        """Restart what died, as Kubernetes would restart a pod; the router's health checks eject the
        engine meanwhile and re-admit it once it is back. False when a child keeps dying."""
        for c in self.all():
            if c.alive():
                if not c.ready and healthy(c.url):
                    c.ready = True
                    say(f"{c.name} ready again at {c.url} ({time.monotonic() - c.started:.1f}s)")
                continue
            code = c.proc.returncode if c.proc else None
            say(f"{c.name} exited with code {code}; last lines of {c.log}:")
            print(c.tail(), flush=True)
            if c.restarts >= MAX_RESTARTS:
                say(f"{c.name} failed {c.restarts + 1} times; giving up")
                return False
            c.restarts += 1
            say(f"restarting {c.name} ({c.restarts}/{MAX_RESTARTS})")
            c.start()
        return True

    def stop(self, timeout: float = 15.0) -> None:
        for group in ([self.router], self.engines):
            live = [c for c in group if c.alive()]
            for c in live:  # all of a group at once, then wait for them together
                c.terminate()
            deadline = time.monotonic() + timeout
            for c in live:
                c.reap(deadline, timeout)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem up", description="Run router + prefill + decode engines locally.")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--prefill",
        type=int,
        default=None,
        help="prefill engines (default 1 when the engine has P/D roles, else 0: colocated)",
    )
    p.add_argument("--decode", type=int, default=1, help="decode engines (colocated ones without prefill)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--policy", choices=POLICIES, default="prefix-aware")
    p.add_argument("--log-dir", default="logs")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=True,
                   help="give each engine a disjoint share of this process's CPUs (affinity), as pods "
                        "with their own cores; each engine sizes its threads to its share")
    p.add_argument("--engine-args", default="", help="extra `tandem serve` arguments, one shell-quoted string")
    p.add_argument("--router-args", default="", help="extra `tandem route` arguments")
    # For tests: the engine program (anything taking `tandem serve`'s flags).
    p.add_argument("--engine-command", default=shlex.join([*TANDEM, "serve"]), help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    host = a.host
    if port_in_use(host, a.port):
        say(f"port {a.port} is in use on {host}; pick another with --port (make run PORT=...)")
        return 1
    engine_cmd = shlex.split(a.engine_command)
    n_prefill = a.prefill
    roles = supports_roles(engine_cmd)
    if n_prefill is None:
        n_prefill = 1 if roles else 0
    elif n_prefill > 0 and not roles:
        say(f"this engine has no prefill/decode roles yet: running {a.decode} colocated engine(s) instead")
        n_prefill = 0
    if n_prefill == 0 and a.prefill is None:
        say("engine has no prefill/decode roles yet: running colocated engines (--role both)")
    logs = Path(a.log_dir)
    kind = "decode" if n_prefill else "colocated"
    say(f"model {a.model}: {n_prefill} prefill + {a.decode} {kind} engine(s) + router; logs in {logs}/")
    extra = shlex.split(a.engine_args)
    engines: list[Child] = []
    for role, count in (("prefill", n_prefill), ("decode" if n_prefill else "engine", a.decode)):
        for i in range(count):
            port = free_port(host)
            argv_e = [*engine_cmd, "--model", a.model, "--host", host, "--port", str(port), *extra]
            if n_prefill:
                argv_e += ["--role", role, "--kv-side-channel-port", str(free_port(host))]
            engines.append(Child(f"{role}-{i}", f"http://{host}:{port}", argv_e, logs / f"{role}-{i}.log"))
    if a.pin_cpus:
        for c, share in zip(engines, split_cpus(len(engines)), strict=True):
            c.cpus = share
    decode_urls = ",".join(c.url for c in engines if not c.name.startswith("prefill"))
    prefill_urls = ",".join(c.url for c in engines if c.name.startswith("prefill"))
    router_argv = [
        *TANDEM,
        "route",
        "--host",
        host,
        "--port",
        str(a.port),
        "--decode",
        decode_urls,
        "--policy",
        a.policy,
        *shlex.split(a.router_args),
    ]
    if prefill_urls:
        router_argv += ["--prefill", prefill_urls]
    router = Child("router", f"http://{host}:{a.port}", router_argv, logs / "router.log")
    stack = Stack(engines, router, a.startup_timeout)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stack.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.monotonic()
    code = 0
    try:
        for c in engines:
            c.start()
            pinned = f", CPUs {','.join(map(str, c.cpus))}" if c.cpus else ""
            say(f"starting {c.name} on {c.url} (pid {c.proc.pid if c.proc else '?'}, log {c.log}{pinned})")
        if not stack.wait_ready(engines):
            code = 0 if stack.stopping else 1
            return code
        say(f"starting router on {router.url} (log {router.log})")
        router.start()
        if not stack.wait_ready([router]):
            code = 0 if stack.stopping else 1
            return code
        say(f"ready in {time.monotonic() - t0:.1f}s: {router.url}  (Ctrl-C to stop)")
        say(
            f"try: curl {router.url}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{a.model}", "messages": [{{"role": "user", "content": "Hi!"}}]}}\''
        )
        while not stack.stopping:
            if not stack.supervise():
                code = 1
                break
            time.sleep(0.5)
        return code
    finally:
        say("stopping ...")
        stack.stop()
        say("stopped")
