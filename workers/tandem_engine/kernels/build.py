"""Builds the engine's small C kernels with the system C compiler and loads them through ctypes.

A kernel is built once per source text, compiler flags and CPU (-march=native code must not be reused on
another CPU, as a shared home or a baked image would), cached as `<cache_dir>/kernels/<name>_<key>.so`;
when `cache_dir` is read-only (a cache baked into an image) a missing kernel is built under
config.build_dir's. `TANDEM_CPU_KERNEL_MARCH=x86-64-v3` builds for a named ISA level instead of this CPU
(what an image's build does), keyed on the level and loaded only on a CPU with that level's features.
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
import re
import subprocess
import tempfile
from pathlib import Path

from tandem_engine.config import build_dir

logger = logging.getLogger(__name__)

# Build for a named ISA level (x86-64-v3) instead of this CPU, so that a kernel built into an image runs on
# every node of that level (docs/operations.md, "Start-up and the model cache").
KERNEL_MARCH_ENV = "TANDEM_CPU_KERNEL_MARCH"
# /proc/cpuinfo flags a level needs (a subset that tells the levels apart); other values are trusted.
_MARCH_CPU_FLAGS = {"x86-64-v2": {"ssse3", "sse4_2", "popcnt"}, "x86-64-v3": {"avx2", "fma", "bmi2", "f16c", "movbe"}}


def base_flags() -> tuple[str, ...]:
    """Every kernel's compile flags start with these: optimised for this CPU (or the ISA level named by
    `TANDEM_CPU_KERNEL_MARCH`), threaded over rows with OpenMP."""
    return ("-O3", f"-march={os.environ.get(KERNEL_MARCH_ENV) or 'native'}", "-fopenmp")


def cpu_id(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The machine type and the CPU's model name and feature flags: what -march=native code depends on."""
    ident = os.uname().machine
    try:
        with open(cpuinfo) as f:
            ident += "".join(ln for ln in f if ln.startswith(("model name", "flags")))
    except OSError:
        pass
    return ident


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    for line in cpu_id(cpuinfo).splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# A kernel's `#include "name.h"` lines name headers in this folder (code several kernels share).
_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"/]+)"', re.MULTILINE)


def local_headers(source: str) -> dict[str, str]:
    """The headers `source` includes with quotes, by name, read from this folder: each build writes them
    beside its source and keys its shared object on their text as well as the source's."""
    here = Path(__file__).parent
    return {name: (here / name).read_text() for name in _LOCAL_INCLUDE.findall(source)}


def build_library(name: str, source: str, flags: tuple[str, ...], cache_dir: Path) -> ctypes.CDLL:
    """Compile `source` (C) with `flags` into `<cache_dir>/kernels/<name>_<key>.so` unless that file
    exists (or the build directory's, for a read-only `cache_dir`), and load it. Raises OSError or
    subprocess.SubprocessError without a compiler, on a failed build, or for an ISA level this CPU lacks."""
    march = next((f.removeprefix("-march=") for f in flags if f.startswith("-march=")), "native")
    missing = _MARCH_CPU_FLAGS.get(march, set()) - set(cpu_id().split())
    if missing:
        raise OSError(f"this CPU lacks {' '.join(sorted(missing))} for -march={march}")
    # -march=native code is keyed on this CPU; a named level on the level.
    ident = cpu_id() if march == "native" else march
    headers = local_headers(source)
    key = hashlib.sha256((source + "".join(headers.values()) + " ".join(flags) + ident).encode()).hexdigest()[:16]
    so = cache_dir / "kernels" / f"{name}_{key}.so"
    root = so.parent if so.is_file() else build_dir(cache_dir) / "kernels"
    so = root / so.name
    if not so.is_file():
        root.mkdir(parents=True, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            src, obj = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.o"
            src.write_text(source)
            for header, text in headers.items():
                (Path(tmp) / header).write_text(text)
            for cmd in ([cc, *flags, "-fPIC", "-c", str(src), "-o", str(obj)],
                        [cc, "-shared", "-fopenmp", str(obj), "-o", f"{tmp}/k.so", "-lm"]):
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            os.replace(f"{tmp}/k.so", so)  # atomic: concurrent builders race harmlessly
    return ctypes.CDLL(str(so))


def address(lib: ctypes.CDLL, name: str) -> int:
    """Where C function `name` of `lib` is: for a kernel that calls another through a function pointer
    (models/gguf_decode.c), so that each is built once, with its own flags."""
    return int(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0)


@functools.cache  # one attempt per kernel, flags and directory
def try_build(name: str, source: str, flags: tuple[str, ...], cache_dir: Path, fallback: str) -> ctypes.CDLL | None:
    """`build_library`, or None with a warning naming `fallback` (what runs instead) if it cannot be built."""
    try:
        return build_library(name, source, flags, cache_dir)
    except (OSError, subprocess.SubprocessError) as e:
        detail = e.stderr.decode(errors="replace")[-400:] if isinstance(e, subprocess.CalledProcessError) else e
        logger.warning("C kernel %s unavailable (%s); %s", name, detail, fallback)
        return None
