"""`--quantization gguf`'s C kernel over Q4_1/Q8_0 blocks against a plain torch reference: the weights
dequantized by the gguf package, then a float32 matmul. Both builds: -march=native (AVX2/FMA where the CPU
has it) and the portable one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from tandem_engine.kernels.build import cpu_flags
from tandem_engine.models.gguf_linear import (
    DENSE_FROM_ROWS,
    GGUFEmbedding,
    GGUFKernel,
    GGUFLinear,
    QuantizedWeight,
    load_gguf_kernel,
)
from tests.engine.utils import torch_threads

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0


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


def test_kernel_writes_a_column_slice_of_a_wider_output(kernel: GGUFKernel) -> None:
    w, ref_w = random_weight(11, 64, Q4_1, seed=5)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    y = torch.zeros(3, 20)
    kernel.matmul(x, w, y[:, 4:15])
    assert (y[:, :4] == 0).all() and (y[:, 15:] == 0).all()
    assert ((y[:, 4:15] - x @ ref_w.T).abs() <= bound(x, ref_w)).all()


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_dequantize_equals_the_gguf_package_bit_for_bit(kernel: GGUFKernel, qtype: GGMLQuantizationType) -> None:
    w, ref_w = random_weight(45, 160, qtype, seed=1)
    assert torch.equal(kernel.dequantize(w), ref_w)
    rows = torch.tensor([44, 0, 22, 22, 7])
    assert torch.equal(kernel.dequantize(w, rows), ref_w[rows])


def test_the_native_build_runs_avx2_where_the_cpu_has_it(tmp_path: Path) -> None:
    native, portable = load_gguf_kernel(tmp_path), load_gguf_kernel(tmp_path, portable=True)
    assert native.simd == ({"avx2", "fma", "f16c"} <= cpu_flags())
    assert not portable.simd


@pytest.mark.parametrize("m", [2, DENSE_FROM_ROWS + 3])  # the kernel, and dequantize + torch's matmul
def test_linear_of_mixed_parts_with_bias(kernel: GGUFKernel, m: int) -> None:
    """q|k|v-style: parts of different types and sizes side by side, plus a bias."""
    parts = [random_weight(13, 96, Q4_1, 2), random_weight(5, 96, Q8_0, 3), random_weight(9, 96, Q4_1, 4)]
    bias = torch.randn(27)
    layer = GGUFLinear([p for p, _ in parts], bias, kernel)
    assert [p.rows for p in layer.parts] == [13, 5, 9] and layer.out_features == 27
    ref_w = torch.cat([r for _, r in parts])
    assert torch.equal(layer.dequantized(), ref_w)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    y = layer(x)
    assert y.shape == (m, 27)
    assert ((y - (x @ ref_w.T + bias)).abs() <= bound(x, ref_w) + 1e-6).all()


def test_adjacent_parts_of_one_type_become_one_weight(kernel: GGUFKernel) -> None:
    (a, ra), (b, rb) = random_weight(6, 64, Q8_0, 6), random_weight(10, 64, Q8_0, 7)
    layer = GGUFLinear([a, b], None, kernel)
    assert len(layer.parts) == 1 and layer.parts[0].rows == 16
    x = torch.randn(4, 64)
    ref_w = torch.cat([ra, rb])
    assert ((layer(x) - x @ ref_w.T).abs() <= bound(x, ref_w)).all()


def test_results_do_not_depend_on_the_thread_count(kernel: GGUFKernel) -> None:
    w, _ = random_weight(301, 256, Q4_1, 8)
    x = torch.randn(5, 256)
    y1, y2 = torch.empty(5, 301), torch.empty(5, 301)
    torch.set_num_threads(1)
    kernel.matmul(x, w, y1)
    torch.set_num_threads(2)
    kernel.matmul(x, w, y2)
    assert torch.equal(y1, y2)


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
