"""Which native model class serves which HF architecture."""

from __future__ import annotations

from typing import Any

from tandem_engine.models.llama import LlamaForCausalLM

# All four share one implementation; Qwen2 differs by its qkv bias, Qwen3 by per-head q/k RMSNorm.
_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def get_model_class(config: Any) -> type[LlamaForCausalLM]:
    """config: a transformers config or loader.ResolvedConfig (attributes only)."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and config.model_type in _MODEL_TYPES:
        archs = [_MODEL_TYPES[config.model_type]]
    for arch in archs:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ValueError(
        f"unsupported architecture {archs or config.model_type!r}; supported: {', '.join(_ARCHITECTURES)}"
    )
