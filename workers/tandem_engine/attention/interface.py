"""Attention backend contract: what the model runner hands every layer, and what a backend returns.

The KV cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
A step's tokens are flattened across requests: request i owns query rows
`query_start_loc[i]:query_start_loc[i+1]`, and its keys are the first `seq_lens[i]` positions of the
blocks listed in `block_table[i]` (context already cached, then this step's tokens, which `write_kv`
stored first). Attention is causal: query row j of request i (at position
`seq_lens[i] - query_len_i + j`) sees keys at positions up to and including its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, cached context + this step's tokens
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, block_id * block_size + offset
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU backends can plan without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """One instance per model runner; stateless across steps except for scratch buffers."""

    name: str

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        """Store this step's keys and values into their slots."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal paged attention of every query row over its request's cached keys."""
