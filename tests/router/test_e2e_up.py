"""What `make run` does: `tandem up` with its defaults on the embedded model, one request, Ctrl-C."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from tests.router.engines import ENGINE_ARGS, MODEL, UpProcess

from tandem_router.procs import free_port

pytestmark = pytest.mark.slow


def test_tandem_up_defaults_serve_a_request_and_stop_cleanly(tmp_path: Path) -> None:
    port = free_port()
    up = UpProcess(["--model", MODEL, "--port", str(port), "--engine-args", " ".join(ENGINE_ARGS)], tmp_path)
    try:
        up.wait_for("] ready in", timeout=400)
        url = f"http://127.0.0.1:{port}"
        assert any("ready in" in ln and url in ln for ln in up.lines)
        # The engine has P/D roles: one prefill and one decode engine (else it says it runs colocated).
        assert "1 prefill + 1 decode engine(s)" in up.text() or "colocated" in up.text()
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0.0
        )
        assert out.choices[0].message.content
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices)
    finally:
        up.interrupt()
    assert up.proc.returncode == 0, up.text()
    assert up.lines[-1] == "[up] stopped"
    logs = {p.name for p in tmp_path.iterdir()}
    assert "router.log" in logs and len(logs) == 3
