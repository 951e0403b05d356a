"""Logprobs in both endpoints' shapes, whole and streamed."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.engine.entrypoints.toy_engine import CHAT, ToyEngine, sse_events


async def test_completion_logprobs(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    body = (
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 2})
    ).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"]
    assert lp["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert lp["text_offset"] == [0, 1, 2]
    assert lp["top_logprobs"] == [{"a": -0.5, "b": -1.5}, {"b": -0.5, "c": -1.5}, {"c": -0.5, "d": -1.5}]
    assert engine.calls[0][2].logprobs == 2

    engine.reset()
    body = (
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 0})
    ).json()
    lp = body["choices"][0]["logprobs"]
    assert engine.calls[0][2].logprobs == 0
    assert lp["top_logprobs"] == [{"a": -0.5}, {"b": -0.5}]  # the sampled token only


async def test_completion_logprobs_streamed_offsets_continue(client: httpx.AsyncClient) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "logprobs": 1, "stream": True}
    events = [json.loads(e) for e in sse_events((await client.post("/v1/completions", json=body)).text)]
    offsets = [e["choices"][0]["logprobs"]["text_offset"] for e in events]
    assert offsets == [[0], [1], [2]]


async def test_chat_logprobs(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    body = {"messages": CHAT, "max_tokens": 2, "logprobs": True}
    choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert engine.calls[0][2].logprobs == 0
    assert choice["logprobs"] == {
        "content": [
            {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []},
            {"token": "b", "logprob": -0.5, "bytes": [98], "top_logprobs": []},
        ]
    }
    body = {"messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": 2}
    choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice["logprobs"]["content"][0]["top_logprobs"] == [
        {"token": "a", "logprob": -0.5, "bytes": [97]},
        {"token": "b", "logprob": -1.5, "bytes": [98]},
    ]
    choice = (await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})).json()[
        "choices"
    ][0]
    assert choice["logprobs"] is None and engine.calls[-1][2].logprobs is None


# --------------------------------------------------------------------------------------- streaming


# 🎉 is F0 9F 8E 89; a byte-level tokenizer splits it into tokens whose text alone is U+FFFD.
PARTY_PIECES = [b"\xf0\x9f", b"\x8e", b"\x89"]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_bytes_of_a_split_character(
    client: httpx.AsyncClient, engine: ToyEngine, stream: bool
) -> None:
    engine.pieces = PARTY_PIECES
    body = {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 1, "stream": stream}
    resp = await client.post("/v1/chat/completions", json=body)
    if stream:
        choices = [json.loads(e)["choices"][0] for e in sse_events(resp.text)][1:]
        text = "".join(c["delta"].get("content", "") for c in choices)
        content = [item for c in choices for item in c["logprobs"]["content"]]
    else:
        [choice] = resp.json()["choices"]
        text, content = choice["message"]["content"], choice["logprobs"]["content"]
    assert text == "🎉"
    assert [c["token"] for c in content] == ["\ufffd"] * 3
    assert [bytes(c["bytes"]) for c in content] == PARTY_PIECES  # each token's own bytes
    assert b"".join(bytes(c["bytes"]) for c in content) == "🎉".encode()
    assert [[bytes(t["bytes"]) for t in c["top_logprobs"]] for c in content] == [[p] for p in PARTY_PIECES]
