"""The fused C kernels (kernels/fused.c) against torch's own ops: residual add + RMSNorm, SiLU(gate) * up,
rotary embedding, and the greedy step's argmax.

Odd sizes (not a multiple of the kernels' 8-wide partial sums), one row, 33 rows and 257 rows (split
between threads, not a multiple of them), strided inputs, and dtypes the kernels do not take (which must give
torch's result exactly, through the fallback).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tandem_engine.kernels.build import cpu_flags
from tandem_engine.kernels.fused import TORCH_OPS, FusedOps, load_fused_ops

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")

# (257, 577): enough elements for the kernels to split the rows between threads.
SHAPES = [(1, 576), (33, 577), (33, 1), (5, 7), (2, 4099), (257, 577)]


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> FusedOps:
    built = load_fused_ops(tmp_path_factory.mktemp("cache"))
    assert built.native, "the fused kernels did not build"
    return built


def _inputs(rows: int, n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, n, generator=g).to(dtype)
    weight = (1 + 0.2 * torch.randn(n, generator=g)).to(dtype)
    return x, delta, weight


@pytest.mark.parametrize(("rows", "n"), SHAPES)
def test_add_rms_norm_matches_torch(ops: FusedOps, rows: int, n: int) -> None:
    x, delta, weight = _inputs(rows, n, torch.float32, rows * n)
    ref_x = x + delta
    ref = F.rms_norm(ref_x, (n,), weight, 1e-5)
    got = ops.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(x, ref_x), "the residual stream must hold exactly x + delta"
    # Only the mean of squares is summed in another order (in double): a few float ulps at most.
    torch.testing.assert_close(got, ref, rtol=3e-7, atol=1e-7)


def test_rms_norm_without_add_and_strided_rows(ops: FusedOps) -> None:
    base, delta, weight = _inputs(9, 2 * 301, torch.float32, 1)
    x = base[:, :301]  # rows 602 floats apart
    before = x.clone()
    got = ops.add_rms_norm(x, None, weight[:301], 1e-6)
    assert torch.equal(x, before)
    torch.testing.assert_close(got, F.rms_norm(before, (301,), weight[:301], 1e-6), rtol=3e-7, atol=1e-7)
    d = delta[:, 1::2]  # a delta with rows 602 floats apart
    ref = F.rms_norm(before + d, (301,), weight[:301], 1e-6)
    torch.testing.assert_close(ops.add_rms_norm(x, d, weight[:301], 1e-6), ref, rtol=3e-7, atol=1e-7)
    assert torch.equal(x, before + d)


@pytest.mark.parametrize(("rows", "n"), SHAPES)
def test_silu_mul_matches_torch(ops: FusedOps, rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    gate_up = torch.randn(rows, 2 * n, generator=g) * 4
    ref = F.silu(gate_up[:, :n]) * gate_up[:, n:]
    torch.testing.assert_close(ops.silu_mul(gate_up), ref, rtol=4e-7, atol=1e-30)


def test_silu_mul_extremes_and_strided_rows(ops: FusedOps) -> None:
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20, -20, 86.9, 87.5, -87.5, -88.5, 89, -89, 100, -100, 1e4,
                         -1e4, 3e38, -3e38])
    n = gate.numel()
    up = torch.linspace(-1, 1, n)  # |up| <= 1: silu(3e38) * up stays finite
    wide = torch.zeros(2, 3 * n)
    wide[:, :n], wide[:, n : 2 * n] = gate, up
    gate_up = wide[:, : 2 * n]  # rows 3n floats apart
    got = ops.silu_mul(gate_up)
    ref = F.silu(gate) * up
    torch.testing.assert_close(got, ref.expand(2, n), rtol=4e-7, atol=1e-30)
    assert torch.isfinite(got).all()


def _rope_inputs(rows: int, heads: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A QKV-like projection [rows, heads + 5, d] (its first `heads` heads are the view RoPE reads), and the
    model's cos and sin rows for random positions."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (heads + 5) * d, generator=g) * 3
    freqs = torch.randint(0, 8192, (rows, 1), generator=g).float() * (10000.0 ** (-torch.arange(0, d, 2) / d))
    cos = torch.cat((freqs.cos(), freqs.cos()), -1).unsqueeze(1)  # [rows, 1, d]
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1).unsqueeze(1)
    return qkv[:, : heads * d].view(rows, heads, d), cos, sin


@pytest.mark.parametrize(("rows", "heads", "d"), [(1, 12, 64), (32, 12, 64), (33, 5, 128), (3, 1, 2),
                                                   (257, 12, 64)])
def test_rope_matches_torch(ops: FusedOps, rows: int, heads: int, d: int) -> None:
    """Bit for bit what torch's three ops give (on a CPU with FMA, where torch's addcmul fuses its
    multiply-add), over a strided view of the projection and 257 rows split between threads."""
    x, cos, sin = _rope_inputs(rows, heads, d, rows * heads + d)
    before = x.clone()
    ref = torch.addcmul(x * cos, x.roll(d // 2, dims=-1), sin)
    got = ops.rope(x, cos, sin)
    assert torch.equal(x, before), "RoPE must not write its input"
    assert got.shape == ref.shape and got.is_contiguous()
    if "fma" in cpu_flags():
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, rtol=2e-7, atol=1e-30)


def test_rope_takes_torchs_path_where_the_kernel_does_not_apply(ops: FusedOps) -> None:
    x, cos, sin = _rope_inputs(4, 3, 64, 9)
    for args in [(x.to(torch.bfloat16), cos.to(torch.bfloat16), sin.to(torch.bfloat16)),  # another dtype
                 (x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin)]:  # heads not adjacent
        ref = torch.addcmul(args[0] * args[1], args[0].roll(32, dims=-1), args[2])
        assert torch.equal(ops.rope(*args), ref)
    assert torch.equal(TORCH_OPS.rope(x, cos, sin), torch.addcmul(x * cos, x.roll(32, dims=-1), sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes_fall_back_to_torch(ops: FusedOps, dtype: torch.dtype) -> None:
    x, delta, weight = _inputs(33, 577, dtype, 3)
    ref_x = x + delta
    ref = F.rms_norm(ref_x, (577,), weight, 1e-5)
    got = ops.add_rms_norm(x, delta, weight, 1e-5)
    assert got.dtype == dtype and torch.equal(x, ref_x) and torch.equal(got, ref)
    gate_up = torch.randn(33, 2 * 577).to(dtype)
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate_up[:, :577]) * gate_up[:, 577:])


def test_torch_ops_are_torch(ops: FusedOps) -> None:
    x, delta, weight = _inputs(4, 64, torch.float32, 4)
    ref_x = x + delta
    assert not TORCH_OPS.native
    assert torch.equal(TORCH_OPS.add_rms_norm(x, delta, weight, 1e-5), F.rms_norm(ref_x, (64,), weight, 1e-5))
    assert torch.equal(x, ref_x)


def test_build_is_cached_per_directory(tmp_path: Path) -> None:
    assert load_fused_ops(tmp_path) is load_fused_ops(tmp_path)
    assert len(list((tmp_path / "kernels").glob("fused_*.so"))) == 1


def test_loading_a_kernel_keeps_denormals(ops: FusedOps, tmp_path: Path) -> None:
    """The attention kernel is compiled with -ffast-math; linking it must not switch this thread to
    flush-to-zero, or torch's own float32 ops would change."""
    from tandem_engine.kernels.paged_attention import load_kernel

    assert load_kernel(tmp_path) is not None
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # a float32 subnormal
    assert (tiny * 0.5).item() != 0.0


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="reads x86-64 machine code with objdump")
def test_silu_mul_row_is_vectorised(tmp_path: Path) -> None:
    """SiLU runs once per layer and decode step over every row. Built with trapping math (GCC's default),
    its clamps stayed branches and the loop scalar: 3x slower than vectorised on an AVX2 EPYC, and 2x
    slower than torch's. The built row function must divide packed floats."""
    assert load_fused_ops(tmp_path).native
    (lib,) = (tmp_path / "kernels").glob("fused_*.so")
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True,
                          check=True).stdout
    body = code.split("<tandem_silu_mul_row>:", 1)[1].split("\n\n", 1)[0]
    assert "divps" in body, "tandem_silu_mul_row divides one float at a time"


@pytest.mark.parametrize(("rows", "n"), [*SHAPES, (32, 49152)])
def test_argmax_is_torchs_token_for_token(ops: FusedOps, rows: int, n: int) -> None:
    """A greedy step's tokens: the kernel's argmax of each row is torch's, on random logits and on rows built
    to trip it: equal maxima (the first wins), a NaN (the first NaN wins), infinities and signed zeros."""
    x, _, _ = _inputs(rows, n, torch.float32, n)
    assert ops.argmax(x) == x.argmax(dim=-1).tolist()
    tricky = torch.full((6, n), -torch.inf)
    if n > 2:
        tricky[0, [n // 3, n - 1]] = 5.0  # a tie, at a place past the first vector
        tricky[1, [1, n // 2]] = torch.nan
        tricky[1, 0] = torch.inf
        tricky[2, :] = 0.0
        tricky[2, 0] = -0.0
        tricky[3, n - 1] = torch.inf  # the last place
        tricky[4] = torch.randn(n)
        tricky[4, n - 2] = torch.nan  # a NaN beside the last element
    assert ops.argmax(tricky) == tricky.argmax(dim=-1).tolist()  # row 5: all -inf, the first


def test_argmax_of_strided_rows_and_other_dtypes(ops: FusedOps) -> None:
    base = torch.randn(7, 2 * 1001)
    x = base[:, 1001:]  # rows 2002 floats apart
    assert ops.argmax(x) == x.argmax(dim=-1).tolist()
    half = torch.randn(5, 301).to(torch.bfloat16)  # not the kernel's: torch's own argmax
    assert ops.argmax(half) == TORCH_OPS.argmax(half) == half.argmax(dim=-1).tolist()
