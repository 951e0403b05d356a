"""The AMX matmuls (kernels/amx_matmul.py) against torch.

The bfloat16 kernel of a bfloat16 model: the panel layout the tile product reads, x rounded to bfloat16
exactly as torch rounds it (ties, NaN, infinities, subnormals), and the product of the rounded x and the
bfloat16 weights to float32 rounding in float64, for every shape from one row and one tile up (partial tiles
of rows and of columns, column ranges of a run).

The float32 kernel over a GGUF file's Q4_1 and Q8_0 blocks: the blocks' values are the file's dequantization,
x's three bfloat16 parts add back to x exactly, and the product is float32 arithmetic: within float32's
error bound of the float64 product, no worse on average than torch's float32 matmul, the same floats on any
thread count and for a row alone or in a batch.

The kernels need a CPU with AMX-BF16 (`amx_unfit`); elsewhere only the layouts are tested."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from tandem_engine.kernels.amx_matmul import (
    BLOCK_PANEL_BYTES,
    K_TILE,
    PANEL,
    Q4_1,
    Q8_0,
    AmxBlockLinear,
    AmxKernel,
    AmxLinear,
    amx_unfit,
    block_values,
    load_amx_kernel,
    pack_amx,
    pack_amx_blocks,
)
from tandem_engine.kernels.gguf_matmul import QuantizedWeight
from tests.engine.kernels.test_decode_step import edge_values
from tests.engine.kernels.test_panel_matmul import reference
from tests.engine.utils import torch_threads

needs_amx = pytest.mark.skipif(amx_unfit() is not None, reason=f"{amx_unfit()}: the AMX kernel cannot run here")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> AmxKernel:
    k = load_amx_kernel(tmp_path_factory.mktemp("amx"))
    assert k is not None
    return k


def test_panels_hold_each_tiles_weight_pairs_as_the_tile_product_reads_them() -> None:
    n, k = 40, 96  # a partial last panel (8 of 16 columns), three tiles in k
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k).bfloat16()
    p = pack_amx(w)
    assert p.shape == (-(-n // PANEL), k // K_TILE, K_TILE // 2, PANEL, 2) and p.dtype == torch.bfloat16
    for panel, tile, row, col, half in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 2, 15, 3, 1), (2, 1, 7, 7, 0)]:
        assert p[panel, tile, row, col, half] == w[panel * PANEL + col, tile * K_TILE + 2 * row + half]
    assert (p[2, :, :, 8:] == 0).all()  # columns past n
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_amx(torch.zeros(16, 40, dtype=torch.bfloat16))


@needs_amx
def test_x_is_rounded_to_bfloat16_as_torch_rounds_it(kernel: AmxKernel) -> None:
    x = edge_values()
    x = torch.cat([x, torch.tensor([float("nan"), -float("nan"), 1e-40, -1e-44])])
    x = torch.cat([x, torch.zeros(-x.numel() % K_TILE)]).reshape(-1, K_TILE)
    got, want = kernel.round_x(x), x.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


# tiles of 16 rows, two at a time; panels of 16 columns, two at a time
@needs_amx
@pytest.mark.parametrize("m", [1, 5, 16, 17, 31, 32, 33, 70])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 96), (48, 64), (576, 576), (200, 1536)])
def test_matmul_is_the_product_of_the_rounded_inputs_to_float32_rounding(kernel: AmxKernel, m: int, n: int,
                                                                         k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).bfloat16()
    got = kernel.matmul(x, pack_amx(w), n)
    exact, bound = reference(x.bfloat16().float(), w.float())
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= bound).all()


@needs_amx
def test_strided_rows_in_and_out_threads_and_a_bfloat16_input(kernel: AmxKernel) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(72, 64, generator=g).bfloat16()
    lin = AmxLinear(w, kernel)
    x = torch.randn(37, 128, generator=g)[:, :64]  # rows 128 apart
    with torch_threads(1):
        one = lin(x)
    with torch_threads(3):
        three = lin(x)
    out = torch.full((37, 100), -1.0)
    kernel.matmul(x, lin.panels, 72, out[:, 10:82])
    assert torch.equal(one, three) and torch.equal(out[:, 10:82], one)
    assert (out[:, :10] == -1).all() and (out[:, 82:] == -1).all()  # nothing written outside
    assert torch.equal(lin(x.bfloat16()), one)  # a bfloat16 x is taken as it is
    with pytest.raises(ValueError, match="does not fit"):
        kernel.matmul(x[:, :32], lin.panels, 72)


def test_a_cpu_without_amx_is_named(tmp_path: Path) -> None:
    assert amx_unfit({"avx512f", "avx2"}) == "the CPU lacks amx_bf16 amx_tile"
    assert amx_unfit({"amx_tile", "amx_bf16", "avx512f"}) is None


def gguf_weight(n: int, k: int, qtype: int, g: torch.Generator) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random [n, k] weight in `qtype` blocks, and the float32 weight the loader makes of them."""
    blocks = quants.quantize(torch.randn(n, k, generator=g).numpy(), GGMLQuantizationType(qtype))
    weight = quants.dequantize(blocks, GGMLQuantizationType(qtype)).astype(np.float32)
    return QuantizedWeight(qtype, torch.from_numpy(blocks), k), torch.from_numpy(weight)


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])
def test_block_panels_hold_the_files_values(qtype: int) -> None:
    """d * q + m from the blocks is the file's dequantization bit for bit; a panel's block is q's bfloat16 tile
    (laid out as pack_amx lays out a weight: q is exact in bfloat16), then its 16 columns' d and m."""
    n, k = 40, 96
    blocks, weight = gguf_weight(n, k, qtype, torch.Generator().manual_seed(qtype))
    q, d, m = block_values(blocks.data, qtype)
    assert torch.equal((q.view(n, -1, 32) * d[..., None] + m[..., None]).view(n, k), weight)
    assert q.min() >= (0 if qtype == Q4_1 else -128) and q.max() <= (15 if qtype == Q4_1 else 127)
    assert qtype == Q4_1 or (m == 0).all()
    p = pack_amx_blocks(blocks.data, qtype)
    assert p.shape == (-(-n // PANEL), k // 32 * BLOCK_PANEL_BYTES) and p.dtype == torch.uint8
    per_block = p.view(p.shape[0], k // 32, BLOCK_PANEL_BYTES)
    tiles = per_block[..., :1024].contiguous().view(torch.bfloat16).view(-1, k // 32, K_TILE // 2, PANEL, 2)
    assert torch.equal(tiles, pack_amx(q.bfloat16()))
    scales = per_block[..., 1024:].contiguous().view(torch.float32).view(-1, k // 32, 2, PANEL)
    for panel, block, col in [(0, 0, 0), (1, 2, 5), (2, 1, 7)]:
        assert scales[panel, block, 0, col] == d[panel * PANEL + col, block]
        assert scales[panel, block, 1, col] == m[panel * PANEL + col, block]
    assert (scales[2, :, :, 8:] == 0).all() and (tiles[2, :, :, 8:] == 0).all()  # columns past n


@needs_amx
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 31, 32, 33, 70])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 96), (48, 64), (576, 576), (200, 1536)])
def test_float32_matmul_over_blocks_is_float32_arithmetic(kernel: AmxKernel, qtype: int, m: int, n: int,
                                                          k: int) -> None:
    """Within float32's bound for the sums it takes (three exact products per weight, then two fused
    multiply-adds per block) of the float64 product, and on average about as far from it as torch's float32
    matmul (bfloat16 inputs would be ~1000x further): at SmolLM2's k of 576 and 1536 within 1.5x of torch's
    mean error; below that Q4_1's m * (the block's sum of x) partly cancels d * (its sum of x * q), and the
    small cases reach 2.4x."""
    g = torch.Generator().manual_seed(m * 1000 + n + k + qtype)
    blocks, w = gguf_weight(n, k, qtype, g)
    x = torch.randn(m, k, generator=g)
    got = AmxBlockLinear([blocks], kernel)(x)
    exact, _ = reference(x, w)
    bound = (3 * k + 2 * k // 32 + 2) * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= bound).all()
    torch_error = float(((x @ w.T).double() - exact).abs().mean())
    assert float((got.double() - exact).abs().mean()) <= (1.5 if k >= 576 else 3) * torch_error


@needs_amx
def test_x_splits_into_three_bfloat16_parts_exactly(kernel: AmxKernel) -> None:
    """Weights that pick one value of x (Q8_0, d = 1, q = 1) give x back bit for bit: hi + mid + lo is x, all
    24 bits of its significand, over magnitudes from 1e-20 to 1e20 (x rounded to bfloat16 would keep 8)."""
    g = torch.Generator().manual_seed(3)
    k = 64
    x = torch.randn(40, k, generator=g) * 10.0 ** torch.randint(-20, 21, (40, k), generator=g).float()
    block = np.zeros(34, dtype=np.uint8)
    block[0:2] = np.frombuffer(np.float16(1).tobytes(), dtype=np.uint8)
    rows = []
    for j in range(k):  # output j = x[:, j]
        row = np.zeros((k // 32, 34), dtype=np.uint8)
        row[:, 0:2] = block[0:2]
        row[j // 32, 2 + j % 32] = 1
        rows.append(row.reshape(-1))
    got = AmxBlockLinear([QuantizedWeight(Q8_0, torch.from_numpy(np.stack(rows)), k)], kernel)(x)
    assert torch.equal(got.view(torch.int32), x.view(torch.int32))
    assert not torch.equal(x.bfloat16().float(), x)


@needs_amx
def test_float32_matmul_threads_batches_strides_and_bad_shapes(kernel: AmxKernel) -> None:
    """The same floats on 1 and 3 threads and for a row alone or among 40 (each row's sums are its own);
    strided rows in and out, nothing written outside; a bias added; shapes that do not fit refused."""
    g = torch.Generator().manual_seed(5)
    blocks, _ = gguf_weight(72, 64, Q4_1, g)
    lin = AmxBlockLinear([blocks], kernel)
    x = torch.randn(40, 128, generator=g)[:, :64]  # rows 128 apart
    with torch_threads(1):
        one = lin(x)
    with torch_threads(3):
        three = lin(x)
    assert torch.equal(one, three)
    assert all(torch.equal(lin(x[i:i + 1])[0], one[i]) for i in (0, 17, 39))
    out = torch.full((40, 100), -1.0)
    kernel.f32_matmul(x, lin.panels, 72, Q4_1, out[:, 10:82])
    assert torch.equal(out[:, 10:82], one)
    assert (out[:, :10] == -1).all() and (out[:, 82:] == -1).all()
    bias = torch.randn(72, generator=g)
    assert torch.equal(lin(x, bias), one + bias)
    with pytest.raises(ValueError, match="does not fit"):
        kernel.f32_matmul(x[:, :32], lin.panels, 72, Q4_1)
    with pytest.raises(ValueError, match="does not fit"):
        kernel.f32_matmul(x, lin.panels, 72, 2)  # Q4_0: not a type the kernel reads
    with pytest.raises(ValueError, match="not all Q4_1 or all Q8_0"):
        AmxBlockLinear([blocks, gguf_weight(8, 64, Q8_0, g)[0]], kernel)
