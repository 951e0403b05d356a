"""P/D with a bfloat16 KV cache under a float32 model on both engines, over real NIXL: the decode engine
reads the 16-bit blocks and continues exactly as the prefill engine does colocated, and each engine
reports its cache dtype (log line and `vllm:cache_config_info`)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.engine.kv_transfer.pd_proxy import completion, idle, pd_completion, start_pair, wait_for

pytestmark = pytest.mark.slow

SENTENCE = "The quick brown fox jumps over the lazy dog while the river keeps flowing to the sea. "
PROMPTS = ["Summarise this: " + SENTENCE * 3, "The capital of France is", "Count the dogs in: " + SENTENCE * 8]
ARGS = ["--kv-cache-dtype", "bfloat16"]  # the model stays float32 (the test servers' default)


async def test_bfloat16_blocks_move_between_float32_engines(tmp_path: Path) -> None:
    p, d = start_pair(tmp_path, 10.0, decode_args=ARGS, prefill_args=ARGS)
    try:
        for s in (p, d):
            assert s.metric("vllm:cache_config_info", cache_dtype="bfloat16") == 1
            assert "(bfloat16 KV cache)" in s.log()
        async with httpx.AsyncClient(timeout=120) as c:
            refs = [await c.post(p.url + "/v1/completions", json=completion(t)) for t in PROMPTS]
            received = d.metric("tandem:kv_transfer_received_blocks_total")
            outs = [await pd_completion(c, p.url, d.url, completion(t)) for t in PROMPTS]
        for ref, out in zip(refs, outs, strict=True):
            assert out.status_code == 200, out.text
            assert out.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
        assert d.metric("tandem:kv_transfer_received_blocks_total") - received > 0
        wait_for(lambda: idle(p) and idle(d), 5.0, "both engines idle")
    finally:
        d.stop()
        p.stop()
