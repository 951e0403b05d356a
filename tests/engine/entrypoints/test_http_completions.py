"""/v1/completions and what reaches the engine: prompt forms and batches, the n fan-out, sampling
fields, stop reasons."""

from __future__ import annotations

import httpx

from tandem_engine.sampling_params import SamplingParams
from tests.engine.entrypoints.toy_engine import BOS, CHAT, MODEL, ToyEngine


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


# The defaults OpenAI's published OpenAPI spec (openai/openai-openapi, openapi.yaml) gives the fields of
# CreateCompletionRequest and CreateChatCompletionRequest that a request may leave out, as SamplingParams.
SPEC_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                 "logprobs": None, "stop": []}


async def test_a_completion_without_max_tokens_gets_the_specs_16(client: httpx.AsyncClient,
                                                                 engine: ToyEngine) -> None:
    """CreateCompletionRequest.max_tokens: default 16 (vLLM's too); a request generated from the spec
    without it used to run to the end of the context. `"max_tokens": null` asks for that, as in vLLM."""
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    body = resp.json()
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"  # stream: false
    assert body["choices"] == [{"index": 0, "text": "abcdefghijklmnop", "logprobs": None,  # n: 1, no echo
                                "finish_reason": "length", "stop_reason": None}]
    assert body["usage"]["completion_tokens"] == 16
    params = engine.calls[0][2]
    assert params.max_tokens == 16
    assert {k: getattr(params, k) for k in SPEC_DEFAULTS} == SPEC_DEFAULTS
    await client.post("/v1/completions", json={"prompt": "x" * 59, "max_tokens": None})
    assert engine.calls[1][2].max_tokens == 64 - 60  # null: what the context leaves
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 40, "n": None, "best_of": 1})
    assert len(engine.calls) == 3 and engine.calls[2][2].max_tokens == 40  # best_of: 1, its default
    short = await client.post("/v1/completions", json={"prompt": "x" * 55})  # 56 tokens + 16 > 64
    assert short.status_code == 400 and short.json()["error"]["param"] == "max_tokens"


async def test_a_chat_without_a_limit_runs_to_the_end_of_the_context(client: httpx.AsyncClient,
                                                                     engine: ToyEngine) -> None:
    """CreateChatCompletionRequest gives max_tokens and max_completion_tokens no default (the model's
    context is the bound), and the other fields the same defaults as completions; logprobs: false."""
    resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert len(resp.json()["choices"]) == 1 and resp.json()["choices"][0]["logprobs"] is None
    params = engine.calls[0][2]
    assert params.max_tokens == 64 - len("\x01<user>hi<assistant>")
    assert {k: getattr(params, k) for k in SPEC_DEFAULTS} == SPEC_DEFAULTS
    await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": None})
    assert engine.calls[1][2].max_tokens == params.max_tokens
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
    # Every other field of the body is the SamplingParams field of the same name, with the same value.
    sampling = {k: v for k, v in body.items() if k not in ("prompt", "kv_transfer_params")}
    assert params == SamplingParams(**sampling)
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
