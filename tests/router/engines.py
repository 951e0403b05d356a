"""Real `tandem serve` and `tandem route` processes for the router's end-to-end tests."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
from tests.router.utils import REPO

MODEL = "smollm2-135m-instruct"
TANDEM = [sys.executable, "-c", "import sys; from tandem_cli import main; sys.exit(main())"]
# One thread each: the CI machine has two cores and the tests run two engines.
ENGINE_ARGS = ["--num-threads", "1", "--max-model-len", "2048"]


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([*TANDEM, *argv], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def start_engine(
    port: int, log: Path, role: str | None = None, extra: list[str] | None = None
) -> subprocess.Popen[bytes]:
    argv = ["serve", "--model", MODEL, "--port", str(port), *ENGINE_ARGS, *(extra or [])]
    if role:
        argv += ["--role", role]
    return start(argv, log)


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
