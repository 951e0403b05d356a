"""The CPU tiled causal attention of prefill chunks (prefill_attention.c): float32 queries over a float32,
bfloat16 or float16 paged cache, over threads of its own or one work item at a time for the whole-step kernel,
built with kernels/build.py and called through ctypes by attention/cpu_backend.py. Its own library beside the
decode kernel's (paged_attention.py), built with the same flags; the vector code both compile is
kernels/attention_simd.h (docs/architecture.md, "CPU kernels")."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from tandem_engine.kernels.build import base_flags, try_build
from tandem_engine.kernels.paged_attention import KERNEL_MATH_FLAGS

# The kernel's C source ships beside this module; the built library is keyed on its text (and its headers').
SOURCE = (Path(__file__).parent / "prefill_attention.c").read_text()


def build_flags() -> tuple[str, ...]:
    """prefill_attention.c's compile flags: paged_attention.c's (KERNEL_MATH_FLAGS)."""
    return (*base_flags(), *KERNEL_MATH_FLAGS)


@functools.cache  # one attempt per directory
def load_kernel(cache_dir: Path) -> ctypes.CDLL | None:
    """Build (once per source version, cached under `cache_dir`/kernels, or config.build_dir's when
    `cache_dir` is read-only; kernels/build.py) and load the C kernel; None if impossible. Its entries:
    `tandem_prefill_attention_kv` (prefill chunks over threads, tiled, over any of the KV cache's types; over a
    float32 cache: `tandem_prefill_attention`), `tandem_prefill_attention_item` (one work item of it, for the
    whole-step kernel) and the sizes of its work (`tandem_prefill_items`, `tandem_prefill_scratch`)."""
    return build_kernel(SOURCE, cache_dir)


def build_kernel(source: str, cache_dir: Path, name: str = "prefill_attention") -> ctypes.CDLL | None:
    """Build and load a prefill-attention kernel `source` (load_kernel's, or another version of it, as
    bench/prefill_attention.py compares) with its entries' signatures set; None if it cannot be built."""
    lib = try_build(name, source, build_flags(), cache_dir, "using the torch SDPA path")
    if lib is None:
        return None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.tandem_prefill_attention.argtypes = [p, i64, p, p, p, i64, p, p, p, p, i64, p, p, i32, i32, i32, i32, f32,
                                             i32]
    lib.tandem_prefill_attention.restype = i32
    lib.tandem_prefill_scratch.argtypes = [i32, i32]
    lib.tandem_prefill_scratch.restype = i64
    if hasattr(lib, "tandem_prefill_attention_kv"):  # older sources (bench/prefill_attention.py's baseline) lack it
        lib.tandem_prefill_attention_kv.argtypes = [p, i64, p, p, i32, p, i64, p, p, p, p, i64, p, p, i32, i32, i32,
                                                    i32, f32, i32]
        lib.tandem_prefill_attention_kv.restype = i32
    if hasattr(lib, "tandem_prefill_items"):
        lib.tandem_prefill_items.argtypes = [p, i64, i32]
        lib.tandem_prefill_items.restype = i64
    return lib
