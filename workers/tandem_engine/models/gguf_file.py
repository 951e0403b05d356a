"""One GGUF file, parsed once: the model config its metadata describes, and its tensors under our names,
dequantized to float32 or as the file stores them.

Built on llama.cpp's own reader (the `gguf` package): opening the file parses its header (metadata and
tensor table) once; tensor data stays memory-mapped and is read only when a tensor is asked for. The
tokenizer the metadata describes is built in gguf_tokenizer.py from `GGUFFile.metadata`.

Tensor names are our model's (HF Llama's: `model.layers.3.self_attn.q_proj.weight`). llama.cpp stores
the rows of q_proj and k_proj permuted per head for its RoPE layout (the two halves of each head
interleaved); both `dense` and `raw` give them back in HF order. The permutation moves whole rows, and
quantization blocks run along a row, so the raw quantized rows can be reordered like the dense ones.
See docs/architecture.md, "Start-up and the model cache".
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

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


def _scalar(value: Any) -> Any:
    """numpy scalars (the reader's) as Python ones, so configs serialise to plain JSON."""
    return value.item() if isinstance(value, np.generic) else value


class GGUFFile:
    """The header of `path`, parsed on construction; tensors read on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        reader = GGUFReader(path)
        self.metadata: dict[str, Any] = {}
        for key, fld in reader.fields.items():
            value = fld.contents()
            self.metadata[key] = [_scalar(v) for v in value] if isinstance(value, list) else _scalar(value)
        self.architecture = str(self.metadata.get("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"{path}: GGUF architecture {self.architecture!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
        self._tensors: dict[str, Any] = {}  # our name -> the reader's tensor
        for t in reader.tensors:
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
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml lists the fastest dimension first
        data = torch.from_numpy(np.array(t.data, copy=True))  # off the read-only map: torch wants it writable
        order = self._row_order(name, shape[0])
        if order is not None:
            data = data[order]
        return RawTensor(name, GGMLQuantizationType(t.tensor_type), shape, data)

    def dense(self, name: str) -> torch.Tensor:
        """Tensor `name` (ours) dequantized to float32, rows in HF order."""
        t = self._tensor(name)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        values = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True)
        out = torch.from_numpy(values).reshape(shape)
        order = self._row_order(name, shape[0])
        return out if order is None else out[order].contiguous()

    def iter_dense(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._tensors:
            yield name, self.dense(name)

    def _tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {name!r}") from None
