"""Triton attention backend against a dense causal torch reference.

The CPU cases run the kernels under `TRITON_INTERPRET=1` in one spawned worker process shared by this
module. Triton fixes compiled-vs-interpreted when the kernel module is first imported, so setting the
variable in the pytest process would leak into every later test module (and into the GPU test here).
The worker imports nothing from triton until its initializer has set the variable.
"""

from __future__ import annotations

import importlib.util
import math
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tandem_engine.attention.interface import AttentionMetadata

WORKER_TIMEOUT_S = 120


@dataclass(frozen=True)
class Case:
    query_lens: tuple[int, ...]  # this step's rows per sequence
    seq_lens: tuple[int, ...]  # cached context + this step's rows
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    num_padding_rows: int = 0  # trailing rows with slot -1 (CUDA-graph padding), outputs ignored
    split_kv: bool | None = False
    seed: int = 0
    kv_dtype: torch.dtype | None = None  # what the cache stores (--kv-cache-dtype); None: the query's dtype


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim], padding rows last
    new_keys: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], this step's keys in query order
    new_values: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim], context then new
    values: list[torch.Tensor]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    num_real_rows: int


def make_batch(case: Case, device: str, dtype: torch.dtype) -> Batch:
    """A batch with cached context in shuffled, non-contiguous blocks; unwritten cache slots hold NaN,
    so any read outside a sequence's keys poisons the output. Block 0 is never handed out: padded
    block-table entries point at it."""
    gen = torch.Generator().manual_seed(case.seed)
    bs, kvh, hd = case.block_size, case.num_kv_heads, case.head_dim
    blocks_per_seq = [math.ceil(s / bs) for s in case.seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_seq)
    block_table = torch.zeros(len(case.seq_lens), max_blocks, dtype=torch.int32)
    # Keys and values are rounded through the cache's dtype, so the cache holds them exactly.
    kv_dtype = case.kv_dtype or dtype
    k_cache = torch.full((num_blocks, bs, kvh, hd), float("nan"), dtype=kv_dtype)
    v_cache = torch.full_like(k_cache, float("nan"))

    keys, values, slots, new_k, new_v = [], [], [], [], []
    for i, (q_len, seq_len) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
        assert 1 <= q_len <= seq_len
        table = [free.pop() for _ in range(blocks_per_seq[i])]
        block_table[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(seq_len, kvh, hd, generator=gen).to(kv_dtype).to(dtype)  # [seq_len, kvh, hd]
        v = torch.randn(seq_len, kvh, hd, generator=gen).to(kv_dtype).to(dtype)
        keys.append(k)
        values.append(v)
        ctx = seq_len - q_len
        for pos in range(seq_len):
            slot = table[pos // bs] * bs + pos % bs
            if pos < ctx:  # cached by earlier steps
                k_cache[slot // bs, slot % bs] = k[pos]
                v_cache[slot // bs, slot % bs] = v[pos]
            else:
                slots.append(slot)
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])

    num_real = sum(case.query_lens)
    pad = case.num_padding_rows
    new_k.append(torch.randn(pad, kvh, hd, generator=gen).to(dtype))
    new_v.append(torch.randn(pad, kvh, hd, generator=gen).to(dtype))
    slots += [-1] * pad
    query = torch.randn(num_real + pad, case.num_q_heads, hd, generator=gen).to(dtype)
    qsl = [0]
    for q_len in case.query_lens:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(case.query_lens),
        max_seq_len=max(case.seq_lens),
        query_lens_cpu=list(case.query_lens),
        seq_lens_cpu=list(case.seq_lens),
    )
    return Batch(
        query=query.to(device),
        new_keys=torch.cat(new_k).to(device),
        new_values=torch.cat(new_v).to(device),
        keys=keys,
        values=values,
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        meta=meta,
        num_real_rows=num_real,
    )


def reference_attention(batch: Batch, scale: float) -> torch.Tensor:
    """Dense causal attention per sequence in fp32: [num_real_rows, num_q_heads, head_dim]."""
    rows = []
    qsl = batch.meta.query_start_loc.tolist()
    lens = zip(batch.meta.query_lens_cpu, batch.meta.seq_lens_cpu, strict=True)
    for i, (q_len, seq_len) in enumerate(lens):
        q = batch.query[qsl[i] : qsl[i + 1]].float().cpu()  # [q_len, hq, hd]
        group = q.shape[1] // batch.keys[i].shape[1]
        k = batch.keys[i].float().repeat_interleave(group, dim=1)  # [seq_len, hq, hd]
        v = batch.values[i].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [hq, q_len, seq_len]
        q_pos = seq_len - q_len + torch.arange(q_len)
        visible = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        rows.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(rows)


def gathered_keys(batch: Batch, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i's keys and values read back from the paged cache through its block table."""
    table = batch.meta.block_table[i].long()
    seq_len = batch.meta.seq_lens_cpu[i]
    shape = (-1, batch.k_cache.shape[2], batch.k_cache.shape[3])
    return (
        batch.k_cache[table].reshape(shape)[:seq_len].cpu(),
        batch.v_cache[table].reshape(shape)[:seq_len].cpu(),
    )


def run_attention_case(case: Case, device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """write_kv then forward through the backend; returns the max abs error against the reference."""
    from tandem_engine.attention.triton_backend import TritonAttentionBackend

    batch = make_batch(case, device, dtype)
    backend = TritonAttentionBackend(split_kv=case.split_kv)
    backend.write_kv(batch.new_keys, batch.new_values, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    for i in range(batch.meta.num_seqs):
        k, v = gathered_keys(batch, i)
        assert k.dtype == (case.kv_dtype or dtype)
        assert torch.equal(k.to(dtype), batch.keys[i]) and torch.equal(v.to(dtype), batch.values[i]), f"seq {i}"
    scale = case.head_dim**-0.5
    out = backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    assert out.shape == batch.query.shape and out.dtype == dtype
    got = out[: batch.num_real_rows].float().cpu()
    assert not got.isnan().any(), "NaN in output: a masked or foreign cache slot was read"
    return (got - reference_attention(batch, scale)).abs().max().item()


def run_store_case(seed: int) -> None:
    """Store kernel alone: strided key/value views, -1 slots skipped, every other slot untouched."""
    from tandem_engine.attention.triton_backend import TritonAttentionBackend

    gen = torch.Generator().manual_seed(seed)
    num_blocks, bs, kvh, hd = 5, 16, 3, 64
    # key and value as views into one fused [tokens, 2 * kvh * hd] projection, like a qkv split.
    fused = torch.randn(6, 2 * kvh * hd, generator=gen)
    key = fused[:, : kvh * hd].view(6, kvh, hd)
    value = fused[:, kvh * hd :].view(6, kvh, hd)
    slots = torch.tensor([17, -1, 3, 79, -1, 40], dtype=torch.int64)
    k_cache = torch.full((num_blocks, bs, kvh, hd), 7.0)
    v_cache = torch.full((num_blocks, bs, kvh, hd), -7.0)
    TritonAttentionBackend().write_kv(key, value, k_cache, v_cache, slots)
    expect_k = torch.full_like(k_cache, 7.0).view(-1, kvh, hd)
    expect_v = torch.full_like(v_cache, -7.0).view(-1, kvh, hd)
    keep = slots >= 0
    expect_k[slots[keep]] = key[keep]
    expect_v[slots[keep]] = value[keep]
    assert torch.equal(k_cache.view(-1, kvh, hd), expect_k)
    assert torch.equal(v_cache.view(-1, kvh, hd), expect_v)


def _enter_interpreter() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def interpreter() -> Iterator[ProcessPoolExecutor]:
    if importlib.util.find_spec("triton") is None:  # find, not import: keep triton out of this process
        pytest.skip("triton is not installed")
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_enter_interpreter) as pool:
        yield pool


CPU_CASES = {
    "decode": Case(query_lens=(1, 1, 1, 1), seq_lens=(1, 17, 32, 40)),
    "prefill": Case(query_lens=(13, 32), seq_lens=(13, 32)),
    "prefill_with_context": Case(query_lens=(7, 20), seq_lens=(30, 53)),
    "mixed_with_padding": Case(query_lens=(1, 9, 1, 20), seq_lens=(25, 9, 48, 37), num_padding_rows=3),
    "gqa_9_3_mixed": Case(query_lens=(1, 6, 11), seq_lens=(33, 6, 27), num_q_heads=9, num_kv_heads=3),
    "mha_2_2_block_8": Case(
        query_lens=(5, 1), seq_lens=(21, 16), num_q_heads=2, num_kv_heads=2, block_size=8
    ),
    "split_kv_decode": Case(query_lens=(1, 1, 1), seq_lens=(3, 50, 97), split_kv=True),
    "split_kv_mixed_gqa_9_3": Case(
        query_lens=(1, 12), seq_lens=(70, 30), num_q_heads=9, num_kv_heads=3, split_kv=True
    ),
    "bf16_cache_mixed_gqa_9_3": Case(
        query_lens=(1, 6, 11), seq_lens=(33, 6, 27), num_q_heads=9, num_kv_heads=3, kv_dtype=torch.bfloat16
    ),
    "fp16_cache_split_kv_block_8": Case(
        query_lens=(1, 5), seq_lens=(50, 21), block_size=8, split_kv=True, kv_dtype=torch.float16
    ),
}


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_attention_interpreted(interpreter: ProcessPoolExecutor, name: str) -> None:
    err = interpreter.submit(run_attention_case, CPU_CASES[name]).result(timeout=WORKER_TIMEOUT_S)
    assert err < 1e-4, f"{name}: max abs error {err}"


def test_store_kv_interpreted(interpreter: ProcessPoolExecutor) -> None:
    interpreter.submit(run_store_case, 0).result(timeout=WORKER_TIMEOUT_S)


def test_reference_matches_sdpa() -> None:
    """The reference itself, on a case SDPA can express: prefill without context, GQA expanded."""
    batch = make_batch(CPU_CASES["prefill"], "cpu", torch.float32)
    scale = 0.125
    ref = reference_attention(batch, scale)
    for i, (start, end) in enumerate([(0, 13), (13, 45)]):
        q = batch.query[start:end].transpose(0, 1)  # [hq, q_len, hd]
        k = batch.keys[i].repeat_interleave(2, dim=1).transpose(0, 1)  # [hq, seq_len, hd]
        v = batch.values[i].repeat_interleave(2, dim=1).transpose(0, 1)
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1)
        torch.testing.assert_close(ref[start:end], sdpa, atol=1e-5, rtol=1e-5)


def test_import_does_not_need_triton() -> None:
    """The backend module must import (and report availability) without importing triton."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from tandem_engine.attention import triton_backend as tb\n"
        "assert tb.TritonAttentionBackend.name == 'triton'\n"
        "print(tb.triton_available())\n"
    )
    workers = os.path.join(os.path.dirname(__file__), "..", "..", "..", "workers")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(workers)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_kernels_compile_for_sm90() -> None:
    """Lower every kernel variant to an sm_90 cubin without a GPU: catches typing and lowering errors
    (loop-carried types, dot shapes, constexpr misuse) that the interpreter lets through."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("kernels are interpreted in this process")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tandem_engine.attention import triton_kernels as tk

    def compile_for_sm90(fn: Any, types: dict[str, str], consts: dict[str, Any]) -> None:
        # Unlisted arguments are integer strides and counts.
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": tk.FP_FUSION})

    act = "*bf16"
    cache = {"k_cache_ptr": act, "v_cache_ptr": act}
    compile_for_sm90(
        tk._store_kv_kernel,
        {"key_ptr": act, "value_ptr": act, "slot_ptr": "*i64", **cache},
        dict(NUM_KV_HEADS=3, HEAD_DIM=64, BLOCK_SIZE=16, HEADS_PAD=4, DIM_PAD=64),
    )
    seg = {"seg_out_ptr": "*fp32", "seg_max_ptr": "*fp32", "seg_sum_ptr": "*fp32"}
    types = {
        "out_ptr": act, "q_ptr": act, "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
        "query_start_loc_ptr": "*i32", "qk_scale": "fp32", **cache, **seg,
    }  # fmt: skip
    for segments, (block_q, block_m) in ((1, tk.tile_config(3, 2048)), (16, tk.tile_config(3, 1))):
        consts = dict(
            NUM_Q_HEADS=9, GROUP=3, HEAD_DIM=64, DIM_PAD=64, BLOCK_SIZE=16, BLOCK_Q=block_q, BLOCK_M=block_m,
            TILE_N=32, NUM_SEGMENTS=segments, DOT_PRECISION="tf32",
        )  # fmt: skip
        compile_for_sm90(tk._unified_attention_kernel, types, consts)
    compile_for_sm90(
        tk._reduce_segments_kernel,
        {"out_ptr": act, **seg},
        dict(NUM_Q_HEADS=9, HEAD_DIM=64, DIM_PAD=64, NUM_SEGMENTS=16),
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_attention_cuda(name: str, dtype: torch.dtype) -> None:
    pytest.importorskip("triton")
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    for split in (CPU_CASES[name].split_kv, None):
        err = run_attention_case(replace(CPU_CASES[name], split_kv=split), "cuda", dtype)
        assert err < tol, f"{name} {dtype} split_kv={split}: max abs error {err}"
