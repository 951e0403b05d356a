"""oneDNN-packed projections compute the same product as F.linear, for few rows and for batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem_engine.models.packed_linear import MIN_PACKED_ROWS, linear, pack

# Only a torch build without oneDNN's packing op skips (not the TANDEM_ONEDNN_PACK knob: these tests
# call pack() directly).
pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")),
    reason="this torch build has no oneDNN weight packing",
)


@pytest.mark.parametrize("rows", [1, MIN_PACKED_ROWS - 1, MIN_PACKED_ROWS, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 64, generator=g)
    packed = pack(w)
    assert packed is not None
    expected = F.linear(x, w, b)
    torch.testing.assert_close(linear(x, w, b, packed), expected, rtol=1e-5, atol=1e-4)
    # Which copy computed it: a batch must use the packed one, a few rows the plain weight. Each is
    # checked by handing over the other copy of a zero weight, which would give just the bias.
    zeros = torch.zeros_like(w)
    if rows >= MIN_PACKED_ROWS:
        torch.testing.assert_close(linear(x, zeros, b, packed), expected, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(linear(x, w, b, pack(zeros)), expected, rtol=1e-5, atol=1e-4)


def test_transposed_storage_and_strided_rows_are_handled() -> None:
    w = torch.randn(64, 96).t()  # [96, 64] weight kept in [in, out] storage, as the model does
    x = torch.randn(40, 128)[:, ::2]  # strided rows
    packed = pack(w)
    assert packed is not None and x.shape[0] >= MIN_PACKED_ROWS  # the packed path, not F.linear twice
    torch.testing.assert_close(linear(x, torch.zeros_like(w), None, packed), F.linear(x, w), rtol=1e-5, atol=1e-4)
