"""A GGUF file's tensors as the file stores them, under the checkpoint (HF) names the model loads.

`read_gguf_tensors` is the one place that reads a GGUF's tensor data (with the `gguf` package's reader,
which memory-maps the file): quantized tensors come back as their raw blocks, one row of blocks per
output row, float tensors as float32 values. llama.cpp's converter stores the q and k projections of
Llama-architecture files with the rows of each head interleaved for its RoPE; they are put back in the
checkpoint's order here, whole rows of blocks at a time, so nothing is dequantized.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

# ggml types served as stored (the C kernel's blocks) and types widened to float32 at load.
KERNEL_TYPES = {GGMLQuantizationType.Q4_1.value: "Q4_1", GGMLQuantizationType.Q8_0.value: "Q8_0"}
FLOAT_TYPES = {GGMLQuantizationType.F32.value: "F32", GGMLQuantizationType.F16.value: "F16"}

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_SKIPPED = {"rope_freqs.weight"}  # RoPE frequencies come from the config (models/llama.py)
# Architectures whose converter interleaved the q/k rows for RoPE.
_PERMUTED_ARCHS = {"llama", "mistral"}


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


def checkpoint_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor; None for one the model does not load; ValueError for an unknown one."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def type_error(path: Path | GGUFReader, label: str) -> str | None:
    """Why `--quantization gguf` cannot serve the file (`label` names it): the tensors of a type it does not
    read, or None. Reads the header only."""
    reader = path if isinstance(path, GGUFReader) else GGUFReader(path)
    bad = [f"{t.name} ({t.tensor_type.name})" for t in reader.tensors
           if int(t.tensor_type) not in KERNEL_TYPES and int(t.tensor_type) not in FLOAT_TYPES]
    if not bad:
        return None
    return (f"--quantization gguf reads Q4_1 and Q8_0 blocks and F32/F16 tensors; {label} holds {len(bad)} "
            f"tensor(s) of other types: {', '.join(bad[:4])}")


def _unpermute(rows: int, n_head: int) -> np.ndarray:
    """Row order undoing the converter's per-head interleave: checkpoint row i is file row order[i]."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def read_gguf_tensors(path: Path, num_heads: int, num_kv_heads: int) -> list[GGUFTensor]:
    """Every tensor the model loads, in file order; ValueError naming a tensor of an unsupported type."""
    reader = GGUFReader(path)
    arch_field = reader.get_field("general.architecture")
    arch = str(arch_field.contents()) if arch_field is not None else ""
    error = type_error(reader, path.name)
    if error:
        raise ValueError(error)
    out = []
    for t in reader.tensors:
        name = checkpoint_name(t.name)
        if name is None:
            continue
        qtype = int(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the fastest dimension first
        # A copy in memory: the reader's arrays are read-only views of the memory-mapped file.
        data = np.array(t.data, dtype=np.uint8 if qtype in KERNEL_TYPES else np.float32).reshape(
            (shape[0], -1) if qtype in KERNEL_TYPES else shape)
        heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}
        for proj, n_head in heads.items():
            if arch in _PERMUTED_ARCHS and f".{proj}." in name:
                data = data[_unpermute(shape[0], n_head)]
        out.append(GGUFTensor(name, t.name, qtype, shape, np.ascontiguousarray(data)))
    return out
