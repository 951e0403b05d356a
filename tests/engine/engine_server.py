"""`tandem serve` on the embedded model for the engine tests, started and stopped by tandem_router.procs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem_router.procs import Child as Server
from tandem_router.procs import free_port, tandem_child

MODEL = "smollm2-135m-instruct"
__all__ = ["MODEL", "Server", "launch", "run_server"]


@contextmanager
def run_server(args: list[str], log_dir: Path, timeout_s: float = 180.0,
               cpus: list[int] | None = None) -> Iterator[Server]:
    server = launch(log_dir, args, cpus=cpus)
    try:
        server.wait_healthy(timeout_s)
        yield server
    finally:
        server.stop()


def launch(log_dir: Path, args: list[str], port: int | None = None, cpus: list[int] | None = None) -> Server:
    """Start `tandem serve` (not waiting for it), pinned to `cpus` when several engines share the machine.

    float32 unless `args` names a dtype: these tests compare greedy answers across paths (P/D against
    colocated, prefix-cache hits against misses, batches against single requests), and only float32 keeps
    them token-exact; in bfloat16 a matmul's rounding depends on its shape and flips near-ties."""
    port = port or free_port()
    if "--dtype" not in args:
        args = ["--dtype", "float32", *args]
    log_path = log_dir / f"serve-{port}.log"
    log_path.unlink(missing_ok=True)  # a restart on the same port: the test reads only the new process's log
    return tandem_child(f"serve-{port}", "serve", ["--model", MODEL, *args], log_path, port=port, cpus=cpus,
                        die_with_parent=False).start()
