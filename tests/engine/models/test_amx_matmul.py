"""The bfloat16 AMX matmul of a bfloat16 model's decode steps (models/amx_matmul.py) against torch: the panel
layout the tile product reads, x rounded to bfloat16 exactly as torch rounds it (ties, NaN, infinities,
subnormals), and the product of the rounded x and the bfloat16 weights to float32 rounding in float64, for
every shape from one row and one tile up (partial tiles of rows and of columns, column ranges of a run).
The kernel needs a CPU with AMX-BF16 (`amx_unfit`); elsewhere only the layout is tested."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem_engine.models.amx_matmul import (
    K_TILE,
    PANEL,
    AmxKernel,
    AmxLinear,
    amx_unfit,
    load_amx_kernel,
    pack_amx,
)
from tests.engine.models.test_dense_matmul import reference
from tests.engine.models.test_gguf_decode import edge_values
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
