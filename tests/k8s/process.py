"""The test cluster's child processes: each in its own process group, output to a log file, gone with us."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from tandem_router.procs import free_port as free_port  # the test cluster's ports (process.free_port())

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. If the test process is killed outright, etcd must not keep
    # its ports nor a pod its netns. The signal follows the spawning *thread*: callers spawn from a thread
    # that outlives the child (the main thread, or the pod's own worker thread).
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn(
    argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None,
    cpus: Sequence[int] | None = None,
) -> subprocess.Popen[bytes]:
    """Starts argv in a new session (so Ctrl-C in a terminal reaches only us, and we stop it in order),
    pinned to `cpus` when given (its children inherit the affinity)."""
    def preexec() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=preexec,
        )


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def stop(proc: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM to the process group, SIGKILL after grace_s; always reaps and kills stragglers in the group."""
    if proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=max(grace_s, 0.0))
        except subprocess.TimeoutExpired:
            logger.debug("[shutdown] pid %s ignored SIGTERM for %.1f s: SIGKILL", proc.pid, grace_s)
    # Children left in the group (a shell's background jobs) go too; a reaped leader's group id is not reused
    # while members remain, so this cannot hit a stranger.
    signal_group(proc, signal.SIGKILL)
    return proc.wait()


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
