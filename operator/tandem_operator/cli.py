"""`tandem operator [kopf run options]`: run kopf with the tandem handlers registered.

Every argument is passed to `kopf run` unchanged, e.g. `tandem operator -A --standalone` or
`tandem operator -n team-a -n team-b --liveness=http://0.0.0.0:8080/healthz`.
"""

from __future__ import annotations

import logging

import click
import kopf.cli

logger = logging.getLogger(__name__)

HANDLERS_MODULE = "tandem_operator.handlers"


def kopf_args(argv: list[str]) -> list[str]:
    """The `kopf` command line for `tandem operator ARGV`."""
    if argv and argv[0] in ("-h", "--help"):
        return ["run", "--help"]
    return ["run", "--module", HANDLERS_MODULE, *argv]


def main(argv: list[str]) -> int:
    try:
        kopf.cli.main.main(args=kopf_args(argv), prog_name="tandem operator", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    return 0
