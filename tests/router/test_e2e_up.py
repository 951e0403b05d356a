"""What `make run` does: `tandem up` with its defaults on the embedded model, one request, Ctrl-C."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from tests.router.engines import BLOCK_SIZE, DECISIONS, ENGINE_ARGS, MODEL, RECEIVED, UpProcess, blocks_to_read, settled

from tandem_router.procs import free_port, metric, scrape

pytestmark = pytest.mark.slow

# Longer than the router's default remote-prefill threshold (32 tokens): it goes through the prefill engine.
LONG_PROMPT = "Once upon a time, " + "in a kingdom by the sea, a lighthouse keeper counted the ships. " * 4


def test_tandem_up_defaults_serve_a_request_and_stop_cleanly(tmp_path: Path) -> None:
    port = free_port()
    engine_args = " ".join([*ENGINE_ARGS, "--block-size", str(BLOCK_SIZE)])
    up = UpProcess(["--model", MODEL, "--port", str(port), "--engine-args", engine_args], tmp_path)
    try:
        up.wait_for("] ready in", timeout=400)
        url = f"http://127.0.0.1:{port}"
        assert any("ready in" in ln and url in ln for ln in up.lines)
        assert "1 prefill + 1 decode engine(s)" in up.text()
        decode = up.url_of("decode-0")
        received = scrape(decode, RECEIVED)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0.0
        )
        assert out.choices[0].message.content
        stream = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=8, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices)
        # The short chat was prefilled on decode; the long prompt on the prefill engine, whose KV blocks
        # decode then read (all but the last prompt token's).
        decisions = httpx.get(url + "/metrics", timeout=10).text
        assert metric(decisions, DECISIONS, decision="local_short_uncached") == 1
        assert metric(decisions, DECISIONS, decision="remote") == 1
        assert metric(decisions, DECISIONS) == 2
        blocks = blocks_to_read(decode, prompt=LONG_PROMPT)
        assert settled(lambda: scrape(decode, RECEIVED) - received, blocks) == blocks
    finally:
        up.interrupt()
    assert up.proc.returncode == 0, up.text()
    assert up.lines[-1] == "[up] stopped"
    logs = {p.name for p in tmp_path.iterdir()}
    assert "router.log" in logs and len(logs) == 3
