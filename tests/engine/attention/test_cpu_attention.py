"""CpuAttentionBackend against a dense per-sequence reference, over scattered paged blocks."""

from __future__ import annotations

import random
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from tandem_engine.attention.cpu_backend import CpuAttentionBackend, _writes_in_one_pass
from tandem_engine.kernels.paged_attention import kernel_scratch, load_kernel
from tests.engine.utils import dense_causal_attention, make_meta

BS = 4
NQ, NKV, D = 6, 2, 8
NUM_BLOCKS = 40
POISON = 1e3


def run_step(
    query_lens: list[int],
    seq_lens: list[int],
    tables: list[list[int]],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    use_kernel: bool = False,
    heads: tuple[int, int, int] = (NQ, NKV, D),
    bs: int = BS,
    kv_dtype: torch.dtype | None = None,
    v_scale: float = 1.0,
    q_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill each sequence's earlier context into its blocks, write this step's K/V, attend; return
    (backend output, reference output), both [T, NQ, D]. A `kv_dtype` cache (default: `dtype`) stores
    rounded keys and values: the reference attends over the same rounded values, in `dtype`."""
    nq, nkv, d = heads
    g = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    # Unwritten slots hold a large finite value: any weight given to one shows up in the result.
    k_cache = torch.full((NUM_BLOCKS, bs, nkv, d), POISON, dtype=kv_dtype)
    v_cache = torch.full((NUM_BLOCKS, bs, nkv, d), POISON, dtype=kv_dtype)
    backend = CpuAttentionBackend(use_kernel=use_kernel)
    keys = [torch.randn(s, nkv, d, generator=g).to(dtype) for s in seq_lens]
    vals = [(torch.randn(s, nkv, d, generator=g) * v_scale).to(dtype) for s in seq_lens]
    # Cached context, written as an earlier step would have.
    ctx = [s - q for q, s in zip(query_lens, seq_lens, strict=True)]
    if sum(ctx):
        with_ctx = [c for c in ctx if c]
        prev = make_meta(with_ctx, with_ctx, [t for t, c in zip(tables, ctx, strict=True) if c], bs)
        backend.write_kv(
            torch.cat([k[:c] for k, c in zip(keys, ctx, strict=True) if c]),
            torch.cat([v[:c] for v, c in zip(vals, ctx, strict=True) if c]),
            k_cache,
            v_cache,
            prev.slot_mapping,
        )
    meta = make_meta(query_lens, seq_lens, tables, bs)
    backend.write_kv(
        torch.cat([k[c:] for k, c in zip(keys, ctx, strict=True)]),
        torch.cat([v[c:] for v, c in zip(vals, ctx, strict=True)]),
        k_cache,
        v_cache,
        meta.slot_mapping,
    )
    query = (torch.randn(sum(query_lens), nq, d, generator=g) * q_scale).to(dtype)
    scale = d**-0.5
    out = backend.forward(query, k_cache, v_cache, meta, scale)
    ref, start = [], 0
    for q, k, v in zip(query_lens, keys, vals, strict=True):
        k, v = k.to(kv_dtype).to(dtype), v.to(kv_dtype).to(dtype)
        ref.append(dense_causal_attention(query[start : start + q], k, v, scale))
        start += q
    return out, torch.cat(ref)


CASES = {
    # name: (query_lens, seq_lens, block tables; blocks deliberately out of order and non-contiguous)
    "prefill": ([5, 9], [5, 9], [[7, 15], [3, 12, 1]]),
    "prefill_with_context": ([3, 6], [11, 14], [[9, 2, 30], [5, 17, 8, 22]]),
    "decode": ([1, 1, 1, 1], [1, 7, 16, 13], [[4], [11, 6], [20, 21, 3, 19], [33, 2, 27, 8]]),
    "decode_equal_full_blocks": ([1, 1], [8, 8], [[1, 2], [4, 3]]),
    "decode_and_two_token_chunks": ([2, 1, 2], [9, 5, 2], [[6, 1, 19], [25, 3], [11]]),
    "long_prefill_with_context": ([20, 1], [27, 5], [[3, 8, 13, 18, 23, 28, 33], [4, 9]]),
    "mixed": (
        [1, 6, 1, 4, 1],
        [9, 6, 3, 12, 20],
        [[2, 9, 31], [14, 5], [7], [13, 26, 1], [36, 35, 34, 33, 32]],
    ),
}


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "c_kernel"])
@pytest.mark.parametrize("case", CASES)
def test_matches_dense_reference(case: str, use_kernel: bool) -> None:
    out, ref = run_step(*CASES[case], use_kernel=use_kernel)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "c_kernel"])
@pytest.mark.parametrize("heads", [(4, 4, 16), (8, 1, 128), (9, 3, 64), (6, 2, 12), (2, 1, 40)],
                         ids=["mha", "mqa_d128", "smollm2", "d12_scalar", "d40_vector_tail"])
def test_head_layouts_at_block_size_16(heads: tuple[int, int, int], use_kernel: bool) -> None:
    """Decode rows, a long prefill with context and a short chunk, at the engine's block size."""
    tables = [[5, 30, 12], [7, 2], [21, 9, 33], [17, 3]]
    out, ref = run_step([1, 20, 3, 1], [40, 20, 35, 17], tables, use_kernel=use_kernel, heads=heads, bs=16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_scale", [10.0, 60.0])
def test_kernel_softmax_over_scores_far_apart(q_scale: float) -> None:
    """Scores tens to hundreds apart (most weights underflow to 0): the kernel's weights still match torch's
    softmax, over context lengths that end mid-vector and mid-block."""
    tables = [[5, 30, 12], [7, 2], [21, 9, 33], [17, 3]]
    out, ref = run_step([1, 1, 1, 1], [40, 20, 35, 17], tables, use_kernel=True, heads=(9, 3, 64), bs=16,
                        q_scale=q_scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [(6, 2, 8), (9, 3, 64), (8, 2, 128), (6, 2, 12)],
                         ids=["d8", "smollm2", "d128_group_of_4", "d12_scalar"])
def test_kernel_head_ranges_are_the_whole_rows_heads(heads: tuple[int, int, int], tmp_path: Path) -> None:
    """The head-range entry (which the fused decode step splits a row's heads over threads with) writes
    exactly what the whole-row kernel writes for those heads, however the heads are cut."""
    nq, nkv, d = heads
    lib = load_kernel(tmp_path)
    assert lib is not None
    g = torch.Generator().manual_seed(nq * d)
    k_cache, v_cache = (torch.randn(NUM_BLOCKS, 16, nkv, d, generator=g) for _ in range(2))
    seq_lens, tables = [40, 7, 33], [[5, 30, 12], [7], [21, 9, 33]]
    meta = make_meta([1] * 3, seq_lens, tables, 16)
    q = torch.randn(3, nq, d, generator=g)
    want = CpuAttentionBackend(use_kernel=True, cache_dir=tmp_path).forward(q, k_cache, v_cache, meta, 0.3)
    got = torch.full_like(want, float("nan"))
    for r, cuts in enumerate([[0, nq], [0, 1, nq - 2, nq], [0, nq // 2, nq // 2 + 1, nq]]):
        scratch = torch.empty(kernel_scratch(nq, nkv, d, 16, seq_lens[r]))
        for h0, h1 in pairwise(cuts):
            lib.tandem_paged_attention_heads(q[r].data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), 0,
                                             meta.block_table[r].data_ptr(), seq_lens[r], got[r].data_ptr(),
                                             scratch.data_ptr(), nq, nkv, d, 16, 0.3, h0, h1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("missing", ["decode", "prefill"])
def test_the_two_kernel_libraries_are_on_together_or_off(missing: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows (paged_attention.c) and prefill chunks (prefill_attention.c) are two libraries: where
    either cannot be built, the backend runs as without a compiler (torch SDPA everywhere, no entries for the
    fused step), and a backend told to use the kernels refuses to start."""
    import tandem_engine.attention.cpu_backend as cpu_backend

    name = "load_kernel" if missing == "decode" else "load_prefill_kernel"
    monkeypatch.setattr(cpu_backend, name, lambda cache: None)
    backend = CpuAttentionBackend(cache_dir=tmp_path)
    assert backend._kernel is None and backend._prefill_kernel is None and backend.step_entries is None
    with pytest.raises(RuntimeError, match="could not be built"):
        CpuAttentionBackend(use_kernel=True, cache_dir=tmp_path)
    monkeypatch.undo()
    entries = CpuAttentionBackend(cache_dir=tmp_path).step_entries
    assert entries is not None and all(entries.values())


def test_plan_is_rebuilt_for_a_new_step() -> None:
    """Two consecutive steps through one backend instance must not reuse the first step's plan."""
    backend = CpuAttentionBackend()
    k_cache = torch.randn(NUM_BLOCKS, BS, NKV, D)
    v_cache = torch.randn(NUM_BLOCKS, BS, NKV, D)
    for seq_lens in ([3, 5], [7, 2, 9]):
        tables = [[i + 1, i + 10, i + 20] for i in range(len(seq_lens))]
        meta = make_meta([1] * len(seq_lens), seq_lens, tables, BS)
        q = torch.randn(len(seq_lens), NQ, D)
        out = backend.forward(q, k_cache, v_cache, meta, 0.3)
        for i, s in enumerate(seq_lens):
            k = torch.cat([k_cache[b] for b in tables[i]])[:s]
            v = torch.cat([v_cache[b] for b in tables[i]])[:s]
            torch.testing.assert_close(
                out[i : i + 1], dense_causal_attention(q[i : i + 1], k, v, 0.3), atol=1e-5, rtol=1e-5
            )


def test_bfloat16_close_to_reference() -> None:
    out, ref = run_step(*CASES["mixed"], seed=1, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


KV16 = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_model_decode_rows_take_the_kernel_in_float32(dtype: str) -> None:
    """A bfloat16 or float16 model's decode rows go through the C kernel: exactly its float32 answer over the
    same cache and the widened query, rounded to the model's dtype; a prefill chunk in the same step stays
    on SDPA; everything is close to the torch-only path."""
    dt = KV16[dtype]
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache = (torch.randn(NUM_BLOCKS, 16, 3, 64, generator=g).to(dt) for _ in range(2))
    meta = make_meta([1, 5, 1], [40, 21, 7], [[5, 30, 12], [7, 2], [21]], 16)
    q = torch.randn(7, 9, 64, generator=g).to(dt)
    kernel = CpuAttentionBackend(use_kernel=True)
    out = kernel.forward(q, k_cache, v_cache, meta, 0.125)
    assert out.dtype == dt
    wide = kernel.forward(q.float(), k_cache, v_cache, meta, 0.125)
    decode_rows = [0, 6]
    assert torch.equal(out[decode_rows], wide[decode_rows].to(dt))
    torch_only = CpuAttentionBackend(use_kernel=False).forward(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(out[1:6], torch_only[1:6])  # the chunk's rows: the same SDPA call
    torch.testing.assert_close(out.float(), torch_only.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv", KV16)
@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "c_kernel"])
@pytest.mark.parametrize("case", CASES)
def test_16_bit_cache_computes_in_float32_over_its_rounded_values(case: str, use_kernel: bool, kv: str) -> None:
    """A float32 model over a bfloat16 or float16 cache (--kv-cache-dtype): exact float32 attention of the
    rounded keys and values, so only the rounding at write time differs from a float32 cache."""
    out, ref = run_step(*CASES[case], use_kernel=use_kernel, kv_dtype=KV16[kv])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv", KV16)
@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "c_kernel"])
@pytest.mark.parametrize(("heads", "bs"), [((9, 3, 64), 16), ((3, 1, 13), 5), ((8, 1, 128), 16), ((5, 5, 7), 3)],
                         ids=["smollm2", "odd_d13_bs5", "mqa_d128", "mha_d7_bs3"])
def test_16_bit_cache_head_layouts_and_block_sizes(heads: tuple[int, int, int], bs: int, use_kernel: bool,
                                                   kv: str) -> None:
    """Decode rows, a long prefill, a two-token chunk, over shuffled blocks (odd head dims and block sizes)."""
    seq_lens = [40, 20, 35, 17]
    free = random.Random(bs).sample(range(1, NUM_BLOCKS), NUM_BLOCKS - 1)
    tables = [[free.pop() for _ in range(-(-s // bs))] for s in seq_lens]
    out, ref = run_step([1, 20, 2, 1], seq_lens, tables, use_kernel=use_kernel, heads=heads, bs=bs,
                        kv_dtype=KV16[kv])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "c_kernel"])
def test_float16_cache_reads_subnormal_values_exactly(use_kernel: bool) -> None:
    """Values under float16's smallest normal (6.1e-5) are stored as subnormals; reading them back must not
    flush them to zero (the output is a weighted mean of values of order 1e-6)."""
    out, ref = run_step(*CASES["decode"], use_kernel=use_kernel, kv_dtype=torch.float16, v_scale=2e-6)
    assert ref.abs().max() < 6.1e-5 and ref.abs().max() > 1e-7
    torch.testing.assert_close(out, ref, atol=1e-11, rtol=1e-4)


def test_write_rounds_to_the_cache_dtype_and_touches_only_its_slots() -> None:
    backend = CpuAttentionBackend()
    key, value = torch.randn(3, NKV, D) * 100, torch.randn(3, NKV, D)
    k_cache = torch.zeros(NUM_BLOCKS, BS, NKV, D, dtype=torch.bfloat16)
    v_cache = torch.zeros(NUM_BLOCKS, BS, NKV, D, dtype=torch.bfloat16)
    slots = torch.tensor([9, 2, 33])
    backend.write_kv(key, value, k_cache, v_cache, slots)
    expect_k = torch.zeros(NUM_BLOCKS * BS, NKV, D, dtype=torch.bfloat16)
    expect_k[slots] = key.to(torch.bfloat16)
    assert torch.equal(k_cache.view(-1, NKV, D), expect_k)
    assert torch.equal(v_cache.view(-1, NKV, D)[slots], value.to(torch.bfloat16))
    assert v_cache.view(-1, NKV, D).count_nonzero() == value.count_nonzero()


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize(("tokens", "nkv", "d"), [(1, NKV, D), (32, 3, 64), (257, 1, 2), (5, 4, 128)])
def test_float32_write_is_index_copy_over_strided_views(tokens: int, nkv: int, d: int, use_kernel: bool,
                                                        tmp_path: Path) -> None:
    """K and V as the layer hands them over (views into one QKV row with Q in front) land in exactly
    their slots, bit for bit, with or without the C kernel's one-pass copy."""
    backend = CpuAttentionBackend(use_kernel=use_kernel, cache_dir=tmp_path)
    nq = 2 * nkv
    qkv = torch.randn(tokens, (nq + 2 * nkv) * d)
    key = qkv[:, nq * d : (nq + nkv) * d].view(tokens, nkv, d)
    value = qkv[:, (nq + nkv) * d :].view(tokens, nkv, d)
    n_slots = 2 * tokens + 16
    slots = torch.randperm(n_slots, generator=torch.Generator().manual_seed(tokens))[:tokens]
    k_cache = torch.full((n_slots // 8 + 1, 8, nkv, d), POISON)
    v_cache = torch.full((n_slots // 8 + 1, 8, nkv, d), -POISON)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    expect_k.view(-1, nkv, d)[slots] = key
    expect_v.view(-1, nkv, d)[slots] = value
    assert _writes_in_one_pass(key, value, k_cache, v_cache, slots)  # the kernel's path, where it is on
    backend.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k)
    assert torch.equal(v_cache, expect_v)


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("bad", [-1, NUM_BLOCKS * BS])
def test_write_to_a_slot_outside_the_cache_raises_and_writes_nothing(bad: int, use_kernel: bool,
                                                                     tmp_path: Path) -> None:
    backend = CpuAttentionBackend(use_kernel=use_kernel, cache_dir=tmp_path)
    key, value = torch.randn(3, NKV, D), torch.randn(3, NKV, D)
    k_cache, v_cache = torch.zeros(NUM_BLOCKS, BS, NKV, D), torch.zeros(NUM_BLOCKS, BS, NKV, D)
    with pytest.raises(IndexError):
        backend.write_kv(key, value, k_cache, v_cache, torch.tensor([5, bad, 7]))
    if use_kernel:  # index_copy_ may have written the slots before the bad one; the kernel checks first
        assert k_cache.count_nonzero() == 0 and v_cache.count_nonzero() == 0


def count_prefill_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    """The backend's calls of the C prefill kernel from now on (the kernel still runs)."""
    calls: list[tuple[object, ...]] = []
    real = CpuAttentionBackend._run_prefill_kernel

    def counted(self: CpuAttentionBackend, *args: object) -> None:
        calls.append(args)
        real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(CpuAttentionBackend, "_run_prefill_kernel", counted)
    return calls


PREFILL_HEADS = [(6, 2, 16), (8, 1, 64), (4, 4, 32), (9, 3, 64), (16, 2, 128)]


@pytest.mark.parametrize("heads", PREFILL_HEADS, ids=["g3_d16", "mqa_d64", "mha_d32", "smollm2", "g8_d128"])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([5, 9], [5, 9]), ([16, 17, 1], [16, 30, 9]), ([37, 1, 33], [37, 12, 50]), ([3, 40], [21, 63]),
     ([150, 1, 20], [150, 9, 300])],
    ids=["short", "tile_edges_and_decode", "long_with_context", "chunk_after_context", "past_one_key_chunk"],
)
def test_prefill_chunks_take_the_kernel_and_match_the_dense_reference(
    query_lens: list[int], seq_lens: list[int], heads: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of every length around the kernel's 16-token tiles, fresh or after cached context, beside
    decode rows, over out-of-order blocks, and past its 128-key softmax chunks (the running maximum and sum
    carried from one chunk to the next): the tiled causal kernel against a dense per-sequence reference."""
    calls = count_prefill_kernel_calls(monkeypatch)
    order = random.Random(sum(seq_lens)).sample(range(NUM_BLOCKS), NUM_BLOCKS)
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // 16)
        tables.append(order[used : used + n])
        used += n
    out, ref = run_step(query_lens, seq_lens, tables, use_kernel=True, heads=heads, bs=16, q_scale=3.0)
    assert calls, "the prefill chunks did not reach the kernel"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", PREFILL_HEADS, ids=["g3_d16", "mqa_d64", "mha_d32", "smollm2", "g8_d128"])
@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_prefill_over_a_16_bit_cache_takes_the_kernel(kv: str, heads: tuple[int, int, int],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 model over a 16-bit cache (--kv-cache-dtype, or a bfloat16 model computing in float32 on AMX):
    each item widens its chunk of keys and values exactly, past one 128-key chunk too, and the kernel matches
    the reference over the same rounded values."""
    calls = count_prefill_kernel_calls(monkeypatch)
    tables = [list(range(3, 13)), [1, 2], list(range(13, 33))]
    out, ref = run_step([20, 1, 150], [147, 5, 300], tables, use_kernel=True, heads=heads, bs=16,
                        kv_dtype=getattr(torch, kv), q_scale=3.0)
    assert calls, "the prefill chunks did not reach the kernel"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
