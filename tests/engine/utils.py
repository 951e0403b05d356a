"""Builders for engine tests: tiny HF configs, paged-cache metadata, a dense attention reference, a
read-only cache directory, and greedy requests served through an in-process EngineCore."""

from __future__ import annotations

import contextlib
import math
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem_engine.attention.cpu_backend import CpuAttentionBackend
from tandem_engine.attention.interface import AttentionMetadata
from tandem_engine.models.llama import LlamaForCausalLM
from tandem_engine.request import Request
from tandem_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem_engine.core.engine_core import EngineCore


def tiny_config(model_type: str = "llama", **overrides: Any) -> Any:
    """A 2-layer, hidden-64 config of the given family with GQA (4 query heads over 2 KV heads)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    base: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    base.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[model_type]
    if model_type == "qwen3":
        base.setdefault("head_dim", 16)
    cfg = cls(**base)
    cfg.architectures = [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    ]
    return cfg


def make_meta(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> AttentionMetadata:
    """Metadata for a step where request i computes its last `query_lens[i]` of `seq_lens[i]` tokens."""
    max_blocks = max(len(b) for b in block_tables)
    table = torch.zeros(len(block_tables), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    for i, (q, s, blocks) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        assert len(blocks) * block_size >= s, "block table too short for the sequence"
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(s - q, s)]
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )


def positions_for(query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    """[T] int64 positions of a step's query rows."""
    return torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)])


def kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # A large finite fill: any attention weight on a slot nobody wrote shows up in the result, while
    # masked-out padding (weight exactly 0) stays harmless, as with a zero-initialised engine cache.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.full(shape, 1e3, dtype=dtype), torch.full(shape, 1e3, dtype=dtype)) for _ in range(num_layers)
    ]


def dense_causal_attention(
    q: torch.Tensor,  # [ql, nq, D] queries at the last ql positions
    k: torch.Tensor,  # [L, nkv, D] all keys of the sequence
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [ql, nq, D]
    """Naive float64 reference: repeat K/V per query head, full score matrix, causal offset mask."""
    ql, nq, _ = q.shape
    seq = k.shape[0]
    g = nq // k.shape[1]
    kr = k.double().repeat_interleave(g, dim=1)  # [L, nq, D]
    vr = v.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kr) * scale  # [nq, ql, L]
    qpos = torch.arange(seq - ql, seq)[:, None]
    scores = scores.masked_fill(torch.arange(seq)[None, :] > qpos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vr).to(q.dtype)


def paged_greedy(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    max_new: int,
    chunk: int,
    block_size: int = 4,
    num_blocks: int = 64,
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Run all prompts concurrently: each step gives every unfinished sequence its next prefill chunk
    (at most `chunk` tokens) or one decode token. Returns generated tokens and per-token logits."""
    spec = model.kv_cache_spec(model.config)
    caches = kv_caches(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, model.dtype)
    pool = list(range(1, num_blocks))
    random.Random(1).shuffle(pool)  # scattered, non-contiguous blocks
    need = [-(-(len(p) + max_new) // block_size) for p in prompts]
    tables = [[pool.pop() for _ in range(n)] for n in need]
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    backend = CpuAttentionBackend()
    while any(len(o) < max_new for o in out):
        live = [i for i in range(len(prompts)) if len(out[i]) < max_new]
        qlens = [min(chunk, len(tokens[i]) - computed[i]) for i in live]
        slens = [computed[i] + q for i, q in zip(live, qlens, strict=True)]
        ids = torch.tensor(
            [t for i, q in zip(live, qlens, strict=True) for t in tokens[i][computed[i] : computed[i] + q]]
        )
        meta = make_meta(qlens, slens, [tables[i] for i in live], block_size)
        hidden = model(ids, positions_for(qlens, slens), caches, meta, backend)
        last = torch.tensor(qlens).cumsum(0) - 1
        step_logits = model.compute_logits(hidden[last])  # [num_live, vocab]
        for row, (i, s) in enumerate(zip(live, slens, strict=True)):
            computed[i] = s
            if s == len(tokens[i]):  # a partial prefill chunk samples nothing
                tok = int(step_logits[row].argmax())
                out[i].append(tok)
                logits[i].append(step_logits[row])
                tokens[i].append(tok)
    return out, logits


def hf_greedy(hf: Any, prompt: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
    res = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    return res.sequences[0, len(prompt) :].tolist(), [x[0].float() for x in res.logits]


def read_only(monkeypatch: Any, root: Path, scratch: Path | None = None) -> None:
    """Make `root` read-only as `config.build_dir` sees it (os.access: tests may run as root, whom
    permission bits do not stop), and, given `scratch`, make it the system's temp dir."""
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: not Path(p).is_relative_to(root) and real_access(p, mode))
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
        monkeypatch.setattr(tempfile, "tempdir", str(scratch))


def prompt_logits(model: LlamaForCausalLM, prompt: torch.Tensor) -> torch.Tensor:
    """[len(prompt), vocab] logits of one prompt (at most 32 tokens) through a paged cache."""
    spec, n = model.kv_cache_spec(model.config), prompt.shape[0]
    caches = kv_caches(spec.num_layers, 16, 4, spec.num_kv_heads, spec.head_dim, torch.float32)
    meta = make_meta([n], [n], [[5, 2, 7, 1, 9, 3, 11, 4]], 4)  # up to 32 tokens, scattered
    return model.compute_logits(model(prompt, torch.arange(n), caches, meta, CpuAttentionBackend()))


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Any]],
               heads: tuple[int, int] | None = None) -> None:
    """A GGUF file of `tensors` (GGUF name -> float32 values in torch order and the ggml type to store
    them as: quantized by the gguf package, as llama.cpp's converter does), with the attention head
    counts (`heads`: query, key/value) in its metadata."""
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    w = GGUFWriter(path, arch)
    if heads is not None:
        w.add_head_count(heads[0])
        w.add_head_count_kv(heads[1])
    for name, (values, qtype) in tensors.items():
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, values.astype(np.float32))
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, values.astype(np.float16))
        else:
            w.add_tensor(name, quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count (which the C kernels use too) set to `n` for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def serve(core: EngineCore, prompts: list[list[int]], tag: str, max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs and cached prompt tokens of every prompt, run as one batch through `core`'s scheduler
    (request ids `tag` + index)."""
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        core.add_request(Request(rid, p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), [0]))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    cached: dict[str, int] = {}
    while core.has_requests:
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
            cached.setdefault(o.request_id, o.num_cached_tokens)
    return [tokens[r] for r in ids], [cached[r] for r in ids]
