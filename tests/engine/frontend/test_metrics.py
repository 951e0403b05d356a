"""The engine's cache description on GET /metrics, as vLLM exports it."""

from __future__ import annotations

from prometheus_client import generate_latest

from tandem_engine.frontend.metrics import EngineMetrics
from tandem_router.procs import metric


def test_cache_config_info_names_the_cache_dtype_and_blocks() -> None:
    m = EngineMetrics("m")
    m.record_cache_config(16, "bfloat16", 2913, True)
    text = generate_latest(m.registry).decode()
    assert metric(text, "vllm:cache_config_info", model_name="m", block_size="16", cache_dtype="bfloat16",
                  num_gpu_blocks="2913", enable_prefix_caching="True") == 1
    assert metric(text, "vllm:cache_config_info", cache_dtype="float32") == 0
