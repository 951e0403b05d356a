"""Runs a container's process inside its pod's network namespace, with the pod's volumes mounted.

`ip netns exec` gives each container a private mount namespace (mounts made there never reach the host)
and the pod's /etc/hosts and resolv.conf; `unshare --uts` a hostname of its own. A few lines of sh then
bind-mount each volume at its mountPath and exec the command, so the container's process is the one we
spawned: its process group is the container. Mount targets that do not exist on the host are created there
first (a mkdir inside the mount namespace would be on the host's filesystem anyway) and removed at the end.
User and group settings (runAsUser, fsGroup) and every securityContext are ignored: all runs as root.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.k8s import process
from tests.k8s.container_config import Mount

logger = logging.getLogger(__name__)

IP = shutil.which("ip") or "/usr/sbin/ip"
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
NSENTER = shutil.which("nsenter") or "/usr/bin/nsenter"

# $1 hostname, $2 default working dir (entered before mounting, so a volume mounted over one of its parents
# does not hide it), $3 the container's workingDir or "" (entered after, as it may be in a volume), $4 STAGE, then
# (source, target, rw|ro) triples, then --, then the command. Every source is first bound into a private
# tmpfs at STAGE, then bound at its target: a volume mounted at /tmp must not hide the sources of the
# volumes after it, which the agent keeps under its work dir (often below /tmp).
STAGE = "/run/tandem-node-stage"
_MOUNT_AND_EXEC = r"""
set -e
hostname "$1"
cd "$2"
wd=$3
repo=$2
stage=$4
shift 4
mount -t tmpfs -o size=1m tandem-stage "$stage"
# The repository (its virtualenv runs every container) may sit below a volume's target, e.g. a clone in
# /tmp under a pod's /tmp emptyDir: keep it reachable at its own path.
repo_id=$(stat -c %d:%i "$repo")
mkdir "$stage/repo"
mount --bind "$repo" "$stage/repo"
# Pass 1: bind each source into the stage; queue (staged source, target, mode) after the command.
set -- "$@" --end--
i=0
while [ "$1" != -- ]; do
  i=$((i + 1))
  if [ -d "$1" ]; then mkdir "$stage/$i"; else touch "$stage/$i"; fi
  mount --bind "$1" "$stage/$i"
  set -- "$@" "$stage/$i" "$2" "$3"
  shift 3
done
set -- "$@" --
shift
# Rotate the command behind the queued triples: staged triples -- command.
while [ "$1" != --end-- ]; do set -- "$@" "$1"; shift; done
shift
# Pass 2: bind each staged source at its target, in the pod spec's order.
while [ "$1" != -- ]; do
  mount --bind "$1" "$2"
  if [ "$3" = ro ]; then mount -o remount,bind,ro "$2"; fi
  shift 3
done
shift
if [ "$(stat -c %d:%i "$repo" 2>/dev/null)" != "$repo_id" ]; then
  mkdir -p "$repo" && mount --bind "$stage/repo" "$repo"
fi
umount -l "$stage"
if [ -n "$wd" ]; then mkdir -p "$wd" && cd "$wd"; fi
exec "$@"
"""


class MountPoints:
    """Host paths created as mount targets, removed when the node agent stops (if still empty)."""

    def __init__(self) -> None:
        self._created: list[Path] = []
        self._lock = threading.Lock()

    def ensure(self, target: Path, is_file: bool) -> None:
        with self._lock:
            directory = target.parent if is_file else target
            missing = [p for p in [directory, *directory.parents] if not p.exists()]
            if missing:
                self._created.append(missing[-1])
                directory.mkdir(parents=True, exist_ok=True)
            if is_file and not target.exists():
                target.touch()
                self._created.append(target)

    def remove(self) -> None:
        with self._lock:
            for top in reversed(self._created):
                for path in sorted([top, *top.rglob("*")] if top.is_dir() else [top], reverse=True):
                    try:
                        if path.is_dir() and not path.is_symlink():
                            path.rmdir()
                        elif path.stat().st_size == 0:
                            path.unlink()
                    except OSError:
                        pass  # something the host put there meanwhile: not ours to remove
            self._created.clear()


def start(
    netns: str, hostname: str, argv: Sequence[str], env: Mapping[str, str], mounts: Sequence[Mount],
    default_dir: str, working_dir: str, log_path: Path, mount_points: MountPoints, cpus: Sequence[int] | None = None,
) -> subprocess.Popen[bytes]:
    """Starts the container (pinned to `cpus` when given, see cpu_placement.py); the repository's virtualenv
    must stay visible, so no mountPath may cover it."""
    triples: list[str] = []
    mount_points.ensure(Path(STAGE), is_file=False)
    for mount in mounts:
        mount_points.ensure(Path(mount.target), is_file=mount.source.is_file())
        triples += [str(mount.source), mount.target, "ro" if mount.read_only else "rw"]
    wrapper = [IP, "netns", "exec", netns, UNSHARE, "--uts", "--", "sh", "-c", _MOUNT_AND_EXEC, "sh",
               hostname, default_dir, working_dir, STAGE, *triples, "--", *argv]
    with open(log_path, "ab") as log:
        pinned = f" on CPUs {list(cpus)}" if cpus else ""
        log.write(f"--- {time.strftime('%H:%M:%S')} start{pinned}: {list(argv)}\n".encode())
    return process.spawn(wrapper, log_path, env=env, cpus=cpus)


def exec_argv(pid: int, command: Sequence[str]) -> list[str]:
    """argv that runs command in the namespaces (mount, network, hostname) of the container process pid."""
    return [NSENTER, "-t", str(pid), "-m", "-n", "-u", "--", *command]


def run(argv: Sequence[str], env: Mapping[str, str], timeout_s: float) -> tuple[int | None, str]:
    """Runs argv to completion; (None, output) if it timed out and was killed with its process group."""
    proc = subprocess.Popen(
        list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=dict(env), start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out.decode(errors="replace")[-2000:]
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        return None, out.decode(errors="replace")[-2000:]
