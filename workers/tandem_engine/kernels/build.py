"""Builds the engine's small C kernels with the system C compiler and loads them through ctypes.

A kernel is built once per source text, compiler flags and CPU (-march=native code must not be reused on
another CPU, as a shared home or a baked image would), cached as `<cache_dir>/kernels/<name>_<key>.so`.
Compiling and linking are separate steps so that a kernel compiled with -ffast-math is not linked with
the start-up code that switches the loading thread to flush denormals to zero: loading a kernel never
changes the numerics of torch's own ops. Kernels are threaded with OpenMP and need `libgomp.so.1`; torch
has already loaded its own copy under that name, so they run on torch's thread pool, not a second one
(docs/architecture.md, "CPU kernels").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# Every kernel's compile flags start with these: optimised for this CPU, threaded over rows with OpenMP.
BASE_FLAGS = ("-O3", "-march=native", "-fopenmp")


def cpu_id() -> str:
    """The machine type and the CPU's model name and feature flags: what -march=native code depends on."""
    ident = os.uname().machine
    try:
        with open("/proc/cpuinfo") as f:
            ident += "".join(ln for ln in f if ln.startswith(("model name", "flags")))
    except OSError:
        pass
    return ident


def build_library(name: str, source: str, flags: tuple[str, ...], cache_dir: Path) -> ctypes.CDLL:
    """Compile `source` (C) with `flags` into `<cache_dir>/kernels/<name>_<key>.so` unless that file
    exists, and load it. Raises OSError or subprocess.SubprocessError without a compiler or on a failed
    build."""
    root = cache_dir / "kernels"
    key = hashlib.sha256((source + " ".join(flags) + cpu_id()).encode()).hexdigest()[:16]
    so = root / f"{name}_{key}.so"
    if not so.is_file():
        root.mkdir(parents=True, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            src, obj = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.o"
            src.write_text(source)
            for cmd in ([cc, *flags, "-fPIC", "-c", str(src), "-o", str(obj)],
                        [cc, "-shared", "-fopenmp", str(obj), "-o", f"{tmp}/k.so", "-lm"]):
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            os.replace(f"{tmp}/k.so", so)  # atomic: concurrent builders race harmlessly
    return ctypes.CDLL(str(so))


@functools.cache  # one attempt per kernel, flags and directory
def try_build(name: str, source: str, flags: tuple[str, ...], cache_dir: Path, fallback: str) -> ctypes.CDLL | None:
    """`build_library`, or None with a warning naming `fallback` (what runs instead) if it cannot be built."""
    try:
        return build_library(name, source, flags, cache_dir)
    except (OSError, subprocess.SubprocessError) as e:
        detail = e.stderr.decode(errors="replace")[-400:] if isinstance(e, subprocess.CalledProcessError) else e
        logger.warning("C kernel %s unavailable (%s); %s", name, detail, fallback)
        return None
