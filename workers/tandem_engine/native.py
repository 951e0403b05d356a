"""Build the engine's small C kernels with the system C compiler, once per source, flags and CPU.

A kernel ships as C source beside the module that calls it (attention/paged_attention.c,
models/gguf_matmul.c); the first process that needs it compiles it into a shared object under the cache
directory (`--cache-dir`, EngineConfig.cache_dir) and later ones load the cached file with ctypes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path


def build_library(cache_dir: Path, name: str, source: str, flags: list[str]) -> ctypes.CDLL:
    """Compile `source` with `flags` (cached under `cache_dir`/kernels) and load it. Raises OSError or
    subprocess.SubprocessError when no compiler or no such flag is available."""
    root = cache_dir / "kernels"
    # -march=native code must not be reused on another CPU (a shared home or a baked image): key on it.
    key = hashlib.sha256((source + " ".join(flags) + cpu_id()).encode()).hexdigest()[:16]
    so = root / f"{name}_{key}.so"
    if not so.is_file():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            src = Path(tmp) / "k.c"
            src.write_text(source)
            cc = os.environ.get("CC", "cc")
            subprocess.run([cc, *flags, str(src), "-o", f"{tmp}/k.so", "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(f"{tmp}/k.so", so)  # atomic: concurrent builders race harmlessly
    return ctypes.CDLL(str(so))


def cpu_id() -> str:
    """The machine and its CPU's model and feature flags (what -march=native compiles for)."""
    ident = os.uname().machine
    try:
        with open("/proc/cpuinfo") as f:
            ident += "".join(ln for ln in f if ln.startswith(("model name", "flags")))
    except OSError:
        pass
    return ident


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    for line in cpu_id().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()
