"""`--quantization gguf`: load a GGUF file into the model keeping the file's own quantized blocks
(docs/architecture.md, "GGUF weight-only quantization").

Every projection whose tensors are Q4_1 or Q8_0 runs the C kernel over those blocks (q|k|v and gate|up
fused by concatenating rows of blocks); a quantized embedding table is dequantized row by row when looked
up and, tied or not, a quantized head runs the kernel too: SmolLM2's tied Q8_0 table is the largest
tensor, and a float32 head would stream 4x its bytes on every decode step. F32 and F16 tensors (the
norms) are loaded as float32 as usual. No dense safetensors copy of the model is built or read.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import cast

import torch

from tandem_engine.kernels.gguf_matmul import (
    DENSE_FROM_ROWS,
    HEAD_DENSE_FROM_ROWS,
    GGUFEmbedding,
    GGUFKernel,
    GGUFLinear,
    QuantizedWeight,
    load_gguf_kernel,
)
from tandem_engine.kernels.panel_matmul import DenseBlocks
from tandem_engine.models.gguf_weights import KERNEL_TYPES, GGUFTensor, read_gguf_tensors
from tandem_engine.models.llama import DecoderLayer, LlamaForCausalLM
from tandem_engine.models.quantization import check_supported

logger = logging.getLogger(__name__)

# The model's fused projections and the checkpoint tensors they are made of, in row order.
_FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
          "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def _weight(t: GGUFTensor) -> QuantizedWeight:
    return QuantizedWeight(t.qtype, torch.from_numpy(t.data), t.shape[1])


def _quantize_layer(layer: DecoderLayer, index: int, quantized: dict[str, GGUFTensor], kernel: GGUFKernel) -> None:
    """Swap in the kernel for every projection of layer `index` made of quantized tensors."""
    for proj, members in _FUSED.items():
        names = [f"model.layers.{index}.{m}.weight" for m in members]
        found = [quantized.get(n) for n in names]
        if all(t is None for t in found):
            continue  # float tensors: the dense projection loads them
        if any(t is None for t in found):
            raise ValueError(f"--quantization gguf: layer {index}'s {proj} projection mixes quantized and float "
                             f"tensors ({', '.join(t.gguf_name for t in found if t is not None)} quantized)")
        parts = [_weight(cast(GGUFTensor, t)) for t in found]
        layer.set_quantized(proj, GGUFLinear(parts, layer.projections()[proj][1], kernel))


def dense_blocks(path: Path, num_layers: int, tied: bool) -> DenseBlocks:
    """The blocks of GGUF file `path` behind a dense model of `num_layers` layers; a projection any of whose
    tensors is not Q4_1 or Q8_0 has none (it keeps float panels)."""
    quantized = {t.name: t for t in read_gguf_tensors(path, only_blocks=True)}
    layers = []
    for index in range(num_layers):
        found = {proj: [quantized.get(f"model.layers.{index}.{m}.weight") for m in members]
                 for proj, members in _FUSED.items()}
        layers.append({proj: [_weight(t) for t in ts if t is not None] for proj, ts in found.items()
                       if all(t is not None for t in ts)})
    head = quantized.get("lm_head.weight") or (quantized.get("model.embed_tokens.weight") if tied else None)
    return DenseBlocks(layers, None if head is None else _weight(head))


def load_gguf_quantized(model: LlamaForCausalLM, path: Path, cache_dir: Path) -> None:
    """Fill `model` (just constructed, float32, on the CPU) from the GGUF file `path`; the kernel is built
    under `cache_dir`. ValueError naming a tensor that cannot be served."""
    check_supported("gguf", model.dtype, model.embed_tokens.device)
    kernel = load_gguf_kernel(cache_dir)
    tensors = read_gguf_tensors(path)
    quantized = {t.name: t for t in tensors if t.qtype in KERNEL_TYPES}
    for i, layer in enumerate(model.layers):
        _quantize_layer(cast(DecoderLayer, layer), i, quantized, kernel)
    embed = quantized.get("model.embed_tokens.weight")
    head = quantized.get("lm_head.weight") or (embed if model.tie_word_embeddings else None)
    if embed is not None:
        model.set_quantized_embedding(GGUFEmbedding(_weight(embed), kernel))
    if head is not None:
        model.set_quantized_head(GGUFLinear([_weight(head)], None, kernel, HEAD_DENSE_FROM_ROWS))
    model.load_weights((t.name, torch.from_numpy(t.data)) for t in tensors if t.qtype not in KERNEL_TYPES)
    model.quantization = "gguf"
    kinds = Counter(t.type_name for t in tensors)
    nbytes = sum(t.data.nbytes for t in quantized.values())
    isa = ("AVX-512 VNNI" if kernel.vnni else "AVX2") if kernel.simd else "portable"
    logger.info("[startup] --quantization gguf: %s tensors of %s served from their blocks (%.1f MiB, %s kernel, "
                "int8 activations below %d rows); embedding %s, head %s",
                ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())), path.name, nbytes / 2**20, isa,
                DENSE_FROM_ROWS,
                f"{embed.type_name} rows dequantized per lookup" if embed is not None else "float32",
                "float32" if head is None else f"{head.type_name} kernel" + " (tied)" * model.tie_word_embeddings)
