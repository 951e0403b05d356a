"""`tandem serve` on the embedded model for the engine tests, started and stopped by tandem_router.procs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem_router.procs import Child as Server
from tandem_router.procs import free_port, free_ports, tandem_child

MODEL = "smollm2-135m-instruct"
__all__ = ["MODEL", "Server", "launch", "launch_sim", "run_server"]


@contextmanager
def run_server(args: list[str], log_dir: Path, timeout_s: float = 180.0,
               cpus: list[int] | None = None, sim: bool = False) -> Iterator[Server]:
    """`tandem serve`, or with `sim` the last of two simulated engines (`tandem sim --engines 2`: the one a
    connection reaches through the fleet's dispatch, not the first port), each given `args`."""
    server = launch_sim(log_dir, args) if sim else launch(log_dir, args, cpus=cpus)
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


def launch_sim(log_dir: Path, args: list[str], engines: int = 2, first_port: int | None = None) -> Server:
    """`tandem sim --engines N` on the embedded model's tokenizer (not waiting for it), as a Server whose URL is
    the last engine's. A `--kv-events-port K` in `args` is that engine's: the fleet's first is K - 2(N-1)."""
    first = first_port or free_ports("127.0.0.1", engines)
    if "--kv-events-port" in args:
        i = args.index("--kv-events-port") + 1
        args = [*args[:i], str(int(args[i]) - 2 * (engines - 1)), *args[i + 1:]]
    log_path = log_dir / f"sim-{first}.log"
    log_path.unlink(missing_ok=True)
    server = tandem_child(f"sim-{first}", "sim", ["--model", MODEL, "--engines", str(engines), *args], log_path,
                          port=first, die_with_parent=False)
    server.url = f"http://127.0.0.1:{first + engines - 1}"
    return server.start()
