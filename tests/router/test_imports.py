"""The router runs where there is no torch: importing it must pull in neither torch nor the engine."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.router.utils import REPO


def test_router_imports_neither_torch_nor_the_engine() -> None:
    code = (
        "import sys, json; sys.path[:0] = ['workers']\n"
        "import tandem_router.cli, tandem_router.server, tandem_router.local_stack, tandem_router.bench\n"
        "import tandem_router.tokenizer\n"
        "import tandem_cli\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tandem_engine'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
