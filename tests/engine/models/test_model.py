"""Native Llama-family model vs transformers on the same random weights (float32).

Each family runs prompts through the paged cache in mixed steps (chunked prefill with cached context
next to decode rows) and must produce transformers' greedy tokens with logits within 1e-4, with torch's
norms and activation and with the fused C kernels.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem_engine.attention.cpu_backend import CpuAttentionBackend
from tandem_engine.kernels.fused import load_fused_ops
from tandem_engine.models.llama import LlamaForCausalLM
from tandem_engine.models.registry import get_model_class
from tandem_engine.worker.decode_step import fuse_decode_steps
from tests.engine.utils import hf_greedy, kv_caches, make_meta, paged_greedy, tiny_config

BS = 4
ATOL = 1e-4

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama_tied_llama3_rope": (
        "llama",
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def build_pair(name: str) -> tuple[Any, LlamaForCausalLM]:
    """A transformers model with random, not-too-small weights, and ours loaded from its state dict."""
    from transformers import AutoModelForCausalLM

    family, overrides = CONFIGS[name]
    cfg = tiny_config(family, **overrides)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            # Norm weights near 1 (so a missing norm shows), everything else large enough that greedy
            # choices are not near-ties.
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in pname else 0.15 * torch.randn_like(p))
    ours = get_model_class(cfg)(cfg, torch.float32)
    ours.load_weights(hf.state_dict().items())
    return hf, ours


@pytest.mark.parametrize("name", CONFIGS)
def test_prompt_logits_match_transformers(name: str) -> None:
    hf, ours = build_pair(name)
    prompt = torch.randint(3, 128, (13,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(prompt[None]).logits[0]  # [13, vocab]
    spec = ours.kv_cache_spec(ours.config)
    caches = kv_caches(spec.num_layers, 8, BS, spec.num_kv_heads, spec.head_dim, torch.float32)
    meta = make_meta([13], [13], [[5, 2, 7, 1]], BS)
    got = ours.compute_logits(ours(prompt, torch.arange(13), caches, meta, CpuAttentionBackend()))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("fused", ["none", "kernels", "step"], ids=["torch-ops", "fused-kernels", "fused-step"])
@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_decode_matches_transformers(name: str, fused: str, kernel_cache: Path) -> None:
    """fused-step: decode steps in one C call on the float32 panel kernel (worker/decode_step.py), where the
    family allows it (not Qwen2's biases or Qwen3's per-head q/k norms)."""
    hf, ours = build_pair(name)
    if fused != "none":
        ours.use_fused_ops(load_fused_ops(kernel_cache))
        assert ours.ops.native or shutil.which(os.environ.get("CC", "cc")) is None
    if fused == "step" and ours.ops.native:
        backend = CpuAttentionBackend(use_kernel=True, cache_dir=kernel_cache)
        why = fuse_decode_steps(ours, backend, torch.float32, kernel_cache)
        assert why == {"qwen2": "a qkv projection with a bias",
                       "qwen3": "q and k are RMS-normalised per head (Qwen3)"}.get(name)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (11, 3, 7)]
    max_new = 10
    got, got_logits = paged_greedy(ours, prompts, max_new, chunk=4)
    for i, prompt in enumerate(prompts):
        ref, ref_logits = hf_greedy(hf, prompt, max_new)
        assert got[i] == ref, f"prompt {i}"
        for a, b in zip(got_logits[i], ref_logits, strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_kv_cache_spec_and_missing_weights_are_reported() -> None:
    cfg = tiny_config("qwen3")
    spec = LlamaForCausalLM.kv_cache_spec(cfg)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 16)
    hf, _ = build_pair("qwen3")
    partial = [(n, t) for n, t in hf.state_dict().items() if "k_norm" not in n]
    with pytest.raises(ValueError, match="k_norm"):
        LlamaForCausalLM(cfg, torch.float32).load_weights(partial)
    with pytest.raises(ValueError, match="unexpected"):
        LlamaForCausalLM(cfg, torch.float32).load_weights([("model.layers.0.foo.weight", torch.zeros(1))])
