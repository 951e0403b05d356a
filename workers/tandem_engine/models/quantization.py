"""Weight quantization of the decoder's projections, chosen with `--quantization` (docs/architecture.md,
"Quantization"): int8 is W8A8 dynamic quantization, weights per output channel and activations per token
(finer than fbgemm's one scale per step, whose outliers coarsened every row), on torch's int8 matmul, or on
Q8_0 blocks and the GGUF kernels where torch's int8 matmul is slow (a CPU without an int8 dot product).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tandem_engine.kernels.gguf_matmul import BLOCKS, QuantizedWeight


class QuantizedLinear(Protocol):
    """A projection that replaced a dense weight: x [rows, in] float32 -> [rows, out] float32."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Int8Linear:
    """y [rows, out] = x [rows, in] @ W.T + b, with W int8 per output channel and each row of x quantized
    to int8 with its own scale when called."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.detach().to(torch.float32)  # [out, in]
        self.out_features, self.in_features = w.shape
        # Symmetric per output channel; an all-zero row gets a tiny scale and stays zero.
        self.scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out] float32
        qweight = torch.round(w / self.scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.qweight_t = qweight.t()  # [in, out]: the view torch._int_mm multiplies by
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Per token: a row's largest magnitude maps to 127, so one outlier token (the first token of a
        # prompt often carries activations 100x the rest) does not coarsen every other row.
        x_scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min_(1e-12)  # [rows, 1]
        xq = torch.round(x / x_scale).to(torch.int8)  # [rows, in], within [-127, 127] by construction
        y: torch.Tensor = torch._int_mm(xq, self.qweight_t).to(torch.float32)  # [rows, out], exact int32 sums
        y.mul_(x_scale).mul_(self.scale)
        return y if self.bias is None else y.add_(self.bias)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The float32 weight [out, in] this layer multiplies by, and its bias (for references)."""
        return self.qweight_t.t().to(torch.float32) * self.scale[:, None], self.bias


# x86 features with which oneDNN's int8 matmul (`torch._int_mm`) has a fast kernel. Without any of them it
# ran at 2.6-2.8 GOP/s on an AVX2-only AMD EPYC, where float32 matmuls run at 47-66 GFLOP/s: single-stream
# decode 10 tok/s against dense's 18-19, a 256-token prompt's first token 14.7 s against 1.0
# (docs/benchmarks.md, "`vs_llama_cpp.py`").
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
Q8_0 = int(GGMLQuantizationType.Q8_0)
Q8_0_BLOCK = BLOCKS[Q8_0][0]  # weights per block


def int8_on_blocks(machine: str, flags: set[str]) -> bool:
    """Whether `--quantization int8` runs on Q8_0 blocks and the GGUF kernels (an x86 CPU without an int8
    dot-product instruction, where torch's int8 matmul is slow) rather than on torch's int8 matmul."""
    return machine in ("x86_64", "AMD64") and bool(flags) and not flags & set(INT8_DOT_FLAGS)


def q8_0_blocks(weight: torch.Tensor) -> QuantizedWeight:
    """A float [out, in] weight (in a multiple of 32) in GGUF's Q8_0 layout: per block of 32, d = max|w| / 127
    as float16, then the 32 values round(w / d) as int8 (the gguf package's quantizer)."""
    out_f, in_f = weight.shape
    if in_f % Q8_0_BLOCK:
        raise ValueError(f"Q8_0 blocks need a multiple of {Q8_0_BLOCK} columns, not {in_f}")
    data = quantize(weight.detach().to(torch.float32).contiguous().numpy(), GGMLQuantizationType.Q8_0)
    return QuantizedWeight(Q8_0, torch.from_numpy(np.ascontiguousarray(data)).view(out_f, -1), in_f)


def check_supported(method: str, dtype: torch.dtype, device: torch.device) -> None:
    """int8 and gguf are CPU paths with float32 activations around them: a ValueError naming the flags
    otherwise."""
    if method in ("int8", "gguf") and dtype != torch.float32:
        raise ValueError(f"--quantization {method} needs float32 activations, not {dtype}: use --dtype float32")
    if method in ("int8", "gguf") and device.type != "cpu":
        raise ValueError(f"--quantization {method} runs on the CPU only, not on {device.type}; "
                         "serve this device with --quantization none")

