"""Start a real `tandem serve` process for a test module and stop it cleanly afterwards."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tandem_router.local_stack import child_preexec

TANDEM = Path(sys.executable).parent / "tandem"
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str) -> float:
        """Sum of a metric's samples (all label sets) from /metrics."""
        total, found = 0.0, False
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        return total if found else 0.0


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"tandem serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"tandem serve not healthy after {timeout_s}s:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.5)


@contextmanager
def run_server(args: list[str], log_dir: Path, timeout_s: float = 180.0,
               cpus: list[int] | None = None) -> Iterator[Server]:
    server = launch(log_dir, args, cpus=cpus)
    proc, log_path = server.proc, server.log_path
    try:
        wait_healthy(server.url, proc, log_path, timeout_s)
        yield server
    finally:
        stop(proc)


def launch(log_dir: Path, args: list[str], port: int | None = None, cpus: list[int] | None = None) -> Server:
    """Start `tandem serve` (not waiting for it), pinned to `cpus` when several engines share the machine.

    float32 unless `args` names a dtype: these tests compare greedy answers across paths (P/D against
    colocated, prefix-cache hits against misses, batches against single requests), and only float32 keeps
    them token-exact; in bfloat16 a matmul's rounding depends on its shape and flips near-ties."""
    port = port or free_port()
    if "--dtype" not in args:
        args = ["--dtype", "float32", *args]
    log_path = log_dir / f"serve-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(TANDEM), "serve", "--model", MODEL, "--port", str(port), *args],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=child_preexec(cpus, die_with_parent=False))
    return Server(f"http://127.0.0.1:{port}", proc, log_path)


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return proc.returncode
