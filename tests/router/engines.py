"""Real `tandem serve` and `tandem route` processes for the router's end-to-end tests."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from tests.router.utils import REPO

from tandem_router.local_stack import child_preexec

MODEL = "smollm2-135m-instruct"
TANDEM = [sys.executable, "-c", "import sys; from tandem_cli import main; sys.exit(main())"]
# Thread counts come from each engine's CPU share: `tandem up` and `start_engine(cpus=...)` pin engines.
# float32: the tests compare greedy answers across engines, paths and prefix-cache hits, which only
# float32 keeps token-exact (bfloat16 rounding depends on the matmul's shape; see docs/operations.md).
ENGINE_ARGS = ["--max-model-len", "2048", "--dtype", "float32"]


def start(argv: list[str], log: Path, cpus: list[int] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([*TANDEM, *argv], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=child_preexec(cpus, die_with_parent=False))


def start_engine(
    port: int, log: Path, role: str | None = None, extra: list[str] | None = None, cpus: list[int] | None = None
) -> subprocess.Popen[bytes]:
    argv = ["serve", "--model", MODEL, "--port", str(port), *ENGINE_ARGS, *(extra or [])]
    if role:
        argv += ["--role", role]
    return start(argv, log, cpus)


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


class UpProcess:
    """`tandem up` with its output collected on a thread (so that its pipe never fills)."""

    def __init__(self, args: list[str], log_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [*TANDEM, "up", "--log-dir", str(log_dir), *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
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
