"""ruff over every Python tree, so `make test` (and CI, which runs only that) refuses what `make lint` would.

mypy --strict stays in `make lint`: a cold run type-checks torch's stubs for minutes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_is_clean() -> None:
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run([str(ruff), "check", "operator", "workers", "tests", "bench"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
