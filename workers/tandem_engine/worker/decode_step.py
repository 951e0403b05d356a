"""A model's step assembled for the whole-step kernel (kernels/decode_step.c): every layer of decode rows and
prefill chunks in one OpenMP region instead of ~150-300 op by op, each waking passive threads. Here: which
matmuls the step runs on (`StepMatmuls`: int8 GGUF, float32 panels, bfloat16 or float32 AMX), whether a model
can take the step and why not (`fuse_decode_steps`), and which steps run fused (`DecodeStep.refusal`)
(docs/architecture.md, "One C call per step" and "Dense decode steps in one call").
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from gguf import GGMLQuantizationType

from tandem_engine.attention.cpu_backend import KERNEL_MAX_QUERY_LEN, CpuAttentionBackend
from tandem_engine.attention.interface import AttentionBackend, AttentionMetadata
from tandem_engine.kernels.amx_matmul import AMX_F32_FROM_ROWS, BF16, AmxKernel, amx_unfit, load_amx_kernel
from tandem_engine.kernels.decode_step import (
    PROJECTIONS,
    CKernels,
    CLayer,
    CModel,
    CPart,
    CProj,
    CStep,
    load_decode_kernel,
    p_,
)
from tandem_engine.kernels.gguf_matmul import GGUFLinear
from tandem_engine.kernels.paged_attention import KERNEL_KV_TYPES, kernel_scratch
from tandem_engine.kernels.panel_matmul import F32, FLOAT_PANELS_FROM_ROWS, DenseBlocks, PanelKernel, load_panel_kernel
from tandem_engine.models.gguf_quantized import dense_blocks
from tandem_engine.models.llama import DecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
_KV_NAMES = ", ".join(str(t).removeprefix("torch.") for t in KERNEL_KV_TYPES)  # the cache types the step takes


@dataclass(frozen=True)
class StepMatmuls:
    """What a fused step's projections run on: the int8 GGUF kernel (gguf_matmul.c) or the float32 panel
    kernel (panel_matmul.c), each as a pair of entry points, `quantize` (x into the kernel's buffer) and
    `matmul_cols` (a range of output columns from it)."""

    kind: str  # what the startup log names
    entries: dict[str, int]
    x_bytes: Callable[[int, int], int]  # (rows, k) -> bytes of the kernel's buffer
    col_align: int  # runs of output columns start on multiples of this
    row_limit: int  # steps of this many rows or more run op by op
    # and steps with a prefill chunk of this many rows or more (where op by op has a faster matmul)
    chunk_row_limit: int
    # per layer, per projection (decode_step.c's layer_t order): its parts (tensor, rows, qtype) and columns
    layers: list[dict[str, tuple[list[tuple[torch.Tensor, int, int]], int]]]


def gguf_matmuls(model: LlamaForCausalLM) -> StepMatmuls:
    """The step's matmuls over the GGUF blocks of `model`'s projections (checked by `_unfit`)."""
    linears = [{name: cast(GGUFLinear, cast(DecoderLayer, layer).quantized[name]) for name in PROJECTIONS}
               for layer in model.layers]
    kernel = linears[0]["qkv"].kernel
    rows = min(p.dense_from_rows for lin in linears for p in lin.values())
    return StepMatmuls(
        "int8 GGUF matmuls", {**kernel.entries}, kernel.xq8_bytes, 4,
        # From this many rows on the op-by-op path dequantizes instead of running the int8 kernel.
        rows, rows,
        [{name: ([(p.data, p.rows, p.qtype) for p in lin.parts], lin.out_features) for name, lin in layer.items()}
         for layer in linears])


def dense_matmuls(model: LlamaForCausalLM, kernel: PanelKernel, blocks: DenseBlocks | None,
                  keep_floats: bool = False) -> StepMatmuls:
    """The step's matmuls over panel copies of `model`'s projections (made here, once: use_panels), kept in
    the GGUF blocks the weights were dequantized from where `blocks` has them (the same floats), with float
    panels beside them as `keep_floats` says (PanelLinear)."""
    layers = [cast(DecoderLayer, layer) for layer in model.layers]
    model.use_panels(kernel, blocks, keep_floats)
    panels = [p for layer in layers for p in layer.panels.values()]
    if model.panel_head is not None:
        panels.append(model.panel_head)
    kinds = Counter("float32" if p.qtype == F32 else GGMLQuantizationType(p.qtype).name for p in panels)
    for why in sorted({p.why_float for p in panels if p.why_float}):
        logger.warning("float32 panels for a projection whose GGUF blocks the kernel cannot keep: %s", why)
    kind = "float32 panel matmuls, weights in " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + " panels"
    return _panel_matmuls(kind, kernel, [{name: (p.panels, p.out_features, p.qtype) for name, p in layer.panels.items()}
                                         for layer in layers])


def _panel_matmuls(kind: str, kernel: PanelKernel, layers: list[dict[str, tuple[torch.Tensor, int, int]]],
                   ) -> StepMatmuls:
    """The panel kernel's StepMatmuls over `layers`' panels (per projection: panels, columns, qtype)."""
    # Prefill chunks op by op run on the panels up to the kernel's max_rows, on oneDNN past them (faster there).
    return StepMatmuls(kind, kernel.entries, kernel.x_bytes, kernel.tile_cols, DENSE_ROW_LIMIT, kernel.max_rows + 1,
                       [{name: ([(panels, cols, qtype)], cols) for name, (panels, cols, qtype) in layer.items()}
                        for layer in layers])


def float_panel_matmuls(model: LlamaForCausalLM) -> StepMatmuls | None:
    """The step's matmuls over the float panels that `model`'s block panels keep beside them (PanelLinear's
    `floats`), for steps of FLOAT_PANELS_FROM_ROWS rows or more; None unless every projection keeps them."""
    layers = [cast(DecoderLayer, layer).panels for layer in model.layers]
    floats = [{name: p.floats for name, p in panels.items() if p.floats is not None} for panels in layers]
    if any(len(f) != len(PROJECTIONS) for f in floats):
        return None
    return _panel_matmuls("float32 panel matmuls over the same weights in float32 panels", layers[0]["qkv"].kernel,
                          [{name: (f[name], p.out_features, F32) for name, p in panels.items()}
                           for f, panels in zip(floats, layers, strict=True)])


def amx_f32_matmuls(model: LlamaForCausalLM, kernel: AmxKernel, blocks: DenseBlocks | None) -> StepMatmuls | None:
    """The step's matmuls on the float32 AMX kernel, over copies of the blocks `model`'s panels keep (made
    here from `blocks`, once: use_amx_f32); None if a projection has no copy."""
    if blocks is not None:
        model.use_amx_f32(kernel, blocks)
    layers = [cast(DecoderLayer, layer) for layer in model.layers]
    if any(len(layer.amx_f32) != len(PROJECTIONS) for layer in layers):
        return None
    return StepMatmuls("float32 AMX matmuls over the same blocks", kernel.f32_entries, kernel.f32_x_bytes,
                       kernel.tile_cols, DENSE_ROW_LIMIT, DENSE_ROW_LIMIT,
                       [{name: ([(a.panels, a.out_features, a.qtype)], a.out_features)
                         for name, a in layer.amx_f32.items()} for layer in layers])


def amx_matmuls(model: LlamaForCausalLM, kernel: AmxKernel) -> StepMatmuls:
    """The step's matmuls over AMX copies of a bfloat16 `model`'s projections, which from here on computes in
    float32 but for its matmuls' inputs (`LlamaForCausalLM.use_amx`: its op-by-op steps too)."""
    model.use_amx(kernel)
    layers = [cast(DecoderLayer, layer) for layer in model.layers]
    return StepMatmuls("bfloat16 AMX matmuls", kernel.entries, kernel.x_bytes, kernel.tile_cols, DENSE_ROW_LIMIT,
                       DENSE_ROW_LIMIT, [{name: ([(a.panels, a.out_features, BF16)], a.out_features)
                                          for name, a in layer.amx.items()} for layer in layers])




# Dense steps of any size run fused (the panel kernel is ahead of oneDNN from one row to hundreds).
DENSE_ROW_LIMIT = 1 << 20

# A step on a kernel that takes row ranges (the float32 AMX kernel) cuts its rows into blocks whose split x
# (6 bytes a value) is at most this for o, gate|up and down, twice it for q|k|v (decode_step.c, row_block).
# All rows at once, the whole split x was read again from L3 for each run of output columns; a block stays in
# L2 while the weights pass. In one-call prefill steps of 512 tokens (SmolLM2, 2 threads of the AVX-512 Xeon,
# three alternating runs each): down 71-78 ms a step against 53-55 cut at 1 MB, gate|up 94-105 against
# 86-91, the step 298-320 against 267-282. q|k|v, whose items are heads with their RoPE and cache writes, ran
# slower cut in two at 512 rows (45 against 41 ms) and faster cut in four at 2,048 (176 against 236).
# bfloat16 AMX steps, whose x is a third the bytes, ran no faster cut: that kernel takes no row ranges.
ROW_BLOCK_BYTES = 1 << 20


class DecodeStep:
    """A step of `model` in one call: x [T, hidden] (the embedded tokens: decode rows and prefill chunks)
    through every layer and the final norm, the projections on `matmuls`, or on `large`'s matmuls for steps of
    at least its rows. `row_entries`: the fused row kernels' entry points (FusedOps.row_entries); `attention`:
    the backend whose C kernels attend (its step_entries and prefill_work)."""

    def __init__(self, lib: ctypes.CDLL, model: LlamaForCausalLM, matmuls: StepMatmuls, row_entries: dict[str, int],
                 attention: CpuAttentionBackend, large: tuple[int, StepMatmuls] | None = None) -> None:
        self._fn = lib.tandem_decode_step
        self._fn.argtypes = [ctypes.POINTER(CModel), ctypes.POINTER(CStep), ctypes.c_int]
        self._fn.restype = ctypes.c_int
        layers = [cast(DecoderLayer, layer) for layer in model.layers]
        first = layers[0]
        self.nq, self.nkv, self.d = first.num_heads, first.num_kv_heads, first.head_dim
        self.hidden, self.inter = model.hidden_size, first.inter
        self.row_limit = matmuls.row_limit
        # steps with a prefill chunk: below this many rows (the large matmuls' limit where they take over)
        self.chunk_row_limit = (matmuls if large is None else large[1]).chunk_row_limit
        self._keep: list[Any] = []  # what the C structures point into
        entries = attention.step_entries
        assert entries is not None
        self._row_entries, self._attention_entries, self._attention = row_entries, entries, attention
        # (from rows, the model on those matmuls, their buffer's bytes): steps of at least `large`'s rows run
        # on its matmuls (the float32 AMX kernel, or float panels: fuse_decode_steps), others on `matmuls`.
        self._models = [(0, self._c_model(model, matmuls), matmuls.x_bytes)]
        self.kind = matmuls.kind
        if large is not None:
            self._models.insert(0, (large[0], self._c_model(model, large[1]), large[1].x_bytes))
            self.kind += f"; from {large[0]} rows {large[1].kind}"
        self.max_positions = model.rope_cos.shape[0]
        self._widths = {"qkv": (self.nq + 2 * self.nkv) * self.d, "attn": self.nq * self.d, "o": self.hidden,
                        "gu": 2 * self.inter, "act": self.inter, "down": self.hidden}
        self._rows = 0
        self._work: dict[str, torch.Tensor] = {}
        self._xq = torch.empty(0, dtype=torch.uint8)
        self._reserve(min(self.row_limit - 1, 32))
        self._scratch = torch.empty(0)
        self._kv: tuple[KVCaches, ctypes.Array[ctypes.c_void_p]] | None = None
        # None, or int64 [len(PHASES)] that every step adds each phase's nanoseconds to (bench/profile_step.py)
        self.phase_ns: torch.Tensor | None = None

    def _c_model(self, model: LlamaForCausalLM, matmuls: StepMatmuls) -> CModel:
        """decode_step.c's model_t for `model` with its projections on `matmuls`."""
        layers = [cast(DecoderLayer, layer) for layer in model.layers]
        first = layers[0]
        # The step computes in float32: a bfloat16 model takes it only after `use_amx` (amx_matmuls) widened its
        # norms and RoPE tables and made float32 its activations' dtype.
        next_norms = [layer.input_norm for layer in layers[1:]] + [model.norm]
        table = (CLayer * len(layers))(*(
            CLayer(*(self._proj(*projs[name]) for name in PROJECTIONS), layer.post_attn_norm.data_ptr(),
                   norm.data_ptr())
            for layer, projs, norm in zip(layers, matmuls.layers, next_norms, strict=True)))
        entries = {**matmuls.entries, **self._row_entries, **self._attention_entries}
        self._keep.append(table)
        return CModel(CKernels(**entries), table, len(layers), self.hidden, self.inter, self.nq, self.nkv, self.d,
                      first.input_norm.data_ptr(), model.rope_cos.data_ptr(), model.rope_sin.data_ptr(), first.eps,
                      first.scale, matmuls.col_align, ROW_BLOCK_BYTES)

    def _reserve(self, rows: int) -> None:
        """Work buffers for steps of up to `rows` rows."""
        if rows <= self._rows:
            return
        self._rows = rows
        self._work = {name: torch.empty(rows * w) for name, w in self._widths.items()}
        # zeroed: the tail the int8 matmul reads past the last rows is never written
        k = max(self._widths["attn"], self.hidden, self.inter)
        self._xq = torch.zeros(max(x_bytes(rows, k) for _, _, x_bytes in self._models), dtype=torch.uint8)

    def _proj(self, parts: list[tuple[torch.Tensor, int, int]], cols: int) -> CProj:
        table = (CPart * len(parts))(*(CPart(data.data_ptr(), rows, qtype) for data, rows, qtype in parts))
        self._keep.append((table, [data for data, _, _ in parts]))
        return CProj(table, len(parts), cols)

    def refusal(self, meta: AttentionMetadata, kv_caches: KVCaches) -> str | None:
        """Why this step runs op by op, or None: it runs fused."""
        rows = int(meta.slot_mapping.shape[0])
        if rows >= self.row_limit:
            return f"{rows} rows (fused below {self.row_limit})"
        if not meta.is_pure_decode and rows >= self.chunk_row_limit:
            return f"{rows} rows with a prefill chunk (fused below {self.chunk_row_limit})"
        if not meta.is_pure_decode and self.d % 16:
            return f"a prefill chunk with heads of {self.d} (fused: a multiple of 16)"
        if kv_caches[0][0].dtype not in KERNEL_KV_TYPES:
            return f"a {str(kv_caches[0][0].dtype).removeprefix('torch.')} KV cache (fused: {_KV_NAMES})"
        if meta.max_seq_len > self.max_positions:
            return f"a position past the RoPE table's {self.max_positions}"
        return None

    def _kv_pointers(self, kv_caches: KVCaches) -> ctypes.Array[ctypes.c_void_p]:
        """Every layer's K and V cache, as decode_step.c's step_t.kv (kept while the runner passes the same list)."""
        if self._kv is None or self._kv[0] is not kv_caches:
            dtype = kv_caches[0][0].dtype
            if dtype not in KERNEL_KV_TYPES or not all(
                    c.is_contiguous() and c.dtype == dtype and c.device.type == "cpu" for kv in kv_caches for c in kv):
                raise ValueError(f"the fused decode step takes contiguous CPU KV caches of one type ({_KV_NAMES})")
            self._kv = kv_caches, (ctypes.c_void_p * (2 * len(kv_caches)))(
                *(c.data_ptr() for kv in kv_caches for c in kv))
        return self._kv[1]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                 meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] float32 contiguous, updated in place (the residual stream) -> [T, hidden] through the
        final norm. `refusal(meta, kv_caches)` must be None."""
        m = x.shape[0]
        self._reserve(m)
        h = torch.empty_like(x)
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        table = meta.block_table.to(torch.int32).contiguous()
        bs, kv_type = kv_caches[0][0].shape[1], KERNEL_KV_TYPES[kv_caches[0][0].dtype]
        per_thread = kernel_scratch(self.nq, self.nkv, self.d, bs, meta.max_seq_len)
        if meta.is_pure_decode:  # no prefill chunk: the step reads none of the chunks' arrays
            klens, row_table, pf_items = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64), table, 0
            chunk: list[torch.Tensor | None] = [None] * 4
        else:
            # As op by op (CpuAttentionBackend): the rows of a sequence of up to KERNEL_MAX_QUERY_LEN new tokens
            # attend one by one, each to the keys up to its own; longer chunks through the tiled prefill
            # kernel (their rows' klens 0).
            q_lens = torch.tensor(meta.query_lens_cpu, dtype=torch.int64)
            seq_lens = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64)
            tiled = q_lens > KERNEL_MAX_QUERY_LEN
            klens = torch.where(tiled.repeat_interleave(q_lens), 0, positions + 1)
            row_table = table.repeat_interleave(q_lens, dim=0)
            ids = torch.nonzero(tiled).flatten()
            chunk_q_lens = q_lens[ids]
            chunk = [ids, meta.query_start_loc.to(torch.int64)[ids], chunk_q_lens, seq_lens[ids]]
            pf_items, pf_scratch = self._attention.prefill_work(chunk_q_lens, self.nq, self.nkv, self.d)
            per_thread = max(per_thread, pf_scratch)
        threads = torch.get_num_threads()
        if self._scratch.numel() < threads * per_thread:
            self._scratch = torch.empty(threads * per_thread)
        w = self._work
        step = CStep(m, x.data_ptr(), h.data_ptr(), positions.data_ptr(), slots.data_ptr(), klens.data_ptr(),
                     row_table.data_ptr(), row_table.stride(0), bs, kv_type,
                     ctypes.cast(self._kv_pointers(kv_caches), p_), w["qkv"].data_ptr(), w["attn"].data_ptr(),
                     w["o"].data_ptr(), w["gu"].data_ptr(), w["act"].data_ptr(), w["down"].data_ptr(),
                     self._xq.data_ptr(), self._scratch.data_ptr(), per_thread,
                     None if self.phase_ns is None else self.phase_ns.data_ptr(), pf_items,
                     *(None if t is None else t.data_ptr() for t in chunk), table.data_ptr(), table.stride(0))
        c_model = next(c for from_rows, c, _ in self._models if m >= from_rows)
        rc = self._fn(ctypes.byref(c_model), ctypes.byref(step), threads)
        if rc:
            raise RuntimeError(f"gguf decode step failed ({rc})")
        return h


def _unfit(model: LlamaForCausalLM, backend: AttentionBackend, kv_dtype: torch.dtype) -> str | None:
    """Why `model` cannot take the fused step at all, or None."""
    if model.quantization == "none" and model.dtype not in (torch.float32, torch.bfloat16):
        return f"a {str(model.dtype).removeprefix('torch.')} model (fused without --quantization: float32, or " \
               "bfloat16 on AMX)"
    if model.quantization == "none" and model.dtype == torch.bfloat16 and (why := amx_unfit()):
        return f"a bfloat16 model, and {why} (fused in bfloat16: AMX-BF16)"
    if kv_dtype not in KERNEL_KV_TYPES:
        return f"a {str(kv_dtype).removeprefix('torch.')} KV cache (--kv-cache-dtype; fused: {_KV_NAMES})"
    if model.ops.row_entries is None:
        return "the fused C kernels are off (--no-cpu-fused-kernels, or no C compiler)"
    if not isinstance(backend, CpuAttentionBackend) or backend.step_entries is None:
        return "the C attention kernel is off (--no-cpu-attention-kernel, or no C compiler)"
    layers = [cast(DecoderLayer, layer) for layer in model.layers]
    if any(layer.qk_norm for layer in layers):
        return "q and k are RMS-normalised per head (Qwen3)"
    first = layers[0]
    if any(n % 32 for n in (model.hidden_size, first.inter, first.q_size)):
        return "a projection input not a multiple of 32"
    for layer in layers:
        for name, (_, dense_bias) in layer.projections().items():
            bias: torch.Tensor | None = dense_bias
            if model.quantization in ("gguf", "int8"):  # int8: on Q8_0 blocks where torch's int8 is slow
                linear = layer.quantized.get(name)
                if not isinstance(linear, GGUFLinear) or not linear.int8_activations:
                    return f"a {name} projection not on the int8 GGUF kernel"
                bias = linear.bias
            if bias is not None:
                return f"a {name} projection with a bias"
    return None


def fuse_decode_steps(model: LlamaForCausalLM, backend: AttentionBackend, kv_dtype: torch.dtype,
                      cache_dir: Path, amx_float32: bool = True, float_panels: bool = True) -> str | None:
    """From now on run `model`'s decode steps fused where they qualify (`model.decode_step`), with the
    kernels built under `cache_dir`; or say why they cannot be (and leave the model as it was).
    `amx_float32` (`--cpu-amx-float32`): a float32 model from a GGUF file, on a CPU with AMX, runs its matmuls
    of AMX_F32_FROM_ROWS rows or more, fused steps and op by op, on the float32 AMX kernel. `float_panels`
    (`--cpu-float-panels`): its block panels keep float panels beside them where the panel kernel's
    `floats_pay` (PanelLinear); off, they never do."""
    reason = _unfit(model, backend, kv_dtype)
    if reason is not None:
        return reason
    lib = load_decode_kernel(cache_dir)
    if lib is None:
        return "its C kernel did not build"
    large: tuple[int, StepMatmuls] | None = None
    if model.quantization in ("gguf", "int8"):
        matmuls = gguf_matmuls(model)
    elif model.dtype == torch.bfloat16:
        amx = load_amx_kernel(cache_dir)
        if amx is None:
            return "the bfloat16 AMX kernel did not build or may not run"
        matmuls = amx_matmuls(model, amx)
    else:
        dense = load_panel_kernel(cache_dir)
        if dense is None:
            return "the float32 panel kernel did not build"
        first = cast(DecoderLayer, model.layers[0])
        # the file's blocks, read once (not again for a second ModelRunner over the same model)
        blocks = None if model.gguf_file is None or first.panels else dense_blocks(
            model.gguf_file, len(model.layers), model.tie_word_embeddings)
        matmuls = dense_matmuls(model, dense, blocks, float_panels and dense.floats_pay)
        amx = load_amx_kernel(cache_dir) if amx_float32 else None
        f32 = None if amx is None else amx_f32_matmuls(model, amx, blocks)
        if f32 is not None:
            large = AMX_F32_FROM_ROWS, f32
        elif (floats := float_panel_matmuls(model)) is not None:
            large = FLOAT_PANELS_FROM_ROWS, floats
    row_entries = model.ops.row_entries
    assert row_entries is not None
    model.decode_step = DecodeStep(lib, model, matmuls, row_entries, cast(CpuAttentionBackend, backend), large)
    return None
