"""Every decision about the forms of a loaded model's weights, made once and logged (what vLLM calls
`process_weights_after_loading`): the fused C ops, the whole-step kernel and the copies it runs on (float32
panels, AMX), then oneDNN's packed copies of what no other form takes. Nothing is predicted and undone: the
packing comes last, so it sees what the step kernel took (docs/architecture.md, "CPU kernels")."""

from __future__ import annotations

import logging
from collections import Counter
from typing import cast

import torch

from tandem_engine.attention.interface import AttentionBackend
from tandem_engine.config import EngineConfig
from tandem_engine.kernels.fused import TORCH_OPS, FusedOps, load_fused_ops
from tandem_engine.models.llama import DecoderLayer, LlamaForCausalLM
from tandem_engine.worker.decode_step import DENSE_ROW_LIMIT, fuse_decode_steps

logger = logging.getLogger(__name__)


def plan_weights(model: LlamaForCausalLM, config: EngineConfig, device: torch.device, backend: AttentionBackend,
                 kv_dtype: torch.dtype) -> FusedOps:
    """Give `model` its fused ops, its whole-step kernel where it can take one, and oneDNN's packed copies
    where `config.onednn_pack` says; log what each projection ended up with. Returns the ops in use."""
    ops = TORCH_OPS
    if config.cpu_fused_kernels and device.type == "cpu":
        ops = load_fused_ops(config.cache_path)
        model.use_fused_ops(ops)
    why = fuse_decode_steps(model, backend, kv_dtype, config.cache_path, amx_float32=config.cpu_amx_float32,
                            float_panels=config.cpu_float_panels)
    if (step := model.decode_step) is not None:
        rows = f"fewer than {step.row_limit} rows" if step.row_limit < DENSE_ROW_LIMIT else "any number of rows"
        if step.chunk_row_limit < step.row_limit:
            rows += f" (with a prefill chunk fewer than {step.chunk_row_limit})"
        logger.info("[startup] steps fused: one C call per step of decode rows and prefill chunks, %s, on %s "
                    "(worker/decode_step.py); other steps op by op", rows, step.kind)
    else:
        logger.info("[startup] steps op by op: %s", why)
    if config.onednn_pack:
        model.prepack(device)  # last: only what the step kernel's copies and quantization left dense
    logger.info("[startup] weights: %s", weight_forms(model))
    return ops


def weight_forms(model: LlamaForCausalLM) -> str:
    """Each projection's forms over the layers, then the head's, e.g. `qkv panels+onednn x30, ..., head panels`."""
    forms = Counter(f"{name} {'+'.join(p.forms()) or 'none'}"
                    for layer in model.layers for name, p in cast(DecoderLayer, layer).proj.items())
    head = f"head {'+'.join(model.head.forms()) or 'none'}"
    return ", ".join([*(f"{k} x{n}" for k, n in forms.items()), head])
