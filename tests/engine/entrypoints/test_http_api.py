"""HTTP behaviour of the engine's OpenAI-compatible API against a deterministic in-test engine.

`ToyEngine` tokenizes text as one token per character (id = code point, BOS = 1) and generates the
letters a, b, c, ... starting at `seed % 26`, one token per delta, with logprobs -0.5 per step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import prometheus_client
import pytest
import uvicorn

from tandem_engine.entrypoints.api_server import build_app
from tandem_engine.frontend.interface import (
    EngineClient,
    EngineDeadError,
    RequestError,
    RequestOutput,
    TokenLogprob,
)
from tandem_engine.sampling_params import SamplingParams
from tandem_router.procs import free_port

BOS = 1
MODEL = "toy-model"


class ToyEngine(EngineClient):
    model_name = MODEL
    max_model_len = 64

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls: list[tuple[str, list[int], SamplingParams, dict[str, Any] | None]] = []
        self.aborted: list[str] = []
        self.cancelled: list[str] = []  # iterators closed or cancelled before their final output
        self.ready = True
        self.dead: BaseException | None = None
        self.hang_after: int | None = None  # block forever after this many deltas
        self.fail_stream_after: int | None = None  # raise EngineDeadError after this many deltas
        self.delay = 0.0

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "BUG" in text:
            raise RuntimeError("tokenizer exploded")
        return ([BOS] if add_special_tokens else []) + [ord(c) for c in text]

    def detokenize(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids if t != BOS)  # chr raises ValueError past 0x10FFFF

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise RequestError(f"unknown role {m['role']!r}", param="messages")
        text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages)
        return "\x01" + text + ("<assistant>" if add_generation_prompt else "")

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self.calls.append((request_id, prompt_token_ids, params, kv_transfer_params))
        finished = False
        try:
            if self.dead is not None:
                raise EngineDeadError("engine core died")
            if ord("!") in prompt_token_ids:
                raise RequestError("prompt contains a forbidden token", param="prompt")
            start = (params.seed or 0) % 26
            for k in range(params.max_tokens):
                if self.hang_after is not None and k >= self.hang_after:
                    await asyncio.Event().wait()
                if self.fail_stream_after is not None and k >= self.fail_stream_after:
                    raise EngineDeadError("engine core died mid-stream")
                if self.delay:
                    await asyncio.sleep(self.delay)
                else:
                    await asyncio.sleep(0)
                tid = ord("a") + (start + k) % 26
                text = chr(tid)
                logprobs = None
                if params.logprobs is not None:
                    top = [
                        (ord("a") + (start + k + j) % 26, chr(ord("a") + (start + k + j) % 26), -0.5 - j)
                        for j in range(params.logprobs)
                    ]
                    logprobs = [TokenLogprob(token_id=tid, token=text, logprob=-0.5, top=top)]
                reason: str | None = None
                stop_reason: str | int | None = None
                if text in params.stop:
                    reason, stop_reason = "stop", text
                    if not params.include_stop_str_in_output:
                        text = ""
                elif tid in params.stop_token_ids:
                    reason, stop_reason = "stop", tid
                elif k + 1 == params.max_tokens:
                    reason = "length"
                finished = reason is not None
                yield RequestOutput(
                    request_id=request_id,
                    text=text,
                    token_ids=[tid],
                    logprobs=logprobs,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_output_tokens=k + 1,
                    num_cached_tokens=0,
                    finished=finished,
                    finish_reason=reason,  # type: ignore[arg-type]
                    stop_reason=stop_reason,
                    kv_transfer_params={"remote_request_id": request_id}
                    if finished and kv_transfer_params
                    else None,
                )
                if finished:
                    return
        finally:
            if not finished:
                self.cancelled.append(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    @property
    def is_ready(self) -> bool:
        return self.ready and self.dead is None

    @property
    def dead_error(self) -> BaseException | None:
        return self.dead


# ----------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def engine() -> ToyEngine:
    return ToyEngine()


@pytest.fixture
def registry() -> prometheus_client.CollectorRegistry:
    reg = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter("vllm:request_success", "done", ["model_name"], registry=reg)
    counter.labels(model_name=MODEL).inc(3)
    return reg


@pytest.fixture
async def client(
    engine: ToyEngine, registry: prometheus_client.CollectorRegistry
) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(engine, registry), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


class ServerThread:
    def __init__(self, engine: ToyEngine) -> None:
        self.engine = engine
        self.port = free_port()
        config = uvicorn.Config(
            build_app(engine, prometheus_client.CollectorRegistry()),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(ToyEngine()) as s:
        yield s


@pytest.fixture
def oai(server: ServerThread) -> openai.OpenAI:
    server.engine.reset()
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=10)


def sse_events(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing of every event on the way."""
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = body.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        assert "\n" not in event
        payloads.append(event[len("data: ") :])
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return payloads[:-1]


def assert_error(resp: httpx.Response, status: int, param: str | None = None, contains: str = "") -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert contains in err["message"], err["message"]


# ----------------------------------------------------------------------------------- plain routes


async def test_models_health_metrics(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"], m["object"]) for m in models["data"]] == [(MODEL, 64, "model")]

    assert (await client.get("/health")).status_code == 200
    engine.ready = False  # draining
    assert (await client.get("/health")).status_code == 503
    engine.ready, engine.dead = True, EngineDeadError("gone")
    assert (await client.get("/health")).status_code == 503

    metrics = await client.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'vllm:request_success_total{model_name="toy-model"} 3.0' in metrics.text


async def test_tokenize_detokenize(client: httpx.AsyncClient) -> None:
    resp = (await client.post("/tokenize", json={"prompt": "hi"})).json()
    assert resp == {"tokens": [BOS, ord("h"), ord("i")], "count": 3, "max_model_len": 64}
    resp = (await client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False})).json()
    assert resp["tokens"] == [ord("h"), ord("i")]
    chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})).json()
    assert chat["tokens"] == [BOS] + [ord(c) for c in "<user>x<assistant>"]
    assert chat["count"] == len(chat["tokens"])
    assert (await client.post("/detokenize", json={"tokens": [BOS, 104, 105]})).json() == {"prompt": "hi"}

    assert_error(await client.post("/tokenize", json={}), 400, "prompt")
    assert_error(await client.post("/tokenize", json={"prompt": "a", "model": "other"}), 404, "model")
    assert_error(await client.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    assert_error(await client.post("/detokenize", json={"tokens": [2**40]}), 400, "tokens")
    assert_error(await client.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


async def test_unknown_route_and_method_are_openai_shaped(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing"), 404)
    assert_error(await client.get("/v1/completions"), 405)


async def test_bug_is_500_in_openai_shape(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/completions", json={"prompt": "BUG", "max_tokens": 2})
    assert_error(resp, 500)
    assert resp.json()["error"]["message"] == "Internal server error"  # no internals leak


# --------------------------------------------------------------------------------------- bad input

LONG = "x" * 70  # 71 tokens with BOS, over max_model_len=64
CHAT = [{"role": "user", "content": "hi"}]

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
    ({"prompt": "hi", "response_format": {"type": "json_object"}}, 400, "response_format", "not supported"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of", ""),
    ({"prompt": "hi", "echo": True}, 400, "echo", "not supported"),
]


@pytest.mark.parametrize(("body", "status", "param", "contains"), BAD_COMPLETIONS)
async def test_completion_bad_input(
    client: httpx.AsyncClient,
    engine: ToyEngine,
    body: dict[str, Any],
    status: int,
    param: str | None,
    contains: str,
) -> None:
    resp = await client.post("/v1/completions", json=body)
    assert_error(resp, status, param, contains)
    if status == 404:
        assert resp.json()["error"]["type"] == "NotFoundError"
    assert engine.calls == []


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
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", ""),
]


@pytest.mark.parametrize(("body", "status", "param", "contains"), BAD_CHAT)
async def test_chat_bad_input(
    client: httpx.AsyncClient,
    engine: ToyEngine,
    body: dict[str, Any],
    status: int,
    param: str | None,
    contains: str,
) -> None:
    assert_error(await client.post("/v1/chat/completions", json=body), status, param, contains)
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
        "tools": [{"type": "function"}],
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
    assert_error(await client.post(path, json=body), 503, contains="boom")
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


# ------------------------------------------------------------------------------------- completions


async def test_completion_non_streamed(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    resp = await client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "model": MODEL, "user": "someone"}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"].startswith("cmpl-") and len(body["id"]) == len("cmpl-") + 32
    assert body["object"] == "text_completion" and isinstance(body["created"], int)
    assert body["model"] == MODEL
    assert body["choices"] == [
        {"index": 0, "text": "abcd", "logprobs": None, "finish_reason": "length", "stop_reason": None}
    ]
    assert body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == 7
    assert body["kv_transfer_params"] is None
    [(rid, prompt, params, kv)] = engine.calls
    assert rid == body["id"] and prompt == [BOS, 104, 105] and kv is None
    assert params.max_tokens == 4 and params.logprobs is None


async def test_max_tokens_defaults_to_the_context_left(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    body = (await client.post("/v1/completions", json={"prompt": "x" * 59})).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert engine.calls[0][2].max_tokens == 64 - 60
    await client.post("/v1/chat/completions", json={"messages": CHAT})
    assert engine.calls[1][2].max_tokens == 64 - len("\x01<user>hi<assistant>")
    await client.post(
        "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 9, "max_completion_tokens": 3}
    )
    assert engine.calls[2][2].max_tokens == 3


async def test_prompt_forms(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    for prompt in ("hi", [BOS, 104, 105], ["hi"]):
        resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert resp.status_code == 200, resp.text
    assert [c[1] for c in engine.calls] == [[BOS, 104, 105]] * 3
    assert len({c[0] for c in engine.calls}) == 3


async def test_prompt_batch(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    resp = await client.post(
        "/v1/completions", json={"prompt": ["hi", "hello"], "max_tokens": 2, "n": 2, "seed": 3}
    )
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["de", "ef", "de", "ef"]
    assert body["usage"] == {
        "prompt_tokens": 3 + 6,
        "completion_tokens": 8,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    rid = body["id"]
    assert [(c[0], c[2].seed, len(c[1])) for c in engine.calls] == [
        (f"0_{rid}", 3, 3),
        (f"1_{rid}", 4, 3),
        (f"2_{rid}", 3, 6),
        (f"3_{rid}", 4, 6),
    ]


async def test_n_fan_out_ids_and_seeds(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    body = (
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 3, "seed": 5})
    ).json()
    rid = body["id"]
    assert sorted(c[0] for c in engine.calls) == [f"0_{rid}", f"1_{rid}", f"2_{rid}"]
    assert {c[0]: c[2].seed for c in engine.calls} == {f"0_{rid}": 5, f"1_{rid}": 6, f"2_{rid}": 7}
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "fg"), (1, "gh"), (2, "hi")]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 6

    engine.reset()
    body = (
        await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "n": 2})
    ).json()
    assert [c[2].seed for c in engine.calls] == [None, None]
    assert sorted(c[0] for c in engine.calls) == [f"0_{body['id']}", f"1_{body['id']}"]
    assert body["id"].startswith("chatcmpl-")


async def test_sampling_fields_reach_the_engine(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "seed": 11,
        "ignore_eos": True,
        "min_tokens": 2,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "stop": ["zz", "q"],
        "stop_token_ids": [7],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    resp = (await client.post("/v1/completions", json=body)).json()
    [(rid, _, params, kv)] = engine.calls
    assert kv == {"do_remote_decode": True}
    assert resp["kv_transfer_params"] == {"remote_request_id": rid}
    assert params == SamplingParams(
        max_tokens=8,
        min_tokens=2,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        stop=["zz", "q"],
        stop_token_ids=[7],
        include_stop_str_in_output=True,
        ignore_eos=True,
        skip_special_tokens=False,
    )
    engine.reset()
    await client.post(
        "/v1/chat/completions", json={"messages": CHAT, "stop": "x", "kv_transfer_params": {"k": 1}}
    )
    assert engine.calls[0][2].stop == ["x"] and engine.calls[0][3] == {"k": 1}


async def test_stop_reason(client: httpx.AsyncClient) -> None:
    choice = (await client.post("/v1/completions", json={"prompt": "hi", "stop": "c"})).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("ab", "stop", "c")
    body = {"prompt": "hi", "stop": ["c"], "include_stop_str_in_output": True}
    choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    assert (choice["text"], choice["stop_reason"]) == ("abc", "c")
    body = {"messages": CHAT, "stop_token_ids": [ord("b")]}
    choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"], choice["stop_reason"]) == (
        "ab",
        "stop",
        98,
    )


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


async def call_asgi_until(
    app: Any, path: str, body: dict[str, Any], disconnect_when: Any
) -> list[dict[str, Any]]:
    """Drive the app directly: send the body, then report http.disconnect once `disconnect_when()` holds."""
    raw = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        while not disconnect_when(sent):
            await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    return sent


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_disconnect_non_streamed_aborts(
    engine: ToyEngine, registry: prometheus_client.CollectorRegistry, path: str
) -> None:
    engine.hang_after = 1
    app = build_app(engine, registry)
    body = {"prompt": "hi", "messages": CHAT, "max_tokens": 10, "n": 2}
    await call_asgi_until(app, path, body, lambda sent: len(engine.calls) == 2)
    ids = sorted(c[0] for c in engine.calls)
    assert sorted(engine.cancelled) == ids  # the engine iterators were cancelled
    assert sorted(engine.aborted) == ids  # and abort was called for each unfinished request


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_disconnect_streamed_aborts(
    engine: ToyEngine, registry: prometheus_client.CollectorRegistry, path: str
) -> None:
    engine.hang_after = 2
    app = build_app(engine, registry)
    body = {"prompt": "hi", "messages": CHAT, "max_tokens": 10, "stream": True}

    def after_first_token(sent: list[dict[str, Any]]) -> bool:
        return any(b'"a"' in m.get("body", b"") for m in sent)

    sent = await call_asgi_until(app, path, body, after_first_token)
    assert sent[0]["status"] == 200
    [(rid, *_)] = engine.calls
    assert engine.cancelled == [rid] and engine.aborted == [rid]
    assert not any(b"[DONE]" in m.get("body", b"") for m in sent)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_disconnect_before_the_first_token_aborts(
    engine: ToyEngine, registry: prometheus_client.CollectorRegistry, path: str
) -> None:
    engine.hang_after = 0  # a long prefill: the stream has not started when the client leaves
    app = build_app(engine, registry)
    body = {"prompt": "hi", "messages": CHAT, "max_tokens": 10, "stream": True, "n": 2}
    await call_asgi_until(app, path, body, lambda sent: len(engine.calls) == 2)
    ids = sorted(c[0] for c in engine.calls)
    assert sorted(engine.cancelled) == ids and sorted(engine.aborted) == ids


async def test_finished_requests_are_not_aborted(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2})
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    assert engine.aborted == [] and engine.cancelled == []


def test_disconnect_through_a_real_server_aborts(server: ServerThread) -> None:
    server.engine.reset()
    server.engine.delay = 0.05
    body = {"prompt": "hi", "max_tokens": 60, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=5) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 5
    while not server.engine.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    [(rid, *_)] = server.engine.calls
    assert server.engine.aborted == [rid] and server.engine.cancelled == [rid]

    server.engine.reset()
    server.engine.hang_after = 1
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}, timeout=0.3)
    deadline = time.monotonic() + 5
    while not server.engine.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    [(rid, *_)] = server.engine.calls
    assert server.engine.aborted == [rid]


# --------------------------------------------------------------------------- the official openai client


def test_openai_client_completions(oai: openai.OpenAI) -> None:
    c = oai.completions.create(model=MODEL, prompt="hi", max_tokens=3, logprobs=2, seed=1)
    assert c.choices[0].text == "bcd" and c.choices[0].finish_reason == "length"
    assert c.choices[0].logprobs is not None and c.choices[0].logprobs.tokens == ["b", "c", "d"]
    assert c.choices[0].logprobs.top_logprobs is not None and c.choices[0].logprobs.top_logprobs[0] == {
        "b": -0.5,
        "c": -1.5,
    }
    assert c.usage is not None and c.usage.total_tokens == 6

    chunks = list(
        oai.completions.create(
            model=MODEL, prompt="hi", max_tokens=3, stream=True, stream_options={"include_usage": True}, n=2
        )
    )
    assert (
        chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    )
    texts = {0: "", 1: ""}
    for ch in chunks[:-1]:
        texts[ch.choices[0].index] += ch.choices[0].text
    assert texts == {0: "abc", 1: "abc"}
    assert all(
        ch.usage is None for ch in oai.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True)
    )


def test_openai_client_chat(oai: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "hi"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == "ab" and r.choices[0].message.role == "assistant"
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    first = r.choices[0].logprobs.content[0]
    assert (first.token, first.logprob, first.bytes) == ("a", -0.5, [97])
    assert [t.token for t in first.top_logprobs] == ["a", "b"]

    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=2, logprobs=True)
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    assert r.choices[0].logprobs.content[1].top_logprobs == []

    stream = oai.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "abc"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_openai_client_errors(oai: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4", messages=msgs)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert info.value.body is not None and "max_tokens" in str(info.value.body)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="hi", suffix="x")
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=msgs, n=17)
