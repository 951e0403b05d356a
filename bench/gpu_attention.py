"""GPU check and timing of the Triton attention backend at SmolLM2 shapes (needs an NVIDIA GPU).

For each case it fills a paged KV cache with shuffled, non-contiguous blocks, runs the backend's
`write_kv` + `forward`, checks the output against an fp32 dense causal reference per sequence, then
times the backend (auto split-KV, and the single-pass kernel alone) against torch SDPA on K/V
gathered through the block table (the gather is part of the baseline: a torch backend pays it).

    python bench/gpu_attention.py [--dtype bfloat16|float16] [--out bench/results/gpu_attention.json]

Prints one line per case and writes JSON; exits 1 if any output is off, 2 without CUDA or triton.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "workers"))

from tandem_engine.attention.interface import AttentionMetadata  # noqa: E402
from tandem_engine.attention.triton_backend import TritonAttentionBackend, triton_available  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2-135M
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


@dataclass(frozen=True)
class Case:
    name: str
    query_lens: list[int]
    seq_lens: list[int]


CASES = [
    Case("decode_b32_ctx512", [1] * 32, [512] * 32),
    Case("prefill_2048", [2048], [2048]),
    # A chunked-prefill step: a 512-token chunk over 1536 cached tokens beside 31 decodes.
    Case("mixed_chunk512_ctx1536_plus_31_decode", [512] + [1] * 31, [2048] + [512] * 31),
]


@dataclass
class Step:
    query: torch.Tensor  # [num_tokens, NUM_Q_HEADS, HEAD_DIM]
    new_k: torch.Tensor  # [num_tokens, NUM_KV_HEADS, HEAD_DIM]
    new_v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    v_cache: torch.Tensor
    meta: AttentionMetadata


def build_step(case: Case, dtype: torch.dtype, device: torch.device) -> Step:
    """Context written straight into shuffled blocks; this step's K/V left for write_kv."""
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = [math.ceil(s / BLOCK_SIZE) for s in case.seq_lens]
    num_blocks = 1 + sum(blocks)
    order = torch.randperm(num_blocks - 1, device=device, generator=gen) + 1  # block 0 stays unused
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device=device)
    new_slots, start = [], 0
    flat_k = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    flat_v = v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    for i, (q_len, seq_len) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
        table = order[start : start + blocks[i]]
        start += blocks[i]
        block_table[i, : blocks[i]] = table.to(torch.int32)
        pos = torch.arange(seq_len, device=device)
        slots = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE  # [seq_len]
        ctx = seq_len - q_len
        shape = (ctx, NUM_KV_HEADS, HEAD_DIM)
        flat_k[slots[:ctx]] = torch.randn(shape, device=device, generator=gen).to(dtype)
        flat_v[slots[:ctx]] = torch.randn(shape, device=device, generator=gen).to(dtype)
        new_slots.append(slots[ctx:])
    num_tokens = sum(case.query_lens)
    qsl = [0]
    for q_len in case.query_lens:
        qsl.append(qsl[-1] + q_len)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=device, generator=gen).to(dtype)

    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        block_table=block_table,
        slot_mapping=torch.cat(new_slots).to(torch.int64),
        max_query_len=max(case.query_lens),
        max_seq_len=max(case.seq_lens),
        query_lens_cpu=list(case.query_lens),
        seq_lens_cpu=list(case.seq_lens),
    )
    return Step(
        query=rand(num_tokens, NUM_Q_HEADS, HEAD_DIM),
        new_k=rand(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        new_v=rand(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        k_cache=k_cache,
        v_cache=v_cache,
        meta=meta,
    )


def gather(step: Step, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i's K/V through its block table: [NUM_KV_HEADS, seq_len, HEAD_DIM] each."""
    seq_len = step.meta.seq_lens_cpu[i]
    table = step.meta.block_table[i, : math.ceil(seq_len / BLOCK_SIZE)].long()
    k = step.k_cache[table].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len]
    v = step.v_cache[table].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len]
    return k.transpose(0, 1), v.transpose(0, 1)


def reference(step: Step, scale: float) -> torch.Tensor:
    """fp32 dense causal attention per sequence: [num_tokens, NUM_Q_HEADS, HEAD_DIM]."""
    rows, start = [], 0
    group = NUM_Q_HEADS // NUM_KV_HEADS
    for i, (q_len, seq_len) in enumerate(zip(step.meta.query_lens_cpu, step.meta.seq_lens_cpu, strict=True)):
        k, v = gather(step, i)
        k = k.float().repeat_interleave(group, dim=0)  # [NUM_Q_HEADS, seq_len, HEAD_DIM]
        v = v.float().repeat_interleave(group, dim=0)
        q = step.query[start : start + q_len].float().transpose(0, 1)  # [NUM_Q_HEADS, q_len, HEAD_DIM]
        scores = q @ k.transpose(1, 2) * scale  # [NUM_Q_HEADS, q_len, seq_len]
        q_pos = seq_len - q_len + torch.arange(q_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        rows.append((probs @ v).transpose(0, 1))
        start += q_len
    return torch.cat(rows)


def sdpa_baseline(step: Step, scale: float) -> Callable[[], Any]:
    """Torch SDPA on gathered K/V: one batched call when every sequence has the same shape, a
    per-sequence loop otherwise (what a gather + SDPA backend does)."""
    meta = step.meta
    uniform = len(set(meta.query_lens_cpu)) == 1 and len(set(meta.seq_lens_cpu)) == 1
    q_len, seq_len = meta.query_lens_cpu[0], meta.seq_lens_cpu[0]
    no_context = all(q == s for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True))
    if uniform and (q_len == 1 or no_context):
        nblk = math.ceil(seq_len / BLOCK_SIZE)

        def batched() -> torch.Tensor:
            table = meta.block_table[:, :nblk].long()  # [num_seqs, nblk]
            k = step.k_cache[table].flatten(1, 2)[:, :seq_len].transpose(1, 2)  # [B, KV, S, D]
            v = step.v_cache[table].flatten(1, 2)[:, :seq_len].transpose(1, 2)
            q = step.query.view(meta.num_seqs, q_len, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)
            return F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, scale=scale, enable_gqa=True)

        return batched

    def looped() -> list[torch.Tensor]:
        outs, start = [], 0
        for i, (ql, sl) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            k, v = gather(step, i)
            q = step.query[start : start + ql].transpose(0, 1)
            mask = None
            if ql > 1:
                q_pos = sl - ql + torch.arange(ql, device=q.device)
                mask = torch.arange(sl, device=q.device)[None, :] <= q_pos[:, None]
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True))
            start += ql
        return outs

    return looped


def bench_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def run_case(case: Case, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    step = build_step(case, dtype, device)
    scale = HEAD_DIM**-0.5
    auto = TritonAttentionBackend()
    single = TritonAttentionBackend(split_kv=False)
    auto.write_kv(step.new_k, step.new_v, step.k_cache, step.v_cache, step.meta.slot_mapping)
    ref = reference(step, scale)
    errors = {}
    for label, backend in (("auto", auto), ("single_pass", single)):
        out = backend.forward(step.query, step.k_cache, step.v_cache, step.meta, scale)
        errors[label] = (out.float() - ref).abs().max().item()
    ok = all(e < TOLERANCE[dtype] for e in errors.values())

    def fwd(backend: TritonAttentionBackend) -> Callable[[], Any]:
        return lambda: backend.forward(step.query, step.k_cache, step.v_cache, step.meta, scale)

    def store() -> None:
        auto.write_kv(step.new_k, step.new_v, step.k_cache, step.v_cache, step.meta.slot_mapping)

    ms = {
        "triton_auto": bench_ms(fwd(auto)),
        "triton_single_pass": bench_ms(fwd(single)),
        "torch_sdpa_gathered": bench_ms(sdpa_baseline(step, scale)),
        "triton_write_kv": bench_ms(store),
    }
    return {
        "num_seqs": len(case.query_lens),
        "num_tokens": sum(case.query_lens),
        "max_query_len": max(case.query_lens),
        "max_seq_len": max(case.seq_lens),
        "split_kv_auto": auto.uses_split_kv(step.query, step.k_cache, step.meta),
        "max_abs_err": errors,
        "tolerance": TOLERANCE[dtype],
        "ok": ok,
        "ms": ms,
        "speedup_vs_sdpa": ms["torch_sdpa_gathered"] / ms["triton_auto"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_attention.json")
    args = parser.parse_args()
    if importlib.util.find_spec("triton") is None or not torch.cuda.is_available() or not triton_available():
        print("gpu_attention: needs CUDA and triton; nothing run", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    import triton

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "model_shape": {"q_heads": NUM_Q_HEADS, "kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "block_size": BLOCK_SIZE,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cases": {},
    }
    for case in CASES:
        res = run_case(case, dtype, device)
        results["cases"][case.name] = res
        ms = res["ms"]
        print(
            f"{case.name:40s} {'ok ' if res['ok'] else 'BAD'} err={max(res['max_abs_err'].values()):.2e} "
            f"triton={ms['triton_auto']:.3f}ms single={ms['triton_single_pass']:.3f}ms "
            f"sdpa={ms['torch_sdpa_gathered']:.3f}ms store={ms['triton_write_kv']:.3f}ms "
            f"x{res['speedup_vs_sdpa']:.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(c["ok"] for c in results["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
