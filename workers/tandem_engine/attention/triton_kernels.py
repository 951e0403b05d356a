# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton paged-attention kernels for the KV cache [num_blocks, block_size, num_kv_heads, head_dim]:
`_store_kv_kernel` writes a step's K/V into their slots (rounded to the cache's dtype), `_unified_attention_kernel`
serves prefill chunks and decode rows in one launch (a program per query tile and KV head, K/V loaded once per
GQA group, online softmax, split-KV for small decode batches) and `_reduce_segments_kernel` merges the split-KV
partials. The design follows vLLM's unified attention; the code is tandem's own (docs/architecture.md, "The
engine"). Only triton_backend imports this module, lazily: compiled or interpreted (`TRITON_INTERPRET=1`)
as fixed at its first import. Kernel parameters are untyped by triton convention, hence the mypy line above."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Fused multiply-add on, stated explicitly: triton 3.10 flips the default (3.9 warns about it).
FP_FUSION = True


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_ptr,  # [num_tokens] int64
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_blk,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    within = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [HEADS_PAD, DIM_PAD]

    k_src = key_ptr + token * stride_k_tok + offs_h[:, None] * stride_k_head
    v_src = value_ptr + token * stride_v_tok + offs_h[:, None] * stride_v_head
    k = tl.load(k_src + offs_d[None, :], mask=mask)
    v = tl.load(v_src + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + blk * stride_kc_blk + within * stride_kc_slot + offs_h[:, None] * stride_kc_head
    v_dst = v_cache_ptr + blk * stride_vc_blk + within * stride_vc_slot + offs_h[:, None] * stride_vc_head
    tl.store(k_dst + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence i's query tiles are numbered from query_start_loc[i] // BLOCK_Q + i, an upper bound on
    # the tiles all earlier sequences need; so the grid is sized without a host-side plan, and some
    # tile ids map past their sequence's last row (those programs exit). Returns the largest i whose
    # first tile id is <= q_block.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seg_out_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS, DIM_PAD] fp32 (split-KV only)
    seg_max_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS] fp32, running max in log2 units
    seg_sum_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS] fp32
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2 so the kernel can use exp2
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_kc_blk,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_slot,
    stride_vc_head,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    BLOCK_Q: tl.constexpr,  # query rows (positions) per tile
    BLOCK_M: tl.constexpr,  # tile rows: BLOCK_Q * GROUP padded to a power of two
    TILE_N: tl.constexpr,  # keys per inner step
    NUM_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # keys already cached before this step's rows

    # Row m of the tile is query position m // GROUP (within this step) of head kv_head*GROUP + m % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    q_pos = local_block * BLOCK_Q + offs_m // GROUP  # [BLOCK_M]
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_pos < q_len)  # [BLOCK_M]
    dim_ok = offs_d < HEAD_DIM  # [DIM_PAD]
    token = (q_start + q_pos).to(tl.int64)  # [BLOCK_M]

    q = tl.load(
        q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, DIM_PAD]

    # The tile's last row sees keys up to ctx_len + its position; later keys are never needed.
    kv_len = tl.minimum(seq_len, ctx_len + (local_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    if NUM_SEGMENTS == 1:
        tile_lo = 0
        tile_hi = num_tiles
    else:
        tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
        tile_lo = segment * tiles_per_segment
        tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)

    causal_limit = ctx_len + q_pos  # [BLOCK_M] last key position each row may see
    block_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)

    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + offs_n  # [TILE_N]
        k_ok = k_pos < kv_len
        blk = tl.load(block_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)  # [TILE_N]
        within = k_pos % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr
            + blk[None, :] * stride_kc_blk
            + within[None, :] * stride_kc_slot
            + kv_head * stride_kc_head
            + offs_d[:, None],
            mask=dim_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(q.dtype)  # [DIM_PAD, TILE_N], widened from a narrower cache (--kv-cache-dtype)
        v = tl.load(
            v_cache_ptr
            + blk[:, None] * stride_vc_blk
            + within[:, None] * stride_vc_slot
            + kv_head * stride_vc_head
            + offs_d[None, :],
            mask=k_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(q.dtype)  # [TILE_N, DIM_PAD]

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        visible = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= causal_limit[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])  # [BLOCK_M, TILE_N]
        alpha = tl.exp2(m_i - m_ref)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        # Every segment of a live tile writes, empty ones as (-inf, 0, 0), so the reduction needs no
        # per-sequence segment count.
        seg_idx = (token * NUM_Q_HEADS + head) * NUM_SEGMENTS + segment  # [BLOCK_M]
        tl.store(
            seg_out_ptr + seg_idx[:, None] * DIM_PAD + offs_d[None, :],
            acc,
            mask=row_ok[:, None],
        )
        tl.store(seg_max_ptr + seg_idx, m_i, mask=row_ok)
        tl.store(seg_sum_ptr + seg_idx, l_i, mask=row_ok)


@triton.jit
def _reduce_segments_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    seg_out_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS, DIM_PAD] fp32
    seg_max_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS] fp32
    seg_sum_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS] fp32
    stride_o_tok,
    stride_o_head,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, DIM_PAD)
    dim_ok = offs_d < HEAD_DIM
    seg_idx = (token * NUM_Q_HEADS + head) * NUM_SEGMENTS + offs_s  # [NUM_SEGMENTS]

    m = tl.load(seg_max_ptr + seg_idx)  # [NUM_SEGMENTS]
    l = tl.load(seg_sum_ptr + seg_idx)  # noqa: E741
    m_all = tl.max(m, 0)
    m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m - m_ref)  # [NUM_SEGMENTS], 0 for empty segments
    denom = tl.sum(l * w, 0)
    parts = tl.load(seg_out_ptr + seg_idx[:, None] * DIM_PAD + offs_d[None, :])  # [NUM_SEGMENTS, DIM_PAD]
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)  # [DIM_PAD]
    tl.store(
        out_ptr + token * stride_o_tok + head * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache head_dim must be contiguous"
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip


def tile_config(group: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M) for a batch: small tiles when rows are few (decode), 64 rows otherwise.

    tl.dot needs at least 16 rows; a GQA group larger than 64 gets one query position per tile.
    """
    block_m = min(64, max(16, triton.next_power_of_2(max_query_len * group)))
    block_m = max(block_m, triton.next_power_of_2(group))
    return max(1, block_m // group), block_m


def unified_attention(
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    num_seqs: int,
    max_query_len: int,
    num_segments: int = 1,
    tile_n: int = 32,
    seg_scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Causal paged attention of every query row; writes `out`. num_segments > 1 selects split-KV,
    which needs `seg_scratch` = (seg_out, seg_max, seg_sum) shaped as documented on the kernel."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert query.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert num_segments == 1 or (num_segments & (num_segments - 1) == 0 and seg_scratch is not None)
    group = num_q_heads // num_kv_heads
    block_q, block_m = tile_config(group, max_query_len)
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    num_q_blocks = num_tokens // block_q + num_seqs  # see _find_seq
    if num_segments > 1:
        assert seg_scratch is not None
        seg_out, seg_max, seg_sum = seg_scratch
        assert seg_out.shape[-2:] == (num_segments, dim_pad) and seg_out.shape[0] >= num_tokens
    else:
        seg_out = seg_max = seg_sum = out  # never touched by the kernel
    # fp32 inputs only occur in tests and the interpreter; keep them exact instead of TF32.
    precision = "ieee" if query.dtype == torch.float32 else "tf32"

    _unified_attention_kernel[(num_q_blocks, num_kv_heads, num_segments)](
        out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        seg_out, seg_max, seg_sum,
        scale * LOG2E, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        NUM_SEGMENTS=num_segments,
        DOT_PRECISION=precision,
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    if num_segments > 1:
        _reduce_segments_kernel[(num_tokens, num_q_heads)](
            out, seg_out, seg_max, seg_sum,
            out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            NUM_SEGMENTS=num_segments,
            enable_fp_fusion=FP_FUSION,
        )  # fmt: skip
