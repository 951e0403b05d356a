"""Builders shared by the router tests: test upstreams as processes, waiting for a condition."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from tandem_router.procs import Child

REPO = Path(__file__).resolve().parents[2]


def start_upstream_process(port: int, name: str, log_dir: Path, tokens: int = 4, token_delay: float = 0.0) -> Child:
    """`python -m tests.router.upstream` on `port`, started (not waited for)."""
    argv = [sys.executable, "-m", "tests.router.upstream", "--port", str(port), "--name", name,
            "--tokens", str(tokens), "--token-delay", str(token_delay)]
    log = log_dir / f"upstream-{name}.log"
    return Child(name, f"http://127.0.0.1:{port}", argv, log, cwd=REPO, die_with_parent=False).start()


async def eventually(predicate, timeout: float = 5.0, interval: float = 0.02) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)
