"""oneDNN-prepacked weights for CPU matmuls with several rows.

MKL's sgemm (behind F.linear) is weak for the short, wide matmuls of a batched decode step on AVX2 CPUs;
oneDNN with weights reordered once into its blocked layout ran 2-3x faster at 32-64 rows and ~1.3x at
2048 rows on SmolLM2 shapes here, but slower for 1-2 rows. So each layer keeps both: the plain weight
for a few rows (single-stream decode) and the packed copy for batches (bench/engine_profile.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Below this many rows the plain F.linear path is faster (measured: 1-7 rows).
MIN_PACKED_ROWS = 8


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `pack` can work here (`--no-onednn-pack` turns packing off before this is asked)."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    mkldnn: bool = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]  # unannotated in torch
    return mkldnn and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack(weight: torch.Tensor, rows_hint: int = 32) -> torch.Tensor | None:
    """oneDNN's blocked copy of a [out, in] weight, or None if this torch build cannot make one."""
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows_hint)
        return packed
    except (RuntimeError, AttributeError) as e:  # a build without the op, or an unsupported shape
        logger.warning("oneDNN weight packing unavailable (%s); using F.linear", e)
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T (+ bias) -> [rows, out], through the packed copy for batches."""
    if packed is not None and x.shape[0] >= MIN_PACKED_ROWS:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)
