"""The layering in STYLE.md, enforced by import-linter: the operator image has no torch and never
imports the engine; the router imports neither the engine nor torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept() -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'workers'}"}
    proc = subprocess.run([str(Path(sys.executable).parent / "lint-imports")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout
