"""Copy the CRDs from crds/ (the source of truth) into charts/tandem/crds/, or check that they match.

python charts/sync_crds.py          # regenerate the chart's copy
python charts/sync_crds.py --check  # exit 1 if the chart's copy has drifted
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "crds"
TARGET = REPO / "charts" / "tandem" / "crds"


def expected() -> dict[str, bytes]:
    """File name -> content the chart must carry: every top-level CRD manifest (not the examples)."""
    return {p.name: p.read_bytes() for p in sorted(SOURCE.glob("*.yaml"))}


def drift() -> list[str]:
    want = expected()
    have = {p.name: p.read_bytes() for p in sorted(TARGET.glob("*.yaml"))}
    problems = [f"missing in chart: {n}" for n in want if n not in have]
    problems += [f"not in crds/: {n}" for n in have if n not in want]
    problems += [f"differs from crds/: {n}" for n in want if n in have and have[n] != want[n]]
    return problems


def sync() -> None:
    TARGET.mkdir(parents=True, exist_ok=True)
    want = expected()
    for stale in TARGET.glob("*.yaml"):
        if stale.name not in want:
            stale.unlink()
    for name, content in want.items():
        (TARGET / name).write_bytes(content)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report drift")
    args = parser.parse_args(argv)
    if args.check:
        problems = drift()
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    sync()
    return 0


if __name__ == "__main__":
    sys.exit(main())
