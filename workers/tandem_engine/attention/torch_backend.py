"""Paged attention in plain torch, for CPU.

Decode rows (one query token) of a step are batched: their blocks are gathered into a padded
[num_decode, max_len, nkv, D] tensor and one masked SDPA runs with the GQA group as the query axis,
so K/V are never repeated per query head. Prefill chunks (with or without cached context) run one SDPA
per sequence with a causal mask offset by the cached context. The plan (which rows are which, masks,
block ids) depends only on the step's metadata, so it is built once per step and reused by every layer.
Padding slots are masked, not zeroed: the cache must never hold NaN/inf (allocate it with torch.zeros).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem_engine.attention.interface import AttentionBackend, AttentionMetadata


@dataclass
class _Prefill:
    start: int  # first query row
    end: int
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] int64 block ids
    seq_len: int
    mask: torch.Tensor | None  # [q_len, seq_len] bool (True = attend), None when no cached context


@dataclass
class _Plan:
    # Decode part: rows of the step's query that are single-token requests.
    decode_rows: torch.Tensor | None  # [Nd] int64 query row of each decode request; None if rows are 0..Nd-1
    num_decode: int
    decode_blocks: torch.Tensor | None  # [Nd * max_blocks] int64, flattened block table
    decode_max_blocks: int
    decode_mask: torch.Tensor | None  # [Nd, 1, 1, max_blocks * block_size] bool, None if no padding
    prefills: list[_Prefill]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._plan_for: AttentionMetadata | None = None
        self._plan: _Plan | None = None

    def write_kv(
        self,
        key: torch.Tensor,  # [T, nkv, D]
        value: torch.Tensor,  # [T, nkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, nkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        nkv, d = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, nkv, d).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, nkv, d).index_copy_(0, slot_mapping, value)

    def _build_plan(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> _Plan:
        qlens, slens = meta.query_lens_cpu, meta.seq_lens_cpu
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        dec = [i for i, q in enumerate(qlens) if q == 1]
        table = meta.block_table
        decode_rows = decode_blocks = decode_mask = None
        max_blocks = 0
        if dec:
            dec_slens = [slens[i] for i in dec]
            max_len = max(dec_slens)
            max_blocks = -(-max_len // block_size)
            if dec != list(range(len(dec))):
                decode_rows = torch.tensor([starts[i] for i in dec], dtype=torch.int64, device=device)
                sel = torch.tensor(dec, dtype=torch.int64, device=table.device)
                table = table.index_select(0, sel)
            decode_blocks = table[: len(dec), :max_blocks].to(torch.int64).reshape(-1)
            if min(dec_slens) != max_blocks * block_size:
                lens = torch.tensor(dec_slens, dtype=torch.int64, device=device)
                pos = torch.arange(max_blocks * block_size, device=device)
                decode_mask = (pos[None, :] < lens[:, None]).view(len(dec), 1, 1, -1)
        prefills = []
        for i, q in enumerate(qlens):
            if q == 1:
                continue
            s = slens[i]
            ctx = s - q
            blocks = meta.block_table[i, : -(-s // block_size)].to(torch.int64)
            mask = None
            if ctx > 0:
                qpos = torch.arange(ctx, s, device=device)
                mask = torch.arange(s, device=device)[None, :] <= qpos[:, None]
            prefills.append(_Prefill(starts[i], starts[i + 1], blocks, s, mask))
        return _Plan(decode_rows, len(dec), decode_blocks, max_blocks, decode_mask, prefills)

    def forward(
        self,
        query: torch.Tensor,  # [T, nq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, nkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, nq, D]
        if self._plan_for is not meta or self._plan is None:
            self._plan = self._build_plan(meta, k_cache.shape[1], query.device)
            self._plan_for = meta
        plan = self._plan
        t, nq, d = query.shape
        nkv = k_cache.shape[2]
        g = nq // nkv
        if plan.num_decode == t:
            return self._decode(query, k_cache, v_cache, plan, scale)
        out = torch.empty_like(query)
        if plan.num_decode:
            if plan.decode_rows is None:
                out[: plan.num_decode] = self._decode(query[: plan.num_decode], k_cache, v_cache, plan, scale)
            else:
                q = query.index_select(0, plan.decode_rows)
                out.index_copy_(0, plan.decode_rows, self._decode(q, k_cache, v_cache, plan, scale))
        for p in plan.prefills:
            ql = p.end - p.start
            # [nkv, L, D] views of this sequence's keys and values
            k = k_cache.index_select(0, p.blocks).view(-1, nkv, d)[: p.seq_len].transpose(0, 1)
            v = v_cache.index_select(0, p.blocks).view(-1, nkv, d)[: p.seq_len].transpose(0, 1)
            # Query head h = kv * g + j -> [nkv, g, ql, D]; K/V broadcast over the group without copies.
            q = query[p.start : p.end].view(ql, nkv, g, d).permute(1, 2, 0, 3)
            k4 = k.unsqueeze(1).expand(nkv, g, p.seq_len, d)
            v4 = v.unsqueeze(1).expand(nkv, g, p.seq_len, d)
            if p.mask is None:
                o = F.scaled_dot_product_attention(q, k4, v4, is_causal=True, scale=scale)
            else:
                o = F.scaled_dot_product_attention(q, k4, v4, attn_mask=p.mask, scale=scale)
            # o: [nkv, g, ql, D] -> [ql, nq, D]
            out[p.start : p.end] = o.permute(2, 0, 1, 3).reshape(ql, nq, d)
        return out

    def _decode(
        self,
        query: torch.Tensor,  # [Nd, nq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: _Plan,
        scale: float,
    ) -> torch.Tensor:  # [Nd, nq, D]
        n, nq, d = query.shape
        nkv = k_cache.shape[2]
        assert plan.decode_blocks is not None
        # [Nd, nkv, L, D] (strided views of the gathered blocks)
        k = k_cache.index_select(0, plan.decode_blocks).view(n, -1, nkv, d).transpose(1, 2)
        v = v_cache.index_select(0, plan.decode_blocks).view(n, -1, nkv, d).transpose(1, 2)
        q = query.view(n, nkv, nq // nkv, d)  # the GQA group is the query-length axis
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_mask, scale=scale)
        return o.reshape(n, nq, d)
