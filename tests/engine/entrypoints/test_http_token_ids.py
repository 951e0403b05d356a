"""`return_token_ids` in vLLM 0.11's shapes: completions carry `prompt_token_ids` on the choice (its first
chunk when streamed), chat at the top level (on the role chunk); every choice carries `token_ids`."""

from __future__ import annotations

import json

import httpx

from tests.engine.entrypoints.toy_engine import BOS, CHAT, sse_events

HI = [BOS, ord("h"), ord("i")]
CHAT_PROMPT = [ord(c) for c in "\x01<user>hi<assistant>"]


async def test_completion_whole_answer(client: httpx.AsyncClient) -> None:
    body = {"prompt": [[5, 6], [7]], "max_tokens": 3, "return_token_ids": True}
    choices = (await client.post("/v1/completions", json=body)).json()["choices"]
    assert [(c["prompt_token_ids"], c["token_ids"], c["text"]) for c in choices] == [
        ([5, 6], [97, 98, 99], "abc"), ([7], [97, 98, 99], "abc")]
    plain = (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


async def test_completion_stream(client: httpx.AsyncClient) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "n": 2, "seed": 1, "stream": True, "return_token_ids": True}
    events = [json.loads(e) for e in sse_events((await client.post("/v1/completions", json=body)).text)]
    seen: dict[int, list[int]] = {0: [], 1: []}
    for e in events:
        [choice] = e["choices"]
        first = not seen[choice["index"]]
        assert ("prompt_token_ids" in choice) == first and choice.get("prompt_token_ids", HI) == HI
        assert [chr(t) for t in choice["token_ids"]] == list(choice["text"])
        seen[choice["index"]] += choice["token_ids"]
    assert seen == {0: [98, 99, 100], 1: [99, 100, 101]}


async def test_chat_whole_answer_and_stream(client: httpx.AsyncClient) -> None:
    body = {"messages": CHAT, "max_tokens": 2, "return_token_ids": True}
    whole = (await client.post("/v1/chat/completions", json=body)).json()
    assert whole["prompt_token_ids"] == CHAT_PROMPT and whole["choices"][0]["token_ids"] == [97, 98]
    assert "prompt_token_ids" not in whole["choices"][0]

    events = [json.loads(e) for e in sse_events((await client.post(
        "/v1/chat/completions", json={**body, "stream": True})).text)]
    assert events[0]["prompt_token_ids"] == CHAT_PROMPT and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert [e["choices"][0]["token_ids"] for e in events[1:]] == [[97], [98]]
    plain = (await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
