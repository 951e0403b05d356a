"""Projections over a GGUF file's own Q4_1/Q8_0 blocks (`--quantization gguf`): a few rows on gguf_matmul.c,
which reads each block once inside the matmul with int8 activations per block of 32 (as llama.cpp), so a
decode step is bound by memory; many rows dequantize once per call into torch's matmul (docs/architecture.md,
"GGUF weight-only quantization").
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tandem_engine.kernels.build import address, base_flags, build_library

# ggml type id -> (weights per block, bytes per block)
# (weights, bytes) of a block of each type the kernels read, as the gguf package has them (ggml's type ids;
# tandem_kernels.h declares the same blocks).
BLOCKS = {int(t): GGML_QUANT_SIZES[t] for t in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)}
# From this many rows on, dequantize-then-GEMM beats the kernel on SmolLM2's projections (one thread,
# CPU time: the kernel ahead at 16 rows, even at 24, behind at 32); `bench/vs_llama_cpp.py --parts kernel`
# measures it. The head's 49,152 rows cost more to write out: the kernel stays ahead to 32 rows there.
DENSE_FROM_ROWS = 24
HEAD_DENSE_FROM_ROWS = 48

SOURCE = (Path(__file__).parent / "gguf_matmul.c").read_text()
# -ffp-contract=off: dequantization rounds d * q and + m separately, as the gguf package does.
# Without FMA contraction, so that `dequantize` equals the gguf package's bit for bit.
_PORTABLE_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")


@dataclass(frozen=True)
class QuantizedWeight:
    """A [rows, cols] weight in GGUF block layout: `data` uint8 [rows, cols / 32 * block bytes]."""

    qtype: int
    data: torch.Tensor
    cols: int

    def __post_init__(self) -> None:
        per, nbytes = BLOCKS[self.qtype]
        if self.cols % per or self.data.dtype != torch.uint8 or self.data.shape[1] != self.cols // per * nbytes:
            raise ValueError(f"{tuple(self.data.shape)} {self.data.dtype} is not a [rows, {self.cols}] "
                             f"weight of ggml type {self.qtype}")

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])


class GGUFKernel:
    """The built gguf_matmul.c: matmul and dequantize over QuantizedWeight, threads as torch's."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._matmul = lib.tandem_gguf_matmul
        self._matmul.argtypes = [p, i64, i64, p, i32, i64, i64, p, i64, i32]
        self._matmul.restype = i32
        self._matmul_q8 = lib.tandem_gguf_matmul_q8
        self._matmul_q8.argtypes = [p, i64, i64, p, i32, i64, i64, p, i64, i32]
        self._matmul_q8.restype = i32
        self._quantize_x = lib.tandem_gguf_quantize_x
        self._quantize_x.argtypes = [p, i64, i64, i64, i64, i64, p]
        self._quantize_x.restype = None
        self._matmul_q8_cols = lib.tandem_gguf_matmul_q8_cols
        self._matmul_q8_cols.argtypes = [p, i64, p, i32, i64, i64, i64, p, i64]
        self._matmul_q8_cols.restype = None
        self.xq8_bytes = lib.tandem_gguf_xq8_bytes  # (m, k) -> bytes of m rows of k quantized
        self.xq8_bytes.argtypes = [i64, i64]
        self.xq8_bytes.restype = i64
        # matmul_q8's two halves, for the fused decode step (decode_step.py) to call from its own threads
        self.entries = {"quantize": address(lib, "tandem_gguf_quantize_x"),
                        "matmul_cols": address(lib, "tandem_gguf_matmul_q8_cols")}
        self._dequantize = lib.tandem_gguf_dequantize
        self._dequantize.argtypes = [p, i32, i64, p, i64, p, i32]
        self._dequantize.restype = i32
        self.simd = bool(lib.tandem_gguf_simd())  # the AVX2/FMA path, else the portable one
        self.vnni = bool(lib.tandem_gguf_vnni())  # matmul_q8 on AVX-512 VNNI, else AVX2 (or portable)
        self._scratch = torch.empty(0)

    def matmul(self, x: torch.Tensor, w: QuantizedWeight, out: torch.Tensor) -> None:
        """out [rows, w.rows] (a column slice may do: rows at any stride, columns contiguous)
        = x [rows, w.cols] float32 contiguous @ W.T."""
        rc = self._matmul(x.data_ptr(), x.stride(0), x.shape[0], w.data.data_ptr(), w.qtype, w.rows, w.cols,
                          out.data_ptr(), out.stride(0), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"gguf matmul failed ({rc})")

    def matmul_q8(self, x: torch.Tensor, w: QuantizedWeight, out: torch.Tensor) -> None:
        """As `matmul`, with each row of x quantized to int8 per block of 32 first (d = max|x| / 127,
        q = round(x / d) half away from zero) and integer dot products with the weight's blocks."""
        rc = self._matmul_q8(x.data_ptr(), x.stride(0), x.shape[0], w.data.data_ptr(), w.qtype, w.rows, w.cols,
                             out.data_ptr(), out.stride(0), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"gguf int8 matmul failed ({rc})")

    def quantize_x(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, k] float32 (rows at any stride, columns contiguous) quantized as `matmul_q8` quantizes it,
        into a new buffer for `matmul_q8_cols`."""
        m, k = x.shape
        buf = torch.zeros(self.xq8_bytes(m, k), dtype=torch.uint8)
        self._quantize_x(x.data_ptr(), x.stride(0), m, k, 0, m * (k // 32), buf.data_ptr())
        return buf

    def matmul_q8_cols(self, xq: torch.Tensor, m: int, w: QuantizedWeight, out: torch.Tensor, start: int,
                       end: int) -> None:
        """Columns [start, end) of out [m, w.rows] (rows at any stride) = x @ W.T, from x quantized into `xq`
        by `quantize_x`: what one thread of `matmul_q8` computes."""
        self._matmul_q8_cols(xq.data_ptr(), m, w.data.data_ptr(), w.qtype, w.cols, start, end, out.data_ptr(),
                             out.stride(0))

    def dequantize(self, w: QuantizedWeight, rows: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [n, w.cols] of the rows `rows` (int64, in range; None: all) into `out` or a new tensor."""
        n = w.rows if rows is None else rows.numel()
        if out is None:
            out = torch.empty(n, w.cols)
        rc = self._dequantize(w.data.data_ptr(), w.qtype, w.cols, None if rows is None else rows.data_ptr(), n,
                              out.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"gguf dequantize failed ({rc})")
        return out

    def scratch(self, numel: int) -> torch.Tensor:
        """A float32 buffer of at least `numel` elements, reused by every call (one process, one step)."""
        if self._scratch.numel() < numel:
            self._scratch = torch.empty(numel)
        return self._scratch[:numel]


def build_flags(portable: bool = False) -> tuple[str, ...]:
    """gguf_matmul.c's compile flags: for this CPU (or the ISA level kernels build for), or portable (no
    -march: the scalar path the tests hold the SIMD ones to)."""
    return _PORTABLE_FLAGS if portable else (*base_flags(), "-ffp-contract=off")


@functools.cache  # one build per directory and variant
def load_gguf_kernel(cache_dir: Path, portable: bool = False) -> GGUFKernel:
    """Build (cached under `cache_dir`/kernels; kernels/build.py) and load the kernel: for this CPU (or
    `TANDEM_CPU_KERNEL_MARCH`'s ISA level), or the portable build without SIMD (`portable`). RuntimeError
    naming the flag when the C compiler cannot."""
    flags = build_flags(portable)
    try:
        return GGUFKernel(build_library("gguf_matmul" + "_portable" * portable, SOURCE, flags, cache_dir))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        raise RuntimeError(f"--quantization gguf needs its C kernel, built with the system C compiler and "
                           f"OpenMP (cc -fopenmp): {e} {detail.decode(errors='replace')[-300:]}") from e


class GGUFLinear:
    """y [rows, out] = x [rows, in] @ W.T + b, W the row-wise concatenation of GGUF-block weights (q|k|v
    or gate|up: the parts may differ in type). Below `dense_from_rows` rows the kernel runs on x quantized
    to int8 per block (`int8_activations`, as llama.cpp does) or on float32 x."""

    def __init__(self, parts: list[QuantizedWeight], bias: torch.Tensor | None, kernel: GGUFKernel,
                 dense_from_rows: int = DENSE_FROM_ROWS, int8_activations: bool = True) -> None:
        self.in_features = parts[0].cols
        if any(p.cols != self.in_features for p in parts):
            raise ValueError("the parts of a projection must share their input size")
        self.parts = _merge(parts)
        self.out_features = sum(p.rows for p in self.parts)
        self.bias = bias  # the model's own bias parameter (filled in place at load time) or None
        self.kernel = kernel
        self.dense_from_rows = dense_from_rows  # from this many rows on: dequantize + torch's matmul
        self.int8_activations = int8_activations

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if x.shape[0] >= self.dense_from_rows:
            w = self.kernel.scratch(self.out_features * self.in_features).view(self.out_features, self.in_features)
            start = 0
            for p in self.parts:
                self.kernel.dequantize(p, out=w[start : start + p.rows])
                start += p.rows
            return F.linear(x, w, self.bias)
        y = torch.empty(x.shape[0], self.out_features)
        matmul = self.kernel.matmul_q8 if self.int8_activations else self.kernel.matmul
        start = 0
        for p in self.parts:
            matmul(x, p, y[:, start : start + p.rows])
            start += p.rows
        return y if self.bias is None else y.add_(self.bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer multiplies by (for references)."""
        return torch.cat([self.kernel.dequantize(p) for p in self.parts])


class GGUFEmbedding:
    """Rows of a GGUF-block embedding table, dequantized when looked up: [T] int64 ids -> [T, dim]."""

    def __init__(self, weight: QuantizedWeight, kernel: GGUFKernel) -> None:
        self.weight, self.kernel = weight, kernel

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.weight.rows):
            raise IndexError(f"token id out of range [0, {self.weight.rows})")
        return self.kernel.dequantize(self.weight, ids)


def _merge(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Adjacent parts of one type joined into one weight (one kernel call instead of several)."""
    merged: list[QuantizedWeight] = []
    for p in parts:
        if merged and merged[-1].qtype == p.qtype and merged[-1].cols == p.cols:
            merged[-1] = QuantizedWeight(p.qtype, torch.cat([merged[-1].data, p.data]), p.cols)
        else:
            merged.append(p)
    return merged
