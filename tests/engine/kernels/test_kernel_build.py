"""Where the C attention kernels (and every other C kernel) are built and found: for a named ISA level (the
image's build), only on a CPU with that level's features, and outside a read-only cache directory; and what
every build of them must hold."""

from __future__ import annotations

import ctypes
import math
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tandem_engine.kernels import build, prefill_attention
from tandem_engine.kernels.build import KERNEL_MARCH_ENV
from tandem_engine.kernels.paged_attention import KERNEL_MATH_FLAGS, SOURCE, load_kernel
from tests.engine.attention.test_cpu_attention import CASES, run_step
from tests.engine.utils import read_only


def _has(*flags: str) -> bool:
    return set(flags) <= set(build.cpu_id().split())


@pytest.mark.skipif(platform.machine() != "x86_64" or not _has("avx2", "fma", "bmi2", "f16c", "movbe"),
                    reason="needs an x86-64-v3 CPU")
def test_kernel_built_for_an_isa_level_matches_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(KERNEL_MARCH_ENV, "x86-64-v3")
    out, ref = run_step(*CASES["mixed"], use_kernel=True)  # the backend builds into TANDEM_CACHE_DIR
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    (level,) = (tmp_path / "kernels").glob("paged_attention_*.so")
    assert len(list((tmp_path / "kernels").glob("prefill_attention_*.so"))) == 1
    monkeypatch.delenv(KERNEL_MARCH_ENV)
    assert load_kernel.__wrapped__(tmp_path) is not None
    assert len(list((tmp_path / "kernels").glob("paged_attention_*.so"))) == 2, \
        "the native build must not reuse the level's"
    assert level.is_file()


@pytest.mark.skipif(platform.machine() != "x86_64" or not _has("avx512f", "avx2", "fma", "bmi2", "f16c", "movbe"),
                    reason="needs an AVX-512 CPU")
@pytest.mark.parametrize(("query_lens", "seq_lens", "tables", "heads"), [
    ([1, 1, 1, 1], [40, 20, 35, 17], [[5, 30, 12], [7, 2], [21, 9, 33], [17, 3]], (9, 3, 64)),
    ([150, 1, 20], [150, 9, 300], [list(range(10)), [10], list(range(11, 30))], (9, 3, 64)),
    ([150, 1, 20], [150, 9, 300], [list(range(10)), [10], list(range(11, 30))], (16, 2, 64)),
], ids=["decode_rows", "prefill_chunks", "prefill_chunks_g8"])
def test_avx512_build_computes_the_avx2_builds_floats(query_lens: list[int], seq_lens: list[int],
                                                      tables: list[list[int]], heads: tuple[int, int, int],
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With AVX-512 the decode scores of 16 keys are summed together (four shuffle-and-add levels over pairs
    of keys) instead of one horizontal sum per key; the levels are hsum16's tree, so the outputs are the
    AVX2 build's bit for bit, on rows of whole and partial 16-key blocks. Prefill chunks cut their scores
    and P x V into other register blocks on each (and e^x runs at other vector widths, the kernel's own
    polynomial in every lane: see the next test), with every lane's terms in the same order: the same
    floats, over several 128-key softmax chunks and every row tail (128 rows of eight heads per KV head)."""
    outs = []
    for march in ("x86-64-v3", None):
        monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / str(march)))
        if march:
            monkeypatch.setenv(KERNEL_MARCH_ENV, march)
        else:
            monkeypatch.delenv(KERNEL_MARCH_ENV)
        out, ref = run_step(query_lens, seq_lens, tables, use_kernel=True, heads=heads, bs=16)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        outs.append(out)
    assert sorted(p.name.rsplit("_", 1)[0] for p in (tmp_path / "None" / "kernels").glob("*.so")) == \
        ["paged_attention", "prefill_attention"], "the native kernels were not built"
    assert torch.equal(outs[0], outs[1])


# The ISA levels and tunings the kernel meets: the image's levels, AVX-512 tuned for 256-bit vectors (the
# Xeons GCC knows), for 512-bit ones (AMD's Zen 4 and the generic tuning GCC gives a Xeon it does not know by
# name: -march=native resolved so on one with AVX-512-FP16 and AMX), and that Xeon's own flags.
TARGETS = {
    "x86-64-v3": ("-march=x86-64-v3",),
    "x86-64-v4": ("-march=x86-64-v4",),  # the image's build for AVX-512 nodes
    "sapphirerapids": ("-march=sapphirerapids",),
    "avx512-wide": ("-march=skylake-avx512", "-mtune=generic", "-mprefer-vector-width=512"),
    "cooperlake-fp16-amx": ("-march=cooperlake", "-mavx512fp16", "-mavx512bf16", "-mamx-tile", "-mamx-int8",
                            "-mamx-bf16", "-mtune=generic"),
}


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="reads x86-64 machine code with objdump")
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("kernel", ["paged_attention", "prefill_attention"])
def test_no_build_calls_math_whose_floats_depend_on_the_vector_width(kernel: str, target: str,
                                                                     tmp_path: Path) -> None:
    """Why every build can compute the same floats: under the kernel's -ffast-math GCC turns a loop of expf
    (or sqrtf, or a division) into calls of libmvec's variant for the loop's width (SSE, AVX2, AVX-512) and
    of scalar expf for its tail, or into approximate reciprocals refined per ISA, and those differ in the
    last bit: the decode softmax's expf made the native build on a Zen 4 and on a Xeon with AVX-512-FP16
    disagree with the x86-64-v3 build. Compiled (not run) for each ISA level and tuning: the object calls no
    libm function and holds no approximate reciprocal, so a CPU this machine is not still meets the rule.
    Both attention kernels (decode rows, prefill chunks: the prefill softmax's e^x is in the same loops)."""
    source = SOURCE if kernel == "paged_attention" else prefill_attention.SOURCE
    src = tmp_path / f"{kernel}.c"
    src.write_text(source)
    for header, text in build.local_headers(source).items():
        (tmp_path / header).write_text(text)
    obj = tmp_path / "k.o"
    subprocess.run([os.environ.get("CC", "cc"), "-O3", "-fopenmp", *KERNEL_MATH_FLAGS, *TARGETS[target], "-fPIC",
                    "-c", str(src), "-o", str(obj)], check=True, capture_output=True, timeout=120)
    relocs = subprocess.run(["objdump", "-r", str(obj)], capture_output=True, text=True, check=True).stdout
    called = {ln.split()[-1].split("-")[0] for ln in relocs.splitlines() if "R_X86_64_PLT32" in ln}
    width_dependent = {f for f in called if f.startswith("_ZGV") or f.rstrip("f") in
                       ("exp", "exp2", "log", "pow", "sqrt", "tanh", "erf", "sin", "cos")}
    assert not width_dependent, width_dependent
    assert called, "no call found at all: the relocation listing was not read right"
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True,
                          check=True).stdout
    assert not re.findall(r"\bv?(rcp|rsqrt)\w*(ps|ss)\b", code)


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="reads x86-64 machine code with objdump")
def test_kernel_issues_its_prefetches(tmp_path: Path) -> None:
    """The kernel requests the next blocks of a row's scattered table ahead of use. GCC deletes a loop of
    `__builtin_prefetch` as dead code at -O1 and above, so for a long time the built kernel issued none:
    the shared object must hold prefetch instructions."""
    assert load_kernel.__wrapped__(tmp_path) is not None
    (lib,) = (tmp_path / "kernels").glob("*.so")
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True,
                          check=True).stdout
    assert "prefetcht1" in code


def test_isa_level_the_cpu_lacks_is_not_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(KERNEL_MARCH_ENV, "x86-64-v3")
    monkeypatch.setattr(build, "cpu_id", lambda: "x86_64 flags : fpu sse sse2")
    assert load_kernel.__wrapped__(tmp_path) is None
    assert "lacks avx2 bmi2 f16c fma movbe" in caplog.text
    assert not (tmp_path / "kernels").exists()


def test_read_only_cache_dir_builds_under_the_temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    baked, scratch = tmp_path / "baked", tmp_path / "tmp"
    baked.mkdir()
    read_only(monkeypatch, baked, scratch)
    assert load_kernel.__wrapped__(baked) is not None
    assert not list(baked.iterdir())
    assert list(scratch.glob(f"tandem-cache-{os.getuid()}/kernels/*.so"))


def test_a_shared_header_is_built_with_the_source_and_keys_its_build(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel's quoted #include names a header in kernels/ (tandem_kernels.h): the build finds it, and a
    changed header builds a new shared object instead of loading one built from the old text."""
    source = '#include "tandem_kernels.h"\nfloat e(float x) { return exp_small(x); }\n'
    lib = build.build_library("exp_check", source, build.base_flags(), tmp_path)
    lib.e.argtypes, lib.e.restype = [ctypes.c_float], ctypes.c_float
    assert lib.e(1.0) == pytest.approx(math.e, rel=1e-6)
    assert lib.e(-20.0) == pytest.approx(math.exp(-20.0), rel=1e-6)
    real = build.local_headers(source)
    assert list(real) == ["tandem_kernels.h"]
    monkeypatch.setattr(build, "local_headers", lambda src: {n: t + "\n/* changed */\n" for n, t in real.items()})
    build.build_library("exp_check", source, build.base_flags(), tmp_path)
    assert len(list((tmp_path / "kernels").glob("exp_check_*.so"))) == 2


V3_FLAGS = {"avx2", "fma", "bmi2", "f16c", "movbe"}
V4_FLAGS = V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.skipif(platform.machine() != "x86_64" or not _has(*V3_FLAGS), reason="needs an x86-64-v3 CPU")
def test_an_image_listing_two_levels_holds_kernels_for_each_and_every_node_finds_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The image's TANDEM_CPU_KERNEL_MARCH=x86-64-v4,x86-64-v3: its build (prepare.py, on whatever CPU builds
    the image) compiles the kernels for both levels; a node uses the first level its CPU has and finds that
    build under the key it looks for, with no compiler (the image has none). An AVX2-only node must never get
    the AVX-512 build (SIGILL), an AVX-512 one not the slower AVX2 one (a third less decode rate)."""
    monkeypatch.setenv(KERNEL_MARCH_ENV, "x86-64-v4,x86-64-v3")
    def cpu(flags: set[str]) -> None:
        monkeypatch.setattr(build, "cpu_id", lambda: "x86_64 flags : " + " ".join(sorted(flags)))

    cpu(V3_FLAGS)  # the CPU that builds the image: AVX2
    assert build.kernel_march() == "x86-64-v3"
    source = SOURCE
    flags = (*build.base_flags(), *KERNEL_MATH_FLAGS)
    with build.recording() as built:
        build.build_library("paged_attention", source, flags, tmp_path)
    assert [name for name, _, _ in built] == ["paged_attention"]
    for name, src, fl in built:
        assert build.compile_for_level(name, src, fl, "x86-64-v4", tmp_path) is not None
    read_only(monkeypatch, tmp_path, tmp_path / "scratch")
    image = tmp_path
    monkeypatch.setenv("CC", "false")  # no compiler on the node
    for flags_, level in ((V3_FLAGS, "x86-64-v3"), (V4_FLAGS, "x86-64-v4")):
        cpu(flags_)
        assert build.kernel_march() == level
        lib = build.build_library("paged_attention", source, (*build.base_flags(), *KERNEL_MATH_FLAGS), image)
        assert Path(lib._name).parent == image / "kernels", lib._name
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 2
    cpu({"sse2"})
    with pytest.raises(OSError, match="lacks"):
        build.build_library("paged_attention", source, (*build.base_flags(), *KERNEL_MATH_FLAGS), image)


KERNELS_DIR = Path(build.__file__).parent


def _kernels() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every C kernel the engine builds: (source, flags) by name, as its wrapper builds it."""
    from tandem_engine.kernels import amx_matmul, decode_step, fused, gguf_matmul, paged_attention, panel_matmul

    found = {m.__name__.rsplit(".", 1)[1]: (m.SOURCE, m.build_flags())
             for m in (amx_matmul, decode_step, fused, gguf_matmul, paged_attention, panel_matmul, prefill_attention)}
    found["gguf_matmul_portable"] = (gguf_matmul.SOURCE, gguf_matmul.build_flags(portable=True))
    return found


def test_every_kernel_source_is_in_kernels_and_has_a_wrapper() -> None:
    sources = {p.stem for p in KERNELS_DIR.glob("*.c")}
    assert sources == {name for name in _kernels() if not name.endswith("_portable")}
    assert not list(KERNELS_DIR.parent.glob("[!k]*/*.c")), "C kernels live in kernels/"


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which(os.environ.get("CC", "cc")) is None,
                    reason="needs an x86-64 C compiler")
@pytest.mark.parametrize("level", ["native", "x86-64-v3"])
def test_every_kernel_compiles_without_a_warning(level: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-Wall -Wextra -Werror over each kernel with its own flags, for this CPU and for the image's lowest ISA
    level (compiled, not run: this CPU may lack it), with the entry points' prototypes from tandem_kernels.h
    in scope, so that a definition that drifts from its declaration fails here, and the other headers each
    includes (attention_simd.h) beside it."""
    if level == "native":
        monkeypatch.delenv(KERNEL_MARCH_ENV, raising=False)
    else:
        monkeypatch.setenv(KERNEL_MARCH_ENV, level)
    kernels = _kernels()
    for name, (source, _) in kernels.items():
        assert '#include "tandem_kernels.h"' in source, f"{name} does not include the shared header"
        (tmp_path / f"{name}.c").write_text(source)
        for header, text in build.local_headers(source).items():
            (tmp_path / header).write_text(text)

    def compile_one(name: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        flags = kernels[name][1]
        cmd = [os.environ.get("CC", "cc"), *flags, "-Wall", "-Wextra", "-Werror", "-fPIC", "-c",
               str(tmp_path / f"{name}.c"), "-o", str(tmp_path / f"{name}.o")]
        return name, subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        failed = {name: proc.stderr[-2000:] for name, proc in pool.map(compile_one, kernels) if proc.returncode}
    assert not failed, failed


def test_the_headers_type_ids_and_blocks_are_ggml_s(tmp_path: Path) -> None:
    """The ids and block sizes tandem_kernels.h declares are the gguf package's (Python's one source)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    source = '#include "tandem_kernels.h"\n' + "".join(
        f"int64_t id_{n}(void) {{ return {n}; }}\n" for n in ("F32", "F16", "Q4_1", "Q8_0")) + "".join(
        f"int64_t bytes_{n}(void) {{ return block_bytes({n}); }}\n" for n in ("Q4_1", "Q8_0"))
    lib = build.build_library("type_ids", source, build.base_flags(), tmp_path)
    for n in ("F32", "F16", "Q4_1", "Q8_0"):
        fn = getattr(lib, f"id_{n}")
        fn.restype = ctypes.c_int64
        assert fn() == int(T[n]), n
    for n in ("Q4_1", "Q8_0"):
        fn = getattr(lib, f"bytes_{n}")
        fn.restype = ctypes.c_int64
        assert (32, fn()) == GGML_QUANT_SIZES[T[n]], n
