"""One GGUF file, parsed once: the model config its metadata describes, and its tensors under our names,
dequantized to float32 or as the file stores them.

Opening the file parses its header (metadata and tensor table) once, here, in one pass over a memory map
(the `gguf` package's GGUFReader takes ~3 s on SmolLM2's header, most of it wrapping each of its ~100,000
vocabulary strings in numpy views; this takes a tenth of a second); tensor data stays memory-mapped and is
read only when a tensor is asked for. The `gguf` package still gives the type table and the dequantizers.
The tokenizer the metadata describes is built in gguf_tokenizer.py from `GGUFFile.metadata`.

Tensor names are our model's (HF Llama's: `model.layers.3.self_attn.q_proj.weight`). llama.cpp stores
the rows of q_proj and k_proj permuted per head for its RoPE layout (the two halves of each head
interleaved); both `dense` and `raw` give them back in HF order. The permutation moves whole rows, and
quantization blocks run along a row, so the raw quantized rows can be reordered like the dense ones.
See docs/architecture.md, "Start-up and the model cache".
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

ARCHITECTURES = ("llama",)  # what models/llama.py runs

# llama.cpp's per-layer tensor names -> ours (the `blk.N.` prefix and the `.weight`/`.bias` suffix apart).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class RawTensor:
    """One tensor as the file stores it, rows in our model's order."""

    name: str  # ours
    qtype: GGMLQuantizationType  # Q4_1, Q8_0, F32, ...
    shape: tuple[int, ...]  # the dense tensor's, torch order: [out_features, in_features] for a weight
    data: torch.Tensor  # uint8 [rows, bytes per row] for quantized types; the stored values otherwise


# GGUF metadata value types (the spec's gguf_metadata_value_type) -> struct format of one scalar.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
_FLOAT_ITEMS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


@dataclass(frozen=True)
class _TensorInfo:
    name: str  # the file's
    tensor_type: int  # ggml type id
    shape: tuple[int, ...]  # ggml order: the fastest-moving dimension first
    data: np.ndarray  # read-only view of the map: uint8 [..., bytes per row] when quantized, else typed


class _Header:
    """One pass over a GGUF file's header (format version 2 or 3): metadata as plain Python values (arrays
    as lists), the tensor table, and where tensor data starts."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.buf = memoryview(self.map)
        self.pos = 0
        magic, version = self._unpack("<4sI")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
        n_tensors, n_kv = self._unpack("<QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            qtype, offset = self._unpack("<IQ")
            infos.append((name, dims, qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self.pos // align) * align
        data = np.frombuffer(self.map, dtype=np.uint8)
        self.tensors = []
        for name, dims, qtype, offset in infos:
            ggml = GGMLQuantizationType(qtype)
            n = int(np.prod(dims))
            per, nbytes = GGML_QUANT_SIZES[ggml]
            np_shape = tuple(reversed(dims))
            raw = data[start + offset : start + offset + n * nbytes // per]
            if len(raw) != n * nbytes // per:
                raise ValueError(f"{path}: tensor {name} runs past the end of the file")
            if ggml in _FLOAT_ITEMS:
                view = raw.view(_FLOAT_ITEMS[ggml]).reshape(np_shape)
            else:
                view = raw.reshape(quant_shape_to_byte_shape(np_shape, ggml))
            self.tensors.append(_TensorInfo(name, qtype, tuple(dims), view))

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        return str(self.buf[start : self.pos], "utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<IQ")
            if etype == _STRING:
                return [self._string() for _ in range(count)]
            if etype in _NUMPY:  # numbers in one read; bools as bools
                dtype = np.dtype(_NUMPY[etype])
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return [bool(v) for v in values] if etype == 7 else values.tolist()
            return [self._value(etype) for _ in range(count)]  # arrays of arrays
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF metadata value type {vtype}")
        return self._unpack(_SCALARS[vtype])[0]


class GGUFFile:
    """The header of `path`, parsed on construction; tensors read on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        header = _Header(path)
        self.metadata: dict[str, Any] = header.metadata
        self.architecture = str(self.metadata.get("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"{path}: GGUF architecture {self.architecture!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
        self._tensors: dict[str, _TensorInfo] = {}  # our name -> the file's tensor
        for t in header.tensors:
            name = self._our_name(t.name)
            if name is None:
                raise ValueError(f"{path}: unexpected GGUF tensor {t.name!r}")
            self._tensors[name] = t

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def _our_name(self, gguf_name: str) -> str | None:
        m = _LAYER_RE.fullmatch(gguf_name)
        if m is not None:
            part = _LAYER_NAMES.get(m.group(2))
            return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
        base, _, suffix = gguf_name.rpartition(".")
        return f"{_GLOBAL_NAMES[base]}.{suffix}" if base in _GLOBAL_NAMES else None

    # --- config ---------------------------------------------------------------------------------------

    @property
    def num_heads(self) -> int:
        return int(self._arch("attention.head_count"))

    @property
    def num_kv_heads(self) -> int:
        return int(self._arch("attention.head_count_kv", self.num_heads))

    def config_fields(self) -> dict[str, Any]:
        """The LlamaConfig keyword arguments this file's metadata gives (transformers' names; the same
        config transformers' GGUF route makes)."""
        hidden = int(self._arch("embedding_length"))
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(self._arch("rope.freq_base", 10000.0))}
        scaling = self._arch("rope.scaling.type", "none")
        if scaling == "linear":
            rope.update(rope_type="linear", factor=float(self._arch("rope.scaling.factor")))
        elif scaling != "none":
            raise ValueError(f"{self.path}: RoPE scaling {scaling!r} is not supported (none and linear are)")
        fields: dict[str, Any] = {
            "vocab_size": int(self._arch("vocab_size", len(tokens))),
            "hidden_size": hidden,
            "intermediate_size": int(self._arch("feed_forward_length")),
            "num_hidden_layers": int(self._arch("block_count")),
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": int(self._arch("attention.key_length", self._arch("rope.dimension_count",
                                                                          hidden // self.num_heads))),
            "max_position_embeddings": int(self._arch("context_length", 2048)),
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_parameters": rope,
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
        }
        for key, field_name in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id"),
                                ("unknown", "unk_token_id")):
            token_id = self.metadata.get(f"tokenizer.ggml.{key}_token_id")
            if token_id is not None:
                fields[field_name] = int(token_id)
        return fields

    # --- tensors --------------------------------------------------------------------------------------

    def stored_types(self) -> dict[str, tuple[str, GGMLQuantizationType]]:
        """Our name -> (the file's name, the type it is stored as), from the header alone."""
        return {name: (t.name, GGMLQuantizationType(t.tensor_type)) for name, t in self._tensors.items()}

    def tensor_names(self) -> list[str]:
        """Our names of every tensor in the file, in file order."""
        return list(self._tensors)

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """For q_proj/k_proj: HF row i is the file's row order[i] (llama.cpp's per-head RoPE permutation
        undone); None for every other tensor."""
        if ".self_attn.q_proj." in name:
            heads = self.num_heads
        elif ".self_attn.k_proj." in name:
            heads = self.num_kv_heads
        else:
            return None
        # The file's rows of one head are [half, 2] (pairs interleaved); HF's are [2, half].
        return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)

    def raw(self, name: str) -> RawTensor:
        """Tensor `name` (ours) as stored: quantized blocks stay quantized (rows reordered as `dense`'s)."""
        t = self._tensor(name)
        shape = tuple(reversed(t.shape))  # ggml lists the fastest dimension first
        data = torch.from_numpy(np.array(t.data, copy=True))  # off the read-only map: torch wants it writable
        order = self._row_order(name, shape[0])
        if order is not None:
            data = data[order]
        return RawTensor(name, GGMLQuantizationType(t.tensor_type), shape, data)

    def dense(self, name: str) -> torch.Tensor:
        """Tensor `name` (ours) dequantized to float32, rows in HF order."""
        t = self._tensor(name)
        shape = tuple(reversed(t.shape))
        values = np.array(dequantize(t.data, GGMLQuantizationType(t.tensor_type)), dtype=np.float32, copy=True)
        out = torch.from_numpy(values).reshape(shape)
        order = self._row_order(name, shape[0])
        return out if order is None else out[order].contiguous()

    def iter_dense(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._tensors:
            yield name, self.dense(name)

    def _tensor(self, name: str) -> _TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {name!r}") from None
