"""Builders shared by the router tests: free ports, processes, waiting for readiness."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_upstream_process(port: int, name: str, tokens: int = 4, token_delay: float = 0.0) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.router.upstream",
            "--port",
            str(port),
            "--name",
            name,
            "--tokens",
            str(tokens),
            "--token-delay",
            str(token_delay),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )


async def wait_healthy(url: str, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {url} exited with {proc.returncode}")
            try:
                async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    if resp.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


async def eventually(predicate, timeout: float = 5.0, interval: float = 0.02) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)
