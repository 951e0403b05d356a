"""The CPU paged-attention kernel of decode (paged_attention.c): decode rows, a decode row's head range for the
whole-step kernel, and the store of a step's keys and values, built with kernels/build.py and called through
ctypes by attention/cpu_backend.py. Prefill chunks are another library, prefill_attention.py's, built with the
same flags, KERNEL_MATH_FLAGS (docs/architecture.md, "CPU kernels")."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tandem_engine.kernels.build import base_flags, try_build

# The kernel's C source ships beside this module; the built library is keyed on its text.
SOURCE = (Path(__file__).parent / "paged_attention.c").read_text()
# The cache dtypes the kernel reads, as its `kv_type` argument.
KERNEL_KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# -fno-associative-math: the attention kernels' sums run in the order written (see attention_simd.h, fma16).
# The rest of -ffast-math would let GCC call libm's vector functions, whose floats depend on the vector width:
# the kernels call none (test_kernel_build.py checks the object code of each ISA level).
KERNEL_MATH_FLAGS = ("-ffast-math", "-fno-associative-math")


def build_flags() -> tuple[str, ...]:
    """paged_attention.c's compile flags."""
    return (*base_flags(), *KERNEL_MATH_FLAGS)


@functools.cache  # one attempt per directory
def load_kernel(cache_dir: Path) -> ctypes.CDLL | None:
    """Build (once per source version, cached under `cache_dir`/kernels, or config.build_dir's when
    `cache_dir` is read-only; kernels/build.py) and load the C kernel; None if impossible. Its entries:
    `tandem_paged_attention` (decode rows over threads), `tandem_paged_attention_heads` (a head range of
    one row) and `tandem_write_kv` (a step's keys and values into a float32 cache)."""
    return build_kernel(SOURCE, cache_dir)


def build_kernel(source: str, cache_dir: Path, name: str = "paged_attention") -> ctypes.CDLL | None:
    """Build and load a paged-attention kernel `source` (load_kernel's, or another version of it, as
    bench/attention_kernel.py compares) with its entries' signatures set; None if it cannot be built."""
    lib = try_build(name, source, build_flags(), cache_dir, "using the torch SDPA path")
    if lib is None:
        return None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.tandem_paged_attention.argtypes = [p, i64, p, p, i32, p, i64, p, p, p, p, p, i64, i64, i32, i32, i32, i32,
                                           f32, i32]
    lib.tandem_paged_attention.restype = i32
    lib.tandem_paged_attention_heads.argtypes = [p, p, p, i32, p, i64, p, p, i32, i32, i32, i32, f32, i32, i32]
    lib.tandem_paged_attention_heads.restype = None
    if hasattr(lib, "tandem_write_kv"):  # older sources (bench/attention_kernel.py's baseline) lack it
        lib.tandem_write_kv.argtypes = [p, i64, p, i64, p, p, p, i64, i64, i64]
        lib.tandem_write_kv.restype = i64
    return lib


def kernel_scratch(nq: int, nkv: int, d: int, block_size: int, max_klen: int) -> int:
    """Floats of scratch the kernel needs per thread: scores and accumulators, then one block widened from a
    16-bit cache."""
    return nq * (max_klen + d) + block_size * nkv * d


