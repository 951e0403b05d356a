"""`--quantization gguf`'s C kernel over Q4_1/Q8_0 blocks against a plain torch reference: the weights
dequantized by the gguf package, then a float32 matmul (for the int8-activation path, of x quantized per
block of 32 the way the kernel does it). Both builds: -march=native (AVX2/FMA where the CPU has it, VNNI
where it has AVX-512 VNNI) and the portable one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from tandem_engine.kernels.build import KERNEL_MARCH_ENV, cpu_flags
from tandem_engine.kernels.gguf_matmul import (
    DENSE_FROM_ROWS,
    GGUFEmbedding,
    GGUFKernel,
    GGUFLinear,
    QuantizedWeight,
    load_gguf_kernel,
)
from tests.engine.utils import torch_threads

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
Matmul = Callable[[GGUFKernel, torch.Tensor, QuantizedWeight, torch.Tensor], None]


@pytest.fixture(scope="module", params=["native", "portable"])
def kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> GGUFKernel:
    return load_gguf_kernel(tmp_path_factory.mktemp("kernels"), portable=request.param == "portable")


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """The kernel splits output rows over torch's thread count: run every case split."""
    with torch_threads(2):
        yield


def random_weight(rows: int, cols: int, qtype: GGMLQuantizationType, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random [rows, cols] weight in GGUF blocks (rows of magnitudes 1e-4..3, so some fp16 scales are
    subnormal; one all-zero row) and its dequantization by the gguf package: the reference weight."""
    g = np.random.default_rng(seed)
    w = (g.standard_normal((rows, cols)) * np.logspace(-4, 0.5, rows)[:, None]).astype(np.float32)
    w[rows // 2] = 0
    blocks = quantize(w, qtype)
    ref = torch.from_numpy(dequantize(blocks, qtype).astype(np.float32))
    return QuantizedWeight(int(qtype), torch.from_numpy(blocks), cols), ref


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] as the int8 path quantizes it, per block of 32: d = max|x| / 127 (float32), q = x / d rounded
    half away from zero as C's roundf (torch.round rounds half to even), an all-zero block d = 0, q = 0.
    Returns (q * d as float32 [m, k]: exact, 7 bits times 24; d [m, k / 32])."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    v = torch.where(d > 0, blocks / d, 0.0)
    t = v.trunc()
    q = t + ((v - t).abs() >= 0.5) * v.sign()
    return (q * d).reshape(x.shape), d.squeeze(-1)


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Random x [m, k] with, in row 0's first block, max|x| = 127 (d = 1) and every other value a tie
    (-15.5 .. 14.5, rounded away from zero), and, where there is another block, an all-zero last block."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2
    if m * k > 32:
        x[-1, -32:] = 0
    x[0, :32] = torch.arange(32) - 16.5
    x[0, 0] = -127
    return x


def q8_bound(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Error allowed to the int8 path against float64 (q_x d_x) @ W.T: the integer block sums are exact,
    so only float32 rounding is left: d_w * d_x, one fma per block and lane, the 8 lanes' sum, Q4_1's
    m_w * s_x terms (and the reference's own rounding of d * q + m). 1e-6 of sum_k |xq_k w_k| is 8 float32
    epsilons: measured at most 3e-7 of it over these shapes (Q4_1, whose m_w * s_x are not bounded by
    |x_k w_k|; Q8_0 below 1e-7), at most 17% of the bound. A wrong lane, block or sign errs by whole
    products."""
    return 1e-6 * (xq.abs().double() @ w.abs().double().T) + 1e-7


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 summation-order error allowed: 1e-6 of sum_k |x_k w_k| (8 float32 epsilons; the kernel sums
    per block and scales by d, Q4_1 adds m * sum(x) apart, the reference sums d * q + m: measured at most
    1.5e-7 of it over these shapes, both builds). A wrong block layout errs by the weights themselves."""
    return 1e-6 * (x.abs() @ w.abs().T) + 1e-7


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 96), (37, 576), (129, 1536)])
@pytest.mark.parametrize("m", [1, 3, 7, 8, 9, 33])
def test_kernel_matmul_matches_dequantize_then_float32_matmul(
        kernel: GGUFKernel, qtype: GGMLQuantizationType, n: int, k: int, m: int) -> None:
    w, ref_w = random_weight(n, k, qtype, seed=n * 31 + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2
    y = torch.full((m, n), float("nan"))
    kernel.matmul(x, w, y)
    want = x @ ref_w.T
    assert ((y - want).abs() <= bound(x, ref_w)).all(), float((y - want).abs().max())


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 96), (37, 576), (131, 1536)])
@pytest.mark.parametrize("m", [1, 3, 7, 9, 17])
def test_int8_matmul_matches_quantized_x_times_dequantized_w(
        kernel: GGUFKernel, qtype: GGMLQuantizationType, n: int, k: int, m: int) -> None:
    w, ref_w = random_weight(n, k, qtype, seed=n * 31 + k + m)
    x = activations(m, k, seed=m)
    y = torch.full((m, n), float("nan"))
    kernel.matmul_q8(x, w, y)
    xq, _ = quantize_x(x)
    want = xq.double() @ ref_w.double().T
    assert ((y - want).abs() <= q8_bound(xq, ref_w)).all(), float((y - want).abs().max())


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_int8_activations_err_from_float_x_by_the_rounding_of_x(kernel: GGUFKernel,
                                                                 qtype: GGMLQuantizationType) -> None:
    """Against the float32 path: each x_k moves by at most d_x / 2 (its block's), so y by at most
    sum_k |w_k| d_x(k) / 2; for Gaussian x about 0.5% of y in RMS (d_x / sqrt(12) against x's spread)."""
    w, ref_w = random_weight(131, 1536, qtype, seed=11)
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(3))
    y8, y32 = torch.empty(9, 131), torch.empty(9, 131)
    kernel.matmul_q8(x, w, y8)
    kernel.matmul(x, w, y32)
    _, d = quantize_x(x)
    worst = (d.repeat_interleave(32, dim=1) / 2) @ ref_w.abs().T
    assert ((y8 - y32).abs() <= worst * (1 + 1e-5) + bound(x, ref_w)).all()
    rel = float((y8 - y32).norm() / y32.norm())
    assert 1e-4 < rel < 2e-2, rel


def test_int8_matmul_is_the_same_floats_in_every_build(tmp_path: Path) -> None:
    """Every build takes the same float steps after exact integer sums: native (VNNI or AVX2), the AVX2
    build of x86-64-v3 where the CPU has it, and the portable one agree bit for bit."""
    builds = [load_gguf_kernel(tmp_path), load_gguf_kernel(tmp_path, portable=True)]
    if {"avx2", "fma", "f16c", "bmi2", "movbe"} <= cpu_flags():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(KERNEL_MARCH_ENV, "x86-64-v3")
            builds.append(load_gguf_kernel(tmp_path / "v3"))
        assert builds[-1].simd and not builds[-1].vnni
    for qtype, k in [(Q4_1, 576), (Q8_0, 576), (Q4_1, 544), (Q8_0, 544)]:
        w, _ = random_weight(45, k, qtype, seed=12)
        for m in (1, 5, 11):  # a tile of 1, of 5, of 8 then 3
            x = activations(m, k, seed=m)
            ys = []
            for b in builds:
                ys.append(torch.empty(m, 45))
                b.matmul_q8(x, w, ys[-1])
            assert all(torch.equal(ys[0], y) for y in ys[1:])


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("m", [1, 5, 11])
def test_int8_matmul_by_column_ranges_is_the_whole_matmul(kernel: GGUFKernel, qtype: GGMLQuantizationType,
                                                          m: int) -> None:
    """Its two halves as the fused decode step calls them (x quantized once, then ranges of output columns,
    each thread its own, cut anywhere) give matmul_q8's floats bit for bit."""
    w, _ = random_weight(45, 544, qtype, seed=15)
    x = activations(m, 544, seed=m)
    want = torch.empty(m, 45)
    kernel.matmul_q8(x, w, want)
    xq = kernel.quantize_x(x)
    got = torch.full((m, 50), float("nan"))  # a wider output: its row stride is not the weight's rows
    for start, end in [(0, 7), (7, 8), (8, 8), (8, 31), (31, 45)]:
        kernel.matmul_q8_cols(xq, m, w, got, start, end)
    assert torch.equal(got[:, :45], want) and got[:, 45:].isnan().all()


def test_int8_matmul_turns_a_nan_or_infinite_x_row_into_nans(kernel: GGUFKernel) -> None:
    """No 8-bit value can stand for them: that row's outputs are NaN (the float path's are NaN or
    infinite), the other rows as without them."""
    w, _ = random_weight(19, 96, Q4_1, seed=13)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(4))
    want = torch.empty(4, 19)
    kernel.matmul_q8(x, w, want)
    x[1, 40], x[2, 95] = float("nan"), float("-inf")
    y = torch.empty(4, 19)
    kernel.matmul_q8(x, w, y)
    assert y[1:3].isnan().all() and torch.equal(y[[0, 3]], want[[0, 3]])


def float_x(x: torch.Tensor) -> torch.Tensor:
    return x


def int8_x(x: torch.Tensor) -> torch.Tensor:
    return quantize_x(x)[0]


# (the kernel's entry, what it multiplies x as): the float32 path and the int8-activation one
PATHS = [pytest.param(GGUFKernel.matmul, float_x, id="float32"), pytest.param(GGUFKernel.matmul_q8, int8_x, id="int8")]


@pytest.mark.parametrize(("matmul", "as_x"), PATHS)
def test_kernel_writes_a_column_slice_of_a_wider_output(
        kernel: GGUFKernel, matmul: Matmul, as_x: Callable[[torch.Tensor], torch.Tensor]) -> None:
    w, ref_w = random_weight(11, 64, Q4_1, seed=5)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    y = torch.zeros(3, 20)
    matmul(kernel, x, w, y[:, 4:15])
    assert (y[:, :4] == 0).all() and (y[:, 15:] == 0).all()
    assert ((y[:, 4:15] - as_x(x) @ ref_w.T).abs() <= bound(as_x(x), ref_w)).all()


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_dequantize_equals_the_gguf_package_bit_for_bit(kernel: GGUFKernel, qtype: GGMLQuantizationType) -> None:
    w, ref_w = random_weight(45, 160, qtype, seed=1)
    assert torch.equal(kernel.dequantize(w), ref_w)
    rows = torch.tensor([44, 0, 22, 22, 7])
    assert torch.equal(kernel.dequantize(w, rows), ref_w[rows])


def test_the_native_build_runs_avx2_and_vnni_where_the_cpu_has_them(tmp_path: Path) -> None:
    native, portable = load_gguf_kernel(tmp_path), load_gguf_kernel(tmp_path, portable=True)
    assert native.simd == ({"avx2", "fma", "f16c"} <= cpu_flags())
    assert native.vnni == (native.simd and {"avx512_vnni", "avx512vl"} <= cpu_flags())
    assert not portable.simd and not portable.vnni


# The kernel on float32 x, on int8 x (the default), and dequantize + torch's matmul (float32 x).
@pytest.mark.parametrize(("m", "int8"), [(2, False), (2, True), (DENSE_FROM_ROWS + 3, True)])
def test_linear_of_mixed_parts_with_bias(kernel: GGUFKernel, m: int, int8: bool) -> None:
    """q|k|v-style: parts of different types and sizes side by side, plus a bias."""
    parts = [random_weight(13, 96, Q4_1, 2), random_weight(5, 96, Q8_0, 3), random_weight(9, 96, Q4_1, 4)]
    bias = torch.randn(27)
    layer = GGUFLinear([p for p, _ in parts], bias, kernel, int8_activations=int8)
    assert [p.rows for p in layer.parts] == [13, 5, 9] and layer.out_features == 27
    ref_w = torch.cat([r for _, r in parts])
    assert torch.equal(layer.dequantized(), ref_w)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    y = layer(x)
    assert y.shape == (m, 27)
    xr = int8_x(x) if int8 and m < DENSE_FROM_ROWS else x
    assert ((y - (xr @ ref_w.T + bias)).abs() <= bound(xr, ref_w) + 1e-6).all()


def test_adjacent_parts_of_one_type_become_one_weight(kernel: GGUFKernel) -> None:
    (a, ra), (b, rb) = random_weight(6, 64, Q8_0, 6), random_weight(10, 64, Q8_0, 7)
    layer = GGUFLinear([a, b], None, kernel)
    assert len(layer.parts) == 1 and layer.parts[0].rows == 16 and layer.int8_activations
    x = torch.randn(4, 64)
    ref_w = torch.cat([ra, rb])
    assert ((layer(x) - int8_x(x) @ ref_w.T).abs() <= bound(int8_x(x), ref_w)).all()


@pytest.mark.parametrize(("matmul", "as_x"), PATHS)
def test_results_do_not_depend_on_the_thread_count(
        kernel: GGUFKernel, matmul: Matmul, as_x: Callable[[torch.Tensor], torch.Tensor]) -> None:
    w, _ = random_weight(301, 256, Q4_1, 8)
    x = torch.randn(5, 256)
    y1, y2, y3 = torch.empty(5, 301), torch.empty(5, 301), torch.empty(5, 301)
    torch.set_num_threads(1)
    matmul(kernel, x, w, y1)
    torch.set_num_threads(2)
    matmul(kernel, x, w, y2)
    torch.set_num_threads(3)  # 301 rows split 101/100/100: no split lines up with a tile
    matmul(kernel, x, w, y3)
    assert torch.equal(y1, y2) and torch.equal(y1, y3)


def test_embedding_looks_up_dequantized_rows(kernel: GGUFKernel) -> None:
    w, ref_w = random_weight(50, 64, Q8_0, 9)
    emb = GGUFEmbedding(w, kernel)
    ids = torch.tensor([3, 49, 0, 3])
    assert torch.equal(emb(ids), ref_w[ids])
    assert emb(torch.tensor([], dtype=torch.int64)).shape == (0, 64)
    for bad in (50, -1):
        with pytest.raises(IndexError, match=r"token id out of range \[0, 50\)"):
            emb(torch.tensor([1, bad]))


def test_a_weight_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="is not a"):
        QuantizedWeight(int(Q4_1), torch.zeros(3, 21, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="is not a"):
        QuantizedWeight(int(Q8_0), torch.zeros(3, 34, dtype=torch.uint8), 48)
