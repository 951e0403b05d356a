"""SSE framing, chunk order and the usage chunk of streamed answers."""

from __future__ import annotations

import json

import httpx

from tests.engine.entrypoints.toy_engine import CHAT, sse_events


async def test_completion_stream_framing_and_usage(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["cache-control"] == "no-cache"
    events = [json.loads(e) for e in sse_events(resp.text)]
    assert [e["choices"][0]["text"] for e in events] == ["a", "b", "c"]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "length"]
    assert all(e["usage"] is None and e["object"] == "text_completion" for e in events)
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("cmpl-")

    body = {"prompt": "hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    events = [json.loads(e) for e in sse_events((await client.post("/v1/completions", json=body)).text)]
    assert [e["choices"] for e in events[:-1]] != [] and events[-1]["choices"] == []
    assert events[-1]["usage"]["prompt_tokens"] == 3
    assert events[-1]["usage"]["completion_tokens"] == 3 and events[-1]["usage"]["total_tokens"] == 6
    assert all(e["usage"] is None for e in events[:-1])

    body["stream_options"] = {"include_usage": False}
    events = [json.loads(e) for e in sse_events((await client.post("/v1/completions", json=body)).text)]
    assert all(e["choices"] for e in events)


async def test_chat_stream_framing_and_usage(client: httpx.AsyncClient) -> None:
    body = {
        "messages": CHAT,
        "max_tokens": 2,
        "stream": True,
        "n": 2,
        "stream_options": {"include_usage": True},
    }
    resp = await client.post("/v1/chat/completions", json=body)
    events = [json.loads(e) for e in sse_events(resp.text)]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}] * 2
    per_choice: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for e in events[2:-1]:
        [choice] = e["choices"]
        assert "role" not in choice["delta"]
        per_choice[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert per_choice == {0: "ab", 1: "ab"} and finish == {0: "length", 1: "length"}
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == 4
    assert usage["prompt_tokens"] == len("\x01<user>hi<assistant>")


async def test_chat_stream_logprobs(client: httpx.AsyncClient) -> None:
    body = {"messages": CHAT, "max_tokens": 2, "stream": True, "logprobs": True, "top_logprobs": 1}
    events = [json.loads(e) for e in sse_events((await client.post("/v1/chat/completions", json=body)).text)]
    assert events[0]["choices"][0]["logprobs"] is None
    contents = [e["choices"][0]["logprobs"]["content"] for e in events[1:]]
    assert [[(c["token"], len(c["top_logprobs"])) for c in cs] for cs in contents] == [[("a", 1)], [("b", 1)]]


# -------------------------------------------------------------------------------------- disconnect
