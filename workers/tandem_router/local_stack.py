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
import os
import shlex
import signal
import time
from pathlib import Path
from types import FrameType

from tandem_router.policies import POLICIES
from tandem_router.procs import TANDEM, Child, free_port, free_port_pair, healthy, port_in_use, stop_all

MAX_RESTARTS = 5


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
                    say(f"{c.name} exited with code {code} before it was ready; last lines of {c.log_path}:")
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
            say(f"{c.name} exited with code {code}; last lines of {c.log_path}:")
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
            for c in stop_all(group, timeout):
                say(f"{c.name} did not stop in {timeout:.0f}s; killed it")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem up", description="Run router + prefill + decode engines locally.")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prefill", type=int, default=1, help="prefill engines (0: colocated engines, --role both)")
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
    # For tests: the engine program (anything taking `tandem serve`'s flags, --role included).
    p.add_argument("--engine-command", default=shlex.join([*TANDEM, "serve"]), help=argparse.SUPPRESS)
    return p


def build_engines(a: argparse.Namespace, logs: Path) -> list[Child]:
    """`a.prefill` prefill and `a.decode` decode engines, or `a.decode` colocated ones without prefill."""
    engine_cmd, extra, host = shlex.split(a.engine_command), shlex.split(a.engine_args), a.host
    engines: list[Child] = []
    for role, count in (("prefill", a.prefill), ("decode" if a.prefill else "engine", a.decode)):
        for i in range(count):
            port = free_port(host)
            argv = [*engine_cmd, "--model", a.model, "--host", host, "--port", str(port),
                    "--kv-events-port", str(free_port_pair(host)),  # for the router's KV index
                    "--scheduling-policy", "priority", *extra]  # clients' `priority` reaches the engines
            if a.prefill:
                argv += ["--role", role, "--kv-side-channel-port", str(free_port(host))]
            engines.append(Child(f"{role}-{i}", f"http://{host}:{port}", argv, logs / f"{role}-{i}.log"))
    if a.pin_cpus:
        for c, share in zip(engines, split_cpus(len(engines)), strict=True):
            c.cpus = share
    return engines


def build_router(a: argparse.Namespace, engines: list[Child], logs: Path) -> Child:
    decode_urls = ",".join(c.url for c in engines if not c.name.startswith("prefill"))
    prefill_urls = ",".join(c.url for c in engines if c.name.startswith("prefill"))
    argv = [*TANDEM, "route", "--host", a.host, "--port", str(a.port), "--decode", decode_urls,
            "--policy", a.policy, *shlex.split(a.router_args)]
    if prefill_urls:
        argv += ["--prefill", prefill_urls]
    return Child("router", f"http://{a.host}:{a.port}", argv, logs / "router.log")


def run(stack: Stack, model: str) -> int:
    """Start the engines, then the router once they are healthy; supervise until a signal. The exit code."""
    t0 = time.monotonic()
    for c in stack.engines:
        c.start()
        pinned = f", CPUs {','.join(map(str, c.cpus))}" if c.cpus else ""
        say(f"starting {c.name} on {c.url} (pid {c.proc.pid if c.proc else '?'}, log {c.log_path}{pinned})")
    if not stack.wait_ready(stack.engines):
        return 0 if stack.stopping else 1
    router = stack.router
    say(f"starting router on {router.url} (log {router.log_path})")
    router.start()
    if not stack.wait_ready([router]):
        return 0 if stack.stopping else 1
    say(f"ready in {time.monotonic() - t0:.1f}s: {router.url}  (Ctrl-C to stop)")
    say(
        f"try: curl {router.url}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi!"}}]}}\''
    )
    while not stack.stopping:
        if not stack.supervise():
            return 1
        time.sleep(0.5)
    return 0


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    if port_in_use(a.host, a.port):
        say(f"port {a.port} is in use on {a.host}; pick another with --port (make run PORT=...)")
        return 1
    logs = Path(a.log_dir)
    kind = "decode" if a.prefill else "colocated"
    say(f"model {a.model}: {a.prefill} prefill + {a.decode} {kind} engine(s) + router; logs in {logs}/")
    engines = build_engines(a, logs)
    stack = Stack(engines, build_router(a, engines, logs), a.startup_timeout)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stack.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        return run(stack, a.model)
    finally:
        say("stopping ...")
        stack.stop()
        say("stopped")
