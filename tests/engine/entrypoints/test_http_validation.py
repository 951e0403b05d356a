"""Requests the server refuses before the engine sees them (400, 404), and engine failures as clients
see them (400 for a bad request, 503 for a dead or draining engine)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tandem_engine.frontend.interface import EngineDeadError
from tandem_engine.sampling_params import SamplingParams
from tests.engine.entrypoints.toy_engine import CHAT, LONG, ToyEngine, assert_error, sse_events

BAD_COMPLETIONS: list[tuple[dict[str, Any], int, str | None, str]] = [
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", ""),
    ({"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens", ""),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ""),
    ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens", ""),
    ({"prompt": "hi", "temperature": -0.1}, 400, "temperature", ""),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature", ""),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", ""),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p", ""),
    ({"prompt": "hi", "n": 17}, 400, "n", "16"),
    ({"prompt": "hi", "n": 0}, 400, "n", ""),
    ({"prompt": "hi", "stop": 5}, 400, "stop", ""),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream", ""),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs", ""),
    ({"prompt": "hi", "logprobs": True}, 400, "logprobs", ""),
    ({"prompt": "hi", "seed": "1"}, 400, "seed", ""),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k", ""),
    ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens", ""),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", ""),
    ({"prompt": "hi", "suffix": "end"}, 400, "suffix", "not supported"),
    ({"prompt": "hi", "logit_bias": {"5": 1.0}}, 400, "logit_bias", "not supported"),
    ({"prompt": "hi", "kv_transfer_params": {"a": 1}, "n": 2}, 400, "kv_transfer_params", ""),
    ({"prompt": ""}, 400, "prompt", "empty"),
    ({"prompt": []}, 400, "prompt", "empty"),
    ({"prompt": [""]}, 400, "prompt", "empty"),
    ({"prompt": [[]]}, 400, "prompt", "empty"),
    ({"prompt": [1, -2]}, 400, "prompt", ""),
    ({"prompt": ["a", 1]}, 400, "prompt", ""),
    ({"prompt": ["a"] * 17}, 400, "prompt", "16"),
    ({}, 400, "prompt", "required"),
    ({"prompt": LONG}, 400, "prompt", "64"),
    ({"prompt": "x" * 9, "max_tokens": 60}, 400, "max_tokens", "10 in the prompt, 60 for the completion"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "gpt-4"),
    ({"prompt": "hi", "seed": 2**64}, 400, "seed", ""),
    ({"prompt": "hi", "top_k": 10**20}, 400, "top_k", ""),
    ({"prompt": [10**30]}, 400, "prompt", ""),
    ({"prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format", "json_schema"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, 400,
     "response_format", "name"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integerx"}}}}}}, 400,
     "response_format", "Invalid type: integerx"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, 400, "response_format", "uniqueItems"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/$defs/missing"}}}}, 400, "response_format", "missing"),
    ({"prompt": "hi", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, 400,
     "structured_outputs", "send one"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a+", "choice": ["a"]}}, 400, "structured_outputs",
     "exactly one"),
    ({"prompt": "hi", "structured_outputs": {}}, 400, "structured_outputs", "exactly one"),
    ({"prompt": "hi", "structured_outputs": {"regex": "(unclosed"}}, 400, "structured_outputs", "regex"),
    ({"prompt": "hi", "structured_outputs": {"choice": []}}, 400, "structured_outputs", "non-empty"),
    ({"prompt": "hi", "structured_outputs": {"grammar": "start: foo"}}, 400, "structured_outputs", "foo"),
    ({"prompt": "hi", "structured_outputs": {"json": "{not json"}}, 400, "structured_outputs", "not JSON"),
    ({"prompt": "hi", "structured_outputs": {"structural_tag": "{}"}}, 400, "structured_outputs",
     "not supported"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of", ""),
    ({"prompt": "hi", "echo": True}, 400, "echo", "not supported"),
]


async def test_too_long_prompt_message_names_both_numbers(client: httpx.AsyncClient) -> None:
    message = (await client.post("/v1/completions", json={"prompt": LONG})).json()["error"]["message"]
    assert "64" in message and "71" in message
    message = (await client.post("/v1/completions", json={"prompt": "x" * 9, "max_tokens": 60})).json()
    assert "64" in message["error"]["message"] and "70" in message["error"]["message"]


BAD_CHAT: list[tuple[dict[str, Any], int, str | None, str]] = [
    ({}, 400, "messages", ""),
    ({"messages": []}, 400, "messages", "empty"),
    ({"messages": "hi"}, 400, "messages", ""),
    ({"messages": [{"content": "hi"}]}, 400, "messages", ""),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", "robot"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages",
        "image_url",
    ),
    ({"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", ""),
    ({"messages": CHAT, "max_completion_tokens": 0}, 400, "max_tokens", ""),
    ({"messages": CHAT, "max_tokens": 0}, 400, "max_tokens", ""),
    ({"messages": CHAT, "temperature": -1}, 400, "temperature", ""),
    ({"messages": CHAT, "top_p": 2}, 400, "top_p", ""),
    ({"messages": CHAT, "n": 100}, 400, "n", ""),
    ({"messages": [{"role": "user", "content": LONG}]}, 400, "messages", "64"),
    ({"messages": CHAT, "max_tokens": 60}, 400, "max_tokens", "60"),
    ({"messages": CHAT, "model": "nope"}, 404, "model", ""),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {}}]}, 400, "tools", "name"),
    ({"messages": CHAT, "tools": [{"type": "function"}], "tool_choice": "none"}, 400, "tools", "name"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools", "name"),
    ({"messages": CHAT, "tools": [{"type": "retrieval"}]}, 400, "tools", "function"),
    ({"messages": CHAT, "tools": [{"function": {"name": "f"}}, {"function": {"name": "f"}}]}, 400, "tools",
     "second"),
    ({"messages": CHAT, "tools": [{"function": {"name": "f", "parameters": []}}]}, 400, "tools", "parameters"),
    ({"messages": CHAT, "tools": [{"function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {
        "name": "g"}}}, 400, "tool_choice", "'g'"),
    ({"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ({"messages": CHAT, "tools": [{"function": {"name": "f"}}], "tool_choice": "always"}, 400, "tool_choice", ""),
    ({"messages": CHAT, "tools": [{"function": {"name": "f"}}], "tool_choice": {"type": "function"}}, 400,
     "tool_choice", "name"),
    ({"messages": CHAT, "tools": [{"function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integerx"}}}}}], "tool_choice": "required"}, 400, "tool_choice", "integerx"),
    ({"messages": CHAT, "tools": [{"function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, 400, "tool_choice", "send one"),
]


BAD_INPUT = [("/v1/completions", *case) for case in BAD_COMPLETIONS] + [
    ("/v1/chat/completions", *case) for case in BAD_CHAT
]


@pytest.mark.parametrize(("path", "body", "status", "param", "contains"), BAD_INPUT)
async def test_bad_input(
    client: httpx.AsyncClient,
    engine: ToyEngine,
    path: str,
    body: dict[str, Any],
    status: int,
    param: str | None,
    contains: str,
) -> None:
    resp = await client.post(path, json=body)
    assert_error(resp, status, param, contains)
    if status == 404:
        assert resp.json()["error"]["type"] == "NotFoundError"
    assert engine.calls == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"null"])
async def test_body_not_a_json_object(client: httpx.AsyncClient, path: str, raw: bytes) -> None:
    resp = await client.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(resp, 400)


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "presence_penalty"])
async def test_non_finite_floats_are_400(
    client: httpx.AsyncClient, engine: ToyEngine, field: str, value: bytes
) -> None:
    raw = b'{"prompt": "hi", "%s": %s}' % (field.encode(), value)
    resp = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(resp, 400, field)
    assert engine.calls == []


async def test_null_means_not_given(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    nulls = dict.fromkeys(
        ["n", "stream", "stop", "seed", "temperature", "echo", "logprobs", "suffix", "user"]
    )
    resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **nulls})
    assert resp.status_code == 200, resp.text
    assert engine.calls[0][2] == SamplingParams(max_tokens=2)
    body = {"messages": [{"role": "user", "content": "hi", "name": None}], "max_tokens": None, "n": None}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    assert_error(await client.post("/v1/completions", json={"prompt": None}), 400, "prompt")


async def test_accepted_no_op_fields(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    body = {
        "messages": CHAT,
        "max_tokens": 1,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "user": "u",
        "unknown_field": 1,
        "best_of": 1,
    }
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    body = {"prompt": "hi", "max_tokens": 1, "best_of": 2, "n": 2, "seed": 2**63 - 1 - 16}
    assert (await client.post("/v1/completions", json=body)).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_request_error_is_400(
    client: httpx.AsyncClient, engine: ToyEngine, stream: bool
) -> None:
    body = {"prompt": "hey!", "max_tokens": 3, "stream": stream}
    assert_error(await client.post("/v1/completions", json=body), 400, "prompt", "forbidden")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_dead_or_draining_engine_is_503(
    client: httpx.AsyncClient, engine: ToyEngine, path: str, stream: bool
) -> None:
    body = {"prompt": "hi", "messages": CHAT, "max_tokens": 3, "stream": stream}
    engine.ready = False  # draining
    assert_error(await client.post(path, json=body), 503)
    engine.ready, engine.dead = True, EngineDeadError("boom")
    resp = await client.post(path, json=body)
    assert_error(resp, 503, contains="boom")
    assert resp.json()["error"]["type"] == "ServiceUnavailableError"
    assert engine.calls == []
    # Dies between the readiness check and the first output: the engine's own EngineDeadError.
    engine.dead, engine.fail_stream_after = None, 0
    assert_error(await client.post(path, json=body), 503, contains="died")
    assert len(engine.calls) == 1


async def test_engine_death_mid_stream_ends_with_error_event(
    client: httpx.AsyncClient, engine: ToyEngine
) -> None:
    engine.fail_stream_after = 2
    resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True})
    assert resp.status_code == 200
    events = [json.loads(e) for e in sse_events(resp.text)]
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["a", "b"]
    assert events[-1]["error"]["code"] == 503
