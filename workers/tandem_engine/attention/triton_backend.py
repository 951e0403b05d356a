"""Triton attention backend (NVIDIA GPUs; CPU only under `TRITON_INTERPRET=1`, for tests).

Importing this module never imports triton, so the engine loads on machines without triton or CUDA;
the kernels in `triton_kernels` are imported on first use. Pick the backend with `triton_available()`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from types import ModuleType

import torch

from tandem_engine.attention.interface import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


def triton_available() -> bool:
    """Whether this backend can run here: triton importable, and a CUDA device or the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True
    return torch.cuda.is_available()


def _kernels() -> ModuleType:
    from tandem_engine.attention import triton_kernels

    return triton_kernels


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through the unified Triton kernel; split-KV for small pure-decode batches.

    split_kv: None decides per step (pure decode with fewer (seq, KV head) programs than SMs), True
    forces it for every batch (tests), False never uses it. The decision depends only on the batch's
    shape, never on sequence lengths, so a captured CUDA graph stays valid for its batch size.
    """

    name = "triton"

    def __init__(self, *, split_kv: bool | None = None, num_kv_splits: int = 16, tile_n: int = 32) -> None:
        if num_kv_splits < 2 or num_kv_splits & (num_kv_splits - 1):
            raise ValueError(f"num_kv_splits must be a power of two >= 2, got {num_kv_splits}")
        self.split_kv = split_kv
        self.num_kv_splits = num_kv_splits
        self.tile_n = tile_n
        self._num_sms: dict[torch.device, int] = {}
        # Split-KV partials, grown on demand and reused across steps (and layers).
        self._scratch: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 for padding
    ) -> None:
        _kernels().store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        kernels = _kernels()
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        num_segments = self.num_kv_splits if self.uses_split_kv(query, k_cache, meta) else 1
        scratch = None
        if num_segments > 1:
            scratch = self._segment_scratch(query, num_segments, max(16, _next_pow2(query.shape[2])))
        kernels.unified_attention(
            out,
            query,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            scale,
            num_seqs=meta.num_seqs,
            max_query_len=meta.max_query_len,
            num_segments=num_segments,
            tile_n=self.tile_n,
            seg_scratch=scratch,
        )
        return out

    def uses_split_kv(self, query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether forward() takes the split-KV path for this batch."""
        if self.split_kv is not None:
            return self.split_kv
        if not meta.is_pure_decode or query.device.type != "cuda":
            return False
        return meta.num_seqs * k_cache.shape[2] < self._sm_count(query.device)

    def _sm_count(self, device: torch.device) -> int:
        if device not in self._num_sms:
            self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return self._num_sms[device]

    def _segment_scratch(
        self, query: torch.Tensor, num_segments: int, dim_pad: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens, num_heads, _ = query.shape
        dev = query.device
        have = self._scratch.get(dev)
        shape = (num_heads, num_segments)
        if have is None or have[1].shape[0] < num_tokens or have[1].shape[1:] != shape:
            rows = max(num_tokens, 2 * have[1].shape[0] if have is not None else 0)
            seg_out = torch.empty(rows, *shape, dim_pad, dtype=torch.float32, device=dev)
            seg_max = torch.empty(rows, *shape, dtype=torch.float32, device=dev)
            seg_sum = torch.empty_like(seg_max)
            have = (seg_out, seg_max, seg_sum)
            self._scratch[dev] = have
        return have


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
