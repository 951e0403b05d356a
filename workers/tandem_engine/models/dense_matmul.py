"""float32 matmuls over weights packed into panels of 16 output columns (dense_matmul.c), for the dense
path's decode steps: the fused decode step (gguf_decode.py) calls them from its own threads, and `matmul`
runs one whole, for the tests and the head.

`pack_panels` copies a [n, k] weight once into [ceil(n / 16), k, 16]; every output is one chain of fused
multiply-adds in k order (the same floats on every build of the kernel). Faster than oneDNN's packed matmul
for the short, wide matmuls of a decode step (1.2-1.3x at 32 rows on an AVX2 EPYC), so decode steps run on
it; prefill keeps oneDNN (packed_linear.py).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tandem_engine.kernels.build import address, base_flags, try_build

_SRC = (Path(__file__).parent / "dense_matmul.c").read_text()
PANEL = 16  # output columns of a panel (dense_matmul.c's NR)
# Op-by-op matmuls of up to this many rows run on the panels where a layer has them; larger ones on oneDNN's
# packed copy (DenseKernel.max_rows). The AVX2 build (one-panel tiles), on an AVX2 EPYC: as fast as oneDNN or
# faster from 1 to 512 rows (the CPU's default step budget, config.CPU_STEP_TOKENS), 0.88-0.94x at 2,048.
PANEL_MAX_ROWS = 512
# The AVX-512 build (two-panel tiles), on an AVX-512 Xeon: even with oneDNN at 64-96 rows, 3-10% behind it
# from 128 to 512; a prefill of 32 x 256 tokens in 512-token steps spent 9% less in its matmuls on oneDNN.
PANEL_MAX_ROWS_AVX512 = 96


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A [n, k] float32 weight (any strides) as [ceil(n / PANEL), k, PANEL] contiguous, zeros past row n."""
    n, k = weight.shape
    whole, rest = divmod(n, PANEL)
    out = torch.zeros(whole + (rest > 0), k, PANEL, dtype=torch.float32)  # no copy of the weight on the way
    head = weight[: whole * PANEL]  # any strides: splitting the row dim is always a view
    out[:whole].copy_(head.as_strided((whole, k, PANEL), (PANEL * head.stride(0), head.stride(1), head.stride(0)),
                                      head.storage_offset()))
    if rest:
        out[whole, :, :rest].copy_(weight[whole * PANEL :].t())
    return out


class DenseKernel:
    """The built dense_matmul.c; threads as torch's."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._matmul = lib.tandem_dense_matmul
        self._matmul.argtypes = [p, i64, i64, p, i64, i64, p, i64, ctypes.c_int]
        self._matmul.restype = None
        # For the fused decode step (gguf_decode.c's kernels_t): x copied into its buffer, then columns.
        self.entries = {"quantize": address(lib, "tandem_dense_copy_x"),
                        "matmul_cols": address(lib, "tandem_dense_matmul_cols")}
        # Output columns of a tile (one panel, or two in the AVX-512 build): runs of columns that start on
        # multiples of it take whole tiles.
        self.tile_cols = int(lib.tandem_dense_tile_cols())
        # Op-by-op matmuls of up to this many rows run here, larger ones on oneDNN (DecoderLayer._project).
        self.max_rows = PANEL_MAX_ROWS_AVX512 if self.tile_cols > PANEL else PANEL_MAX_ROWS

    @staticmethod
    def x_bytes(m: int, k: int) -> int:
        """Bytes of the fused step's copy of m rows of k values."""
        return 4 * m * k

    def matmul(self, x: torch.Tensor, panels: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] float32 (rows at any stride, columns contiguous) @ W.T -> [m, n], W packed by
        `pack_panels`; into `out` (rows at any stride, columns contiguous) if given."""
        m, k = x.shape
        if panels.shape[1:] != (k, PANEL) or panels.shape[0] * PANEL < n or x.stride(1) != 1:
            raise ValueError(f"x {tuple(x.shape)} does not fit panels {tuple(panels.shape)} of {n} columns")
        if out is None:
            out = torch.empty(m, n)
        self._matmul(x.data_ptr(), x.stride(0), m, panels.data_ptr(), n, k, out.data_ptr(), out.stride(0),
                     torch.get_num_threads())
        return out


class PanelLinear:
    """A projection's panel copy: y [rows, out] = x [rows, in] @ W.T + b on the panel kernel."""

    def __init__(self, weight: torch.Tensor, kernel: DenseKernel) -> None:
        self.panels, self.out_features, self.kernel = pack_panels(weight), weight.shape[0], kernel

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.kernel.matmul(x if x.stride(-1) == 1 else x.contiguous(), self.panels, self.out_features)
        return y if bias is None else y.add_(bias)


@functools.cache  # one per directory
def load_dense_kernel(cache_dir: Path) -> DenseKernel | None:
    """The kernel built once under `cache_dir` (kernels/build.py), or None with a warning."""
    lib = try_build("dense_matmul", _SRC, base_flags(), cache_dir, "dense decode steps run op by op")
    return None if lib is None else DenseKernel(lib)
