"""oneDNN-packed projections compute the same product as F.linear, for few rows and for batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem_engine.models.packed_linear import MIN_PACKED_ROWS, linear, pack, packing_supported

pytestmark = pytest.mark.skipif(not packing_supported(torch.float32, torch.device("cpu")),
                                reason="this torch build has no oneDNN weight packing")


@pytest.mark.parametrize("rows", [1, MIN_PACKED_ROWS - 1, MIN_PACKED_ROWS, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 64, generator=g)
    packed = pack(w)
    assert packed is not None
    torch.testing.assert_close(linear(x, w, b, packed), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_transposed_storage_and_strided_rows_are_handled() -> None:
    w = torch.randn(64, 96).t()  # [96, 64] weight kept in [in, out] storage, as the model does
    x = torch.randn(40, 128)[:, ::2]  # strided rows
    torch.testing.assert_close(linear(x, w, None, pack(w)), F.linear(x, w), rtol=1e-5, atol=1e-4)
