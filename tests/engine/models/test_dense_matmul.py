"""The float32 panel matmul of the dense decode step (models/dense_matmul.py) against torch in float64: every
shape from a single row and column up (partial tiles of rows, partial panels of columns), column ranges
that cut panels, and the same floats from the AVX2 build and the portable one."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from tandem_engine.kernels.build import KERNEL_MARCH_ENV, build_library, cpu_flags
from tandem_engine.models.dense_matmul import _SRC, PANEL, DenseKernel, load_dense_kernel, pack_panels
from tests.engine.utils import torch_threads


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> DenseKernel:
    k = load_dense_kernel(tmp_path_factory.mktemp("dense"))
    assert k is not None
    return k


def reference(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ w.T in float64, and a bound on a float32 sum's error: k roundings of the absolute products' sum."""
    exact = x.double() @ w.double().T
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    return exact, bound


@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 32])  # tiles of 6 rows: one row, partial, whole, whole + partial
@pytest.mark.parametrize("n,k", [(1, 1), (15, 33), (16, 64), (17, 96), (40, 576), (200, 7)])
def test_matmul_is_the_product_to_float32_rounding(kernel: DenseKernel, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    got = kernel.matmul(x, pack_panels(w), n)
    exact, bound = reference(x, w)
    assert got.shape == (m, n)
    assert ((got.double() - exact).abs() <= bound).all()


def test_strided_rows_in_and_out_and_threads_change_nothing(kernel: DenseKernel) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 64, generator=g)
    panels = pack_panels(w.t().contiguous().t())  # a transposed-storage weight packs the same
    assert torch.equal(panels, pack_panels(w))
    x = torch.randn(9, 100, generator=g)[:, 10:74]  # rows 100 apart
    out = torch.full((9, 80), float("nan"))
    kernel.matmul(x, panels, 70, out=out[:, 5:75])
    assert out[:, :5].isnan().all() and out[:, 75:].isnan().all()  # nothing written outside
    with torch_threads(3):
        assert torch.equal(kernel.matmul(x.contiguous(), panels, 70), out[:, 5:75])
    with pytest.raises(ValueError, match="does not fit"):
        kernel.matmul(torch.randn(2, 63), panels, 70)


def test_panels_are_zero_past_the_last_column() -> None:
    w = torch.arange(1.0, 1 + 17 * 3).view(17, 3)
    p = pack_panels(w)
    assert p.shape == (2, 3, PANEL)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 0], w[16]) and not p[1, :, 1:].any()


def test_column_ranges_cutting_panels_are_the_whole_matmul(kernel: DenseKernel) -> None:
    """The fused step's entry points: x copied into its buffer 32 values at a time, then any range of
    columns (runs start on panels, a head's columns need not)."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    copy_x = ctypes.CFUNCTYPE(None, p, i64, i64, i64, i64, i64, p)(kernel.entries["quantize"])
    cols = ctypes.CFUNCTYPE(None, p, i64, p, ctypes.c_int, i64, i64, i64, p, i64)(kernel.entries["matmul_cols"])
    g = torch.Generator().manual_seed(2)
    m, n, k = 7, 50, 96
    x, w = torch.randn(m, 128, generator=g)[:, :k], torch.randn(n, k, generator=g)
    panels = pack_panels(w)
    buf = torch.empty(kernel.x_bytes(m, k), dtype=torch.uint8)
    blocks = m * k // 32
    copy_x(x.data_ptr(), x.stride(0), m, k, 0, blocks // 2, buf.data_ptr())  # in two calls, as two threads would
    copy_x(x.data_ptr(), x.stride(0), m, k, blocks // 2, blocks, buf.data_ptr())
    assert torch.equal(buf.view(torch.float32).view(m, k), x)
    whole = kernel.matmul(x, panels, n)
    out = torch.full((m, n), float("nan"))
    for c0, c1 in [(0, 3), (3, 16), (16, 37), (37, 48), (48, 50)]:
        cols(buf.data_ptr(), m, panels.data_ptr(), 0, k, c0, c1, out.data_ptr(), n)
    assert torch.equal(out, whole)


@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="the vector path needs AVX2 and FMA")
def test_the_portable_build_computes_the_same_floats(kernel: DenseKernel, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AVX2 the kernel is a scalar loop of fmaf: each output is the same chain of fused
    multiply-adds in k order, so the two builds agree bit for bit (not merely to rounding)."""
    monkeypatch.setenv(KERNEL_MARCH_ENV, "x86-64-v2")
    from tandem_engine.kernels.build import base_flags

    portable = DenseKernel(build_library("dense_matmul", _SRC, base_flags(), tmp_path))
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(13, 200, generator=g), torch.randn(37, 200, generator=g)
    panels = pack_panels(w)
    want = kernel.matmul(x, panels, 37)
    assert torch.equal(portable.matmul(x, panels, 37), want)
    # a sum in any other order (here torch's) is not the same floats: the check can tell orders apart
    assert not torch.equal(x @ w.T, want)
