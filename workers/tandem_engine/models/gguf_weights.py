"""A GGUF file's tensors as the file stores them, under the checkpoint (HF) names the model loads, for
`--quantization gguf`: quantized tensors as their raw blocks, one row of blocks per output row (q/k rows
back in checkpoint order, whole rows of blocks at a time, so nothing is dequantized), float tensors as
float32 values. The file is read by models/gguf_file.py, the engine's one GGUF reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tandem_engine.models.gguf_file import GGUFFile

# ggml types served as stored (the C kernel's blocks) and types widened to float32 at load.
KERNEL_TYPES = {GGMLQuantizationType.Q4_1.value: "Q4_1", GGMLQuantizationType.Q8_0.value: "Q8_0"}
FLOAT_TYPES = {GGMLQuantizationType.F32.value: "F32", GGMLQuantizationType.F16.value: "F16"}


@dataclass(frozen=True)
class GGUFTensor:
    name: str  # the checkpoint name, e.g. model.layers.0.self_attn.q_proj.weight
    gguf_name: str  # the file's name, e.g. blk.0.attn_q.weight
    qtype: int  # ggml type id
    shape: tuple[int, ...]  # torch order: [out, in] for a matrix
    data: np.ndarray  # a kernel type: uint8 [rows, row bytes], else float32 values of `shape`

    @property
    def type_name(self) -> str:
        return KERNEL_TYPES.get(self.qtype) or FLOAT_TYPES.get(self.qtype) or GGMLQuantizationType(self.qtype).name


def type_error(file: Path | GGUFFile, label: str) -> str | None:
    """Why `--quantization gguf` cannot serve the file (`label` names it): the tensors of a type it does not
    read, or None. Reads the header only."""
    f = file if isinstance(file, GGUFFile) else GGUFFile(file)
    bad = [f"{gguf_name} ({qtype.name})" for gguf_name, qtype in f.stored_types().values()
           if qtype.value not in KERNEL_TYPES and qtype.value not in FLOAT_TYPES]
    if not bad:
        return None
    return (f"--quantization gguf reads Q4_1 and Q8_0 blocks and F32/F16 tensors; {label} holds {len(bad)} "
            f"tensor(s) of other types: {', '.join(bad[:4])}")


def read_gguf_tensors(path: Path, only_blocks: bool = False) -> list[GGUFTensor]:
    """Every tensor the model loads, in file order; ValueError naming a tensor of an unsupported type. With
    `only_blocks`, only the Q4_1 and Q8_0 tensors, whatever else the file holds."""
    f = GGUFFile(path)
    error = None if only_blocks else type_error(f, path.name)
    if error:
        raise ValueError(error)
    names = f.stored_types()
    out = []
    for name in f.tensor_names():
        if only_blocks and names[name][1].value not in KERNEL_TYPES:
            continue
        raw = f.raw(name)
        qtype = raw.qtype.value
        if qtype in KERNEL_TYPES:
            data = raw.data.reshape(raw.shape[0], -1).numpy()
        else:
            data = raw.data.to(torch.float32).reshape(raw.shape).numpy()
        out.append(GGUFTensor(name, names[name][0], qtype, raw.shape, np.ascontiguousarray(data)))
    return out
