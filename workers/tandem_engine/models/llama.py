"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Written for few, large tensor ops per layer: q/k/v are one fused projection and gate/up another (the
checkpoint's separate weights are copied into slices of the fused ones at load time), RoPE indexes a
precomputed cos/sin table by position, and attention is delegated to an `AttentionBackend`.
Qwen2 adds a bias to q/k/v; Qwen3 RMS-normalises every q and k head before RoPE.
"""

from __future__ import annotations

import logging
import math
import platform
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from tandem_engine.kernels.amx_matmul import AmxBlockLinear, AmxKernel, AmxLinear
from tandem_engine.kernels.build import cpu_flags
from tandem_engine.kernels.fused import TORCH_OPS, FusedOps
from tandem_engine.kernels.gguf_matmul import GGUFKernel, GGUFLinear, QuantizedWeight, load_gguf_kernel
from tandem_engine.kernels.panel_matmul import DenseBlocks, PanelKernel, PanelLinear
from tandem_engine.models.packed_linear import packing_supported
from tandem_engine.models.projection import Head, Projection, free
from tandem_engine.models.quantization import (
    Q8_0_BLOCK,
    Int8Linear,
    QuantizedLinear,
    check_supported,
    int8_on_blocks,
    q8_0_blocks,
)

if TYPE_CHECKING:  # the model is handed its attention backend; it imports no backend
    from tandem_engine.attention.interface import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int


def _head_dim(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _kv_heads(cfg: Any) -> int:
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def _rope_parameters(cfg: Any) -> dict[str, Any]:
    """transformers 5 keeps RoPE settings in `rope_parameters`; older configs use rope_theta/rope_scaling."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(scaling, dict):
        for k, v in scaling.items():
            params.setdefault(k, v)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return params


def rope_inv_freq(cfg: Any) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with linear or llama3-style scaling if configured."""
    p = _rope_parameters(cfg)
    dim = _head_dim(cfg)
    theta = float(p["rope_theta"])
    inv_freq: torch.Tensor = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = p["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(p["factor"])
    if kind == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_len = p["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope_type {kind!r} is not supported (default, linear, llama3 are)")


class DecodeStep(Protocol):
    """A whole step in one call (worker/decode_step.py): the embedded tokens x [T, hidden] through every layer
    and the final norm, as the layer loop computes it."""

    row_limit: int  # steps of this many rows or more run op by op
    chunk_row_limit: int  # and steps with a prefill chunk of this many rows or more
    kind: str  # what its projections run on

    def refusal(self, meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
        """Why this step must run op by op, or None."""

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata) -> torch.Tensor: ...


def _param(shape: tuple[int, ...], dtype: torch.dtype, transposed: bool = False) -> nn.Parameter:
    """An uninitialised weight. `transposed` keeps a [out, in] weight in [in, out] storage. Measured on
    SmolLM2 shapes with weights streamed from memory (as in a decode step): F.linear runs 1.2-2x faster
    on qkv, o, gate_up and lm_head for 1-16 rows that way and the same for larger batches; only
    down_proj (the long input dim) was slower, so it keeps [out, in]."""
    if transposed:
        return nn.Parameter(torch.empty(shape[1], shape[0], dtype=dtype).t(), requires_grad=False)
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = cfg.hidden_size, _head_dim(cfg)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, _kv_heads(cfg), d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.inter = cfg.intermediate_size
        self.eps = float(cfg.rms_norm_eps)
        self.scale = d**-0.5
        qkv_bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        mlp_bias = bool(getattr(cfg, "mlp_bias", False))

        def param(*shape: int) -> nn.Parameter:
            return _param(shape, dtype)

        self.input_norm = param(h)
        self.post_attn_norm = param(h)
        self.qkv_weight = _param(
            (self.q_size + 2 * self.kv_size, h), dtype, transposed=True
        )  # rows: q | k | v
        self.qkv_bias = param(self.q_size + 2 * self.kv_size) if qkv_bias else None
        self.o_weight = _param((h, self.q_size), dtype, transposed=True)
        self.o_bias = param(h) if getattr(cfg, "attention_bias", False) else None
        self.gate_up_weight = _param((2 * self.inter, h), dtype, transposed=True)  # rows: gate | up
        self.gate_up_bias = param(2 * self.inter) if mlp_bias else None
        self.down_weight = param(h, self.inter)
        self.down_bias = param(h) if mlp_bias else None
        self.qk_norm = cfg.model_type == "qwen3"
        self.q_norm = param(d) if self.qk_norm else None
        self.k_norm = param(d) if self.qk_norm else None
        # Each projection with the forms of its weight made after loading and the choice among them.
        self.proj = {name: Projection(name, w, b) for name, (w, b) in self.projections().items()}

    # Views of the forms the projections hold, by projection name (read only: the Projections own them).
    @property
    def quantized(self) -> dict[str, QuantizedLinear]:
        """Quantized projections replacing the dense ones (`--quantization`)."""
        return {n: p.quantized for n, p in self.proj.items() if p.quantized is not None}

    @property
    def packed(self) -> dict[str, torch.Tensor | None]:
        """oneDNN-packed copies, where packing was decided (None: not packed)."""
        return {n: p.packed for n, p in self.proj.items() if p.pack_decided}

    @property
    def panels(self) -> dict[str, PanelLinear]:
        """float32 panel copies (kernels/panel_matmul.py), for the whole-step kernel and small matmuls."""
        return {n: p.panels for n, p in self.proj.items() if p.panels is not None}

    @property
    def amx(self) -> dict[str, AmxLinear]:
        """AMX copies of a bfloat16 model's projections (kernels/amx_matmul.py)."""
        return {n: p.amx for n, p in self.proj.items() if p.amx is not None}

    @property
    def amx_f32(self) -> dict[str, AmxBlockLinear]:
        """float32 AMX copies over the GGUF blocks, for matmuls of AMX_F32_FROM_ROWS rows or more."""
        return {n: p.amx_f32 for n, p in self.proj.items() if p.amx_f32 is not None}

    def projections(self) -> dict[str, tuple[nn.Parameter, nn.Parameter | None]]:
        """(weight [out, in], bias) of each projection, by name."""
        return {"qkv": (self.qkv_weight, self.qkv_bias), "o": (self.o_weight, self.o_bias),
                "gate_up": (self.gate_up_weight, self.gate_up_bias), "down": (self.down_weight, self.down_bias)}

    def prepack(self) -> None:
        for p in self.proj.values():
            p.prepack()

    def quantize_int8(self, kernel: GGUFKernel | None = None) -> None:
        """Replace every projection by its int8 form: Q8_0 blocks on `kernel` where given (and the input size
        is a multiple of 32), else torch's int8 matmul (quantization.py)."""
        for p in self.proj.values():
            if kernel is not None and p.weight.shape[1] % Q8_0_BLOCK == 0:
                p.quantize(GGUFLinear([q8_0_blocks(p.weight)], p.bias, kernel))
            else:
                p.quantize(Int8Linear(p.weight, p.bias))

    def set_quantized(self, name: str, layer: QuantizedLinear) -> None:
        """Run projection `name` through `layer` and free its dense weight (its shape becomes [0])."""
        self.proj[name].quantize(layer)

    def use_panels(self, kernel: PanelKernel, blocks: dict[str, list[QuantizedWeight]] | None = None,
                   keep_floats: bool = False) -> None:
        """Panel copies of the dense projections (Projection.use_panels), from `blocks` where it has a
        projection's GGUF blocks. Copies made already are kept (a second ModelRunner over the same model)."""
        for name, p in self.proj.items():
            p.use_panels(kernel, (blocks or {}).get(name), keep_floats)

    def use_amx(self, kernel: AmxKernel) -> None:
        """Run the bfloat16 projections on AMX copies for float32 rows, and keep the norms' weights in float32:
        the layer then computes in float32 but for its matmuls' bfloat16 inputs."""
        for p in self.proj.values():
            p.use_amx(kernel)
        for norm in (self.input_norm, self.post_attn_norm, self.q_norm, self.k_norm):
            if norm is not None:
                norm.data = norm.data.float()

    def use_amx_f32(self, kernel: AmxKernel, blocks: dict[str, list[QuantizedWeight]]) -> None:
        """float32 AMX copies of the projections whose panels keep `blocks` (Projection.use_amx_f32)."""
        for name, p in self.proj.items():
            p.use_amx_f32(kernel, blocks.get(name))

    def shard(self, name: str) -> tuple[torch.Tensor, int, int] | None:
        """Where checkpoint tensor `name` (relative to the layer) goes: (param, row start, row end)."""
        q, kv, i = self.q_size, self.kv_size, self.inter
        table: dict[str, tuple[torch.Tensor | None, int, int]] = {
            "input_layernorm.weight": (self.input_norm, 0, -1),
            "post_attention_layernorm.weight": (self.post_attn_norm, 0, -1),
            "self_attn.q_proj.weight": (self.qkv_weight, 0, q),
            "self_attn.k_proj.weight": (self.qkv_weight, q, q + kv),
            "self_attn.v_proj.weight": (self.qkv_weight, q + kv, q + 2 * kv),
            "self_attn.q_proj.bias": (self.qkv_bias, 0, q),
            "self_attn.k_proj.bias": (self.qkv_bias, q, q + kv),
            "self_attn.v_proj.bias": (self.qkv_bias, q + kv, q + 2 * kv),
            "self_attn.o_proj.weight": (self.o_weight, 0, -1),
            "self_attn.o_proj.bias": (self.o_bias, 0, -1),
            "self_attn.q_norm.weight": (self.q_norm, 0, -1),
            "self_attn.k_norm.weight": (self.k_norm, 0, -1),
            "mlp.gate_proj.weight": (self.gate_up_weight, 0, i),
            "mlp.up_proj.weight": (self.gate_up_weight, i, 2 * i),
            "mlp.gate_proj.bias": (self.gate_up_bias, 0, i),
            "mlp.up_proj.bias": (self.gate_up_bias, i, 2 * i),
            "mlp.down_proj.weight": (self.down_weight, 0, -1),
            "mlp.down_proj.bias": (self.down_bias, 0, -1),
        }
        p, start, end = table.get(name, (None, 0, 0))
        if p is None:
            return None
        return p, start, (p.shape[0] if end < 0 else end)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] residual stream, updated in place
        h: torch.Tensor,  # [T, hidden] x through this layer's input norm
        next_norm: torch.Tensor,  # [hidden] the next layer's input norm (the model's final norm after the last)
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: FusedOps,
    ) -> torch.Tensor:  # [T, hidden] the updated x through `next_norm`
        t = x.shape[0]
        qkv = self.proj["qkv"](h)  # [T, q_size + 2 * kv_size]
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv[:, self.q_size + self.kv_size :].view(t, nkv, d)
        if self.qk_norm:
            q = F.rms_norm(qkv[:, : self.q_size].view(t, nq, d), (d,), self.q_norm, self.eps)
            k = F.rms_norm(
                qkv[:, self.q_size : self.q_size + self.kv_size].view(t, nkv, d), (d,), self.k_norm, self.eps
            )
            q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        else:
            qk = ops.rope(qkv[:, : self.q_size + self.kv_size].view(t, nq + nkv, d), cos, sin)
            q, k = qk[:, :nq], qk[:, nq:]  # [T, nq, D], [T, nkv, D]
        k_cache, v_cache = kv_cache
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = backend.forward(q, k_cache, v_cache, meta, self.scale)  # [T, nq, D]
        # Each residual add is fused with the norm that reads its result (kernels/fused.py).
        o = self.proj["o"](o.reshape(t, self.q_size))
        h = ops.add_rms_norm(x, o, self.post_attn_norm, self.eps)
        gu = self.proj["gate_up"](h)  # [T, 2 * inter]
        act = ops.silu_mul(gu)  # [T, inter]
        return ops.add_rms_norm(x, self.proj["down"](act), next_norm, self.eps)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class LlamaForCausalLM(nn.Module):
    rope_cos: torch.Tensor  # [max_positions, D] buffers: (cos, cos) and (-sin, sin)
    rope_sin: torch.Tensor

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        cfg = hf_config
        self.config, self.dtype = cfg, dtype
        spec = self.kv_cache_spec(cfg)
        self.num_layers, self.num_kv_heads, self.head_dim = spec.num_layers, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.hidden_size, self.vocab_size = (
            cfg.num_attention_heads,
            cfg.hidden_size,
            cfg.vocab_size,
        )
        self.eps = float(cfg.rms_norm_eps)
        window = getattr(cfg, "sliding_window", None)
        if window and (getattr(cfg, "use_sliding_window", True) or cfg.model_type == "mistral"):
            # Full attention is exact up to the window; past it the model would need a windowed mask.
            logger.warning(
                "%s: sliding_window=%s is not implemented; keep max_model_len <= %s",
                cfg.model_type,
                window,
                window,
            )
        self.embed_tokens = _param((cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = _param((cfg.hidden_size,), dtype)
        # What the residual stream and every op but the matmuls compute in: the weights' dtype, or float32
        # for a bfloat16 model on AMX (`use_amx`).
        self.act_dtype = dtype
        self.ops = TORCH_OPS  # norms and activation: torch's ops until `use_fused_ops` (kernels/fused.py)
        self.quantization = "none"  # what `--quantization` made of the projections
        # A quantized embedding lookup ([T] ids -> [T, hidden]) and head replacing the dense ones.
        self.quantized_embedding: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.decode_step: DecodeStep | None = None  # runs the decode steps it takes (worker/decode_step.py)
        # The GGUF file the dense weights were dequantized from (load_model), whose blocks the decode step's
        # panels keep (use_panels); None for a safetensors checkpoint.
        self.gguf_file: Path | None = None
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # Its own copy even when tied: the embedding wants [vocab, hidden] rows, the head transposed storage.
        self.lm_head = _param((cfg.vocab_size, cfg.hidden_size), dtype, transposed=True)
        self.head = Head(self.lm_head, self.embed_tokens if self.tie_word_embeddings else None)
        # RoPE tables [max_positions, D] in the model dtype, as HF applies them.
        max_pos = int(getattr(cfg, "max_position_embeddings", 8192))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), rope_inv_freq(cfg))
        cos, sin = freqs.cos(), freqs.sin()
        self.register_buffer("rope_cos", torch.cat((cos, cos), -1).to(dtype), persistent=False)
        self.register_buffer("rope_sin", torch.cat((-sin, sin), -1).to(dtype), persistent=False)

    @classmethod
    def kv_cache_spec(cls, hf_config: Any) -> KVCacheSpec:
        return KVCacheSpec(hf_config.num_hidden_layers, _kv_heads(hf_config), _head_dim(hf_config))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, [num_blocks, block_size, nkv, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]
        # [T, hidden], a fresh tensor we may update in place
        if self.quantized_embedding is not None:
            x = self.quantized_embedding(input_ids)
        else:
            x = F.embedding(input_ids, self.embed_tokens)
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        if self.decode_step is not None and self.decode_step.refusal(meta, kv_caches) is None:
            return self.decode_step(x, positions, kv_caches, meta)
        cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.rope_sin[positions].unsqueeze(1)
        layers = [cast(DecoderLayer, layer) for layer in self.layers]
        # Every layer ends with its residual add fused into the norm after it: the next layer's input norm,
        # or the final one.
        h = self.ops.add_rms_norm(x, None, layers[0].input_norm, self.eps)
        next_norms = [layer.input_norm for layer in layers[1:]] + [self.norm]
        for layer, kv, norm in zip(layers, kv_caches, next_norms, strict=True):
            h = layer(x, h, norm, cos, sin, kv, meta, backend, self.ops)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.head(hidden)

    # The head's forms, read-only (Head holds them).
    @property
    def quantized_head(self) -> QuantizedLinear | None:
        return self.head.quantized

    @property
    def packed_lm_head(self) -> torch.Tensor | None:
        return self.head.packed

    @property
    def panel_head(self) -> PanelLinear | None:
        return self.head.panels

    @property
    def amx_head(self) -> AmxLinear | None:
        return self.head.amx

    @property
    def amx_f32_head(self) -> AmxBlockLinear | None:
        return self.head.amx_f32

    def use_panels(self, kernel: PanelKernel, blocks: DenseBlocks | None = None,
                   keep_floats: bool = False) -> None:
        """Run the dense projections' matmuls of up to `kernel.max_rows` rows, and the head's of any, on float32
        panel copies (kernels/panel_matmul.py): for the fused decode step, which runs every projection on them. The head
        was measured as fast or faster that way from 1 to 64 rows than on each of its other copies, so they
        are freed (their shape becomes [0]). Copies made already are kept. `blocks`: the GGUF blocks the
        weights were dequantized from, which the panels keep instead where they can, with float panels beside
        them as `keep_floats` says (PanelLinear)."""
        for i, layer in enumerate(self.layers):
            cast(DecoderLayer, layer).use_panels(kernel, None if blocks is None else blocks.layers[i], keep_floats)
        self.head.use_panels(kernel, None if blocks is None or blocks.head is None else [blocks.head], keep_floats)

    def use_amx(self, kernel: AmxKernel) -> None:
        """A bfloat16 model on a CPU with AMX: its projections and head on the AMX kernel (kernels/amx_matmul.py)
        and everything else in float32 (the norms' weights and the RoPE tables widened from bfloat16, exactly),
        so that only the matmuls' inputs (and the KV cache) are rounded to bfloat16. Idempotent."""
        for layer in self.layers:
            cast(DecoderLayer, layer).use_amx(kernel)
        self.head.use_amx(kernel)
        self.norm.data = self.norm.data.float()
        self.rope_cos, self.rope_sin = self.rope_cos.float(), self.rope_sin.float()
        self.act_dtype = torch.float32

    @property
    def uses_amx_float32(self) -> bool:
        """Whether projections run on the float32 AMX kernel (`use_amx_f32`)."""
        return any(cast(DecoderLayer, layer).amx_f32 for layer in self.layers)

    def use_amx_f32(self, kernel: AmxKernel, blocks: DenseBlocks) -> None:
        """After `use_panels` with `blocks`: float32 AMX copies of the projections and the head whose panels
        keep their blocks, for matmuls of AMX_F32_FROM_ROWS rows or more (kernels/amx_matmul.py: float32
        arithmetic, each x split into three bfloat16 parts). Idempotent."""
        for i, layer in enumerate(self.layers):
            cast(DecoderLayer, layer).use_amx_f32(kernel, blocks.layers[i])
        self.head.use_amx_f32(kernel, None if blocks.head is None else [blocks.head])

    def use_fused_ops(self, ops: FusedOps) -> None:
        """Run the residual adds, norms and activation through `ops` (the C kernels where they apply)."""
        self.ops = ops

    @torch.no_grad()
    def quantize(self, method: str, device: torch.device, cache_dir: Path) -> None:
        """Quantize the decoder's projections (`--quantization`, models/quantization.py); "none": no-op.
        int8 on a CPU without an int8 dot product takes Q8_0 blocks and the GGUF kernels, built under
        `cache_dir`."""
        if method == "none":
            return
        check_supported(method, self.dtype, device)
        kernel = None
        if method == "int8" and int8_on_blocks(platform.machine(), cpu_flags()):
            try:
                kernel = load_gguf_kernel(cache_dir)
            except RuntimeError as e:
                logger.warning("--quantization int8 falls back to torch's int8 matmul, which runs many times "
                               "slower than float32 on this CPU (no int8 dot-product instruction): %s", e)
        for layer in self.layers:
            cast(DecoderLayer, layer).quantize_int8(kernel)
        self.quantization = method
        if kernel is not None:
            logger.info("[startup] --quantization int8: projections in Q8_0 blocks on the %s GGUF kernel "
                        "(no int8 dot-product instruction here for torch's int8 matmul)",
                        "AVX2" if kernel.simd else "portable")

    def prepack(self, device: torch.device) -> None:
        """Make oneDNN-packed copies of every projection and the head, where that is faster."""
        if not packing_supported(self.dtype, device):
            return
        for layer in self.layers:
            cast(DecoderLayer, layer).prepack()
        self.head.prepack()

    def set_quantized_embedding(self, embedding: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Look tokens up through `embedding` and free the dense table (its shape becomes [0])."""
        self.quantized_embedding = embedding
        free(self.embed_tokens)

    def set_quantized_head(self, head: QuantizedLinear) -> None:
        """Compute logits through `head` and free the dense head (its shape becomes [0])."""
        self.head.quantize(head)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into our (fused) parameters; fail on anything missing."""
        expected = {id(p): n for n, p in self.named_parameters()}
        filled: dict[int, int] = {}  # id(param) -> rows filled
        for name, tensor in weights:
            for p, start, end in self._targets(name):
                if tensor.shape[0] != end - start or tensor.shape[1:] != p.shape[1:]:
                    raise ValueError(
                        f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(p.shape)}[{start}:{end}]"
                    )
                p[start:end].copy_(tensor)
                filled[id(p)] = filled.get(id(p), 0) + end - start
        missing = [n for i, n in expected.items() if filled.get(i, 0) != self._param_rows(n)]
        if missing:
            raise ValueError(f"checkpoint left parameters unfilled: {missing[:8]}")

    def _param_rows(self, name: str) -> int:
        return int(self.get_parameter(name).shape[0])

    def _targets(self, name: str) -> list[tuple[torch.Tensor, int, int]]:
        """Where checkpoint tensor `name` goes: (param, row start, row end) for each copy."""
        if name.endswith("rotary_emb.inv_freq"):
            return []
        if name == "model.embed_tokens.weight":
            embed = (self.embed_tokens, 0, self.vocab_size)
            return [embed, (self.lm_head, 0, self.vocab_size)] if self.tie_word_embeddings else [embed]
        if name == "model.norm.weight":
            return [(self.norm, 0, self.hidden_size)]
        if name == "lm_head.weight":
            return [] if self.tie_word_embeddings else [(self.lm_head, 0, self.vocab_size)]
        m = _LAYER_RE.match(name)
        if m is not None and int(m.group(1)) < self.num_layers:
            dst = cast(DecoderLayer, self.layers[int(m.group(1))]).shard(m.group(2))
            if dst is not None:
                return [dst]
        raise ValueError(f"unexpected checkpoint tensor {name!r}")
