"""float32 matmuls over weights packed once into panels of 16 output columns (panel_matmul.c), faster than
oneDNN's for a decode step's short, wide matmuls: the whole-step kernel calls them from its own threads. A
GGUF model's panels keep its Q4_1/Q8_0 blocks instead where they unpack to the same floats, so a step streams
a fifth or a quarter of the bytes (docs/architecture.md, "Dense decode steps in one call" and "Float panels
beside the blocks").
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from tandem_engine.kernels.build import address, base_flags, try_build
from tandem_engine.kernels.gguf_matmul import BLOCKS, QuantizedWeight

SOURCE = (Path(__file__).parent / "panel_matmul.c").read_text()
PANEL = 16  # output columns of a panel (panel_matmul.c's NR)
# Op-by-op matmuls of up to this many rows run on the panels where a layer has them; larger ones on oneDNN's
# packed copy (PanelKernel.max_rows). The AVX2 build (one-panel tiles), on an AVX2 EPYC: as fast as oneDNN or
# faster from 1 to 512 rows (the CPU's default step budget, config.CPU_STEP_TOKENS), 0.88-0.94x at 2,048.
PANEL_MAX_ROWS = 512
# The AVX-512 build (two-panel tiles), on an AVX-512 Xeon: even with oneDNN at 64-96 rows, 3-10% behind it
# from 128 to 512; a prefill of 32 x 256 tokens in 512-token steps spent 9% less in its matmuls on oneDNN.
PANEL_MAX_ROWS_AVX512 = 96
F32 = int(GGMLQuantizationType.F32)  # the qtype of float panels; block panels take their blocks' type id (BLOCKS)
# Matmuls of this many rows or more read float panels where a projection keeps them beside its block panels
# (PanelLinear's `floats`; the AVX2 build only, PanelKernel.floats_pay). Unpacking a block costs about what
# the FMAs over it cost for a few rows, and a step of many rows is not held up by memory even at 4 bytes a
# weight. On 2 threads of an AVX2 EPYC (Zen 3), SmolLM2's projections with the weights streamed, float against
# Q4_1 panels in turn (best of 7): 16 rows 1.2-1.35x, 32 rows 1.0-1.4x (1.1x typical), 512 rows 1.0-1.3x; the
# engine's batch-32 decode step, two engines in one process stepping in turn, 0.924x and 0.932x the time. With
# fewer rows the 0.6-1 bytes a weight of the blocks win (one stream is bound by memory).
FLOAT_PANELS_FROM_ROWS = 16


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


def pack_block_panels(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """A [n, k] weight in a GGUF file's Q4_1 or Q8_0 blocks (uint8 [n, k / 32 * block bytes], a row of
    blocks per output row) as panel_matmul.c's block panels, uint8 [ceil(n / PANEL), k / 32 * panel block
    bytes]: per panel and block of 32 along k, the 16 columns' fp16 d (and Q4_1's m), then their quantized
    bytes 16 at a time, column-minor. Rows past n are zero blocks (weights 0, like pack_panels' padding)."""
    nbytes = BLOCKS[qtype][1]
    n, row_bytes = blocks.shape
    nb = row_bytes // nbytes
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, nb, nbytes, dtype=torch.uint8)
    padded[:n] = blocks.reshape(n, nb, nbytes)
    v = padded.view(panels, PANEL, nb, nbytes).transpose(1, 2)  # [panels, nb, column, block bytes]
    # bytes of fp16 scales a block starts with: Q4_1's d and m, Q8_0's d
    scales = 4 if qtype == GGMLQuantizationType.Q4_1 else 2
    # fp16 d (and m) of the 16 columns, contiguous: [panels, nb, scale, column, 2 bytes]
    head = v[..., :scales].reshape(panels, nb, PANEL, scales // 2, 2).transpose(2, 3)
    body = v[..., scales:].transpose(2, 3)  # [panels, nb, byte of the block, column]
    out = torch.cat((head.reshape(panels, nb, -1), body.reshape(panels, nb, -1)), dim=2)
    return out.reshape(panels, -1).contiguous()


class PanelKernel:
    """The built panel_matmul.c; threads as torch's."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._matmul = lib.tandem_panel_matmul
        self._matmul.argtypes = [p, i64, i64, p, ctypes.c_int, i64, i64, p, i64, ctypes.c_int]
        self._matmul.restype = None
        self._unpack = lib.tandem_panel_unpack
        self._unpack.argtypes = [p, ctypes.c_int, i64, i64, p]
        self._unpack.restype = None
        self._block_bytes = lib.tandem_panel_block_bytes
        self._block_bytes.argtypes = [ctypes.c_int]
        self._block_bytes.restype = i64
        # For the fused decode step (decode_step.c's kernels_t): x copied into its buffer, then columns.
        self.entries = {"quantize": address(lib, "tandem_panel_copy_x"),
                        "matmul_cols": address(lib, "tandem_panel_matmul_cols")}
        # Output columns of a tile (one panel, or two in the AVX-512 build): runs of columns that start on
        # multiples of it take whole tiles.
        self.tile_cols = int(lib.tandem_panel_tile_cols())
        vector_bits = int(lib.tandem_panel_vector_bits())  # 512, 256, or 0 (the scalar loop)
        # Whether projections that keep block panels should keep float panels too, for FLOAT_PANELS_FROM_ROWS
        # rows or more: measured on the AVX2 build only (on an AVX-512 Xeon such steps take the AMX copies).
        self.floats_pay = vector_bits == 256
        # Op-by-op matmuls of up to this many rows run here, larger ones on oneDNN (models/projection.py, Projection).
        self.max_rows = PANEL_MAX_ROWS_AVX512 if vector_bits == 512 else PANEL_MAX_ROWS

    @staticmethod
    def x_bytes(m: int, k: int) -> int:
        """Bytes of the fused step's copy of m rows of k values."""
        return 4 * m * k

    def _check(self, panels: torch.Tensor, qtype: int, k: int) -> None:
        if qtype == F32:
            fits = panels.dtype == torch.float32 and panels.shape[1:] == (k, PANEL)
        else:
            fits = (qtype in BLOCKS and panels.dtype == torch.uint8 and k % BLOCKS[qtype][0] == 0
                    and panels.shape[1:] == (k // BLOCKS[qtype][0] * self._block_bytes(qtype),))
        if not fits or not panels.is_contiguous():
            raise ValueError(f"k = {k} does not fit {panels.dtype} panels {tuple(panels.shape)} of type {qtype}")

    def matmul(self, x: torch.Tensor, panels: torch.Tensor, n: int, out: torch.Tensor | None = None,
               qtype: int = F32) -> torch.Tensor:
        """x [m, k] float32 (rows at any stride, columns contiguous) @ W.T -> [m, n], W packed by
        `pack_panels` (qtype F32) or `pack_block_panels` (its blocks' type); into `out` (rows at any stride,
        columns contiguous) if given."""
        m, k = x.shape
        self._check(panels, qtype, k)
        if panels.shape[0] * PANEL < n or x.stride(1) != 1:
            raise ValueError(f"x {tuple(x.shape)} does not fit panels {tuple(panels.shape)} of {n} columns")
        if out is None:
            out = torch.empty(m, n)
        self._matmul(x.data_ptr(), x.stride(0), m, panels.data_ptr(), qtype, n, k, out.data_ptr(), out.stride(0),
                     torch.get_num_threads())
        return out

    def unpack(self, panels: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
        """Block panels (`pack_block_panels`) as the float panels (`pack_panels`) of the weights they hold."""
        self._check(panels, qtype, k)
        out = torch.empty(panels.shape[0], k, PANEL)
        self._unpack(panels.data_ptr(), qtype, panels.shape[0], k, out.data_ptr())
        return out


@dataclass(frozen=True)
class DenseBlocks:
    """The Q4_1/Q8_0 blocks a dense model loaded from a GGUF file was dequantized from: per layer, each fused
    projection's parts (the checkpoint tensors in row order) where the file quantizes them, and the head's
    (the tied embedding's when tied). The dense path keeps its decode-step panels in them (panel_matmul.py)."""

    layers: list[dict[str, list[QuantizedWeight]]]
    head: QuantizedWeight | None


class PanelLinear:
    """A projection's panel copy: y [rows, out] = x [rows, in] @ W.T + b on the panel kernel. Given `blocks`,
    the GGUF blocks the weight was dequantized from (its rows in order, one part per checkpoint tensor), it
    keeps them as block panels if they are of one type the kernel reads and unpack to `weight` bit for bit,
    else float panels (`why_float` says why). Beside block panels it keeps the float panels too (`floats`)
    if `keep_floats` (fuse_decode_steps: where the kernel's `floats_pay`): matmuls of FLOAT_PANELS_FROM_ROWS
    rows or more then read those, the same floats."""

    def __init__(self, weight: torch.Tensor, kernel: PanelKernel,
                 blocks: Sequence[QuantizedWeight] | None = None, keep_floats: bool = False) -> None:
        self.out_features, self.kernel = weight.shape[0], kernel
        self.qtype, self.why_float = F32, "" if blocks is None else self._why_not_blocks(weight, blocks)
        self.floats: torch.Tensor | None = None
        if blocks is None or self.why_float:
            self.panels = pack_panels(weight)
            return
        self.qtype = blocks[0].qtype
        self.panels = pack_block_panels(torch.cat([b.data for b in blocks]), self.qtype)
        # Kept only if they are the weight, bit for bit (they are unless the weight is not their dequantization).
        floats = pack_panels(weight)
        if not torch.equal(kernel.unpack(self.panels, self.qtype, weight.shape[1]).view(torch.int32),
                           floats.view(torch.int32)):
            self.qtype, self.why_float, self.panels = F32, "its blocks do not unpack to its weight", floats
        elif keep_floats:
            self.floats = floats

    @staticmethod
    def _why_not_blocks(weight: torch.Tensor, blocks: Sequence[QuantizedWeight]) -> str:
        types = {b.qtype for b in blocks}
        if len(types) != 1 or not types <= BLOCKS.keys():
            return f"its parts are of ggml types {sorted(types)}, not all Q4_1 or all Q8_0"
        if sum(b.data.shape[0] for b in blocks) != weight.shape[0] or any(b.cols != weight.shape[1] for b in blocks):
            return f"its blocks are not a {tuple(weight.shape)} weight"
        return ""

    def step_panels(self, rows: int) -> tuple[torch.Tensor, int]:
        """The panels a matmul of `rows` rows reads, and their qtype."""
        if self.floats is not None and rows >= FLOAT_PANELS_FROM_ROWS:
            return self.floats, F32
        return self.panels, self.qtype

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        panels, qtype = self.step_panels(x.shape[0])
        y = self.kernel.matmul(x if x.stride(-1) == 1 else x.contiguous(), panels, self.out_features, qtype=qtype)
        return y if bias is None else y.add_(bias)


def build_flags() -> tuple[str, ...]:
    """panel_matmul.c's compile flags."""
    return base_flags()


@functools.cache  # one per directory
def load_panel_kernel(cache_dir: Path) -> PanelKernel | None:
    """The kernel built once under `cache_dir` (kernels/build.py), or None with a warning."""
    lib = try_build("panel_matmul", SOURCE, build_flags(), cache_dir, "dense decode steps run op by op")
    return None if lib is None else PanelKernel(lib)
