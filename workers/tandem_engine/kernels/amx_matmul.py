"""Matmuls on AMX tiles (amx_matmul.c), on CPUs with AMX-BF16: bfloat16 weights packed once into panels of
tiles for a bfloat16 model, and exact float32 over a GGUF model's blocks (x split into three bfloat16 parts)
for matmuls of AMX_F32_FROM_ROWS rows or more; the whole-step kernel calls them from its own threads
(docs/architecture.md, "bfloat16 models on AMX" and "float32 matmuls on AMX").
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from tandem_engine.kernels.build import address, base_flags, cpu_flags, try_build
from tandem_engine.kernels.gguf_matmul import QuantizedWeight

SOURCE = (Path(__file__).parent / "amx_matmul.c").read_text()
PANEL = 16  # output columns of a panel (amx_matmul.c's NR)
K_TILE = 32  # steps in k of a weight tile (its KT): k must be a multiple
BF16 = int(GGMLQuantizationType.BF16)  # the qtype the fused step passes for these panels (the kernel does not read it)
# What the CPU must list in /proc/cpuinfo: the tiles, their bf16 products, AVX-512 for the rounding of x.
CPU_FLAGS = {"amx_tile", "amx_bf16", "avx512f"}


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 [n, k] weight as AMX panels [ceil(n / 16), k / 32, 16, 16, 2] (bfloat16): panel p's tile j
    row i holds, for each of its 16 columns c, the weights at k = 32 j + 2 i and + 1 (zeros past n)."""
    n, k = weight.shape
    if k % K_TILE:
        raise ValueError(f"k = {k} is not a multiple of {K_TILE}")
    panels = -(-n // PANEL)
    w = weight
    if n % PANEL:
        w = torch.zeros(panels * PANEL, k, dtype=torch.bfloat16)
        w[:n] = weight
    # [p, c, j, i, 2] -> [p, j, i, c, 2]
    return w.reshape(panels, PANEL, k // K_TILE, K_TILE // 2, 2).permute(0, 2, 3, 1, 4).contiguous()


Q4_1, Q8_0 = 3, 8  # ggml's type ids of the blocks the float32 kernel reads
BLOCK = 32  # weights of a block, along k
# per panel and block: the bfloat16 tile of q, then 16 d and 16 m (amx_matmul.c's BLK_B)
BLOCK_PANEL_BYTES = 1024 + 2 * PANEL * 4
# Matmuls of at least this many rows take the float32 AMX kernel where a model has its copies; below it the
# float32 panels, which read a Q4_1 weight's 0.625 bytes where this reads 2.25. SmolLM2's 30 layers of
# projections, weights streamed, 2 threads of the AVX-512 Xeon: 16 rows 20.5 ms against the panels' 18.1, 24
# rows 24.9 against 24.4, 32 rows 26.4 against 30.1.
AMX_F32_FROM_ROWS = 32


def block_values(blocks: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [n, k] weight's GGUF blocks (uint8 [n, k / 32 * block bytes]) as q [n, k] (uint8 for Q4_1, int8 for
    Q8_0), d [n, k / 32] and m [n, k / 32] (zeros for Q8_0), float32: the weight is d * q + m (Q4_1) or d * q
    (Q8_0), blockwise."""
    n = blocks.shape[0]
    if qtype == Q4_1:
        raw = blocks.reshape(n, -1, 20)
        d, m = raw[..., 0:2].contiguous().view(torch.float16), raw[..., 2:4].contiguous().view(torch.float16)
        qs = raw[..., 4:20]
        q = torch.cat((qs & 15, qs >> 4), dim=-1)  # ggml: value j in byte j's low nibble, j + 16 in its high
    elif qtype == Q8_0:
        raw = blocks.reshape(n, -1, 34)
        d = raw[..., 0:2].contiguous().view(torch.float16)
        m = torch.zeros_like(d)
        q = raw[..., 2:34].contiguous().view(torch.int8)
    else:
        raise ValueError(f"ggml type {qtype} is not Q4_1 or Q8_0")
    return q.reshape(n, -1), d.reshape(n, -1).float(), m.reshape(n, -1).float()


def pack_amx_blocks(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """A [n, k] weight's Q4_1 or Q8_0 blocks as the float32 AMX kernel's panels, uint8 [ceil(n / 16),
    k / 32 * BLOCK_PANEL_BYTES]: per panel and block, q's bfloat16 tile (as `pack_amx` lays out a weight; q is
    exact in bfloat16), then the 16 columns' d and m as float32. Columns past n are zero."""
    q, d, m = block_values(blocks, qtype)
    n, k = q.shape
    panels, nb = -(-n // PANEL), k // BLOCK
    tiles = pack_amx(q.to(torch.bfloat16)).view(torch.uint8).reshape(panels, nb, 1024)
    scales = torch.zeros(2, panels * PANEL, nb)
    scales[0, :n], scales[1, :n] = d, m
    # [2, p, c, j] -> [p, j, 2, c]
    scales = scales.view(2, panels, PANEL, nb).permute(1, 3, 0, 2).contiguous().view(torch.uint8)
    return torch.cat((tiles, scales.reshape(panels, nb, -1)), dim=2).reshape(panels, -1).contiguous()


class AmxKernel:
    """The built amx_matmul.c; threads as torch's."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._matmul = lib.tandem_amx_matmul
        self._matmul.argtypes = [p, i64, i64, p, i64, i64, p, i64, p, ctypes.c_int]
        self._matmul.restype = None
        self._x_bytes = lib.tandem_amx_x_bytes
        self._x_bytes.argtypes = [i64, i64]
        self._x_bytes.restype = i64
        self._copy_x = lib.tandem_amx_copy_x
        self._copy_x.argtypes = [p, i64, i64, i64, i64, i64, p]
        self._copy_x.restype = None
        # For the fused decode step (decode_step.c's kernels_t): x rounded into its buffer, then columns.
        self.entries = {"quantize": address(lib, "tandem_amx_copy_x"),
                        "matmul_cols": address(lib, "tandem_amx_matmul_cols")}
        self.tile_cols = 2 * PANEL  # a tile's columns: runs of columns start on multiples of it
        self._buf = torch.empty(0, dtype=torch.uint8)
        # The float32 kernel over Q4_1 and Q8_0 blocks (pack_amx_blocks).
        self._f32 = lib.tandem_amx_f32_matmul
        self._f32.argtypes = [p, i64, i64, p, ctypes.c_int, i64, i64, p, i64, p, ctypes.c_int]
        self._f32.restype = None
        self._f32_x_bytes = lib.tandem_amx_f32_x_bytes
        self._f32_x_bytes.argtypes = [i64, i64]
        self._f32_x_bytes.restype = i64
        self.f32_entries = {"quantize": address(lib, "tandem_amx_f32_copy_x"),
                            "matmul_cols": address(lib, "tandem_amx_f32_matmul_cols"),
                            "matmul_rows": address(lib, "tandem_amx_f32_matmul_rows")}

    def f32_x_bytes(self, m: int, k: int) -> int:
        """Bytes of the buffer m rows of k values are split into by the float32 kernel."""
        return int(self._f32_x_bytes(m, k))

    def f32_matmul(self, x: torch.Tensor, panels: torch.Tensor, n: int, qtype: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] float32 (rows at any stride, columns contiguous) @ W.T -> [m, n] float32 in float32
        arithmetic, W's blocks packed by `pack_amx_blocks`. Into `out` (rows at any stride, columns contiguous)
        if given."""
        m, k = x.shape
        if (x.dtype != torch.float32 or x.stride(1) != 1 or qtype not in (Q4_1, Q8_0) or panels.dtype != torch.uint8
                or not panels.is_contiguous() or k % BLOCK or panels.shape[1] != k // BLOCK * BLOCK_PANEL_BYTES
                or panels.shape[0] * PANEL < n):
            raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit AMX block panels {tuple(panels.shape)} of "
                             f"{n} columns, type {qtype}")
        if out is None:
            out = torch.empty(m, n)
        need = self.f32_x_bytes(m, k)
        if self._buf.numel() < need:
            self._buf = torch.zeros(need, dtype=torch.uint8)
        self._f32(x.data_ptr(), x.stride(0), m, panels.data_ptr(), qtype, n, k, out.data_ptr(), out.stride(0),
                  self._buf.data_ptr(), torch.get_num_threads())
        return out

    def x_bytes(self, m: int, k: int) -> int:
        """Bytes of the buffer m rows of k values are rounded into."""
        return int(self._x_bytes(m, k))

    def round_x(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, k] float32 (k a multiple of 32) as the kernel rounds it into its buffer (in row tiles of 16 x 32
        there): [m, k] bfloat16."""
        m, k = x.shape
        if x.dtype != torch.float32 or x.stride(1) != 1 or k % K_TILE:
            raise ValueError(f"x {tuple(x.shape)} {x.dtype} is not float32 rows of a multiple of {K_TILE}")
        tiles = -(-m // 16)
        buf = torch.zeros(tiles, k // K_TILE, 16, K_TILE, dtype=torch.bfloat16)  # row tiles, as the kernel keeps x
        self._copy_x(x.data_ptr(), x.stride(0), m, k, 0, m * k // K_TILE, buf.data_ptr())
        return buf.permute(0, 2, 1, 3).reshape(tiles * 16, k)[:m]

    def matmul(self, x: torch.Tensor, panels: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] float32 (rows at any stride, columns contiguous) @ W.T -> [m, n] float32, W packed by
        `pack_amx`; x rounded to bfloat16 first. Into `out` (rows at any stride, columns contiguous) if given."""
        m, k = x.shape
        if (x.dtype != torch.float32 or x.stride(1) != 1 or panels.dtype != torch.bfloat16
                or not panels.is_contiguous() or panels.shape[1:] != (k // K_TILE, K_TILE // 2, PANEL, 2)
                or k % K_TILE or panels.shape[0] * PANEL < n):
            raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit AMX panels {tuple(panels.shape)} of {n} "
                             "columns")
        if out is None:
            out = torch.empty(m, n)
        need = self.x_bytes(m, k)
        if self._buf.numel() < need:
            self._buf = torch.zeros(need, dtype=torch.uint8)
        self._matmul(x.data_ptr(), x.stride(0), m, panels.data_ptr(), n, k, out.data_ptr(), out.stride(0),
                     self._buf.data_ptr(), torch.get_num_threads())
        return out


class AmxLinear:
    """A bfloat16 projection's AMX copy: y [rows, out] (float32) = bf16(x) [rows, in] @ W.T."""

    def __init__(self, weight: torch.Tensor, kernel: AmxKernel) -> None:
        self.out_features, self.kernel = weight.shape[0], kernel
        self.panels = pack_amx(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.matmul(x.float() if x.dtype != torch.float32 else x, self.panels, self.out_features)


class AmxBlockLinear:
    """A float32 projection's copy for the float32 AMX kernel, from the Q4_1 or Q8_0 blocks its weight was
    dequantized from (one part per checkpoint tensor, rows in order, all of one type; the caller knows they
    give the weight: PanelLinear checked them): y [rows, out] = x [rows, in] @ W.T + b in float32 arithmetic."""

    def __init__(self, blocks: Sequence[QuantizedWeight], kernel: AmxKernel) -> None:
        types = {b.qtype for b in blocks}
        if len(types) != 1 or not types <= {Q4_1, Q8_0}:
            raise ValueError(f"blocks of ggml types {sorted(types)}, not all Q4_1 or all Q8_0")
        data = torch.cat([b.data for b in blocks])
        self.out_features, self.kernel, self.qtype = data.shape[0], kernel, types.pop()
        self.panels = pack_amx_blocks(data, self.qtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.kernel.f32_matmul(x if x.stride(-1) == 1 else x.contiguous(), self.panels, self.out_features,
                                   self.qtype)
        return y if bias is None else y.add_(bias)


def amx_unfit(flags: set[str] | None = None) -> str | None:
    """Why this CPU cannot run the kernel, or None."""
    missing = CPU_FLAGS - (cpu_flags() if flags is None else flags)
    return f"the CPU lacks {' '.join(sorted(missing))}" if missing else None


def build_flags() -> tuple[str, ...]:
    """Every kernel's flags, with AMX-BF16 and AVX-512 added whatever ISA level the rest is built for
    (`TANDEM_CPU_KERNEL_MARCH`: an image's x86-64-v3): the engine runs the kernel only on a CPU that has them
    (`amx_unfit`), so one build serves every node with AMX."""
    return (*base_flags(), "-mavx512f", "-mamx-tile", "-mamx-bf16")


def build_amx_kernel(cache_dir: Path) -> ctypes.CDLL | None:
    """The kernel's library built once under `cache_dir` (kernels/build.py; an image's build makes it on any
    x86 machine), or None with a warning: no compiler, or one without AMX."""
    return try_build("amx_matmul", SOURCE, build_flags(), cache_dir, "a bfloat16 model runs op by op in bfloat16")


@functools.cache  # one per directory
def load_amx_kernel(cache_dir: Path) -> AmxKernel | None:
    """The kernel, or None: a CPU without AMX-BF16, no build (a warning), or a kernel Linux does not let use
    the tiles."""
    if amx_unfit() is not None:
        return None
    lib = build_amx_kernel(cache_dir)
    if lib is None or lib.tandem_amx_init() != 0:
        return None
    return AmxKernel(lib)
