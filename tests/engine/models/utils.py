"""Builders for model tests: a tiny Llama written as a GGUF file the way llama.cpp's converter lays it
out (its tensor names, q/k rows permuted per head for its RoPE, chosen tensors quantized), with a small
byte-level BPE vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from tokenizers import pre_tokenizers

# Sizes off the usual powers of two; rows and columns of quantized tensors are multiples of 32 (a block).
TINY = dict(vocab=300, hidden=96, intermediate=160, layers=2, heads=6, kv_heads=3, context=128)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "e n", "a t"]


def tiny_vocab() -> tuple[list[str], list[int]]:
    """SPECIALS, the 256 byte-level characters, the results of MERGES, then plain filler tokens: `vocab`
    tokens in all, and their llama.cpp token types."""
    tokens = [*SPECIALS, *pre_tokenizers.ByteLevel.alphabet()]
    tokens += [m.replace(" ", "") for m in MERGES]
    tokens += [f"<filler{i}>" for i in range(TINY["vocab"] - len(tokens))]
    types = [TokenType.CONTROL] * len(SPECIALS) + [TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    return tokens, [int(t) for t in types]


def tiny_weights(seed: int = 0, tie: bool = True) -> dict[str, torch.Tensor]:
    """Random float32 weights under HF Llama's names."""
    g = torch.Generator().manual_seed(seed)
    h, f, v = TINY["hidden"], TINY["intermediate"], TINY["vocab"]
    d = h // TINY["heads"]
    kv = TINY["kv_heads"] * d

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    out = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": 1 + w(h)}
    if not tie:
        out["lm_head.weight"] = w(v, h)
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": 1 + w(h), p + "post_attention_layernorm.weight": 1 + w(h),
            p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h),
            p + "mlp.down_proj.weight": w(h, f),
        }
    return out


def llama_cpp_layout(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows as llama.cpp's converter stores them: each head's two rotary halves interleaved."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    base = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if name in base:
        return base[name]
    _, _, layer, rest = name.split(".", 3)
    part, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{_GGUF_NAMES[part]}.{suffix}"


def write_tiny_gguf(path: Path, weights: dict[str, torch.Tensor],
                    qtypes: dict[str, GGMLQuantizationType] | None = None, arch: str = "llama",
                    **metadata: Any) -> Path:
    """Write `weights` (HF names) as a GGUF of architecture `arch`; `qtypes` maps names to a quantized
    type (the rest stay F32). Extra `metadata` keys are added as strings."""
    qtypes = qtypes or {}
    w = GGUFWriter(path, arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(TINY["context"])
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["intermediate"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(TINY["hidden"] // TINY["heads"])
    w.add_vocab_size(TINY["vocab"])
    tokens, types = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for key, value in metadata.items():
        w.add_string(key, value)
    for name, t in weights.items():
        if ".q_proj." in name:
            t = llama_cpp_layout(t, TINY["heads"])
        elif ".k_proj." in name:
            t = llama_cpp_layout(t, TINY["kv_heads"])
        array = t.numpy().astype(np.float32)
        qtype = qtypes.get(name)
        if qtype is None:
            w.add_tensor(gguf_name(name), array)
        else:
            blocks = quantize(array, qtype)
            w.add_tensor(gguf_name(name), blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
