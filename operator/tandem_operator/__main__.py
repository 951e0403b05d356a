"""`python -m tandem_operator [kopf run options]`: the operator image's entry point (no torch there)."""

from __future__ import annotations

import sys

from tandem_operator.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
