"""The float32 panel matmul of the dense decode step (kernels/panel_matmul.py) against torch in float64: every
shape from a single row and column up (partial tiles of rows, partial panels of columns), column ranges
that cut panels, and the same floats from the AVX-512, AVX2 and portable builds. Panels kept in a GGUF
file's Q4_1 and Q8_0 blocks against the float panels of the gguf package's dequantization: the same floats,
bit for bit, on every build."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from tandem_engine.kernels.build import KERNEL_MARCH_ENV, build_library, cpu_flags
from tandem_engine.kernels.gguf_matmul import QuantizedWeight
from tandem_engine.kernels.panel_matmul import (
    F32,
    PANEL,
    SOURCE,
    PanelKernel,
    PanelLinear,
    load_panel_kernel,
    pack_block_panels,
    pack_panels,
)
from tests.engine.kernels.test_gguf_matmul import Q4_1, Q8_0, random_weight
from tests.engine.utils import torch_threads


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> PanelKernel:
    k = load_panel_kernel(tmp_path_factory.mktemp("dense"))
    assert k is not None
    return k


def reference(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ w.T in float64, and a bound on a float32 sum's error: k roundings of the absolute products' sum."""
    exact = x.double() @ w.double().T
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    return exact, bound


# tiles of 6 rows (AVX2) or 12 (AVX-512): one row, partial, whole, whole + partial, several
@pytest.mark.parametrize("m", [1, 5, 6, 7, 11, 12, 13, 25, 32])
@pytest.mark.parametrize("n,k", [(1, 1), (15, 33), (16, 64), (17, 96), (40, 576), (200, 7)])
def test_matmul_is_the_product_to_float32_rounding(kernel: PanelKernel, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    got = kernel.matmul(x, pack_panels(w), n)
    exact, bound = reference(x, w)
    assert got.shape == (m, n)
    assert ((got.double() - exact).abs() <= bound).all()


def test_strided_rows_in_and_out_and_threads_change_nothing(kernel: PanelKernel) -> None:
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


@pytest.mark.parametrize("threads", [1, 3])
def test_no_rows_or_no_columns_is_an_empty_product(kernel: PanelKernel, threads: int) -> None:
    """A step whose requests were all aborted samples no rows: the head's matmul of 0 rows is an empty
    [0, n], not a crash (a division by the rows' tile count once killed the engine with SIGFPE); 0 columns
    likewise."""
    panels = pack_panels(torch.randn(70, 64))
    with torch_threads(threads):
        assert kernel.matmul(torch.empty(0, 64), panels, 70).shape == (0, 70)
        assert kernel.matmul(torch.randn(5, 64), panels, 0).shape == (5, 0)


def test_panels_are_zero_past_the_last_column() -> None:
    w = torch.arange(1.0, 1 + 17 * 3).view(17, 3)
    p = pack_panels(w)
    assert p.shape == (2, 3, PANEL)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 0], w[16]) and not p[1, :, 1:].any()


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(1, 32), (16, 64), (37, 96), (50, 576)])
def test_block_panels_unpack_to_the_files_dequantization(kernel: PanelKernel, qtype: int, n: int, k: int) -> None:
    """Weights of magnitudes 1e-4..3 (subnormal fp16 scales among them) and an all-zero row: unpacked block
    panels are the float panels of the gguf package's dequantization, bit for bit."""
    w, ref = random_weight(n, k, qtype, seed=n + k)
    panels = pack_block_panels(w.data, int(qtype))
    assert panels.dtype == torch.uint8 and panels.shape == (-(-n // PANEL), k // 32 * (320 if qtype == Q4_1 else 544))
    assert torch.equal(kernel.unpack(panels, int(qtype), k).view(torch.int32), pack_panels(ref).view(torch.int32))


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("threads", [1, 3])
def test_block_panels_compute_the_float_panels_floats(kernel: PanelKernel, qtype: int, threads: int) -> None:
    """Every row count that takes a different path (none; one row; a lone tile unpacking k in chunks of 64;
    several tiles sharing chunks of 128, or of 256 past 4 tiles' rows), k past one chunk of each and not a
    multiple of it, columns past the last whole panel: the same floats as the float panels."""
    g = torch.Generator().manual_seed(threads)
    w, ref = random_weight(75, 320, qtype, seed=threads)
    blocks, floats = pack_block_panels(w.data, int(qtype)), pack_panels(ref)
    with torch_threads(threads):
        for m in (0, 1, 2, 5, 12, 13, 25, 32, 50, 61):
            x = torch.randn(m, 320, generator=g)
            got = kernel.matmul(x, blocks, 75, qtype=int(qtype))
            assert torch.equal(got, kernel.matmul(x, floats, 75)), m
    with pytest.raises(ValueError, match="does not fit"):
        kernel.matmul(torch.randn(2, 320), blocks, 75)  # block panels called float ones


def test_a_panel_linear_keeps_blocks_only_when_they_are_its_weight(kernel: PanelKernel) -> None:
    """Given the blocks its weight was dequantized from (in parts, as q|k|v are), a PanelLinear keeps them; a
    weight one ulp off anywhere, parts of two types, or blocks of another shape leave it on float panels, and
    every one computes its own weight's product."""
    (q, q_ref), (k, k_ref) = random_weight(40, 64, Q4_1, 1), random_weight(24, 64, Q4_1, 2)
    weight = torch.cat([q_ref, k_ref])
    x = torch.randn(3, 64)
    kept = PanelLinear(weight, kernel, [q, k])
    assert kept.qtype == int(Q4_1) and not kept.why_float
    assert torch.equal(kept(x), PanelLinear(weight, kernel)(x))
    off = weight.clone()
    off[63, 17] = torch.nextafter(off[63, 17], torch.tensor(1e9))
    other = QuantizedWeight(int(Q8_0), random_weight(24, 64, Q8_0, 2)[0].data, 64)
    for w, parts, why in [(off, [q, k], "do not unpack to its weight"), (weight, [q, other], "types [3, 8]"),
                          (weight, [q], "are not a (64, 64) weight")]:
        lin = PanelLinear(w, kernel, parts)
        assert lin.qtype == F32 and why in lin.why_float
        assert torch.equal(lin(x), PanelLinear(w, kernel)(x))


def test_column_ranges_cutting_panels_are_the_whole_matmul(kernel: PanelKernel) -> None:
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
    assert kernel.tile_cols in (PANEL, 2 * PANEL)  # AVX-512 tiles take two panels
    # cuts inside a tile's first panel, its second, on and between panels, and a last lone panel
    for runs in [[(0, 3), (3, 16), (16, 37), (37, 48), (48, 50)], [(0, 5), (5, 40), (40, 50)], [(0, 50)]]:
        out = torch.full((m, n), float("nan"))
        for c0, c1 in runs:
            cols(buf.data_ptr(), m, panels.data_ptr(), 0, k, c0, c1, out.data_ptr(), n)
        assert torch.equal(out, whole)
    # block panels of the same ranges: x's first row alone (up to four panels at a time on AVX-512), all 7
    for qtype in (Q4_1, Q8_0):
        wq, ref = random_weight(n, k, qtype, 2)
        blocks, whole = pack_block_panels(wq.data, int(qtype)), kernel.matmul(x, pack_panels(ref), n)
        for rows in (1, m):
            for runs in [[(0, 3), (3, 16), (16, 37), (37, 48), (48, 50)], [(0, 5), (5, 40), (40, 50)], [(0, 50)]]:
                out = torch.full((rows, n), float("nan"))
                for c0, c1 in runs:
                    cols(buf.data_ptr(), rows, blocks.data_ptr(), int(qtype), k, c0, c1, out.data_ptr(), n)
                assert torch.equal(out, whole[:rows])


@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="the vector path needs AVX2 and FMA")
@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3"])
def test_every_build_computes_the_same_floats(kernel: PanelKernel, march: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The portable build (x86-64-v2: a scalar loop of fmaf) and the AVX2 one (x86-64-v3) against this
    CPU's (AVX-512 where it has it): each output is the same chain of fused multiply-adds in k order in
    every build, so they agree bit for bit (not merely to rounding)."""
    monkeypatch.setenv(KERNEL_MARCH_ENV, march)
    from tandem_engine.kernels.build import base_flags

    other = PanelKernel(build_library("panel_matmul", SOURCE, base_flags(), tmp_path))
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(31, 200, generator=g), torch.randn(37, 200, generator=g)
    panels = pack_panels(w)
    want = kernel.matmul(x, panels, 37)  # tiles of every size of the vector builds: 6 or 12 rows, 7, 1
    assert torch.equal(other.matmul(x, panels, 37), want)
    assert torch.equal(other.matmul(x[:5], panels, 37), want[:5])
    xb = torch.randn(31, 320, generator=g)  # 31 rows: chunks of 256 and 64 on AVX2, of 128 on AVX-512
    for qtype in (Q4_1, Q8_0):  # block panels, unpacked by each build's own code (the portable one's scalar)
        qw, ref = random_weight(37, 320, qtype, 4)
        bp, want = pack_block_panels(qw.data, int(qtype)), kernel.matmul(xb, pack_panels(ref), 37)
        assert torch.equal(other.matmul(xb, bp, 37, qtype=int(qtype)), want)
        assert torch.equal(other.matmul(xb[:5], bp, 37, qtype=int(qtype)), want[:5])
    # a sum rounded otherwise (here in float64, rounded once) is not the same floats: the check can tell them
    # apart (torch's own x @ w.T may be the same chain: MKL's small-matrix path on an AVX-512 Xeon is)
    assert not torch.equal((x.double() @ w.double().T).float(), want)
