"""One projection of a decoder layer (q|k|v, o, gate|up, down) or the LM head: its dense weight and bias, the
other forms of the weight made after loading (oneDNN's packed copy, a quantized layer, float32 panels, AMX
copies), and the choice among them for each call, by the rows it computes (docs/architecture.md, "CPU
kernels")."""

from __future__ import annotations

import torch
from torch import nn

from tandem_engine.kernels.amx_matmul import AMX_F32_FROM_ROWS, AmxBlockLinear, AmxKernel, AmxLinear
from tandem_engine.kernels.gguf_matmul import QuantizedWeight
from tandem_engine.kernels.panel_matmul import F32, PanelKernel, PanelLinear
from tandem_engine.models import packed_linear
from tandem_engine.models.packed_linear import linear
from tandem_engine.models.quantization import QuantizedLinear


def free(weight: nn.Parameter) -> None:
    """Drop a weight's storage once another form computes with it (its shape becomes [0])."""
    weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)


class Projection:
    """x [T, in] -> [T, out] through whichever form of the weight serves T rows best:
    - quantized (`--quantization`): always, the dense weight freed;
    - AMX bfloat16 copy (a bfloat16 model on AMX): always, for float32 rows;
    - float32 AMX copy over the GGUF blocks: from AMX_F32_FROM_ROWS rows on;
    - float32 panels: up to the panel kernel's rows, or any rows where no oneDNN copy is left;
    - else the dense weight, through oneDNN's packed copy where there is one (packed_linear.linear)."""

    def __init__(self, name: str, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        self.name, self.weight, self.bias = name, weight, bias
        self.quantized: QuantizedLinear | None = None
        self.packed: torch.Tensor | None = None
        self.pack_decided = False  # prepack ran (or a copy that replaces oneDNN's was made): `packed` is final
        self.panels: PanelLinear | None = None
        self.amx: AmxLinear | None = None
        self.amx_f32: AmxBlockLinear | None = None

    def prepack(self) -> None:
        """oneDNN's packed copy of the dense weight, for the matmuls no other form takes (None where packing does
        not pay): none when quantized or on AMX, or when packing was settled already. Where panels take the
        small matmuls and this copy the large ones, the plain weight goes."""
        if self.quantized is not None or self.amx is not None or self.pack_decided or self.weight.numel() == 0:
            return
        self.packed, self.pack_decided = packed_linear.pack(self.weight), True
        if self.panels is not None and self.packed is not None:
            free(self.weight)

    def quantize(self, layer: QuantizedLinear) -> None:
        """Compute through `layer` from now on; the dense weight and any packed copy go."""
        self.quantized = layer
        free(self.weight)
        self.packed, self.pack_decided = None, False

    def use_panels(self, kernel: PanelKernel, blocks: list[QuantizedWeight] | None, keep_floats: bool) -> None:
        """Panel copies (PanelLinear, keeping `blocks` where they unpack to the weight); a projection that has
        oneDNN's copy for the larger matmuls frees its plain weight. Kept if made already."""
        if self.quantized is not None or self.panels is not None:
            return
        self.panels = PanelLinear(self.weight, kernel, blocks, keep_floats)
        if self.packed is not None:
            free(self.weight)

    def use_amx(self, kernel: AmxKernel) -> None:
        """An AMX copy of a bfloat16 weight, which every matmul then takes (the weight freed). Idempotent."""
        if self.amx is None:
            self.amx = AmxLinear(self.weight, kernel)
            free(self.weight)

    def use_amx_f32(self, kernel: AmxKernel, blocks: list[QuantizedWeight] | None) -> None:
        """A float32 AMX copy over the GGUF blocks the panels keep (PanelLinear checked that they give the
        weight), for matmuls of AMX_F32_FROM_ROWS rows or more; fewer rows stay on the panels, so oneDNN's copy
        and the plain weight go. Idempotent."""
        if self.amx_f32 is not None or self.panels is None or self.panels.qtype == F32 or blocks is None:
            return
        self.amx_f32 = AmxBlockLinear(blocks, kernel)
        self.packed, self.pack_decided = None, True
        free(self.weight)

    def forms(self) -> list[str]:
        """The forms this projection holds, for the start-up log."""
        held = {"quantized": self.quantized, "amx": self.amx, "amx_f32": self.amx_f32, "panels": self.panels,
                "onednn": self.packed}
        return [name for name, form in held.items() if form is not None] + (["dense"] * (self.weight.numel() > 0))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x)
        bias = self.bias
        if self.amx is not None:  # float32 rows, bfloat16 weights
            y = self.amx(x)
            return y if bias is None else y.add_(bias)
        if self.amx_f32 is not None and x.shape[0] >= AMX_F32_FROM_ROWS:
            return self.amx_f32(x, bias)
        panels, packed = self.panels, self.packed
        if panels is not None and (x.shape[0] <= panels.kernel.max_rows or packed is None):
            return panels(x, bias)
        return self.dense(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class Head(Projection):
    """The LM head, [N, hidden] -> [N, vocab] float32 logits: a Projection whose weight, when tied to the
    embedding, is also read from the [vocab, hidden] embedding table: its float32 copies are made from it,
    and the dense matmul of 3 rows or more runs against it (as fast or faster from 4 rows on; 1-2 rows run
    ~1.5x faster against the head's transposed copy). Panels, once made, take every matmul: from 1 to 64 rows
    they measured as fast or faster than each other copy, which therefore go."""

    def __init__(self, weight: nn.Parameter, table: nn.Parameter | None) -> None:
        super().__init__("head", weight, None)
        self.table = table  # the embedding, when tied

    def source(self) -> nn.Parameter:
        """The dense weight the other forms are made from: the embedding table while tied and kept."""
        return self.table if self.table is not None and self.table.numel() > 0 else self.weight

    def use_panels(self, kernel: PanelKernel, blocks: list[QuantizedWeight] | None, keep_floats: bool) -> None:
        if self.quantized is not None or self.panels is not None or self.weight.dtype != torch.float32:
            return
        self.panels = PanelLinear(self.source(), kernel, blocks, keep_floats)
        free(self.weight)
        self.packed, self.pack_decided = None, True

    def use_amx(self, kernel: AmxKernel) -> None:
        if self.amx is None:
            self.amx = AmxLinear(self.source(), kernel)
            free(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x).float()

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        table = self.table
        w = table if table is not None and table.numel() > 0 and x.shape[0] > 2 else self.weight
        return linear(x, w, None, self.packed)
