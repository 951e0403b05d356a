"""Paged attention on a CPU (docs/architecture.md, "CPU kernels"): decode rows and two-token chunks on the C
decode kernel (kernels/paged_attention.c), which reads K/V straight from the cache blocks, once per row for
all heads (gathering them first would cost more than the attention); longer float32 chunks on the tiled
prefill kernel (kernels/prefill_attention.c; the two libraries are on or off together); the rest, and all
of it without a C compiler, on torch SDPA over gathered blocks. The kernels compute in float32 whatever the
cache holds (`--kv-cache-dtype`). A step's plan depends only on its metadata: built once, reused by every
layer. Padding slots are masked, not zeroed, so the cache must never hold NaN/inf (torch.zeros)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem_engine.attention.interface import AttentionBackend, AttentionMetadata
from tandem_engine.config import default_cache_dir
from tandem_engine.kernels.build import address
from tandem_engine.kernels.paged_attention import KERNEL_KV_TYPES, kernel_scratch, load_kernel
from tandem_engine.kernels.prefill_attention import load_kernel as load_prefill_kernel

logger = logging.getLogger(__name__)

# Chunks up to this many query tokens go to the C kernel; longer ones to SDPA, whose GEMMs win from
# about 3 query rows on (measured with SmolLM2 shapes at 300 and 2000 tokens of context).
KERNEL_MAX_QUERY_LEN = 2

def _writes_in_one_pass(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slots: torch.Tensor) -> bool:
    """Whether the kernel's tandem_write_kv stores these: float32 CPU tensors, each token's K and V one run
    of floats, contiguous caches of the same shape and int64 slots."""
    nkv, d = k_cache.shape[2], k_cache.shape[3]
    return (all(x.dtype == torch.float32 and x.device.type == "cpu" for x in (key, value, k_cache, v_cache))
            and k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
            and all(x.shape[1:] == (nkv, d) and x.stride(2) == 1 and x.stride(1) == d for x in (key, value))
            and key.shape[0] == value.shape[0] == slots.shape[0]
            and slots.dtype == torch.int64 and slots.device.type == "cpu" and slots.is_contiguous())


def _int32_table(meta: AttentionMetadata) -> torch.Tensor:
    """The block table as the kernels read it: int32, each row's entries contiguous."""
    table = meta.block_table
    return table if table.dtype == torch.int32 and table.stride(1) == 1 else table.to(torch.int32).contiguous()


@dataclass
class _Prefill:
    start: int  # first query row
    end: int
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] int64 block ids
    seq_len: int
    mask: torch.Tensor | None  # [q_len, seq_len] bool (True = attend), None when no cached context


@dataclass
class _KernelRows:
    rows: torch.Tensor  # [R] int64 query row
    seqs: torch.Tensor  # [R] int64 request index into block_table
    klens: torch.Tensor  # [R] int64 keys visible to the row (causal)
    scratch_per_thread: int  # floats


@dataclass
class _KernelPrefills:
    seq_ids: torch.Tensor  # [P] int64 request index into block_table
    q_starts: torch.Tensor  # [P] int64 first query row
    q_lens: torch.Tensor  # [P] int64 query rows
    seq_lens: torch.Tensor  # [P] int64 tokens in all (cached context + this chunk)


@dataclass
class _SdpaDecode:
    rows: torch.Tensor | None  # [Nd] int64 query rows; None when they are 0..Nd-1
    blocks: torch.Tensor  # [Nd * max_blocks] int64, flattened block table
    mask: torch.Tensor | None  # [Nd, 1, 1, max_blocks * block_size] bool, None if no padding


@dataclass
class _Plan:
    kernel: _KernelRows | None
    decode: _SdpaDecode | None
    num_decode: int  # rows handled by `decode` (SDPA fallback)
    prefills: list[_Prefill]  # through SDPA
    kernel_prefills: _KernelPrefills | None = None  # through the prefill kernel's tandem_prefill_attention_kv


class CpuAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, use_kernel: bool | None = None, cache_dir: Path | None = None) -> None:
        """use_kernel: None = use the C kernels where they apply and build; False = torch only.
        cache_dir: where the built kernels are kept (None: EngineConfig's default)."""
        cache = cache_dir if cache_dir is not None else Path(default_cache_dir()).expanduser()
        # Two libraries, decode rows' (kernels/paged_attention.c) and prefill chunks' (prefill_attention.c):
        # both or neither, so that the kernels are on or off together, as when they were one library.
        decode = load_kernel(cache) if use_kernel is not False else None
        prefill = load_prefill_kernel(cache) if decode is not None else None
        if prefill is None:
            decode = None
        self._kernel, self._prefill_kernel = decode, prefill
        if use_kernel and self._kernel is None:
            raise RuntimeError("the CPU attention kernel could not be built")
        self._plan_meta: AttentionMetadata | None = None
        self._plan_key: tuple[object, ...] | None = None
        self._plan: _Plan | None = None
        self._scratch = torch.empty(0)

    @property
    def step_entries(self) -> dict[str, int] | None:
        """Where the kernels' entries for the fused step (worker/decode_step.py) are: a decode row's head range
        (`attention_heads`, the decode library's) and one work item of the tiled prefill attention
        (`prefill_attention_item`, the prefill library's); None when the kernels are off."""
        if self._kernel is None or self._prefill_kernel is None:
            return None
        return {"attention_heads": address(self._kernel, "tandem_paged_attention_heads"),
                "prefill_attention_item": address(self._prefill_kernel, "tandem_prefill_attention_item")}

    def prefill_work(self, q_lens: torch.Tensor, nq: int, nkv: int, d: int) -> tuple[int, int]:
        """(work items, scratch floats per thread) of the tiled prefill attention of chunks of q_lens [P] int64
        contiguous query tokens, nq query heads over nkv KV heads of size d (the kernels must be on)."""
        assert self._prefill_kernel is not None
        return (self._prefill_kernel.tandem_prefill_items(q_lens.data_ptr(), q_lens.numel(), nkv),
                self._prefill_kernel.tandem_prefill_scratch(nq // nkv, d))

    def write_kv(
        self,
        key: torch.Tensor,  # [T, nkv, D]
        value: torch.Tensor,  # [T, nkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, nkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        nkv, d = k_cache.shape[2], k_cache.shape[3]
        if self._kernel is not None and _writes_in_one_pass(key, value, k_cache, v_cache, slot_mapping):
            n_slots = k_cache.shape[0] * k_cache.shape[1]
            bad = self._kernel.tandem_write_kv(
                key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
                v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0], nkv * d, n_slots)
            if bad >= 0:
                raise IndexError(f"KV slot {int(slot_mapping[bad])} is outside the cache's {n_slots} slots")
            return
        # A 16-bit cache under a wider model rounds here (to nearest even), once per token.
        k_cache.view(-1, nkv, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, nkv, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def _kernel_applies(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (
            self._kernel is not None
            and query.device.type == "cpu"
            and query.dtype in KERNEL_KV_TYPES  # a 16-bit query widens to float32 for it (_run_kernel)
            and k_cache.dtype in KERNEL_KV_TYPES
            and query.stride(2) == 1
            and query.stride(1) == query.shape[2]
            and k_cache.is_contiguous()
        )

    def _build_plan(
        self, meta: AttentionMetadata, block_size: int, g: int, nkv: int, d: int, use_kernel: bool,
        prefill_kernel: bool = False,
    ) -> _Plan:
        dev = (
            meta.block_table.device
        )  # the kernel's row lists stay on the host; the SDPA path's tensors go here
        qlens, slens = meta.query_lens_cpu, meta.seq_lens_cpu
        limit = KERNEL_MAX_QUERY_LEN if use_kernel else 0
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        kernel = decode = None
        rows: list[int] = []
        seqs: list[int] = []
        klens: list[int] = []
        for i, q in enumerate(qlens):
            if q <= limit:
                rows += range(starts[i], starts[i + 1])
                seqs += [i] * q
                klens += range(slens[i] - q + 1, slens[i] + 1)
        if rows:
            scratch = kernel_scratch(g * nkv, nkv, d, block_size, max(klens))
            kernel = _KernelRows(torch.tensor(rows), torch.tensor(seqs), torch.tensor(klens), scratch)
        dec = [i for i, q in enumerate(qlens) if q == 1 and not use_kernel]
        if dec:
            dec_slens = [slens[i] for i in dec]
            max_blocks = -(-max(dec_slens) // block_size)
            table = meta.block_table
            decode_rows = None
            if dec != list(range(len(dec))):
                decode_rows = torch.tensor([starts[i] for i in dec], device=dev)
                table = table.index_select(0, torch.tensor(dec, device=dev))
            mask = None
            if min(dec_slens) != max_blocks * block_size:
                pos = torch.arange(max_blocks * block_size, device=dev)
                mask = (pos[None, :] < torch.tensor(dec_slens, device=dev)[:, None]).view(len(dec), 1, 1, -1)
            decode = _SdpaDecode(
                decode_rows, table[: len(dec), :max_blocks].to(torch.int64).reshape(-1), mask
            )
        prefills = []
        kernel_prefills: list[tuple[int, int, int, int]] = []
        for i, q in enumerate(qlens):
            if q <= limit or (q == 1 and not use_kernel):
                continue
            s = slens[i]
            if prefill_kernel:
                kernel_prefills.append((i, starts[i], q, s))
                continue
            mask = None
            if s > q:
                mask = torch.arange(s, device=dev)[None, :] <= torch.arange(s - q, s, device=dev)[:, None]
            blocks = meta.block_table[i, : -(-s // block_size)].to(torch.int64)
            prefills.append(_Prefill(starts[i], starts[i + 1], blocks, s, mask))
        kp = None
        if kernel_prefills:
            kp = _KernelPrefills(*(torch.tensor(col, dtype=torch.int64) for col in zip(*kernel_prefills, strict=True)))
        return _Plan(kernel, decode, len(dec), prefills, kp)

    def forward(
        self,
        query: torch.Tensor,  # [T, nq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, nkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, nq, D]
        t, nq, d = query.shape
        nkv = k_cache.shape[2]
        g = nq // nkv
        use_kernel = self._kernel_applies(query, k_cache)
        # Prefill chunks take the kernel's tiled causal attention where the queries are float32 (a 16-bit
        # model keeps SDPA), over a cache of any type it reads, and its head layout fits.
        prefill_kernel = (use_kernel and query.dtype == torch.float32 and k_cache.dtype == v_cache.dtype
                          and d % 16 == 0 and nq % nkv == 0 and v_cache.is_contiguous())
        # The plan is cached per step on the metadata object's identity (a runner builds one per step;
        # holding the reference keeps its id from being reused); the lengths in the key guard against a
        # runner that mutates one object in place.
        key = (use_kernel, prefill_kernel, tuple(meta.query_lens_cpu), tuple(meta.seq_lens_cpu))
        if self._plan_meta is not meta or self._plan_key != key or self._plan is None:
            self._plan = self._build_plan(meta, k_cache.shape[1], g, nkv, d, use_kernel, prefill_kernel)
            self._plan_meta, self._plan_key = meta, key
        plan = self._plan
        if plan.decode is not None and plan.num_decode == t:
            return self._sdpa_decode(query, k_cache, v_cache, plan.decode, scale)
        out = torch.empty(t, nq, d, dtype=query.dtype, device=query.device)
        if plan.kernel is not None:
            self._run_kernel(query, k_cache, v_cache, meta, plan.kernel, out, scale)
        if plan.kernel_prefills is not None:
            self._run_prefill_kernel(query, k_cache, v_cache, meta, plan.kernel_prefills, out, scale)
        if plan.decode is not None:
            if plan.decode.rows is None:
                out[: plan.num_decode] = self._sdpa_decode(
                    query[: plan.num_decode], k_cache, v_cache, plan.decode, scale
                )
            else:
                q = query.index_select(0, plan.decode.rows)
                out.index_copy_(
                    0, plan.decode.rows, self._sdpa_decode(q, k_cache, v_cache, plan.decode, scale)
                )
        for p in plan.prefills:
            ql = p.end - p.start
            # [nkv, L, D] views of this sequence's keys and values
            k = k_cache.index_select(0, p.blocks).view(-1, nkv, d)[: p.seq_len].transpose(0, 1).to(query.dtype)
            v = v_cache.index_select(0, p.blocks).view(-1, nkv, d)[: p.seq_len].transpose(0, 1).to(query.dtype)
            # Query head h = kv * g + j -> [nkv, g, ql, D]; K/V broadcast over the group without copies.
            q = query[p.start : p.end].view(ql, nkv, g, d).permute(1, 2, 0, 3)
            k4 = k.unsqueeze(1).expand(nkv, g, p.seq_len, d)
            v4 = v.unsqueeze(1).expand(nkv, g, p.seq_len, d)
            if p.mask is None:
                o = F.scaled_dot_product_attention(q, k4, v4, is_causal=True, scale=scale)
            else:
                o = F.scaled_dot_product_attention(q, k4, v4, attn_mask=p.mask, scale=scale)
            out[p.start : p.end] = o.permute(2, 0, 1, 3).reshape(ql, nq, d)  # [nkv, g, ql, D] -> [ql, nq, D]
        return out

    def _run_kernel(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kr: _KernelRows,
        out: torch.Tensor,  # [T, nq, D] contiguous, the kernel fills its rows
        scale: float,
    ) -> None:
        assert self._kernel is not None
        threads = torch.get_num_threads()
        scratch = self._scratch_floats(threads * kr.scratch_per_thread)
        table = _int32_table(meta)
        _, nq, d = query.shape
        # The kernel computes in float32: a 16-bit model's query rows widen for it and their outputs round
        # back to the model's dtype (more exact than the 16-bit SDPA path, and one OpenMP region per layer
        # instead of a dozen ops).
        wide = query.dtype != torch.float32
        if wide:
            query = query.float()
            dest, out = out, torch.empty(out.shape, dtype=torch.float32)
        self._kernel.tandem_paged_attention(
            query.data_ptr(),
            query.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            KERNEL_KV_TYPES[k_cache.dtype],
            table.data_ptr(),
            table.stride(0),
            kr.rows.data_ptr(),
            kr.seqs.data_ptr(),
            kr.klens.data_ptr(),
            out.data_ptr(),
            scratch.data_ptr(),
            kr.scratch_per_thread,
            kr.rows.numel(),
            nq,
            k_cache.shape[2],
            d,
            k_cache.shape[1],
            scale,
            threads,
        )
        if wide:
            if kr.rows.numel() == out.shape[0]:
                dest.copy_(out)
            else:
                dest.index_copy_(0, kr.rows, out.index_select(0, kr.rows).to(dest.dtype))

    def _scratch_floats(self, n: int) -> torch.Tensor:
        """The kernels' per-thread scratch, grown to at least n floats and kept between calls."""
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=torch.float32)
        return self._scratch

    def _run_prefill_kernel(
        self,
        query: torch.Tensor,  # [T, nq, D] float32
        k_cache: torch.Tensor,  # float32, bfloat16 or float16
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kp: _KernelPrefills,
        out: torch.Tensor,  # [T, nq, D] contiguous float32, the kernel fills the prefills' rows
        scale: float,
    ) -> None:
        assert self._prefill_kernel is not None
        _, nq, d = query.shape
        nkv = k_cache.shape[2]
        threads = torch.get_num_threads()
        scratch = self._scratch_floats(threads * self._prefill_kernel.tandem_prefill_scratch(nq // nkv, d))
        table = _int32_table(meta)
        rc = self._prefill_kernel.tandem_prefill_attention_kv(
            query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            KERNEL_KV_TYPES[k_cache.dtype], table.data_ptr(),
            table.stride(0), kp.seq_ids.data_ptr(), kp.q_starts.data_ptr(), kp.q_lens.data_ptr(),
            kp.seq_lens.data_ptr(), kp.seq_ids.numel(), out.data_ptr(), scratch.data_ptr(), nq, nkv, d,
            k_cache.shape[1], scale, threads)
        if rc != 0:  # forward checked the layout; this is a bug, not an input error
            raise RuntimeError(f"tandem_prefill_attention refused nq={nq} nkv={nkv} d={d}")

    def _sdpa_decode(
        self,
        query: torch.Tensor,  # [Nd, nq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        dp: _SdpaDecode,
        scale: float,
    ) -> torch.Tensor:  # [Nd, nq, D]
        n, nq, d = query.shape
        nkv = k_cache.shape[2]
        # [Nd, nkv, L, D] (strided views of the gathered blocks)
        k = k_cache.index_select(0, dp.blocks).view(n, -1, nkv, d).transpose(1, 2).to(query.dtype)
        v = v_cache.index_select(0, dp.blocks).view(n, -1, nkv, d).transpose(1, 2).to(query.dtype)
        q = query.view(n, nkv, nq // nkv, d)  # the GQA group is the query-length axis
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=dp.mask, scale=scale)
        return o.reshape(n, nq, d)
