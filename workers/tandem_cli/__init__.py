"""`tandem` command: dispatches to each component's own CLI, importing only that component.

The operator image has no torch and the router imports no engine code, so each subcommand's module is
imported lazily here.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function taking argv)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("tandem_engine.entrypoints.cli", "main", "run an engine (OpenAI API server + EngineCore)"),
    "sim": ("tandem_engine.sim.server", "main", "run N simulated engines in one process (fleet-scale tests)"),
    "route": ("tandem_router.cli", "main", "run the router"),
    "up": ("tandem_router.local_stack", "main", "run router + prefill + decode engines locally"),
    "bench": ("tandem_router.bench", "main", "benchmark any OpenAI-compatible endpoint"),
    "operator": ("tandem_operator.cli", "main", "run the Kubernetes operator (kopf run options)"),
}


def usage() -> str:
    lines = ["usage: tandem <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {doc}" for name, (_, _, doc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"tandem: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = COMMANDS[name]
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
