"""Builds the engine's C kernels with the system C compiler, caches each per source, flags and CPU (or named ISA
level: an image's x86-64-v4,x86-64-v3), outside a read-only cache, and loads them through ctypes on torch's
OpenMP pool; compiling and linking apart, so that no kernel's -ffast-math start-up code changes torch's
numerics (docs/architecture.md, "CPU kernels").
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tandem_engine.config import build_dir

logger = logging.getLogger(__name__)

# Build for named ISA levels (x86-64-v4,x86-64-v3) instead of this CPU, so that kernels built into an image
# run on every node of those levels (docs/operations.md, "Start-up and the model cache").
KERNEL_MARCH_ENV = "TANDEM_CPU_KERNEL_MARCH"
# /proc/cpuinfo flags a level needs (a subset that tells the levels apart); other values are trusted.
_V3 = {"avx2", "fma", "bmi2", "f16c", "movbe"}
_MARCH_CPU_FLAGS = {"x86-64-v2": {"ssse3", "sse4_2", "popcnt"}, "x86-64-v3": _V3,
                    "x86-64-v4": _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}}


def kernel_levels() -> list[str]:
    """The ISA levels `TANDEM_CPU_KERNEL_MARCH` names, in order of preference (empty: build for this CPU)."""
    return [level.strip() for level in os.environ.get(KERNEL_MARCH_ENV, "").split(",") if level.strip()]


def kernel_march() -> str:
    """What kernels build for here: the first of `kernel_levels()` this CPU has (the last if it has none:
    `build_library` then says what it lacks), or `native`."""
    levels = kernel_levels()
    if not levels:
        return "native"
    words = set(cpu_id().split())  # the flags (and the model name's words, which name no flag)
    return next((level for level in levels if _MARCH_CPU_FLAGS.get(level, set()) <= words), levels[-1])


def base_flags() -> tuple[str, ...]:
    """Every kernel's compile flags start with these: optimised for this CPU (or the ISA level picked from
    `TANDEM_CPU_KERNEL_MARCH`), threaded over rows with OpenMP."""
    return ("-O3", f"-march={kernel_march()}", "-fopenmp")


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


# (name, source, flags) of every build_library call while `recording()` is active (prepare.py).
_recorded: list[tuple[str, str, tuple[str, ...]]] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, str, tuple[str, ...]]]]:
    """Collects the (name, source, flags) of each kernel built inside the block: prepare.py builds the
    kernels this CPU's level loads, then compiles the same for the image's other levels."""
    global _recorded
    _recorded = []
    try:
        yield _recorded
    finally:
        _recorded = None


def _march(flags: tuple[str, ...]) -> str:
    return next((f.removeprefix("-march=") for f in flags if f.startswith("-march=")), "native")


def _compile(name: str, source: str, flags: tuple[str, ...], cache_dir: Path) -> Path:
    """The shared object of `source` built with `flags`: compiled into `<cache_dir>/kernels/<name>_<key>.so`
    (or the build directory's, for a read-only `cache_dir`) unless it is there already."""
    march = _march(flags)
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
    return so


def build_library(name: str, source: str, flags: tuple[str, ...], cache_dir: Path) -> ctypes.CDLL:
    """Compile `source` (C) with `flags` into `<cache_dir>/kernels/<name>_<key>.so` unless that file
    exists (or the build directory's, for a read-only `cache_dir`), and load it. Raises OSError or
    subprocess.SubprocessError without a compiler, on a failed build, or for an ISA level this CPU lacks."""
    missing = _MARCH_CPU_FLAGS.get(_march(flags), set()) - set(cpu_id().split())
    if missing:
        raise OSError(f"this CPU lacks {' '.join(sorted(missing))} for -march={_march(flags)}")
    if _recorded is not None:
        _recorded.append((name, source, flags))
    return ctypes.CDLL(str(_compile(name, source, flags, cache_dir)))


def compile_for_level(name: str, source: str, flags: tuple[str, ...], level: str, cache_dir: Path) -> Path | None:
    """Compile (never load: this CPU may lack the level) what `build_library(name, source, flags)` built,
    for ISA level `level` instead of the one in `flags`, under the key an engine on such a CPU looks for.
    None for a build not made for a named level (a portable one)."""
    if _march(flags) not in _MARCH_CPU_FLAGS:
        return None
    return _compile(name, source, tuple(f"-march={level}" if f.startswith("-march=") else f for f in flags),
                    cache_dir)


def address(lib: ctypes.CDLL, name: str) -> int:
    """Where C function `name` of `lib` is: for a kernel that calls another through a function pointer
    (kernels/decode_step.c), so that each is built once, with its own flags."""
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
