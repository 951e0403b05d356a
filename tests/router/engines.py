"""`tandem up` as a real process for the router's end-to-end tests, with its output read as it comes."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from tests.router.utils import REPO

from tandem_router.procs import TANDEM

MODEL = "smollm2-135m-instruct"
# Thread counts come from each engine's CPU share (`tandem up` pins engines).
# float32: the tests compare greedy answers across engines, paths and prefix-cache hits, which only
# float32 keeps token-exact (bfloat16 rounding depends on the matmul's shape; see docs/operations.md).
ENGINE_ARGS = ["--max-model-len", "2048", "--dtype", "float32"]
BLOCK_SIZE = 16  # the engines' --block-size where a test counts blocks
DECISIONS = "tandem:router_pd_decisions_total"
RECEIVED = "tandem:kv_transfer_received_blocks_total"


def blocks_to_read(engine: str, **prompt: Any) -> int:
    """The blocks a decode engine that holds none of the prompt (`prompt=` or `messages=`) reads: all
    but the last prompt token's, which it recomputes for its logits."""
    tokens = int(httpx.post(engine + "/tokenize", json={"model": MODEL, **prompt}, timeout=30).json()["count"])
    return -(-(tokens - 1) // BLOCK_SIZE)


def settled(read: Callable[[], float], target: float, timeout: float = 20.0) -> float:
    """`read()` once it reaches `target` (a counter that trails the answer: the router counts a streamed
    answer once its stream is closed, an engine publishes its counters with the next step's stats), or
    its value when `timeout` runs out, for the caller's exact assertion."""
    deadline = time.monotonic() + timeout
    while (value := read()) < target and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


class UpProcess:
    """`tandem up` with its output collected on a thread (so that its pipe never fills)."""

    def __init__(self, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*TANDEM, "up", "--log-dir", str(log_dir), *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(needle in ln for ln in self.lines):
            if self.proc.poll() is not None and not self._reader.is_alive():
                raise RuntimeError(f"tandem up exited with {self.proc.returncode}:\n{self.text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {needle!r} from tandem up after {timeout}s:\n{self.text()}")
            time.sleep(0.1)

    def _starting(self, name: str) -> str:
        return next(ln for ln in self.lines if f"starting {name} on " in ln)

    def url_of(self, name: str) -> str:
        return self._starting(name).split(" on ")[1].split(" ")[0]

    def pid_of(self, name: str) -> int:
        return int(self._starting(name).split("(pid ")[1].split(",")[0])

    def interrupt(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
