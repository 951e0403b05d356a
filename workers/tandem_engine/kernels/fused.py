"""The decoder's elementwise work between its matmuls, fused: residual add + RMSNorm, SiLU(gate) * up, and
rotary embedding; and the greedy step's argmax over the logits.

`FusedOps` runs the C kernels of `fused.c` for float32 CPU tensors when they are built, and torch's ops
otherwise (other dtypes or devices, no compiler, `--no-cpu-fused-kernels`). The torch path is the
reference: the kernels keep its order of float operations where it is observable, so greedy output is
unchanged (docs/architecture.md, "CPU kernels").
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem_engine.kernels.build import address, base_flags, try_build

SOURCE = (Path(__file__).parent / "fused.c").read_text()


class FusedOps:
    """Residual add + RMSNorm, SiLU * up and RoPE; `lib` None: torch's ops only."""

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        self._lib = lib
        if lib is not None:
            p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            lib.tandem_add_rms_norm.argtypes = [p, i64, p, i64, p, p, i64, i64, ctypes.c_float, i32]
            lib.tandem_add_rms_norm.restype = None
            lib.tandem_silu_mul.argtypes = [p, i64, p, i64, i64, i32]
            lib.tandem_silu_mul.restype = None
            lib.tandem_rope.argtypes = [p, i64, p, p, i64, p, i64, i64, i64, i32]
            lib.tandem_rope.restype = None
            lib.tandem_argmax.argtypes = [p, i64, p, i64, i64, i32]
            lib.tandem_argmax.restype = None

    @property
    def row_entries(self) -> dict[str, int] | None:
        """Where the one-row kernels are, for the fused decode step (worker/decode_step.py); None: torch's ops."""
        if self._lib is None:
            return None
        return {"add_rms_norm_row": address(self._lib, "tandem_add_rms_norm_row"),
                "silu_mul_row": address(self._lib, "tandem_silu_mul_row")}

    @property
    def native(self) -> bool:
        """Whether the C kernels are in use (for float32 CPU tensors)."""
        return self._lib is not None

    def _applies(self, *tensors: torch.Tensor) -> bool:
        return self._lib is not None and all(
            t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1
            for t in tensors)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x [T, n] += delta [T, n] (in place; None: no add), then rmsnorm(x) * weight [n] -> new [T, n]."""
        native = self._applies(x, weight.reshape(1, -1)) and weight.numel() == x.shape[1]
        if not native or (delta is not None and not (self._applies(delta) and delta.shape == x.shape)):
            if delta is not None:
                x.add_(delta)
            return F.rms_norm(x, x.shape[-1:], weight, eps)
        rows, n = x.shape
        out = torch.empty(rows, n, dtype=x.dtype)
        assert self._lib is not None
        self._lib.tandem_add_rms_norm(
            x.data_ptr(), x.stride(0), None if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0), weight.data_ptr(), out.data_ptr(), rows, n, eps,
            torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2n] (gate | up) -> silu(gate) * up [T, n]."""
        n = gate_up.shape[-1] // 2
        if not self._applies(gate_up):
            return F.silu(gate_up[:, :n]) * gate_up[:, n:]
        rows = gate_up.shape[0]
        out = torch.empty(rows, n, dtype=gate_up.dtype)
        assert self._lib is not None
        self._lib.tandem_silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, n,
                                  torch.get_num_threads())
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, n_heads, D] (may be a strided view of the QKV projection), cos [T, 1, D] = (cos, cos), sin
        [T, 1, D] = (-sin, sin) -> new [T, n_heads, D]: the rotate-half convention of HF checkpoints,
        (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
        t, nh, d = x.shape
        native = (self._lib is not None and x.device.type == "cpu"
                  and all(u.dtype == torch.float32 for u in (x, cos, sin))
                  and x.stride(2) == 1 and x.stride(1) == d and d % 2 == 0
                  and cos.shape == sin.shape == (t, 1, d) and cos.stride() == sin.stride()
                  and cos.stride(2) == 1)
        if not native:
            # Rolling the last dim by D/2 gives (x2, x1): three ops.
            return torch.addcmul(x * cos, x.roll(d // 2, dims=-1), sin)
        out = torch.empty(t, nh, d, dtype=x.dtype)
        assert self._lib is not None
        self._lib.tandem_rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                              out.data_ptr(), t, nh, d, torch.get_num_threads())
        return out

    def argmax(self, x: torch.Tensor) -> list[int]:
        """The index of each row's largest value of x [rows, n], as torch.argmax(x, -1) (the first of equal
        maxima, the first NaN if any): a greedy step's tokens from its logits."""
        if not self._applies(x) or x.shape[1] == 0:
            return [int(t) for t in x.argmax(dim=-1).tolist()]
        out = torch.empty(x.shape[0], dtype=torch.int64)
        assert self._lib is not None
        self._lib.tandem_argmax(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1],
                                torch.get_num_threads())
        return [int(t) for t in out.tolist()]


TORCH_OPS = FusedOps()


def build_flags() -> tuple[str, ...]:
    """fused.c's compile flags."""
    # -fno-trapping-math: without it GCC keeps silu_mul's clamps as branches and its loop scalar (the
    # kernel reads no floating-point exception flags); results are the same either way.
    # -mprefer-vector-width=512: GCC's cost model vectorises 8 floats wide even with AVX-512; 16 wide took a
    # 512-token prefill step's SiLU * up from 21 to 14 ms and its norms from 11.6 to 9.6 (the same floats:
    # without -ffast-math every lane does what the scalar loop does). Ignored without AVX-512.
    return (*base_flags(), "-fno-trapping-math", "-mprefer-vector-width=512")


@functools.cache  # one per directory
def load_fused_ops(cache_dir: Path) -> FusedOps:
    """The C kernels built (once, cached under `cache_dir`/kernels), or torch's ops if they cannot be."""
    return FusedOps(try_build("fused", SOURCE, build_flags(), cache_dir, "using torch's norm and activation"))
